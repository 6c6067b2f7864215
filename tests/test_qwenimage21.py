"""Qwen-Image 2.1 through the CLI at tiny size: a pipeline folder built by plain diffusers and transformers as the
release is (the whole Qwen3-VL model as its text encoder, a processor folder and no tokenizer folder, the RGBA
autoencoder with its latent statistics), recognised and fine-tuned; the conditioning, the denoiser's call and the
sampling shift are the pipeline's own; a LoRA loads whole through diffusers' loader and changes the image; full and
DreamBooth runs export folders diffusers loads; encoded shards train without the text encoder; from scratch it
trains, exports and generates. (The spec-level guarantees are the conformance suite's,
tests/test_family_conformance.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdtrain.cli.main import main
from sdtrain.export import export_run
from sdtrain.models import build, families
from sdtrain.models.families import causal_lm, qwenimage21
from sdtrain.models.tokenizer import CaptionTokenizer

from .conftest import FINE_TUNE_MODES, TINY_CLI, config_path

CONFIGS = config_path("diffusion.yaml").parents[1]
QWEN21 = families.get("qwen-image-2.1")
TEXT_LENGTH = 40
COMMON = [*TINY_CLI, f"model.t5_text_length={TEXT_LENGTH}"]
CAPTIONS = [f"a {c} {s}" for c in ("red", "green", "blue", "yellow") for s in ("circle", "square", "triangle")]


def _release(folder: Path, sample_sigmas: list[float] | None = None) -> Path:
    """A Qwen-Image 2.1 pipeline folder as diffusers saves the release: the whole Qwen3-VL model (its vision tokens'
    ids in its config), the processor folder (image settings beside a Qwen2 chat tokenizer with the vision markers;
    no tokenizer folder), the RGBA autoencoder with latent statistics, the transformer, the released scheduler
    settings (Turbo's sample_sigmas in model_index.json when given)."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = causal_lm.train_chat_tokenizer([*CAPTIONS * 4, qwenimage21.SYSTEM], folder.parent / "tokenizer", 600,
                                               TEXT_LENGTH, tuple(qwenimage21.VISION_MARKERS.values()))
    markers = {f"{role}_token_id": tokenizer.convert_tokens_to_ids(token)
               for role, token in qwenimage21.VISION_MARKERS.items()}
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                             out_hidden_size=32, num_position_embeddings=64,
                                             deepstack_visual_indexes=[0]), **markers))
    transformer = QwenImage21Transformer2DModel(in_channels=64, out_channels=64, num_layers=2, attention_head_dim=16,
                                                num_attention_heads=2, context_in_dim=32, axes_dims_rope=(4, 6, 6))
    generator = torch.Generator().manual_seed(1)
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=64, dim_mult=[1, 1, 2, 2, 2],
                                   num_res_blocks=1, latents_mean=(torch.randn(64, generator=generator) * 0.1).tolist(),
                                   latents_std=(1 + torch.rand(64, generator=generator)).tolist())
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, time_shift_type="exponential",
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096, shift_terminal=0.02)
    pipe = QwenImage21Pipeline(scheduler=scheduler, vae=vae, text_encoder=encoder, transformer=transformer,
                               processor=qwenimage21.text_processor(tokenizer), sample_sigmas=sample_sigmas)
    # The release's model_index names transformers' processor (transformers needs torchvision to build it whole).
    pipe.register_to_config(processor=("transformers", "Qwen3VLProcessor"))
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    return _release(tmp_path_factory.mktemp("qwen-image-2.1") / "pipeline")


def _pipeline(folder: Path):
    pipe = QWEN21.sampling.pipeline_from_folder(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe) -> np.ndarray:
    return pipe("a red circle", num_inference_steps=2, true_cfg_scale=2.0, negative_prompt="", height=32, width=32,
                output_type="np", generator=torch.Generator().manual_seed(0)).images[0]


def _command(mode: str, run: Path, pretrained: Path, shapes_dir: Path, steps: int, *extra: str) -> list[str]:
    config, settings = FINE_TUNE_MODES[mode]
    return ["train", str(CONFIGS / config), f"run_dir={run}", *COMMON, f"model.pretrained={pretrained}",
            f"data.shards={shapes_dir}", f"train.max_steps={steps}", "checkpoint.every=1",
            "data.caption_dropout=0.25", *settings, *extra]


def _conditioning(pipe, captions: list[str]) -> dict[str, torch.Tensor]:
    tokenizer = build.load_tokenizer(str(pipe.name_or_path), TEXT_LENGTH, "processor")
    ids, masks = QWEN21.token_inputs(CaptionTokenizer([tokenizer], QWEN21)(captions))
    return QWEN21.conditioner.encode_text([pipe.text_encoder], ids, captions, masks)


def test_a_released_folder_is_recognised_and_read_through_its_processor(released):
    """No tokenizer folder: the tokenizer is the processor folder's, the pipeline loads with the processor sdtrain
    builds (transformers' needs torchvision), the RGBA autoencoder's latents are 16x smaller."""
    assert families.detect(released) is QWEN21
    assert not (released / "tokenizer").exists()
    tokenizer = build.load_tokenizer(str(released), TEXT_LENGTH, "processor")
    assert type(tokenizer).__name__ == "Qwen2Tokenizer" and tokenizer.model_max_length == TEXT_LENGTH
    pipe = _pipeline(released)
    assert type(pipe).__name__ == "QwenImage21Pipeline" and pipe.processor.tokenizer.chat_template
    # The system turn the pipeline drops is the one the conditioning drops.
    assert pipe._drop_idx == qwenimage21.prefix_length(tokenizer)
    posterior = QWEN21.codec.encode(pipe.vae, torch.rand(1, 3, 64, 32) * 2 - 1)
    assert posterior.mean.shape == (1, 64, 4, 2)
    assert QWEN21.codec.decode(pipe.vae, posterior.mode()).shape == (1, 3, 64, 32)


def test_the_conditioning_is_the_pipelines_own(released):
    """Each caption's states from the user turn on, the system turn dropped, before the language model's final norm,
    its padding masked and zeroed: what QwenImage21Pipeline.encode_prompt gives it (left-padding a batch to its
    longest caption, an empty caption read as a space)."""
    pipe = _pipeline(released)
    captions = ["a red circle", "", "a green square beside a yellow triangle"]
    with torch.no_grad():
        text = _conditioning(pipe, captions)
        embeds, mask, _ = pipe.encode_prompt(captions)
        alone, no_mask, _ = pipe.encode_prompt(captions[:1])
    assert text["text_emb"].shape == (3, TEXT_LENGTH, 32) and text["text_mask"].shape == (3, TEXT_LENGTH)
    width = embeds.shape[1]
    assert torch.equal(text["text_mask"][:, :width].long(), mask.long()) and not text["text_mask"][:, width:].any()
    torch.testing.assert_close(text["text_emb"][:, :width], embeds, rtol=1e-5, atol=1e-5)
    assert not text["text_emb"][:, width:].any()
    assert no_mask is None  # one caption alone is not padded
    torch.testing.assert_close(text["text_emb"][:1, :alone.shape[1]], alone, rtol=1e-5, atol=1e-5)
    # Not the final norm's output: the states the transformer was trained on.
    normed = pipe.text_encoder.model.language_model.norm(embeds)
    assert not torch.allclose(normed[mask.bool()], embeds[mask.bool()], atol=1e-3)


def test_the_denoiser_call_is_the_pipelines(released):
    """The transformer's prediction for a batch of captions of different lengths, as the pipeline's denoising step
    calls it (latents one token per pixel after the text, sigma in [0, 1], the image's tokens read off the end)."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import QwenImage21Pipeline

    pipe = _pipeline(released)
    captions = ["a red circle", "a green square beside a yellow triangle"]
    latents = torch.randn(2, 64, 4, 2, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([700.0, 700.0])
    with torch.no_grad():
        condition = QWEN21.denoising.condition(_conditioning(pipe, captions), {}, torch.device("cpu"))
        got = QWEN21.denoising.denoise(pipe.transformer, latents, timesteps, condition)
        embeds, mask, slots = pipe.encode_prompt(captions)
        packed = QwenImage21Pipeline._pack_latents(latents, 2, 64, 4, 2)
        slots = torch.cat([slots, slots.new_ones(2, packed.shape[1] // 4)], dim=1)
        expected = pipe.transformer(hidden_states=packed, timestep=timesteps / 1000, encoder_hidden_states=embeds,
                                    encoder_hidden_states_mask=mask, img_shapes=[[(1, 4, 2)]] * 2, img_mask=slots,
                                    return_dict=False)[0][:, -packed.shape[1]:]
    expected = QwenImage21Pipeline._unpack_latents(expected, 64, 32, 16)[:, :, 0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_training_shifts_sigmas_as_the_pipeline_samples_them(released):
    """The dynamic shift's mu counts one token per latent pixel, as the pipeline's calculate_shift counts its packed
    latents (not the 2x2 slots the bucket sides keep even for)."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    from sdtrain.config import DiffusionConfig
    from sdtrain.train.tasks import make_objective

    pipe = _pipeline(released)
    objective = make_objective(QWEN21, DiffusionConfig(), pipe.scheduler, torch.device("cpu"),
                               pipe.transformer.config)
    assert objective.patch_size == 1 and QWEN21.denoising.downsampling(pipe.transformer.config) == 2
    config = pipe.scheduler.config
    tokens = 32 * 48  # the latents of a 512 x 768 image
    mu = calculate_shift(tokens, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                         config.max_shift)
    assert objective.mu(tokens) == pytest.approx(mu, rel=1e-9)
    sigmas = torch.tensor([0.2, 0.5, 0.9])
    torch.testing.assert_close(objective.shift(sigmas, tokens), pipe.scheduler.time_shift(mu, 1.0, sigmas))


def test_the_turbo_release_samples_its_own_sigmas_without_guidance(tmp_path):
    turbo = _release(tmp_path / "turbo" / "pipeline", sample_sigmas=[1.0, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05])
    assert QWEN21.sampling.distilled(turbo) and not QWEN21.sampling.distilled(tmp_path / "none")
    assert QWEN21.sampling.defaults(None, distilled=True) == {"guidance": 1.0, "steps": 8}
    assert QWEN21.sampling.arguments(None, 1.0, None) == {"true_cfg_scale": 1.0, "negative_prompt": None}
    assert QWEN21.sampling.arguments(None, 4.0, None) == {"true_cfg_scale": 4.0, "negative_prompt": ""}


def test_a_lora_loads_whole_through_diffusers_and_changes_the_image(tmp_path, released, shapes_dir):
    run = tmp_path / "lora"
    assert main(_command("lora", run, released, shapes_dir, 2, "model.frozen_precision=fp8")) == 0
    out = export_run(run, tmp_path / "out")
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.") for k in keys)  # diffusers' loader adapts the transformer alone
    kohya = load_file(str(out / "lora_kohya.safetensors"))
    assert kohya and all(k.startswith("lora_unet_transformer_blocks_") for k in kohya)
    before = _image(_pipeline(released))
    pipe = _pipeline(released)
    pipe.load_lora_weights(out, weight_name="pytorch_lora_weights.safetensors")
    from peft.tuners.lora import LoraLayer

    in_file = {k.removeprefix("transformer.").rsplit(".lora", 1)[0] for k in keys}
    attached = {n for n, module in pipe.transformer.named_modules() if isinstance(module, LoraLayer)}
    assert attached == in_file and any(n.endswith("attn.to_q") for n in attached)
    assert not np.array_equal(_image(pipe), before)
    pipe.fuse_lora()
    fused = {k.replace(".base_layer.", "."): v for k, v in pipe.transformer.state_dict().items() if "lora_" not in k}
    # kohya's names, as diffusers' Qwen-Image loader reads them, make the same model.
    kohya_pipe = _pipeline(released)
    kohya_pipe.load_lora_weights(out, weight_name="lora_kohya.safetensors")
    kohya_pipe.fuse_lora()
    for key, value in kohya_pipe.transformer.state_dict().items():
        if "lora_" not in key:
            torch.testing.assert_close(value, fused[key.replace(".base_layer.", ".")], rtol=1e-5, atol=1e-6, msg=key)
    assert "- qwen-image-2.1" in (out / "README.md").read_text()  # the model card names the family
    # `generate` with the adapters on the released (RGBA) model writes its images.
    assert main(["generate", "--model", str(released), "--lora", str(out), "--prompt", "a red circle", "--steps", "2",
                 "--size", "32", "--out", str(tmp_path / "images")]) == 0
    assert (tmp_path / "images" / "grid.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "dreambooth"])
def test_full_and_dreambooth_exports_load_in_diffusers_and_change_the_image(mode, tmp_path, released, shapes_dir):
    run = tmp_path / mode
    assert main(_command(mode, run, released, shapes_dir, 2)) == 0
    out = export_run(run, tmp_path / "out")
    assert families.detect(out) is QWEN21
    index = json.loads((out / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen3VLProcessor"] and "tokenizer" not in index
    assert np.abs(_image(_pipeline(out)) - _image(_pipeline(released))).max() > 1e-4


@pytest.mark.slow
def test_from_scratch_the_autoencoder_fits_each_channel_and_the_model_trains_exports_and_generates(
        tmp_path, tiny_autoencoder, tiny_scratch_run):
    """The autoencoder run records a mean and deviation per latent channel (what the pipeline normalises by); the
    text encoder and transformer train on them, validation renders through QwenImage21Pipeline, the export loads
    in diffusers and `generate` draws from it."""
    vae = json.loads((tiny_autoencoder("qwen-image-2.1") / "checkpoints" / "step_00000002" / "meta.json").read_text())
    settings = vae["modules"]["vae"]["config"]
    assert len(settings["latents_mean"]) == 16 and min(settings["latents_std"]) > 0
    assert settings["latents_std"] != [1.0] * 16
    run = tiny_scratch_run("qwen-image-2.1", tmp_path / "scratch", 2, f"model.t5_text_length={TEXT_LENGTH}",
                           "data.caption_dropout=0.25", "validation.prompts=[a red circle]", "validation.steps=2")
    assert (run / "samples" / "step_00000002.png").is_file()
    out = tmp_path / "pipeline"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "QwenImage21Pipeline"
    _image(_pipeline(out))
    assert main(["generate", "--model", str(out), "--prompt", "a red circle", "--steps", "2",
                 "--out", str(tmp_path / "images")]) == 0
    assert (tmp_path / "images" / "grid.png").is_file()


def test_encoded_shards_train_without_the_text_encoder(tmp_path, released, shapes_dir):
    """`prepare encode` stores each sample's latent posterior (64 channels, 16x smaller) and the caption's states
    with their mask; a LoRA then trains on them."""
    from sdtrain.data.encoded import load_npy
    from sdtrain.data.order import read_shard, resolve_shards

    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(released), "--out", str(encoded),
                 "--resolution", "32", "--dtype", "float32", "--t5-text-length", str(TEXT_LENGTH)]) == 0
    sample = next(iter(read_shard(resolve_shards(str(encoded))[0].url)))
    assert load_npy(sample["latent_mean.npy"]).shape == (64, 2, 2)
    states, mask = load_npy(sample["text_emb.npy"]), load_npy(sample["text_mask.npy"])
    assert states.shape[-2:] == (TEXT_LENGTH, 32) and mask.shape[-1] == TEXT_LENGTH
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={encoded}", "train.max_steps=2",
                 "data.caption_dropout=0.25", "lora.rank=4"]) == 0


def test_params_counts_the_released_architecture(capsys):
    assert main(["params", str(CONFIGS / "lora.yaml"), "model.family=qwen-image-2.1",
                 "model.preset=qwen-image-2.1"]) == 0
    report = capsys.readouterr().out
    # The released transformer (about 7B), RGBA autoencoder and the whole Qwen3-VL-8B.
    assert "7,115,124,736" in report and "337,740,404" in report and "8,767,123,696" in report


def test_a_batch_whose_captions_are_as_long_passes_no_text_mask():
    """The text is cut to the batch's longest caption, so a batch of one masks nothing: the call passes no mask then
    (an explicit one is what cuDNN's SDPA backward on Hopper answers with NaN, pytorch/pytorch#196678)."""
    call, received = families.get("qwen-image-2.1").denoising, []

    def denoiser(**kwargs):
        received.append(kwargs)
        return (torch.zeros_like(kwargs["hidden_states"]),)

    noisy, states = torch.zeros(2, 4, 4, 4), torch.zeros(2, 6, 8)
    for lengths in ([3, 3], [3, 1]):
        mask = (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]).float()
        condition = call.condition({"text_emb": states, "text_mask": mask}, {}, "cpu")
        call.denoise(denoiser, noisy, torch.tensor([500.0, 500.0]), condition)
    full, padded = (kwargs["encoder_hidden_states_mask"] for kwargs in received)
    assert full is None and padded.tolist() == [[1, 1, 1], [1, 0, 0]]
