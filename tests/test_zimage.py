"""Z-Image through the CLI at tiny size: a pipeline folder built by plain diffusers and transformers, as users
download one, is recognised and fine-tuned in each mode; from scratch it trains and exports what ZImagePipeline
loads and `generate` draws from; encoded shards keep each caption's tokens and no padding; a LoRA resumes bitwise
after kill -9 and loads whole through diffusers' own Z-Image LoRA loader. (The spec-level guarantees are the
conformance suite's, tests/test_family_conformance.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdtrain.cli.main import main
from sdtrain.errors import UserError
from sdtrain.export import export_run
from sdtrain.models import families
from sdtrain.models.families import causal_lm

from .conftest import FINE_TUNE_MODES, TINY_CLI, config_path, resumes_bitwise_after_kill_9

CONFIGS = config_path("diffusion.yaml").parents[1]
TEXT_LENGTH = 24
COMMON = [*TINY_CLI, f"model.t5_text_length={TEXT_LENGTH}"]
MODES = FINE_TUNE_MODES


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A Z-Image pipeline folder as diffusers saves one: plain diffusers and transformers classes at tiny size,
    Flux.1's VAE shape, a Qwen3 text encoder and its chat tokenizer."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    folder = tmp_path_factory.mktemp("z-image") / "pipeline"
    torch.manual_seed(0)
    tokenizer = causal_lm.train_chat_tokenizer(
        [f"a {c} {s}" for c in ("red", "green", "blue", "yellow") for s in ("circle", "square", "triangle")] * 4,
        folder.parent / "tokenizer", 600, TEXT_LENGTH)
    encoder = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     pad_token_id=tokenizer.pad_token_id))
    transformer = ZImageTransformer2DModel(all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=32,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                                           axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    vae = AutoencoderKL(block_out_channels=[32, 32, 64], down_block_types=["DownEncoderBlock2D"] * 3,
                        up_block_types=["UpDecoderBlock2D"] * 3, layers_per_block=1, latent_channels=16,
                        norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
                        shift_factor=0.1159)
    ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=encoder,
                   tokenizer=tokenizer, transformer=transformer).save_pretrained(folder)
    return folder


def _pipeline(folder: Path):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe) -> np.ndarray:
    return pipe("a red circle", num_inference_steps=2, guidance_scale=2.0, height=32, width=32, output_type="np",
                max_sequence_length=TEXT_LENGTH, generator=torch.Generator().manual_seed(0)).images[0]


def _command(mode: str, run: Path, pretrained: Path, shapes_dir: Path, steps: int) -> list[str]:
    config, extra = MODES[mode]
    return ["train", str(CONFIGS / config), f"run_dir={run}", *COMMON, f"model.pretrained={pretrained}",
            f"data.shards={shapes_dir}", f"train.max_steps={steps}", "checkpoint.every=1",
            "data.caption_dropout=0.25", *extra]


def test_a_released_folder_is_recognised_from_its_files(released):
    assert families.detect(released) is families.get("z-image")


def test_a_lora_loads_whole_through_diffusers_z_image_loader_and_changes_the_image(tmp_path, released, shapes_dir):
    run = tmp_path / "lora"
    assert main(_command("lora", run, released, shapes_dir, 2)) == 0
    out = export_run(run, tmp_path / "out")
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.") for k in keys)  # diffusers' loader adapts the transformer alone
    before = _image(_pipeline(released))
    with_lora = _pipeline(released)
    with_lora.load_lora_weights(out)
    from peft.tuners.lora import LoraLayer

    in_file = {k.removeprefix("transformer.").rsplit(".lora", 1)[0] for k in keys}
    attached = {name for name, module in with_lora.transformer.named_modules() if isinstance(module, LoraLayer)}
    assert attached == in_file and any(name.endswith("attention.to_q") for name in attached)
    assert np.abs(_image(with_lora) - before).max() > 1e-3
    assert "- z-image" in (out / "README.md").read_text()  # the model card names the family


def test_turbo_samples_in_8_steps_without_guidance_and_the_base_model_with_it(tmp_path, released, shapes_dir,
                                                                               monkeypatch):
    """Z-Image-Turbo's folder (its scheduler shifts by 3, the base model's by 6; or the Hub id's name) samples as it
    was distilled to, in validation and `generate` on the run: 8 transformer calls of one latent each, no
    classifier-free guidance; the base model keeps guidance (the empty prompt's latent beside each)."""
    import shutil

    from diffusers import ZImageTransformer2DModel

    from sdtrain.generate import run_sampling_of
    from sdtrain.models.pipeline import sample_images

    calls = []
    forward = ZImageTransformer2DModel.forward

    def counted(self, x, *args, **kwargs):
        if not torch.is_grad_enabled():  # sampling, not a training step
            calls.append(len(x))
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(ZImageTransformer2DModel, "forward", counted)
    zimage = families.get("z-image")
    assert json.loads((released / "scheduler" / "scheduler_config.json").read_text())["shift"] == 3.0
    run = tmp_path / "lora"
    assert main([*_command("lora", run, released, shapes_dir, 1), "validation.prompts=[a red circle]"]) == 0
    assert calls == [1] * 8 * len(list((run / "samples").glob("step_*.png"))) and calls
    assert run_sampling_of(run)["distilled"] is True

    base = shutil.copytree(released, tmp_path / "Z-Image")
    settings = json.loads((base / "scheduler" / "scheduler_config.json").read_text())
    (base / "scheduler" / "scheduler_config.json").write_text(json.dumps({**settings, "shift": 6.0}))
    calls.clear()
    sample_images(_pipeline(base), ["a red circle"], steps=2, size=32)
    assert calls == [2, 2] and not zimage.sampling.distilled(base)
    snapshot = tmp_path / "models--Tongyi-MAI--Z-Image-Turbo" / "snapshots" / "0123abc"
    shutil.copytree(base, snapshot)
    assert zimage.sampling.distilled(snapshot) and zimage.sampling.distilled(snapshot / "transformer")


@pytest.mark.parametrize("mode", ["full", "dreambooth"])
def test_full_and_dreambooth_exports_load_in_diffusers_and_change_the_image(mode, tmp_path, released, shapes_dir):
    run = tmp_path / mode
    assert main(_command(mode, run, released, shapes_dir, 2)) == 0
    out = export_run(run, tmp_path / "out")
    assert families.detect(out) is families.get("z-image")
    assert np.abs(_image(_pipeline(out)) - _image(_pipeline(released))).max() > 1e-3


# Slow: Flux.1's LoRA resume runs by default (a transformer's adapters over a flow objective), as SD's.
@pytest.mark.slow
def test_a_lora_resumes_bitwise_after_kill_9(tmp_path, released, shapes_dir):
    resumes_bitwise_after_kill_9(lambda run: _command("lora", run, released, shapes_dir, 3), tmp_path)


def test_from_scratch_it_trains_exports_and_generates(tmp_path, tiny_scratch_run):
    # The tokenizer is learnt from the captions in Qwen2's layout with the chat template, the Qwen3 encoder and the
    # transformer train; validation renders through ZImagePipeline.
    run = tiny_scratch_run("z-image", tmp_path / "scratch", 2, f"model.t5_text_length={TEXT_LENGTH}",
                           "data.caption_dropout=0.25", "validation.prompts=[a red circle]", "validation.steps=2")
    assert (run / "samples" / "step_00000002.png").is_file()
    assert "<|im_start|>" in (run / "tokenizer" / "chat_template.jinja").read_text()
    out = tmp_path / "pipeline"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "ZImagePipeline"
    _image(_pipeline(out))
    assert main(["generate", "--model", str(out), "--prompt", "a red circle", "--steps", "2",
                 "--out", str(tmp_path / "images")]) == 0
    assert (tmp_path / "images" / "grid.png").is_file()


def test_encoded_shards_hold_each_captions_states_and_its_mask(tmp_path, released, shapes_dir):
    """The states the transformer reads are those of the caption's tokens: the mask kept beside them drops the
    padding, as ZImagePipeline drops it; training on the shards then runs without the text encoder."""
    from sdtrain.data.encoded import load_npy
    from sdtrain.data.order import read_shard, resolve_shards

    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(released), "--out", str(encoded),
                 "--resolution", "32", "--dtype", "float32", "--t5-text-length", str(TEXT_LENGTH)]) == 0
    sample = next(iter(read_shard(resolve_shards(str(encoded))[0].url)))
    caption = sample["txt"].decode().splitlines()[0]
    states, mask = load_npy(sample["text_emb.npy"]), load_npy(sample["text_mask.npy"])
    pipe = _pipeline(released)
    expected = pipe.encode_prompt(caption, do_classifier_free_guidance=False, max_sequence_length=TEXT_LENGTH)[0][0]
    if states.ndim == 3:  # several captions per sample: the first line's
        states, mask = states[0], mask[0]
    kept = states[mask.astype(bool)]
    np.testing.assert_allclose(kept, expected.detach().numpy(), rtol=1e-4, atol=1e-5)
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={encoded}", "train.max_steps=2",
                 "data.caption_dropout=0.25", "lora.rank=4"]) == 0


def test_an_unknown_preset_names_the_family_s_own(tmp_path):
    with pytest.raises(UserError, match="'sdxl' is not a Z-Image preset; choose one of tiny, z-image"):
        families.get("z-image").preset("sdxl", "transformer")


def test_a_single_file_export_loads_in_diffusers_and_is_a_training_source(tmp_path, released, shapes_dir, capsys):
    """`export --single-file` writes the transformer alone in the authors' layout (fused qkv, no diffusers names):
    diffusers' own from_single_file reads the run's weights from it, sdtrain trains from it as model.transformer,
    and `generate` on it says in one line what to pass instead."""
    from diffusers import ZImageTransformer2DModel

    from sdtrain.loaders.pipelines import pipeline_from_run

    run = tmp_path / "full"
    assert main(_command("full", run, released, shapes_dir, 2)) == 0
    single = tmp_path / "z-image.safetensors"
    assert main(["export", str(run), str(single), "--single-file"]) == 0
    assert families.detect(single) is families.get("z-image")
    keys = load_file(str(single))
    assert "layers.0.attention.qkv.weight" in keys and "x_embedder.weight" in keys
    assert not any(".to_q." in key or key.startswith("all_") for key in keys)
    loaded = ZImageTransformer2DModel.from_single_file(str(single), config=str(released / "transformer"),
                                                       local_files_only=True, torch_dtype=torch.float32)
    trained = pipeline_from_run(run).transformer.state_dict()
    assert set(loaded.state_dict()) == set(trained)
    assert all(torch.equal(loaded.state_dict()[key], tensor) for key, tensor in trained.items())
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'again'}", *COMMON,
                 f"model.pretrained={released}", f"model.transformer={single}", f"data.shards={shapes_dir}",
                 "train.max_steps=1", "lora.rank=4"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(single), "--prompt", "a red circle", "--out", str(tmp_path / "x")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "transformer alone" in error[0] and str(single) in error[0]


def test_the_released_text_encoder_folder_loads_a_tensor_at_a_time_into_a_low_precision_base(tmp_path):
    """Z-Image's text encoder is released as Qwen3ForCausalLM (its weights under ``model.``): a frozen base in fp8
    reads its Qwen3Model from that folder as from_pretrained does."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sdtrain.loaders.components import load_component

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "text_encoder")
    family = families.get("z-image")
    whole = load_component("text_encoder", tmp_path / "text_encoder", family=family)
    low = load_component("text_encoder", tmp_path / "text_encoder", family=family, frozen_precision="fp8")
    ids = torch.randint(0, 64, (1, 6))
    expected = whole(input_ids=ids).last_hidden_state
    got = low(input_ids=ids).last_hidden_state
    assert (got - expected).abs().max() <= 0.2 * expected.abs().max()
