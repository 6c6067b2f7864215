"""Flux.1 in Black Forest Labs' original layout: the transformer both ways, read back by diffusers' own converter and
from_single_file, LoRA adapters as kohya files read by diffusers, and (slow, with a local ComfyUI) ComfyUI's loaders.

diffusers' Flux converters take Flux.1's full width as given (3072 wide, MLP 12288, where they split a single
block's fused linear1): a tiny model goes through them with `_diffusers_at_width`, and the full width, on the meta
device or as bare LoRA factors, goes through them untouched."""

from __future__ import annotations

import copy
import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sdtrain.errors import UserError
from sdtrain.models.families import bfl_flux as flux
from sdtrain.models.single_file import FORMAT_VERSION

from . import comfyui

TINY = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
TINY_WIDTH = TINY["attention_head_dim"] * TINY["num_attention_heads"]
# Flux.1's own sizes, but one block of each kind: built on the meta device, or as LoRA factors only.
FULL = dict(in_channels=64, num_layers=1, num_single_layers=1)


def _tiny(guidance: bool = True, seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**TINY, guidance_embeds=guidance)
    # Away from the initialisation, so no weight (a zero bias, a norm's ones) hides a misplaced one.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def _meta_full(guidance: bool = True):
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        return FluxTransformer2DModel(**FULL, guidance_embeds=guidance)


def _inputs(guidance: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = w = 4
    ids = torch.zeros(h * w, 3)
    ids[:, 1] = torch.arange(h).repeat_interleave(w)
    ids[:, 2] = torch.arange(w).repeat(h)
    inputs = {"hidden_states": torch.randn(1, h * w, TINY["in_channels"], generator=g),
              "encoder_hidden_states": torch.randn(1, 5, TINY["joint_attention_dim"], generator=g),
              "pooled_projections": torch.randn(1, TINY["pooled_projection_dim"], generator=g),
              "timestep": torch.tensor([0.7]), "img_ids": ids, "txt_ids": torch.zeros(5, 3)}
    if guidance:
        inputs["guidance"] = torch.tensor([3.5])
    return inputs


@torch.no_grad()
def _run(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs, return_dict=False)[0]


class _TorchAtWidth:
    """torch as diffusers' Flux converter sees it, splitting a single block's linear1 at the tiny width where the
    converter names Flux.1's (3072 x 3 + 12288)."""

    def __init__(self, width: int):
        self._rows = (width, width, width, 4 * width)

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def split(self, tensor, sizes, dim=0):
        if isinstance(sizes, (list, tuple)) and tuple(sizes) == (3072, 3072, 3072, 12288):
            sizes = self._rows
        return torch.split(tensor, sizes, dim=dim)


@pytest.fixture
def _diffusers_at_width(monkeypatch):
    import diffusers.loaders.single_file_utils as single_file_utils

    monkeypatch.setattr(single_file_utils, "torch", _TorchAtWidth(TINY_WIDTH))


def _config_matches(read: dict, model) -> None:
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    assert read.pop("out_channels", config["in_channels"]) == (config.pop("out_channels") or config["in_channels"])
    assert {**read, "axes_dims_rope": list(read["axes_dims_rope"])} == \
        {**config, "axes_dims_rope": list(config["axes_dims_rope"])}


# --------------------------------------------------------------------------------------------------- transformer

@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_round_trip_is_exact_and_the_shapes_tell_the_config(guidance):
    model = _tiny(guidance)
    state = model.state_dict()
    original = flux.to_original(state, model.config)
    assert any(k.startswith("guidance_in.") for k in original) == guidance
    assert {"double_blocks.0.img_attn.qkv.weight", "single_blocks.1.linear1.bias", "img_in.weight", "txt_in.bias",
            "time_in.in_layer.weight", "vector_in.out_layer.bias", "final_layer.adaLN_modulation.1.weight",
            "double_blocks.0.txt_attn.norm.key_norm.scale", "single_blocks.0.modulation.lin.weight"} <= set(original)
    # linear1 holds q, k, v and the MLP's input, in that order.
    assert torch.equal(original["single_blocks.1.linear1.weight"][2 * TINY_WIDTH:3 * TINY_WIDTH],
                       state["single_transformer_blocks.1.attn.to_v.weight"])
    # BFL's final modulation is (shift, scale), diffusers' (scale, shift).
    assert torch.equal(original["final_layer.adaLN_modulation.1.weight"][:TINY_WIDTH],
                       state["norm_out.linear.weight"][TINY_WIDTH:])

    metadata = flux.original_metadata(model.config)
    _config_matches(flux.transformer_config_from_original(original, metadata), model)
    for back in (flux.from_original(original, model.config),
                 flux.from_original({"model.diffusion_model." + k: v for k, v in original.items()}, model.config)):
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_diffusers_converter_reads_every_key_at_full_width(guidance):
    """Untouched, on Flux.1's real shapes (meta tensors): diffusers' converter reads every key we write, and makes
    each of the model's weights in its shape."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    model = _meta_full(guidance)
    state = model.state_dict()
    written = flux.to_original(state, model.config)
    left = dict(written)
    converted = convert_flux_transformer_checkpoint_to_diffusers(left)
    assert left == {}, f"diffusers left {sorted(left)[:3]} unread"
    assert converted.keys() == state.keys()
    assert all(converted[k].shape == state[k].shape for k in state)
    # Flux.1's own rope axes, as a file without our metadata (BFL's) is read.
    _config_matches(flux.transformer_config_from_original({k: v.shape for k, v in written.items()}), model)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_diffusers_converter_gives_the_same_model(guidance, _diffusers_at_width):
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    model = _tiny(guidance)
    converted = convert_flux_transformer_checkpoint_to_diffusers(flux.to_original(model.state_dict(), model.config))
    fresh = FluxTransformer2DModel(**TINY, guidance_embeds=guidance).eval()
    fresh.load_state_dict(converted, strict=True)
    inputs = _inputs(guidance)
    torch.testing.assert_close(_run(fresh, inputs), _run(model, inputs), rtol=0, atol=0)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_from_single_file_loads_what_save_original_wrote(guidance, tmp_path, _diffusers_at_width):
    from diffusers import FluxTransformer2DModel

    model = _tiny(guidance)
    path = flux.save_original(tmp_path / "flux.safetensors", model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flux.safetensors"]  # no temporary left
    with safe_open(str(path), framework="pt") as f:
        metadata, shapes = f.metadata(), {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    assert metadata["sdtrain_format"] == FORMAT_VERSION and metadata["model_family"] == "flux"
    assert json.loads(metadata[flux.CONFIG_KEY]) == {"axes_dims_rope": [4, 6, 6], "patch_size": 1}
    _config_matches(flux.transformer_config_from_original(shapes, metadata), model)
    # A tiny model's rope axes cannot be Flux.1's: without the metadata the file says so instead of loading wrong.
    with pytest.raises(ValueError, match=flux.CONFIG_KEY):
        flux.transformer_config_from_original(shapes)

    model.save_config(tmp_path / "config")
    loaded = FluxTransformer2DModel.from_single_file(str(path), config=str(tmp_path / "config"),
                                                     local_files_only=True, torch_dtype=torch.float32).eval()
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    # The same weights, but read in place from the file, at addresses BLAS may take another path for (safetensors
    # aligns tensors to 8 bytes): the last bits of an output can differ.
    inputs = _inputs(guidance)
    torch.testing.assert_close(_run(loaded, inputs), _run(model, inputs), rtol=1e-5, atol=1e-5)

    half = load_file(str(flux.save_original(tmp_path / "half.safetensors", model, half=True)))
    assert {t.dtype for t in half.values()} == {torch.bfloat16}


def test_conversions_refuse_what_has_no_place():
    model = _tiny()
    state = model.state_dict()
    with pytest.raises(ValueError, match="extra.weight"):
        flux.to_original({**state, "extra.weight": torch.zeros(1)}, model.config)
    with pytest.raises(ValueError, match="to_k.bias"):
        flux.to_original({k: v for k, v in state.items() if k != "transformer_blocks.0.attn.to_k.bias"},
                         model.config)
    original = flux.to_original(state, model.config)
    with pytest.raises(ValueError, match="not Flux.1's"):
        flux.from_original({**original, "extra.weight": torch.zeros(1)}, model.config)
    with pytest.raises(UserError, match="cannot be written"):
        flux.save_original(Path("/nonexistent/never.safetensors"), _Renamed(model))


class _Renamed:
    """A model whose config claims a block it has no weights for."""

    def __init__(self, model):
        self.config = {**model.config, "num_single_layers": model.config.num_single_layers + 1}
        self.state_dict = model.state_dict


# --------------------------------------------------------------------------------------------------- LoRA

def _linear_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _with_lora(model, targets: list[str], seed: int = 2):
    """A copy of `model` with a peft LoRA on `targets` (full paths): rank 4, alpha 6, random non-zero factors;
    one part of a fused module at another scale, one at another rank with the same scale."""
    from peft import LoraConfig, inject_adapter_in_model

    pattern = {"rank_pattern": {}, "alpha_pattern": {}}
    if "transformer_blocks.0.attn.to_k" in targets:
        pattern["alpha_pattern"]["transformer_blocks.0.attn.to_k"] = 2
    if "transformer_blocks.0.attn.add_v_proj" in targets:
        pattern["rank_pattern"]["transformer_blocks.0.attn.add_v_proj"] = 2
        pattern["alpha_pattern"]["transformer_blocks.0.attn.add_v_proj"] = 3
    model = copy.deepcopy(model)
    # A regex over whole names: a list would take "proj_out" for every module named so.
    config = LoraConfig(r=4, lora_alpha=6, target_modules="|".join(re.escape(t) for t in targets), **pattern)
    inject_adapter_in_model(config, model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    return model


def _peft_layers(model) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    from peft.tuners.lora import LoraLayer

    return {name: (m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach(),
                   float(m.lora_alpha["default"]))
            for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _merged(model) -> dict[str, torch.Tensor]:
    """The effective weights of a model with LoRA layers: merged, on the plain keys."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m.merge()
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()
            if ".lora_" not in k and ".lokr_" not in k}


def _delta(down: torch.Tensor, up: torch.Tensor, alpha: float) -> torch.Tensor:
    return up.double() @ down.double() * (alpha / down.shape[0])


def _full_width_layers(model, names: list[str], seed: int = 3) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """LoRA factors for modules of a (meta) model: rank 4, alpha 6, except a few at other scales or ranks."""
    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    layers = {}
    for name in names:
        rank, alpha = (2, 3.0) if name.endswith("add_v_proj") else (4, 2.0 if name.endswith("attn.to_k") else 6.0)
        m = modules[name]
        layers[name] = (torch.randn(rank, m.in_features, generator=g) * 0.1,
                        torch.randn(m.out_features, rank, generator=g) * 0.1, alpha)
    return layers


# The modules outside the blocks, which diffusers' kohya reader names without the transformer's prefix.
_OUTSIDE_BLOCKS = ("x_embedder", "context_embedder", "time_text_embed.", "norm_out.", "proj_out")


def _with_transformer_prefix(read: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' kohya Flux reader (0.42) names the LoRA of img_in, txt_in, time_in, vector_in, guidance_in and
    final_layer without ``transformer.``, so load_lora_weights, which takes only ``transformer.*``, drops them
    (ComfyUI and kohya apply them). Their factors are right: here they get the prefix and are checked too."""
    outside = {k for k in read if not k.startswith("transformer.")}
    assert all(k.startswith(_OUTSIDE_BLOCKS) for k in outside), sorted(outside)[:3]
    return {k if k.startswith("transformer.") else f"transformer.{k}": v for k, v in read.items()}


def test_kohya_lora_fuses_to_the_same_deltas():
    config = {**TINY, "guidance_embeds": True}
    g = torch.Generator().manual_seed(0)
    w = TINY_WIDTH

    def layer(rows, rank, alpha):
        return torch.randn(rank, w, generator=g), torch.randn(rows, rank, generator=g), alpha

    # Equal scales: the factors as trained, alpha keeping the scale at the summed rank.
    qkv = {f"transformer_blocks.0.attn.to_{p}": layer(w, r, 1.5 * r) for p, r in zip("qkv", (4, 2, 4))}
    out = flux.kohya_lora(qkv, config)
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    assert out[f"{name}.alpha"].ndim == 0 and out[f"{name}.alpha"].item() == 1.5 * 10
    assert torch.equal(out[f"{name}.lora_down.weight"], torch.cat([qkv[k][0] for k in qkv]))
    assert torch.equal(out[f"{name}.lora_up.weight"][w:2 * w, 4:6], qkv["transformer_blocks.0.attn.to_k"][1])
    # Only some of linear1's parts, at different scales: zero rows for the others, each part's own delta.
    parts = {"single_transformer_blocks.1.attn.to_q": layer(w, 4, 6.0),
             "single_transformer_blocks.1.proj_mlp": layer(4 * w, 3, 1.0)}
    out = flux.kohya_lora(parts, config)
    name = "lora_unet_single_blocks_1_linear1"
    fused = _delta(out[f"{name}.lora_down.weight"], out[f"{name}.lora_up.weight"], out[f"{name}.alpha"].item())
    assert fused.shape == (7 * w, w)
    torch.testing.assert_close(fused[:w], _delta(*parts["single_transformer_blocks.1.attn.to_q"]), rtol=1e-6,
                               atol=1e-6)
    assert not fused[w:3 * w].any()
    torch.testing.assert_close(fused[3 * w:], _delta(*parts["single_transformer_blocks.1.proj_mlp"]), rtol=1e-6,
                               atol=1e-6)
    # The final modulation's rows as BFL orders them, the scale in the factors (diffusers ignores its alpha).
    norm_out = {"norm_out.linear": layer(2 * w, 4, 2.0)}
    out = flux.kohya_lora(norm_out, config)
    name = "lora_unet_final_layer_adaLN_modulation_1"
    assert out[f"{name}.alpha"].item() == 4
    expected = _delta(*norm_out["norm_out.linear"])
    got = _delta(out[f"{name}.lora_down.weight"], out[f"{name}.lora_up.weight"], 4)
    torch.testing.assert_close(got, torch.cat([expected[w:], expected[:w]]), rtol=1e-6, atol=1e-6)


def test_kohya_lora_refuses_paths_without_an_original():
    config = {**TINY, "guidance_embeds": False}
    pair = (torch.zeros(2, TINY_WIDTH), torch.zeros(TINY_WIDTH, 2), 2.0)
    for path in ("transformer_blocks.0.attn.norm_q", "transformer_blocks.3.attn.to_q",
                 "time_text_embed.guidance_embedder.linear_1", "unet.conv_in"):
        with pytest.raises(ValueError, match=path.replace(".", r"\.")):
            flux.kohya_lora({path: pair}, config)
    with pytest.raises(ValueError, match="rows"):
        flux.kohya_lora({"transformer_blocks.0.attn.to_q": (torch.zeros(2, TINY_WIDTH), torch.zeros(5, 2), 2.0)},
                        config)


# dev's layout by default (the suite's time), schnell's (no guidance embedding) slow.
@pytest.mark.parametrize("guidance", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["dev", "schnell"])
def test_diffusers_reads_every_kohya_key_at_full_width_with_the_same_deltas(guidance, tmp_path):
    """Untouched diffusers (its kohya reader splits linear1 at Flux.1's width): every module of the transformer,
    the fused ones at mixed scales and ranks, reads back with the delta peft would apply."""
    from diffusers import FluxPipeline

    model = _meta_full(guidance)
    layers = _full_width_layers(model, _linear_names(model))
    kohya = flux.kohya_lora(layers, model.config)
    assert all(k.startswith("lora_unet_") for k in kohya)
    assert all(v.ndim == 0 for k, v in kohya.items() if k.endswith(".alpha"))
    save_file(kohya, str(tmp_path / "lora.safetensors"))

    read = _with_transformer_prefix(FluxPipeline.lora_state_dict(str(tmp_path / "lora.safetensors")))
    assert {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in read} == set(layers)
    for name, layer in layers.items():
        down, up = read[f"transformer.{name}.lora_A.weight"], read[f"transformer.{name}.lora_B.weight"]
        torch.testing.assert_close(_delta(down, up, down.shape[0]), _delta(*layer), rtol=0, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_diffusers_applies_the_kohya_file_as_peft_merged_it(guidance, tmp_path):
    """Tiny, so the LoRA applies to a real model; a single block's q, k, v and proj_mlp (linear1, which diffusers'
    reader splits at Flux.1's width) are left to the full-width test and ComfyUI's."""
    from diffusers import FluxPipeline

    base = _tiny(guidance)
    fused_in_linear1 = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
    targets = [n for n in _linear_names(base)
               if not (n.startswith("single_transformer_blocks.") and n.endswith(fused_in_linear1))]
    adapted = _with_lora(base, targets)
    layers = _peft_layers(adapted)
    assert set(layers) == set(targets)
    save_file(flux.kohya_lora(layers, base.config), str(tmp_path / "lora.safetensors"))

    loaded = copy.deepcopy(base)
    read = _with_transformer_prefix(FluxPipeline.lora_state_dict(str(tmp_path / "lora.safetensors")))
    FluxPipeline.load_lora_into_transformer(read, None, transformer=loaded)
    got, expected = _merged(loaded), _merged(adapted)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


# --------------------------------------------------------------------------------------------------- ComfyUI

_COMFY_SCRIPT = comfyui.PREAMBLE + comfyui.FLUX_TINY_DETECT + comfyui.LOAD_LORA + textwrap.dedent('''
    model_path, lora_path, expected_path = sys.argv[1:4]
    import comfy.sd, comfy.lora, comfy.utils
    collect_messages()
    flux_tiny_detection(model_path)

    patcher = comfy.sd.load_diffusion_model(model_path, model_options={"dtype": torch.float32})
    net = patcher.model.diffusion_model
    written = load_file(model_path)
    state = net.state_dict()
    report = {"model": type(patcher.model).__name__, "config": type(patcher.model.model_config).__name__,
              "missing": sorted(set(written) - set(state)), "unexpected": sorted(set(state) - set(written)),
              "weights_equal": all(torch.equal(state[k], written[k]) for k in written if k in state),
              "load_warnings": [m for m in messages if "missing" in m or "unexpected" in m]}

    lora, key_map, patches, modules = load_lora(patcher, lora_path, report)

    patcher.add_patches(patches, 1.0)
    patcher.patch_model()
    expected = load_file(expected_path)
    state = net.state_dict()
    report["max_weight_diff"] = max((state[k] - expected["weight." + k]).abs().max().item() for k in state)
    report["worst"] = sorted(state, key=lambda k: -(state[k] - expected["weight." + k]).abs().max().item())[:3]
    inputs = {k[len("input."):]: v for k, v in expected.items() if k.startswith("input.")}
    with torch.no_grad():
        out = net.forward_orig(inputs["img"], inputs["img_ids"], inputs["txt"], inputs["txt_ids"],
                               inputs["timesteps"], inputs["y"], inputs.get("guidance"))
    report["max_output_diff"] = (out - expected["output"]).abs().max().item()
    print("REPORT " + json.dumps(report))
''')


def _save_expected(base, adapted, guidance: bool, path) -> None:
    """What ComfyUI's patched model must hold and compute, at `path`: the weights peft merged in BFL's layout
    (``weight.*``), the inputs as its forward_orig takes them (the same packed tokens, its ids batched, time and
    guidance unscaled: ``input.*``) and diffusers' output with the merged weights (``output``)."""
    merged = _merged(adapted)
    inputs = _inputs(guidance)
    expected = {"weight." + k: v.contiguous() for k, v in flux.to_original(merged, base.config).items()}
    merged_model = copy.deepcopy(base)
    merged_model.load_state_dict(merged)
    expected["output"] = _run(merged_model, inputs)
    expected.update({"input.img": inputs["hidden_states"], "input.img_ids": inputs["img_ids"][None],
                     "input.txt": inputs["encoder_hidden_states"], "input.txt_ids": inputs["txt_ids"][None],
                     "input.timesteps": inputs["timestep"], "input.y": inputs["pooled_projections"]})
    if guidance:
        expected["input.guidance"] = inputs["guidance"]
    save_file({k: v.contiguous() for k, v in expected.items()}, str(path))


@pytest.mark.slow
@comfyui.needs_comfyui
@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_comfyui_loads_the_transformer_and_every_lora_key(guidance, tmp_path):
    """ComfyUI (its own venv, in a subprocess) loads our file as a Flux model with every key placed, and our kohya
    LoRA (every Linear, linear1 fused at mixed scales) with no key left: patched, it holds the weights peft merged
    and computes what diffusers computes with them."""
    base = _tiny(guidance)
    flux.save_original(tmp_path / "flux.safetensors", base)
    adapted = _with_lora(base, _linear_names(base))
    save_file(flux.kohya_lora(_peft_layers(adapted), base.config), str(tmp_path / "lora.safetensors"))
    _save_expected(base, adapted, guidance, tmp_path / "expected.safetensors")

    report = comfyui.run_comfyui(
        _COMFY_SCRIPT, str(tmp_path / "flux.safetensors"),
        str(tmp_path / "lora.safetensors"),
        str(tmp_path / "expected.safetensors"))
    print(report)
    assert report["model"] == "Flux" and report["config"] == ("Flux" if guidance else "FluxSchnell")
    assert report["missing"] == [] and report["unexpected"] == [] and report["load_warnings"] == []
    assert report["weights_equal"]
    assert report["not_loaded"] == [] and report["patched"] == report["lora_modules"]
    assert report["max_weight_diff"] < 1e-5
    assert report["max_output_diff"] < 1e-4


@pytest.mark.slow
@comfyui.needs_comfyui
@pytest.mark.parametrize("kind", ["dora", "lokr"])
def test_comfyui_applies_dora_and_lokr_files_to_the_fused_layers_as_peft_merged_them(kind, tmp_path):
    """DoRA and LoKr adapters on every Linear (q, k, v and a single block's MLP input among them, which BFL's layout
    fuses), written as a run writes them: ComfyUI reads DoRA's file of diffusers' module names (magnitudes as
    dora_scale) and LoKr's diffusers file as it is, every key placed on its rows of the fused layers, and patched
    it holds the weights peft merged and computes what diffusers computes with them."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from sdtrain.config import LoraConfig
    from sdtrain.loaders.adapters import add_lora
    from sdtrain.loaders.writers import KOHYA_WEIGHTS, LORA_WEIGHTS, save_lora
    from sdtrain.models.families import get
    from sdtrain.train.modes.lora import lora_settings

    base = _tiny(True)
    flux.save_original(tmp_path / "flux.safetensors", base)
    adapted = copy.deepcopy(base)
    add_lora(adapted, lora_settings(LoraConfig(type=kind, rank=2, alpha=3, target_modules=_linear_names(base))),
             "targets")
    with torch.no_grad():  # trained: every factor and magnitude away from where it started
        for name, parameter in adapted.named_parameters():
            if "lora_" in name or "lokr_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    save_lora({"transformer": adapted}, {"transformer": adapted.state_dict()}, tmp_path, get("flux"))
    _save_expected(base, adapted, True, tmp_path / "expected.safetensors")
    lora = tmp_path / (KOHYA_WEIGHTS if kind == "dora" else LORA_WEIGHTS)
    report = comfyui.run_comfyui(_COMFY_SCRIPT, str(tmp_path / "flux.safetensors"), str(lora),
                                 str(tmp_path / "expected.safetensors"))
    print(report)
    adapted_layers = sum(isinstance(m, BaseTunerLayer) for m in adapted.modules())
    assert report["not_loaded"] == [] and report["patched"] == adapted_layers > 0
    assert report["max_weight_diff"] < 1e-5 and report["max_output_diff"] < 1e-4
