"""Chroma at tiny size: a pipeline folder built by plain diffusers and transformers, as users download one, is
recognised and conditions, masks and predicts as diffusers' ChromaPipeline does (but for the mask's dtype, which
training and sdtrain's sampling keep boolean: see the family's docstring); through the CLI it is fine-tuned in each
mode and exports what ChromaPipeline loads, its LoRA whole through the pipeline's own loader and in kohya's names
of Black Forest Labs' layout, its transformer alone as the released single file. (The spec-level guarantees are
the conformance suite's, tests/test_family_conformance.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdtrain.cli.main import main
from sdtrain.errors import UserError
from sdtrain.models import families
from sdtrain.models.families import chroma

from .conftest import FINE_TUNE_MODES, TINY_CLI, config_path, resumes_bitwise_after_kill_9, t5_tokenizer

CONFIGS = config_path("diffusion.yaml").parents[1]
TEXT_LENGTH = 24
COMMON = [*TINY_CLI, f"model.t5_text_length={TEXT_LENGTH}"]
MODES = FINE_TUNE_MODES
CAPTIONS = [f"a {c} {s}" for c in ("red", "green", "blue", "yellow") for s in ("circle", "square", "triangle")]


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A Chroma pipeline folder as diffusers saves one (Chroma1-HD's layout: scheduler, text_encoder, tokenizer,
    transformer, vae; no IP-adapter image encoder): plain diffusers and transformers classes at tiny size."""
    from diffusers import AutoencoderKL, ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    folder = tmp_path_factory.mktemp("chroma") / "pipeline"
    torch.manual_seed(0)
    tokenizer = t5_tokenizer(folder.parent / "tokenizer", CAPTIONS, TEXT_LENGTH)
    encoder = T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                      num_heads=4, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                      dropout_rate=0.0, pad_token_id=0, eos_token_id=1))
    transformer = ChromaTransformer2DModel(in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
                                           num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 6, 6],
                                           approximator_num_channels=16, approximator_hidden_dim=32,
                                           approximator_layers=2)
    vae = AutoencoderKL(block_out_channels=[32, 32, 64], down_block_types=["DownEncoderBlock2D"] * 3,
                        up_block_types=["UpDecoderBlock2D"] * 3, layers_per_block=1, latent_channels=16,
                        norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
                        shift_factor=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=encoder, tokenizer=tokenizer,
                   transformer=transformer).save_pretrained(folder)
    return folder


def _pipeline(folder: Path):
    from diffusers import ChromaPipeline

    pipe = ChromaPipeline.from_pretrained(folder, local_files_only=True)
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


def _transformer_calls(pipe, monkeypatch) -> list[dict]:
    """Every call's keyword arguments to `pipe`'s transformer, recorded as it samples."""
    calls: list[dict] = []
    forward = type(pipe.transformer).forward

    def record(self, *args, **kwargs):
        calls.append(kwargs)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(pipe.transformer), "forward", record)
    return calls


def test_a_released_folder_is_recognised_from_its_files(released):
    assert families.detect(released) is families.get("chroma")
    index = json.loads((released / "model_index.json").read_text())
    assert index["_class_name"] == "ChromaPipeline" and index["image_encoder"] == [None, None]


def test_training_conditions_and_predicts_as_the_pipeline_samples(released, monkeypatch):
    """T5's states under the tokenizer's mask, then the transformer given the caption's tokens and one padding token,
    the image tokens all, at (0, row, column) positions, sigma as its timestep: the family's conditioner and
    denoiser call give the prediction the pipeline's transformer call gives, for a caption and the empty one
    (caption dropout is the pipeline's unconditional half)."""
    from sdtrain.models.tokenizer import CaptionTokenizer

    family = families.get("chroma")
    pipe = family.sampling.prepare(_pipeline(released))
    calls = _transformer_calls(pipe, monkeypatch)
    captions = ["a red circle", ""]
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(1))  # 32 px: the VAE's 4x
    pipe(captions, num_inference_steps=1, guidance_scale=1.0, height=32, width=32, output_type="latent",
         max_sequence_length=TEXT_LENGTH, latents=pipe._pack_latents(latents, 2, 16, 8, 8))
    (call,) = calls
    ids, masks = family.token_inputs(CaptionTokenizer([pipe.tokenizer], family)(captions))
    with torch.no_grad():
        text = family.conditioner.encode_text([pipe.text_encoder], ids, captions, masks)
        condition = family.denoising.condition(text, {}, torch.device("cpu"))
        torch.testing.assert_close(text["text_emb"], call["encoder_hidden_states"])
        lengths = [len(pipe.tokenizer(c).input_ids) for c in captions]
        assert condition["text_attended"].sum(dim=1).tolist() == [n + 1 for n in lengths]
        mask = call["attention_mask"]
        assert mask.dtype == torch.bool and torch.equal(mask[:, :TEXT_LENGTH], condition["text_attended"])
        assert mask[:, TEXT_LENGTH:].all() and mask.shape[1] == TEXT_LENGTH + 16
        predicted = family.denoising.denoise(pipe.transformer, latents, call["timestep"] * 1000, condition)
        sampled = pipe.transformer(**call)[0]
    torch.testing.assert_close(predicted, pipe._unpack_latents(sampled, 32, 32, pipe.vae_scale_factor))


def test_plain_diffusers_adds_its_float_mask_where_sdtrain_masks(released, monkeypatch):
    """The documented difference: ChromaPipeline's own mask is 0/1 floats (added to the attention scores), the
    prepared pipeline's is boolean; where it masks, the image differs."""
    plain = _pipeline(released)
    calls = _transformer_calls(plain, monkeypatch)
    before = _image(plain)
    assert calls[0]["attention_mask"].is_floating_point()
    prepared = families.get("chroma").sampling.prepare(_pipeline(released))
    calls.clear()
    after = _image(prepared)
    assert calls[0]["attention_mask"].dtype == torch.bool
    assert np.abs(after - before).max() > 1e-4


def test_sampling_runs_true_guidance_against_the_empty_prompt_by_default(released, monkeypatch):
    from sdtrain.models.pipeline import sample_images

    family = families.get("chroma")
    assert family.sampling.defaults(None) == {"guidance": 5.0}
    pipe = family.sampling.prepare(_pipeline(released))
    calls = _transformer_calls(pipe, monkeypatch)
    sample_images(pipe, ["a red circle"], steps=2, size=32)
    assert len(calls) == 4  # two steps, each the prompt's call and the negative's
    negative = calls[1]["attention_mask"][0, :TEXT_LENGTH]
    assert negative.sum() == 2  # "" is </s> alone, and one padding token
    calls.clear()
    sample_images(pipe, ["a red circle"], steps=2, size=32, guidance=1.0)
    assert len(calls) == 2


def test_the_released_architecture_s_parameters(capsys):
    assert main(["params", str(config_path("diffusion.yaml")), "run_dir=x", "data.shards=x", "model.vae=null",
                 "model.family=chroma", "model.preset=chroma", "model.unet_overrides={}", "data.resolution=1024",
                 "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["transformer"]["cls"] == "ChromaTransformer2DModel"
    # Flux.1-schnell's 11,891,178,560 less its per-block and final modulations and its time and vector embedders
    # (3,269,480,448), plus the approximator (278,285,312).
    assert rows["transformer"]["parameters"] == 8_899_983_424
    assert rows["text_encoder"]["cls"] == "T5EncoderModel"


def test_the_original_layout_is_what_diffusers_converts_at_the_released_width():
    """At Chroma1-HD's widths (on the meta device: diffusers' converter splits a single block's linear1 at 3,072
    columns, so no smaller model goes through it), the layout sdtrain writes is the one diffusers' from_single_file
    reads: every weight back under its own name and shape, and read back by sdtrain's own reader likewise."""
    from diffusers import ChromaTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        model = ChromaTransformer2DModel(num_layers=2, num_single_layers=2)
    state = model.state_dict()
    original = chroma.to_original(state)
    assert "double_blocks.1.img_attn.qkv.weight" in original and "distilled_guidance_layer.norms.4.scale" in original
    assert not any(key.startswith(("time_in.", "vector_in.", "guidance_in.")) or "_mod." in key or "modulation" in key
                   for key in original)
    converted = convert_chroma_transformer_checkpoint_to_diffusers(dict(original))
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in state.items()}
    back = dict(chroma.iter_from_original(list(original), original.__getitem__))
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in state.items()}
    shapes = {k: tuple(v.shape) for k, v in original.items()}
    settings = chroma.transformer_config(shapes, {})
    assert {k: settings[k] for k in ("num_layers", "num_single_layers", "approximator_layers", "attention_head_dim",
                                     "num_attention_heads", "approximator_hidden_dim", "approximator_num_channels")} \
        == {"num_layers": 2, "num_single_layers": 2, "approximator_layers": 5, "attention_head_dim": 128,
            "num_attention_heads": 24, "approximator_hidden_dim": 5120, "approximator_num_channels": 64}
    # Flux.1's reader leaves such a file to Chroma's.
    assert families.family_of_keys(list(original)) is families.get("chroma")
    assert families.family_of_keys(["model.diffusion_model." + k for k in original]) is families.get("chroma")


def test_the_kohya_lora_names_every_adapter_by_a_weight_of_the_original_layout(released):
    """ComfyUI's LoRA key map names each weight ``lora_unet_`` + its path in the model's own (original) layout,
    dots as underscores: every adapter the default LoRA trains must have such a name, q, k and v fused."""
    from diffusers import ChromaTransformer2DModel

    transformer = ChromaTransformer2DModel.from_pretrained(released / "transformer")
    config = yaml_targets()
    layers = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in config):
            layers[name] = (torch.randn(4, module.in_features), torch.randn(module.out_features, 4), 4.0)
    kohya = families.get("chroma").files.kohya_lora("transformer", layers, transformer.config)
    original = chroma.to_original(transformer.state_dict())
    names = {key.rsplit(".", 2)[0] for key in kohya}
    by_weight = {"lora_unet_" + key[:-len(".weight")].replace(".", "_") for key in original if key.endswith(".weight")}
    assert names <= by_weight
    assert {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_txt_attn_qkv",
            "lora_unet_single_blocks_1_linear1", "lora_unet_single_blocks_1_linear2",
            "lora_unet_final_layer_linear"} <= names
    qkv = kohya["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"]
    assert qkv.shape == (3 * 32, 12)  # to_q, to_k and to_v's adapters, block-diagonal


def yaml_targets() -> list[str]:
    import yaml

    return yaml.safe_load((CONFIGS / "chroma-lora.yaml").read_text())["lora"]["target_modules"]


def test_a_single_file_in_the_original_layout_reads_back_weight_for_weight(tmp_path, released):
    from diffusers import ChromaTransformer2DModel

    transformer = ChromaTransformer2DModel.from_pretrained(released / "transformer")
    out = tmp_path / "chroma.safetensors"
    family = families.get("chroma")
    family.files.single_file.write(out, {"transformer": transformer}, half=False, scheduler=None, text_layout="auto",
                             text_source=None)
    assert families.detect(out) is family
    keys = load_file(str(out))
    assert "double_blocks.0.img_attn.qkv.weight" in keys and "distilled_guidance_layer.layers.1.in_layer.bias" in keys
    loaded = chroma.load_transformer_file(out)
    assert loaded.config.axes_dims_rope == [4, 6, 6] and loaded.config.approximator_layers == 2
    for key, tensor in transformer.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    # ComfyUI's whole checkpoints keep it under model.diffusion_model.
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(out), framework="pt") as file:
        metadata = file.metadata()  # the tiny model's RoPE axes: a file without them takes the released ones
    prefixed = tmp_path / "comfyui.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in keys.items()}, str(prefixed), metadata=metadata)
    assert families.detect(prefixed) is family
    assert torch.equal(chroma.load_transformer_file(prefixed).proj_out.weight, transformer.proj_out.weight)
    # A file that lacks a weight is one line naming it.
    broken = tmp_path / "broken.safetensors"
    save_file({k: v for k, v in keys.items() if k != "single_blocks.1.linear2.bias"}, str(broken), metadata=metadata)
    with pytest.raises(UserError, match=r"broken.safetensors: .*single_blocks\.1\.linear2\.bias"):
        chroma.load_transformer_file(broken)


def test_textual_inversion_is_refused_in_one_line(tmp_path, released, shapes_dir, capsys):
    assert main(["train", str(CONFIGS / "textual-inversion.yaml"), f"run_dir={tmp_path / 'ti'}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={shapes_dir}", "train.max_steps=1",
                 "textual_inversion.placeholder_token=<shp>", "textual_inversion.initializer_token=circle"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert "textual_inversion learns CLIP token vectors" in error[-1] and "mode: lora" in error[-1]


# ------------------------------------------------------------------------------------------ end to end (slow)

@pytest.mark.slow
def test_a_lora_resumes_bitwise_after_kill_9(tmp_path, released, shapes_dir):
    resumes_bitwise_after_kill_9(lambda run: _command("lora", run, released, shapes_dir, 3), tmp_path)


@pytest.mark.slow
def test_a_lora_loads_whole_through_chroma_s_loader_and_changes_the_image(tmp_path, released, shapes_dir):
    from peft.tuners.lora import LoraLayer

    from sdtrain.export import export_run

    run = tmp_path / "lora"
    assert main(["train", str(CONFIGS / "chroma-lora.yaml"), f"run_dir={run}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={shapes_dir}", "train.max_steps=2",
                 "data.aspect_buckets=false", "lora.rank=4", "lora.alpha=4", "optim.lr=0.01"]) == 0
    out = export_run(run, tmp_path / "out")
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.") for k in keys)
    before = _image(_pipeline(released))
    with_lora = _pipeline(released)
    with_lora.load_lora_weights(out)
    in_file = {k.removeprefix("transformer.").rsplit(".lora", 1)[0] for k in keys}
    attached = {name for name, module in with_lora.transformer.named_modules() if isinstance(module, LoraLayer)}
    assert attached == in_file and any(name.endswith("proj_mlp") for name in attached)
    assert np.abs(_image(with_lora) - before).max() > 1e-3
    kohya = load_file(str(next(out.glob("*kohya*.safetensors"))))
    assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in kohya
    assert "- chroma" in (out / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "dreambooth"])
def test_full_and_dreambooth_exports_load_in_diffusers_and_change_the_image(mode, tmp_path, released, shapes_dir):
    from sdtrain.export import export_run

    run = tmp_path / mode
    assert main(_command(mode, run, released, shapes_dir, 2)) == 0
    out = export_run(run, tmp_path / "out")
    assert families.detect(out) is families.get("chroma")
    assert np.abs(_image(_pipeline(out)) - _image(_pipeline(released))).max() > 1e-3


@pytest.mark.slow
def test_from_scratch_it_trains_exports_and_generates(tmp_path, tiny_scratch_run):
    run = tiny_scratch_run("chroma", tmp_path / "scratch", 2, f"model.t5_text_length={TEXT_LENGTH}",
                           "data.caption_dropout=0.25", "validation.prompts=[a red circle]", "validation.steps=2")
    assert (run / "samples" / "step_00000002.png").is_file()
    out = tmp_path / "pipeline"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "ChromaPipeline"
    _image(_pipeline(out))
    assert main(["generate", "--model", str(out), "--prompt", "a red circle", "--steps", "2",
                 "--out", str(tmp_path / "images")]) == 0
    assert (tmp_path / "images" / "grid.png").is_file()


@pytest.mark.slow
def test_encoded_shards_hold_t5_s_states_and_the_tokenizer_s_mask(tmp_path, released, shapes_dir):
    """What the shards store is what the pipeline's T5 gives (under the tokenizer's mask), with that mask: training
    on the shards then runs without T5 and makes the transformer's mask from it."""
    from sdtrain.data.encoded import load_npy
    from sdtrain.data.order import read_shard, resolve_shards

    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(released), "--out", str(encoded),
                 "--resolution", "32", "--dtype", "float32", "--t5-text-length", str(TEXT_LENGTH)]) == 0
    sample = next(iter(read_shard(resolve_shards(str(encoded))[0].url)))
    caption = sample["txt"].decode().splitlines()[0]
    states, mask = load_npy(sample["text_emb.npy"]), load_npy(sample["text_mask.npy"])
    if states.ndim == 3:  # several captions per sample: the first line's
        states, mask = states[0], mask[0]
    expected, _ = _pipeline(released)._get_t5_prompt_embeds(caption, max_sequence_length=TEXT_LENGTH)
    np.testing.assert_allclose(states, expected[0].detach().numpy(), rtol=1e-4, atol=1e-5)
    assert mask.sum() == len(_pipeline(released).tokenizer(caption, truncation=True,
                                                             max_length=TEXT_LENGTH).input_ids)
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={encoded}", "train.max_steps=2",
                 "data.caption_dropout=0.25", "lora.rank=4"]) == 0


@pytest.mark.slow
def test_a_single_file_export_is_a_training_source_and_diffusers_layout(tmp_path, released, shapes_dir, capsys):
    """`export --single-file` writes the transformer alone in the original layout; sdtrain trains from it as
    model.transformer, and `generate` on it says in one line what to pass instead."""
    from sdtrain.loaders.pipelines import pipeline_from_run

    run = tmp_path / "full"
    assert main(_command("full", run, released, shapes_dir, 2)) == 0
    single = tmp_path / "chroma.safetensors"
    assert main(["export", str(run), str(single), "--single-file"]) == 0
    assert families.detect(single) is families.get("chroma")
    trained = pipeline_from_run(run).transformer.state_dict()
    loaded = chroma.load_transformer_file(single).state_dict()
    assert all(torch.equal(loaded[key], tensor) for key, tensor in trained.items())
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'again'}", *COMMON,
                 f"model.pretrained={released}", f"model.transformer={single}", f"data.shards={shapes_dir}",
                 "train.max_steps=1", "lora.rank=4"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(single), "--prompt", "a red circle", "--out", str(tmp_path / "x")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "transformer alone" in error[0] and str(single) in error[0]


def _calls(received: list[dict]):
    def denoiser(**kwargs):
        received.append(kwargs)
        return (torch.zeros_like(kwargs["hidden_states"]),)
    return denoiser


def test_captions_that_fill_t5s_length_are_attended_with_no_mask():
    """An explicit mask (all True included) is what cuDNN's SDPA backward on Hopper answers with NaN gradients
    (pytorch/pytorch#196678): where nothing is masked the call passes none; padding is masked."""
    call, received = families.get("chroma").denoising, []
    noisy, states = torch.zeros(2, 4, 8, 8), torch.zeros(2, 5, 8)
    for lengths in ([5, 5], [5, 2]):
        mask = (torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]).float()
        condition = call.condition({"text_emb": states, "text_mask": mask}, {}, "cpu")
        call.denoise(_calls(received), noisy, torch.tensor([500.0, 500.0]), condition)
    full, padded = (kwargs["attention_mask"] for kwargs in received)
    assert full is None and not bool(padded.all()) and padded.shape == (2, 5 + 16)
