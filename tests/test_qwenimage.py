"""Qwen-Image through the CLI at tiny size: a pipeline folder built by plain diffusers and transformers as the release
is (the whole Qwen2.5-VL model as its text encoder), recognised and fine-tuned in each mode, its text encoder's
language tower read alone (also a tensor at a time, for a low-precision base); the conditioning is the pipeline's
own; encoded shards train without the text encoder; a LoRA loads whole through diffusers' Qwen-Image loader from
either file; from scratch it trains, exports and generates. (The spec-level guarantees are the conformance suite's,
tests/test_family_conformance.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdtrain.cli.main import main
from sdtrain.export import export_run
from sdtrain.models import families
from sdtrain.models.families import causal_lm

from .conftest import FINE_TUNE_MODES, TINY_CLI, config_path

CONFIGS = config_path("diffusion.yaml").parents[1]
QWEN = families.get("qwen-image")
TEXT_LENGTH = 16
COMMON = [*TINY_CLI, f"model.t5_text_length={TEXT_LENGTH}"]
MODES = FINE_TUNE_MODES


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A Qwen-Image pipeline folder as diffusers saves the release: the whole vision-language model as the text
    encoder, the 3D autoencoder with its latent statistics, the transformer, a Qwen2 chat tokenizer, and the
    released scheduler settings."""
    from diffusers import QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = tmp_path_factory.mktemp("qwen-image") / "pipeline"
    torch.manual_seed(0)
    tokenizer = causal_lm.train_chat_tokenizer(
        [f"a {c} {s}" for c in ("red", "green", "blue", "yellow") for s in ("circle", "square", "triangle")] * 4,
        folder.parent / "tokenizer", 600, TEXT_LENGTH)
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=None, eos_token_id=None, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]})
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                             out_hidden_size=32)))
    QwenImagePipeline(text_encoder=encoder, tokenizer=tokenizer, **released_parts()).save_pretrained(folder)
    return folder


def released_parts(**transformer_settings: Any) -> dict[str, Any]:
    """The release's transformer (with `transformer_settings` beside its shape), 3D autoencoder (with latent
    statistics) and scheduler settings, at a tiny size: what Qwen-Image's and Qwen-Image-Edit's pipelines share."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6), **transformer_settings)
    generator = torch.Generator().manual_seed(1)
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True],
                                 latents_mean=(torch.randn(16, generator=generator) * 0.1).tolist(),
                                 latents_std=(1 + torch.rand(16, generator=generator)).tolist())
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02)
    return {"transformer": transformer, "vae": vae, "scheduler": scheduler}


def _pipeline(folder: Path):
    from diffusers import QwenImagePipeline

    pipe = QWEN.sampling.prepare(QwenImagePipeline.from_pretrained(folder, local_files_only=True))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe) -> np.ndarray:
    return pipe("a red circle", num_inference_steps=2, true_cfg_scale=2.0, negative_prompt="", height=32, width=32,
                output_type="np", max_sequence_length=TEXT_LENGTH, generator=torch.Generator().manual_seed(0)).images[0]


def _command(mode: str, run: Path, pretrained: Path, shapes_dir: Path, steps: int, *extra: str) -> list[str]:
    config, settings = MODES[mode]
    return ["train", str(CONFIGS / config), f"run_dir={run}", *COMMON, f"model.pretrained={pretrained}",
            f"data.shards={shapes_dir}", f"train.max_steps={steps}", "checkpoint.every=1",
            "data.caption_dropout=0.25", *settings, *extra]


def test_a_released_folder_is_recognised_and_its_language_tower_read_alone(released):
    from transformers import Qwen2_5_VLTextModel

    from sdtrain.loaders.components import load_component

    assert families.detect(released) is QWEN
    whole = _pipeline(released).text_encoder
    ids = torch.randint(0, 100, (2, 9))
    mask = torch.ones_like(ids)
    expected = whole(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    for precision in ("fp32", "fp8"):
        tower = load_component("text_encoder", released, family=QWEN, frozen_precision=precision)
        assert type(tower) is Qwen2_5_VLTextModel  # no vision tower, no head
        got = causal_lm.hidden_states(tower, ids, mask, -1)
        tolerance = 0 if precision == "fp32" else 0.2
        assert (got - expected).abs().max() <= tolerance * expected.abs().max(), precision


def test_the_conditioning_is_the_pipelines_own(released):
    """Each caption's states from the user turn on, the system turn dropped, its padding masked and zeroed: what
    QwenImagePipeline.encode_prompt gives for it (which pads to the longest caption instead)."""
    from sdtrain.models import build
    from sdtrain.models.tokenizer import CaptionTokenizer

    pipe = _pipeline(released)
    tokenizer = build.load_tokenizer(str(released), TEXT_LENGTH)
    captions = ["a red circle", "", "a green square beside a yellow triangle and a blue circle, both small"]
    batch = CaptionTokenizer([tokenizer], QWEN)(captions)
    ids, masks = QWEN.token_inputs(batch)
    with torch.no_grad():
        text = QWEN.conditioner.encode_text([pipe.text_encoder], ids, captions, masks)
        embeds, mask = pipe.encode_prompt(captions, max_sequence_length=TEXT_LENGTH)
    assert text["text_emb"].shape == (3, TEXT_LENGTH, 32) and text["text_mask"].shape == (3, TEXT_LENGTH)
    width = embeds.shape[1]
    assert torch.equal(text["text_mask"][:, :width].long(), mask) and not text["text_mask"][:, width:].any()
    torch.testing.assert_close(text["text_emb"][:, :width], embeds, rtol=1e-5, atol=1e-6)
    assert not text["text_emb"][:, width:].any()


def test_a_tokenizer_that_pads_left_conditions_as_the_pipeline_does(tmp_path, released):
    """A tokenizer folder whose tokenizer_config.json pads on the left (as some Qwen releases' do) drops the same
    system turn and gives each caption the states the pipeline gives it alone: not the system prompt kept."""
    import shutil

    from sdtrain.models import build
    from sdtrain.models.tokenizer import CaptionTokenizer

    folder = shutil.copytree(released / "tokenizer", tmp_path / "tokenizer")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "padding_side": "left"}))
    tokenizer = build.load_tokenizer(str(folder), TEXT_LENGTH)
    assert tokenizer.padding_side == "left"
    pipe = _pipeline(released)
    pipe.tokenizer = tokenizer
    captions = ["a red circle", "a green square beside a yellow triangle"]
    ids, masks = QWEN.token_inputs(CaptionTokenizer([tokenizer], QWEN)(captions))
    with torch.no_grad():
        text = QWEN.conditioner.encode_text([pipe.text_encoder], ids, captions, masks)
        for row, caption in enumerate(captions):
            embeds, mask = pipe.encode_prompt([caption], max_sequence_length=TEXT_LENGTH)
            width = embeds.shape[1]  # a caption alone is not padded: the pipeline gives no mask
            assert mask is None and text["text_mask"][row, :width].all() and not text["text_mask"][row, width:].any()
            torch.testing.assert_close(text["text_emb"][row, :width], embeds[0], rtol=1e-5, atol=1e-6)


def test_a_lora_over_a_low_precision_base_loads_whole_through_diffusers_from_either_file(tmp_path, released,
                                                                                          shapes_dir):
    run = tmp_path / "lora"
    assert main(_command("lora", run, released, shapes_dir, 2, "model.frozen_precision=fp8")) == 0
    out = export_run(run, tmp_path / "out")
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.") for k in keys)  # diffusers' loader adapts the transformer alone
    kohya = load_file(str(out / "lora_kohya.safetensors"))
    assert all(k.startswith("lora_unet_transformer_blocks_") for k in kohya)
    before = _image(_pipeline(released))
    fused = {}
    for name in ("pytorch_lora_weights.safetensors", "lora_kohya.safetensors"):
        pipe = _pipeline(released)
        pipe.load_lora_weights(out, weight_name=name)
        if name == "pytorch_lora_weights.safetensors":
            from peft.tuners.lora import LoraLayer

            in_file = {k.removeprefix("transformer.").rsplit(".lora", 1)[0] for k in keys}
            attached = {n for n, module in pipe.transformer.named_modules() if isinstance(module, LoraLayer)}
            assert attached == in_file and any(n.endswith("attn.to_q") for n in attached)
            assert not np.array_equal(_image(pipe), before)  # the tiny autoencoder's images move little
        pipe.fuse_lora()
        fused[name] = {k: v for k, v in pipe.transformer.state_dict().items() if "lora_" not in k}
    first, second = fused.values()
    base = _pipeline(released).transformer.state_dict()
    assert any(not torch.equal(value, base[key.replace(".base_layer.", ".")]) for key, value in first.items())
    for key, value in first.items():
        torch.testing.assert_close(second[key.replace(".base_layer.", ".")] if key not in second else second[key],
                                   value, rtol=1e-5, atol=1e-6, msg=key)
    assert "- qwen-image" in (out / "README.md").read_text()  # the model card names the family


@pytest.mark.parametrize("mode", ["full", "dreambooth"])
def test_full_and_dreambooth_exports_load_in_diffusers_and_change_the_image(mode, tmp_path, released, shapes_dir):
    run = tmp_path / mode
    assert main(_command(mode, run, released, shapes_dir, 2)) == 0
    out = export_run(run, tmp_path / "out")
    assert families.detect(out) is QWEN
    assert np.abs(_image(_pipeline(out)) - _image(_pipeline(released))).max() > 1e-3
    if mode == "full":
        _single_file_export_loads_in_diffusers_and_trains(run, out, tmp_path, released, shapes_dir)


def _single_file_export_loads_in_diffusers_and_trains(run: Path, out: Path, tmp_path: Path, released: Path,
                                                      shapes_dir: Path) -> None:
    """`export --single-file` writes the transformer alone, as ComfyUI's diffusion_models/ file holds it: diffusers'
    own from_single_file reads the run's weights from it, and sdtrain trains from it as model.transformer."""
    from diffusers import QwenImageTransformer2DModel

    single = tmp_path / "qwen-image.safetensors"
    assert main(["export", str(run), str(single), "--single-file"]) == 0
    assert families.detect(single) is QWEN
    loaded = QwenImageTransformer2DModel.from_single_file(str(single), config=str(released / "transformer"),
                                                          local_files_only=True, torch_dtype=torch.float32)
    trained = _pipeline(out).transformer.state_dict()
    assert set(loaded.state_dict()) == set(trained)
    assert all(torch.equal(loaded.state_dict()[key], tensor) for key, tensor in trained.items())
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'again'}", *COMMON,
                 f"model.pretrained={released}", f"model.transformer={single}", f"data.shards={shapes_dir}",
                 "train.max_steps=1", "lora.rank=4"]) == 0


def test_from_scratch_the_autoencoder_fits_each_channel_and_the_model_trains_exports_and_generates(
        tmp_path, tiny_autoencoder, tiny_scratch_run):
    """The autoencoder run records a mean and deviation per latent channel (what the pipeline normalises by); the
    text encoder and transformer train on them, validation renders through QwenImagePipeline, the export loads
    in diffusers and `generate` draws from it."""
    vae = json.loads((tiny_autoencoder("qwen-image") / "checkpoints" / "step_00000002" / "meta.json").read_text())
    settings = vae["modules"]["vae"]["config"]
    assert len(settings["latents_mean"]) == 16 and min(settings["latents_std"]) > 0
    assert settings["latents_std"] != [1.0] * 16
    run = tiny_scratch_run("qwen-image", tmp_path / "scratch", 2, f"model.t5_text_length={TEXT_LENGTH}",
                           "data.caption_dropout=0.25", "validation.prompts=[a red circle]", "validation.steps=2")
    assert (run / "samples" / "step_00000002.png").is_file()
    out = tmp_path / "pipeline"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"
    _image(_pipeline(out))
    assert main(["generate", "--model", str(out), "--prompt", "a red circle", "--steps", "2",
                 "--out", str(tmp_path / "images")]) == 0
    assert (tmp_path / "images" / "grid.png").is_file()


def test_encoded_shards_train_without_the_text_encoder(tmp_path, released, shapes_dir):
    """`prepare encode` stores each sample's latent posterior (4D: the frame axis gone) and the caption's states
    with their mask; a LoRA then trains on them."""
    from sdtrain.data.encoded import load_npy
    from sdtrain.data.order import read_shard, resolve_shards

    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(released), "--out", str(encoded),
                 "--resolution", "32", "--dtype", "float32", "--t5-text-length", str(TEXT_LENGTH)]) == 0
    sample = next(iter(read_shard(resolve_shards(str(encoded))[0].url)))
    assert load_npy(sample["latent_mean.npy"]).shape == (16, 8, 8)
    states, mask = load_npy(sample["text_emb.npy"]), load_npy(sample["text_mask.npy"])
    assert states.shape[-2:] == (TEXT_LENGTH, 32) and mask.shape[-1] == TEXT_LENGTH
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={encoded}", "train.max_steps=2",
                 "data.caption_dropout=0.25", "lora.rank=4"]) == 0


def test_params_counts_the_released_architecture(capsys):
    assert main(["params", str(CONFIGS / "lora.yaml"), "model.family=qwen-image", "model.preset=qwen-image"]) == 0
    report = capsys.readouterr().out
    # The released transformer, autoencoder and Qwen2.5-VL-7B's language tower.
    assert "20,430,401,088" in report and "126,892,531" in report and "7,070,619,136" in report


def test_a_text_mask_with_no_padding_is_passed_as_none_as_the_pipeline_passes_it():
    """QwenImagePipeline drops a prompt mask that is all True; an explicit mask is also what cuDNN's SDPA backward
    on Hopper answers with NaN gradients (pytorch/pytorch#196678): the training call passes none either."""
    call = families.get("qwen-image").denoising
    states = torch.zeros(2, 5, 8)
    full = call.condition({"text_emb": states, "text_mask": torch.ones(2, 5, dtype=torch.long)}, {}, "cpu")
    assert full["encoder_hidden_states_mask"] is None
    padded = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert call.condition({"text_emb": states, "text_mask": padded}, {}, "cpu")["encoder_hidden_states_mask"] is padded
