"""Z-Image's kohya LoRA file (``lora_kohya.safetensors``), written beside diffusers' by every LoRA run and export:
the transformer's adapters named as the authors' modules under ``lora_unet_`` (musubi-tuner's ComfyUI layout), the
adapters on to_q, to_k and to_v one adapter on the fused ``attention.qkv`` (downs stacked, ups block-diagonal, the
alpha keeping each part's alpha / rank), ``to_out.0`` as ``attention.out``.

* diffusers' own Z-Image loader (ZImagePipeline.load_lora_weights) reads that file whole, splitting each fused qkv
  adapter back into to_q, to_k and to_v: fused, the transformer carries what the run's diffusers file gives it;
* ComfyUI's Load LoRA (slow, with a local ComfyUI; tests/comfyui.py) maps every key onto its Z-Image model, the
  Lumina 2 NextDiT, which holds the authors' keys: patched, it holds the weights sdtrain's adapters merge into.
"""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sdtrain.cli.main import main
from sdtrain.export import export_run

from . import comfyui
from .test_zimage import _command, _pipeline, released  # noqa: F401 - released is a fixture used here

RANK, ALPHA = 4, 8
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
KOHYA = "lora_kohya.safetensors"
DIFFUSERS = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def lora_export(tmp_path_factory, released, shapes_dir) -> Path:  # noqa: F811 - the fixture imported above
    """A tiny Z-Image LoRA run (attention and feed-forward adapted, rank 4 at alpha 8) exported."""
    root = tmp_path_factory.mktemp("z-image-lora-file")
    run = root / "run"
    assert main([*_command("lora", run, released, shapes_dir, 2), f"lora.rank={RANK}", f"lora.alpha={ALPHA}",
                 f"lora.target_modules=[{','.join(TARGETS)}]"]) == 0
    return export_run(run, root / "out")


# The tiny pipeline's transformer's blocks: one refiner of each kind, two joint layers.
BLOCKS = ["noise_refiner.0", "context_refiner.0", "layers.0", "layers.1"]


def _originals(blocks: list[str]) -> dict[str, str]:
    """kohya's name -> the module in the authors' layout, of each module TARGETS adapts in `blocks`."""
    return {"lora_unet_" + original.replace(".", "_"): original
            for original in (f"{block}.{module}" for block in blocks
                             for module in ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2",
                                            "feed_forward.w3"))}


def test_a_lora_export_holds_the_kohya_file_in_the_authors_layout(lora_export):
    path = lora_export / KOHYA
    assert path.is_file()
    with safe_open(str(path), framework="pt") as file:
        assert file.metadata()["ss_network_module"] == "networks.lora"
    ours = load_file(str(path))
    names = _originals(BLOCKS)
    assert set(ours) == {f"{name}.{end}" for name in names for end in ("lora_down.weight", "lora_up.weight", "alpha")}

    # Tied to diffusers' file of the same run, whose ups carry the scale alpha / rank (its alpha is the rank).
    theirs = load_file(str(lora_export / DIFFUSERS))
    dim = 32
    for name, original in names.items():
        down, up, alpha = ours[f"{name}.lora_down.weight"], ours[f"{name}.lora_up.weight"], ours[f"{name}.alpha"]
        assert alpha.ndim == 0
        block = original.removesuffix(".qkv") if original.endswith(".qkv") else None
        if block is None:
            module = original.replace("attention.out", "attention.to_out.0")
            assert down.shape[0] == RANK and float(alpha) == ALPHA
            assert torch.equal(down, theirs[f"transformer.{module}.lora_A.weight"])
            torch.testing.assert_close(up * (ALPHA / RANK), theirs[f"transformer.{module}.lora_B.weight"])
            continue
        # One adapter of rank 3 x 4 on the fused qkv, at the same scale: alpha 3 x 8.
        assert down.shape == (3 * RANK, dim) and up.shape == (3 * dim, 3 * RANK) and float(alpha) == 3 * ALPHA
        for i, part in enumerate(("to_q", "to_k", "to_v")):
            rows, columns = slice(i * dim, (i + 1) * dim), slice(i * RANK, (i + 1) * RANK)
            assert torch.equal(down[columns], theirs[f"transformer.{block}.{part}.lora_A.weight"])
            torch.testing.assert_close(up[rows, columns] * (ALPHA / RANK),
                                       theirs[f"transformer.{block}.{part}.lora_B.weight"])
            off = up[rows].clone()
            off[:, columns] = 0
            assert not off.any(), f"{original}: {part}'s rows reach another part's rank"


def test_diffusers_loads_the_kohya_file_whole_as_it_loads_its_own(lora_export, released):  # noqa: F811
    """ZImagePipeline.load_lora_weights on the kohya file: every module it names (its keys converted by diffusers'
    Z-Image converter) is one of the transformer's and gets its adapter, the fused qkv split onto to_q, to_k and
    to_v; fused, the transformer's weights are those the run's diffusers file gives it."""
    from diffusers import ZImagePipeline
    from peft.tuners.lora import LoraLayer

    converted = ZImagePipeline.lora_state_dict(str(lora_export / KOHYA))
    named = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in converted}
    assert all(key.startswith("transformer.") and key.endswith((".lora_A.weight", ".lora_B.weight"))
               for key in converted)
    expected = {f"{block}.attention.{part}" for block in BLOCKS for part in ("to_q", "to_k", "to_v", "to_out.0")}
    expected |= {f"{block}.feed_forward.w{i}" for block in BLOCKS for i in (1, 2, 3)}
    assert named == expected

    base = _pipeline(released).transformer.state_dict()
    fused = {}
    for weights in (DIFFUSERS, KOHYA):
        pipe = _pipeline(released)
        pipe.load_lora_weights(lora_export, weight_name=weights)
        attached = {name for name, module in pipe.transformer.named_modules() if isinstance(module, LoraLayer)}
        assert attached == expected, weights
        pipe.fuse_lora()
        fused[weights] = {key.replace(".base_layer.", "."): value
                          for key, value in pipe.transformer.state_dict().items() if "lora_" not in key}
    assert set(fused[KOHYA]) == set(fused[DIFFUSERS]) == set(base)
    changed = {key for key, value in fused[DIFFUSERS].items() if not torch.equal(value, base[key])}
    assert changed == {f"{module}.weight" for module in expected}  # every adapter trained
    for key, value in fused[DIFFUSERS].items():
        torch.testing.assert_close(fused[KOHYA][key], value, rtol=0, atol=1e-5, msg=key)


# --------------------------------------------------------------------------------------------------- ComfyUI

_COMFY_SCRIPT = comfyui.PREAMBLE + comfyui.LOAD_LORA + comfyui.LOAD_MODEL + textwrap.dedent('''
    model_path, lora_path, expected_path = sys.argv[1:4]
    import comfy.lora, comfy.model_detection, comfy.sd, comfy.supported_models, comfy.utils
    collect_messages()

    # ComfyUI takes Z-Image's sizes as the released model's (width 3840 in 30 heads, 2 refiners, RoPE axes
    # 32/48/48), and tells it from Lumina 2 by that width alone: a smaller one needs its own, from the shapes and
    # from the settings our metadata carries.
    with safe_open(model_path, framework="pt") as f:
        settings = json.loads(f.metadata()["transformer_config"])
    detect = comfy.model_detection.detect_unet_config
    def detect_tiny(state_dict, key_prefix, metadata=None):
        config = detect(state_dict, key_prefix, metadata=metadata)
        if config and config.get("image_model") == "lumina2":
            shape = lambda key: state_dict[key_prefix + key].shape
            dim = config["dim"]
            heads = dim // shape("layers.0.attention.q_norm.weight")[0]
            refiners = len({k.split(".")[1] for k in state_dict if k.startswith(key_prefix + "noise_refiner.")})
            config.update(n_heads=heads, n_kv_heads=heads, n_refiner_layers=refiners,
                          in_channels=shape("x_embedder.weight")[1] // 4, axes_dims=settings["axes_dims"],
                          axes_lens=settings["axes_lens"], rope_theta=settings["rope_theta"],
                          norm_eps=settings["norm_eps"], time_scale=settings["t_scale"], z_image_modulation=True,
                          ffn_dim_multiplier=shape("layers.0.feed_forward.w1.weight")[0] / dim, multiple_of=1,
                          pad_tokens_multiple=32)
            comfy.supported_models.ZImage.unet_config = {"image_model": "lumina2", "dim": dim}
        return config
    comfy.model_detection.detect_unet_config = detect_tiny

    patcher, net, written, report = load_model(model_path)

    lora, key_map, patches, modules = load_lora(patcher, lora_path, report)
    report["targets"] = {m: str(key_map.get(m)) for m in modules}
    apply(patcher, patches, report)

    # ComfyUI's patched weights against the run's merged ones (in the same layout).
    expected = load_file(expected_path)
    state = net.state_dict()
    compared = [k for k in state if "merged." + k in expected]
    report["compared"] = len(compared)
    report["changed_by_comfy"] = sorted(k for k in compared if not torch.equal(state[k], expected["base." + k]))
    report["changed_by_sdtrain"] = sorted(k for k in compared
                                          if not torch.equal(expected["merged." + k], expected["base." + k]))
    report["max_weight_diff"] = max((state[k] - expected["merged." + k]).abs().max().item() for k in compared)
    print("REPORT " + json.dumps(report))
''')


@pytest.mark.slow
@comfyui.needs_comfyui
@comfyui.needs_model("ZImage")
def test_comfyui_loads_every_key_of_the_kohya_file_onto_its_z_image_model(tmp_path):
    """ComfyUI (its own venv, in a subprocess) loads the transformer written in the authors' layout as its Z-Image
    model and the kohya file with no key left: each ``lora_unet_`` name onto the weight it names, q, k and v as one
    adapter on the fused qkv; patched, it holds the weights peft merges. The transformer is 1024 wide: ComfyUI's
    timestep embedder and modulations are the released model's widths up to 1024 and 256, diffusers' too only from
    there."""
    from diffusers import ZImageTransformer2DModel
    from peft.tuners.lora import LoraLayer

    from sdtrain.loaders.adapters import add_lora, merge_lora
    from sdtrain.models.families.zimage import ZIMAGE, save_original, to_original

    torch.manual_seed(0)
    base = ZImageTransformer2DModel(all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=1024, n_layers=1,
                                    n_refiner_layers=1, n_heads=8, n_kv_heads=8, cap_feat_dim=32,
                                    axes_dims=[32, 48, 48], axes_lens=[64, 32, 32])
    with torch.no_grad():
        for parameter in base.parameters():  # the pad tokens are left uninitialised
            parameter.normal_(0, 0.02)
    save_original(tmp_path / "z-image.safetensors", base)
    adapted = copy.deepcopy(base)
    add_lora(adapted, {"r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS, "init_lora_weights": False},
             "lora.target_modules")
    layers = {name: (m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach(),
                     float(m.lora_alpha["default"]))
              for name, m in adapted.named_modules() if isinstance(m, LoraLayer)}
    lora = ZIMAGE.files.kohya_lora("transformer", layers, adapted.config)
    save_file(lora, str(tmp_path / "lora.safetensors"))
    config = dict(base.config)
    expected = {f"merged.{k}": v for k, v in to_original(merge_lora(adapted).state_dict(), config).items()}
    expected.update({f"base.{k}": v for k, v in to_original(base.state_dict(), config).items()})
    save_file({k: v.contiguous() for k, v in expected.items()}, str(tmp_path / "expected.safetensors"))

    report = comfyui.run_comfyui(_COMFY_SCRIPT, str(tmp_path / "z-image.safetensors"),
                                 str(tmp_path / "lora.safetensors"), str(tmp_path / "expected.safetensors"))
    print(json.dumps(report, indent=1))
    assert report["model"] == "Lumina2" and report["config"] == "ZImage"
    assert report["missing"] == [] and report["weights_equal"]
    # Every key loads: one patch per module of the file, none left, none unapplied.
    modules = {key.rsplit(".lora_", 1)[0].removesuffix(".alpha") for key in lora}
    assert report["lora_keys"] == len(lora) == 3 * len(modules)
    assert report["not_loaded"] == [] and report["not_applied"] == [] and report["patched"] == len(modules)
    originals = _originals(["noise_refiner.0", "context_refiner.0", "layers.0"])
    assert modules == set(originals)
    assert report["targets"] == {name: f"diffusion_model.{original}.weight" for name, original in originals.items()}
    # Patched, ComfyUI changes exactly the weights sdtrain's merge changes, by as much.
    assert report["changed_by_comfy"] == report["changed_by_sdtrain"]
    assert len(report["changed_by_comfy"]) == 3 * 5  # qkv, out, w1, w2, w3 in each of the three blocks
    assert report["max_weight_diff"] < 1e-5
