"""Flux.1 single files through the CLI: `sdtrain export --single-file` of a tiny Flux run writes the transformer alone
in Black Forest Labs' layout, which plain diffusers' from_single_file loads with the run's weights (and the same
image); such a file (or ComfyUI's ``model.diffusion_model.``-prefixed one) is a training source as
``model.transformer`` or ``model.pretrained``; unreadable or foreign files are one line. With a local ComfyUI (slow):
ComfyUI loads the exported file and the kohya LoRA of a Flux LoRA run with no key left, patched to the weights we
merge."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sdtrain.checkpoint import latest_checkpoint, read_meta
from sdtrain.cli.main import main
from sdtrain.errors import UserError
from sdtrain.export import export_run
from sdtrain.loaders.adapters import merge_partial
from sdtrain.loaders.components import load_component, load_run_modules
from sdtrain.models import families
from sdtrain.models.families import ldm_checkpoint
from sdtrain.models.families.flux import FLUX

from . import comfyui
from .conftest import TINY, config_path
from .test_flux_layout import _TorchAtWidth

CONFIGS = config_path("diffusion.yaml").parents[1]
COMMON = [*TINY, "data.batch_size=2", "validation.prompts=[]", "evaluation.every_samples=0"]


@pytest.fixture(scope="module")
def flux_vae(tmp_path_factory, shapes_dir) -> Path:
    """Flux.1's 16-channel autoencoder (with a latent shift), tiny."""
    run = tmp_path_factory.mktemp("flux-vae") / "autoencoder"
    assert main(["train", str(config_path("autoencoder.yaml")), f"run_dir={run}", *TINY, "model.family=flux",
                 f"data.shards={shapes_dir}", "train.max_steps=2"]) == 0
    return run


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory, shapes_dir, flux_vae) -> Path:
    """A tiny Flux.1-dev-structured run from scratch (guidance embedding, double and single blocks), with EMA. It
    stands for a released model, so it keeps diffusers' initialisation: two steps from the reference's (zero
    output projection and modulations) leave a base through which adapters get almost no gradient."""
    run = tmp_path_factory.mktemp("flux-run") / "scratch"
    assert main(["train", str(config_path("diffusion.yaml")), f"run_dir={run}", *COMMON, "model.family=flux",
                 f"model.vae={flux_vae}", f"data.shards={shapes_dir}", "train.max_steps=2",
                 "model.t5_text_length=12", "model.denoiser_init=library"]) == 0
    return run


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, flux_run) -> Path:
    return export_run(flux_run, tmp_path_factory.mktemp("flux-pipeline") / "pipeline")


@pytest.fixture(scope="module")
def single(tmp_path_factory, flux_run) -> Path:
    out = tmp_path_factory.mktemp("flux-single") / "flux.safetensors"
    assert main(["export", str(flux_run), str(out), "--single-file"]) == 0
    return out


@pytest.fixture
def diffusers_at_width(monkeypatch, pipeline):
    """diffusers' converter splits a single block's linear1 at Flux.1's width: here at the tiny run's."""
    import diffusers.loaders.single_file_utils as single_file_utils

    config = json.loads((pipeline / "transformer" / "config.json").read_text())
    width = config["num_attention_heads"] * config["attention_head_dim"]
    monkeypatch.setattr(single_file_utils, "torch", _TorchAtWidth(width))


def _image(pipe) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe("a red circle", num_inference_steps=2, guidance_scale=3.0, height=32, width=32, output_type="np",
                max_sequence_length=pipe.tokenizer_2.model_max_length,
                generator=torch.Generator().manual_seed(0)).images[0]


def _same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _trained_transformer(run: Path) -> dict[str, torch.Tensor]:
    return merge_partial(load_run_modules(run, ["transformer"])["transformer"]).state_dict()


# --------------------------------------------------------------------------------------------------- export

def test_export_writes_the_transformer_alone_in_bfl_layout_which_diffusers_loads_as_trained(
        single, pipeline, flux_run, diffusers_at_width):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    # Nothing beside it but its model card (no tokenizer folders, no temporary): BFL's file is the transformer alone.
    assert sorted(p.name for p in single.parent.iterdir()) == ["README.md", "flux.safetensors"]
    with safe_open(str(single), framework="pt") as f:
        metadata, keys = f.metadata(), set(f.keys())  # noqa: SIM118 (not a dict)
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert metadata["model_family"] == "flux" and metadata["sdtrain_format"]
    assert {"img_in.weight", "txt_in.weight", "guidance_in.in_layer.weight", "double_blocks.0.img_attn.qkv.weight",
            "single_blocks.1.linear1.weight", "final_layer.adaLN_modulation.1.weight"} <= keys
    assert not any(k.startswith(("transformer_blocks.", "vae.", "text_encoders.")) for k in keys)
    assert dtypes == {"F32"}

    loaded = FluxTransformer2DModel.from_single_file(str(single), config=str(pipeline / "transformer"),
                                                     local_files_only=True, torch_dtype=torch.float32).eval()
    _same_weights(loaded.state_dict(), _trained_transformer(flux_run))
    # The exported pipeline with the file's transformer in place of its own draws the same image.
    before = _image(FluxPipeline.from_pretrained(pipeline, local_files_only=True))
    after = _image(FluxPipeline.from_pretrained(pipeline, transformer=loaded, local_files_only=True))
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-5)


def test_half_is_bf16_and_an_export_replaces_only_its_own_earlier_file(tmp_path, flux_run, capsys):
    out = tmp_path / "flux-bf16.safetensors"
    for _ in range(2):  # the second replaces the first
        assert main(["export", str(flux_run), str(out), "--single-file", "--half"]) == 0
    assert {t.dtype for t in load_file(str(out)).values()} == {torch.bfloat16}
    read = load_component("transformer", out, family=FLUX).state_dict()
    trained = _trained_transformer(flux_run)
    _same_weights(read, {k: v.to(torch.bfloat16).float() for k, v in trained.items()})
    assert {v.dtype for v in read.values()} == {torch.float32}  # trains from fp32 master weights

    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(1)}, str(foreign))
    assert main(["export", str(flux_run), str(foreign), "--single-file"]) == 2
    assert "not an earlier sdtrain single-file export" in capsys.readouterr().err
    assert load_file(str(foreign)).keys() == {"x"}


def test_export_refuses_a_text_layout_for_a_flux_file_in_one_line(tmp_path, flux_run, capsys):
    assert main(["export", str(flux_run), str(tmp_path / "a.safetensors"), "--single-file",
                 "--text-layout", "clip"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--text-layout" in error[0] and "transformer alone" in error[0]


# --------------------------------------------------------------------------------------------------- reading

def _finetune(config: str, run: Path, shapes_dir: Path, *sources: str, steps: int = 1) -> Path:
    assert main(["train", str(CONFIGS / config), f"run_dir={run}", *COMMON, *sources, f"data.shards={shapes_dir}",
                 f"train.max_steps={steps}", "optim.lr=0.01", "optim.warmup_steps=0"]) == 0
    return latest_checkpoint(run)


def test_full_fine_tune_from_the_file_as_model_transformer_trains_as_from_the_pipeline(
        tmp_path, single, pipeline, shapes_dir):
    """The file holds the pipeline's transformer: a step from either source gives the same weights, bit for bit."""
    from_file = _finetune("finetune-full.yaml", tmp_path / "file", shapes_dir, f"model.pretrained={pipeline}",
                          f"model.transformer={single}")
    from_folder = _finetune("finetune-full.yaml", tmp_path / "folder", shapes_dir, f"model.pretrained={pipeline}")
    assert read_meta(from_file)["sources"]["transformer"] == str(single.resolve())
    for name in ("model.safetensors", "ema.safetensors"):
        _same_weights(load_file(str(from_file / name)), load_file(str(from_folder / name)))


def test_lora_on_the_file_as_model_pretrained_with_the_other_components_named(tmp_path, single, pipeline,
                                                                              shapes_dir):
    run = tmp_path / "lora"
    checkpoint = _finetune("lora.yaml", run, shapes_dir, f"model.pretrained={single}", f"model.vae={pipeline}",
                           f"model.text_encoder={pipeline}", f"model.text_encoder_2={pipeline}",
                           f"model.tokenizer={pipeline}", steps=2)
    assert read_meta(checkpoint)["sources"]["transformer"] == str(single.resolve())
    # Both exports rebuild the adapters' base from the pinned single file.
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "lora_kohya.safetensors").is_file()
    assert main(["export", str(run), str(tmp_path / "merged.safetensors"), "--single-file"]) == 0
    merged = load_component("transformer", tmp_path / "merged.safetensors", family=FLUX).state_dict()
    _same_weights(merged, _trained_transformer(run))
    base = load_component("transformer", single, family=FLUX).state_dict()
    assert any(not torch.equal(merged[k], base[k]) for k in base)  # the adapters trained


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_low_precision_base_streams_from_the_file_into_what_the_folder_gives(single, pipeline, precision,
                                                                             monkeypatch):
    """kohya's and ComfyUI's users train from flux1-dev.safetensors: with model.frozen_precision the file is read a
    tensor at a time, each linear weight stored low as it comes (a 24 GB file never becomes 48 GB of fp32), into
    the same bits the pipeline folder gives. Planning (`weights=False`) reads the header alone."""
    from sdtrain.models.single_file import OpenFile

    streamed = load_component("transformer", single, family=FLUX, frozen_precision=precision)
    folder = load_component("transformer", pipeline, family=FLUX, frozen_precision=precision)
    assert not any(p.requires_grad or p.is_meta for p in streamed.parameters())
    _same_weights(streamed.state_dict(), folder.state_dict())
    _same_weights(dict(streamed.named_buffers()), dict(folder.named_buffers()))
    monkeypatch.setattr(OpenFile, "tensors", lambda *_: pytest.fail("a tensor was read"))
    shape = load_component("transformer", single, family=FLUX, weights=False)
    assert all(p.is_meta for p in shape.parameters())

    def settings(module) -> dict:
        return {k: v for k, v in module.config.items() if not k.startswith("_")}
    assert settings(shape) == settings(folder)


def test_comfyui_prefixed_whole_checkpoint_gives_its_transformer(tmp_path, single, flux_run):
    """ComfyUI's whole checkpoints hold the transformer under model.diffusion_model., beside other components."""
    with safe_open(str(single), framework="pt") as f:
        metadata = f.metadata()
    whole = {f"model.diffusion_model.{k}": v for k, v in load_file(str(single)).items()}
    whole.update({"vae.decoder.conv_in.weight": torch.zeros(2, 2, 3, 3),
                  "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight": torch.ones(4)})
    path = tmp_path / "comfy-flux.safetensors"
    save_file(whole, str(path), metadata=metadata)
    assert families.detect(path) is FLUX
    _same_weights(load_component("transformer", path, family=FLUX).state_dict(), _trained_transformer(flux_run))


def test_bad_flux_files_are_one_line_user_errors(tmp_path, single, pipeline, shapes_dir, capsys):
    state = load_file(str(single))
    with safe_open(str(single), framework="pt") as f:
        metadata = f.metadata()

    def write(name: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = metadata) -> Path:
        path = tmp_path / name
        save_file(tensors, str(path), metadata=meta)
        return path

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(single.read_bytes()[: single.stat().st_size // 2])
    cases = {
        truncated: "not a readable safetensors file",
        write("sd.safetensors", {"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4, 3, 3)}):
            "holds Stable Diffusion 1.x/2.x's model, no Flux.1 transformer",
        write("hole.safetensors", {k: v for k, v in state.items() if k != "double_blocks.0.img_attn.qkv.bias"}):
            r"cannot read it as a Flux.1 transformer .*double_blocks\.0\.img_attn\.qkv\.bias",
        write("extra.safetensors", {**state, "double_blocks.0.lora_extra.weight": torch.zeros(2)}):
            r"cannot read it as a Flux.1 transformer .*not Flux.1's",
        # Without our metadata a file is read with Flux.1's rope axes, which the tiny heads cannot take.
        write("no-metadata.safetensors", state, None): "transformer_config",
    }
    for path, message in cases.items():
        with pytest.raises(UserError, match=message) as caught:
            load_component("transformer", path, family=FLUX)
        assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UserError, match="transformer alone, no Flux.1 vae; set model.components.vae.source"):
        load_component("vae", single, family=FLUX)
    # Stable Diffusion's reader (what `generate --model FILE` asks of a file no family's keys name) says what it is.
    with pytest.raises(UserError, match="holds a Flux.1 transformer alone.*Flux pipeline folder"):
        ldm_checkpoint.inspect(single)
    with pytest.raises(UserError, match="pickle"):
        torch.save(state, tmp_path / "flux.ckpt")
        load_component("transformer", tmp_path / "flux.ckpt", family=FLUX)

    # Through the CLI: one line naming the file, no traceback.
    assert main(["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={pipeline}", f"model.transformer={truncated}", f"data.shards={shapes_dir}",
                 "train.max_steps=1"]) == 2
    error = capsys.readouterr().err
    assert str(truncated) in error.strip().splitlines()[-1] and "Traceback" not in error
    # The file as the whole model, the other components not named: one line naming it and what to set.
    assert main(["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={tmp_path / 'alone'}", *COMMON,
                 f"model.pretrained={single}", f"data.shards={shapes_dir}", "train.max_steps=1"]) == 2
    error = capsys.readouterr().err
    assert str(single) in error.strip().splitlines()[-1] and "model." in error.strip().splitlines()[-1]
    assert "Traceback" not in error


# --------------------------------------------------------------------------------------------------- ComfyUI

_COMFY_SCRIPT = comfyui.PREAMBLE + comfyui.FLUX_TINY_DETECT + comfyui.LOAD_LORA + textwrap.dedent('''
    model_path, lora_path, expected_path, resaved_path = sys.argv[1:5]
    import comfy.lora, comfy.model_patcher, comfy.sd, comfy.sd1_clip, comfy.utils
    collect_messages()
    metadata = flux_tiny_detection(model_path)

    patcher = comfy.sd.load_diffusion_model(model_path, model_options={"dtype": torch.float32})
    net = patcher.model.diffusion_model
    written = load_file(model_path)
    state = net.state_dict()
    report = {"model": type(patcher.model).__name__, "config": type(patcher.model.model_config).__name__,
              "missing": sorted(set(written) - set(state)), "unexpected": sorted(set(state) - set(written)),
              "weights_equal": all(torch.equal(state[k], written[k]) for k in written if k in state),
              "load_warnings": [m for m in messages if "missing" in m or "unexpected" in m]}

    # ComfyUI's CLIP-L module (under clip_l, as in its Flux text encoder) at the tiny text encoder's size, given its
    # encoder layers (what LoRA adapts; its token table is CLIP's vocabulary, ours a tiny one): the kohya
    # text-encoder keys must find their modules in it as in the real one.
    expected = load_file(expected_path)
    te_weights = {k[len("te."):]: v for k, v in expected.items() if k.startswith("te.text_model.encoder.")}
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.clip_l = comfy.sd1_clip.SDClipModel(textmodel_json_config=json.loads(sys.argv[5]),
                                                     dtype=torch.float32)
    clip = Holder()
    missing, unexpected = clip.clip_l.transformer.load_state_dict(te_weights, strict=False)
    report["clip_unexpected"] = unexpected
    report["clip_layers_missing"] = [k for k in missing if k.startswith("text_model.encoder.")]

    lora, key_map, patches, modules = load_lora(patcher, lora_path, report, clip)

    unet_patches = {k: v for k, v in patches.items() if k.startswith("diffusion_model.")}
    clip_patches = {k: v for k, v in patches.items() if k.startswith("clip_l.")}
    report["patched_te"] = len(clip_patches)
    patcher.add_patches(unet_patches, 1.0)
    patcher.patch_model()
    state = net.state_dict()
    report["max_weight_diff"] = max((state[k] - expected["merged." + k]).abs().max().item() for k in state)
    clip_patcher = comfy.model_patcher.ModelPatcher(clip, load_device=torch.device("cpu"),
                                                    offload_device=torch.device("cpu"))
    clip_patcher.add_patches(clip_patches, 1.0)
    clip_patcher.patch_model()
    clip_state = clip.clip_l.transformer.state_dict()
    report["max_te_weight_diff"] = max((clip_state[k] - expected["merged_te." + k]).abs().max().item()
                                       for k in clip_state if k.startswith("text_model.encoder."))

    # ComfyUI's own whole-checkpoint save (model.diffusion_model.*) of the file as loaded, which sdtrain reads back.
    # A model of its own: saving loads it into ComfyUI's model management, after which patches are not applied.
    fresh = comfy.sd.load_diffusion_model(model_path, model_options={"dtype": torch.float32})
    comfy.sd.save_checkpoint(resaved_path, fresh, metadata=metadata)
    print("REPORT " + json.dumps(report))
''')


@pytest.mark.slow
@comfyui.needs_comfyui
def test_comfyui_loads_the_exported_file_and_the_lora_runs_kohya_file(tmp_path, single, pipeline, shapes_dir,
                                                                       flux_run):
    """ComfyUI (its own venv, in a subprocess) loads `sdtrain export --single-file`'s file as a Flux model with every
    key placed; the kohya file of a LoRA run on the pipeline (transformer and CLIP adapted) loads with no key left,
    and patched gives the weights of the LoRA run's own merged single-file export. ComfyUI's whole-checkpoint
    save of the model reads back in sdtrain as the same transformer."""
    run = tmp_path / "lora"
    _finetune("lora.yaml", run, shapes_dir, f"model.pretrained={pipeline}", "lora.text_encoder=true", steps=2)
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    assert main(["export", str(run), str(tmp_path / "merged.safetensors"), "--single-file"]) == 0
    base_te = load_component("text_encoder", pipeline)
    merged_te = merge_partial(load_run_modules(run, ["text_encoder"])["text_encoder"])
    # ComfyUI names CLIP's weights as transformers 4 did, under text_model. (which transformers 5 leaves out).
    def clip_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in state.items()}

    expected = {**{f"merged.{k}": v for k, v in load_file(str(tmp_path / "merged.safetensors")).items()},
                **{f"te.{k}": v for k, v in clip_names(base_te.state_dict()).items()},
                **{f"merged_te.{k}": v for k, v in clip_names(merged_te.state_dict()).items()}}
    save_file({k: v.contiguous() for k, v in expected.items()}, str(tmp_path / "expected.safetensors"))
    c = base_te.config
    te_config = {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                 "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
                 "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
                 "hidden_act": c.hidden_act, "eos_token_id": c.eos_token_id}

    resaved = tmp_path / "comfy-resaved.safetensors"
    report = comfyui.run_comfyui(
        _COMFY_SCRIPT, str(single),
        str(tmp_path / "out" / "lora_kohya.safetensors"),
        str(tmp_path / "expected.safetensors"),
        str(resaved),
        json.dumps(te_config))
    print(report)
    assert report["model"] == "Flux" and report["config"] == "Flux"
    assert report["missing"] == [] and report["unexpected"] == [] and report["load_warnings"] == []
    assert report["weights_equal"]
    assert report["clip_unexpected"] == [] and report["clip_layers_missing"] == []
    assert report["not_loaded"] == [] and report["patched"] == report["lora_modules"]
    assert report["patched_te"] > 0 and report["patched"] > report["patched_te"]
    assert report["max_weight_diff"] < 1e-5 and report["max_te_weight_diff"] < 1e-5
    _same_weights(load_component("transformer", resaved, family=FLUX).state_dict(), _trained_transformer(flux_run))
