"""ComfyUI's own loaders on the Wan 2.1 files sdtrain writes (slow; skipped without a local ComfyUI, see
tests/comfyui.py): Load Diffusion Model reads the transformer file with every weight, and Load LoRA applies every
key of sdtrain's Wan LoRA file (no "lora key not loaded"), each patched weight the one sdtrain's merge gives."""

from __future__ import annotations

import copy
import json
import textwrap

import pytest
import torch
from diffusers import WanTransformer3DModel
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file

from sdtrain.loaders.adapters import merge_lora
from sdtrain.models.families import wan_file

from . import comfyui

# ComfyUI builds Wan at the sizes its detection reads off the tensors, and at the released ones where it reads none
# (128-wide heads, umT5's 4096 text features, a 256-wide time embedding, CLIP-H's 1280 image features, I2V's 36
# input channels): the tiny model takes those, and stays small by its width and depth.
TINY = {"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 128, "in_channels": 16,
        "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 64, "num_layers": 2}
VARIANTS = {"t2v": ({}, "WAN21_T2V"),
            "i2v": ({"in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 256}, "WAN21_I2V"),
            "flf2v": ({"in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 256, "pos_embed_seq_len": 8},
                      "WAN21_I2V")}
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2",
           "proj_out", "time_proj", "text_embedder.linear_1", "time_embedder.linear_2",
           "image_embedder.ff.net.0.proj", "patch_embedding"]
"""The blocks' attention and feed-forward layers, layers outside them (alpha folded), and the patch embedding's
convolution, which ComfyUI reads too."""

_SCRIPT = comfyui.PREAMBLE + comfyui.LOAD_LORA + comfyui.LOAD_MODEL + textwrap.dedent('''
    model_path, expected_path, lora_path = sys.argv[1:]
    collect_messages()
    patcher, net, written, report = load_model(model_path)
    report["model_messages"] = [m for m in messages if "missing" in m.lower() or "unexpected" in m.lower()]
    expected = load_file(expected_path)
    lora, key_map, patches, modules = load_lora(patcher, lora_path, report)
    apply(patcher, patches, report)
    patched = net.state_dict()
    report["changed"] = sorted(k for k in patched if k in expected and not torch.equal(patched[k], written[k]))
    report["max_weight_diff"] = max((patched[k] - expected[k]).abs().max().item() for k in expected)
    print("REPORT " + json.dumps(report))
''')


@pytest.mark.slow
@comfyui.needs_comfyui
@comfyui.needs_model("WAN21_T2V")
@pytest.mark.parametrize("variant", VARIANTS)
def test_comfyui_loads_the_transformer_file_and_applies_every_key_of_the_lora_file(tmp_path, variant):
    extra, config_class = VARIANTS[variant]
    torch.manual_seed(0)
    base = WanTransformer3DModel(**{**TINY, **extra})
    with torch.no_grad():
        for parameter in base.parameters():
            parameter.normal_(0, 0.02)
    model = tmp_path / "wan2.1_tiny.safetensors"
    wan_file.TRANSFORMER_FILE.write(model, {"transformer": base}, half=False, scheduler=None, text_layout="",
                                    text_source=None)

    adapted = copy.deepcopy(base)
    adapted.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    layers = {path: (layer.lora_A["default"].weight.detach().clone(), layer.lora_B["default"].weight.detach().clone(),
                     float(layer.lora_alpha["default"]))
              for path, layer in adapted.named_modules() if isinstance(layer, LoraLayer)}
    lora = tmp_path / "wan_lora.safetensors"
    save_file({k: v.contiguous() for k, v in wan_file.lora_state(layers).items()}, str(lora))
    expected = tmp_path / "expected.safetensors"
    save_file({k: v.contiguous() for k, v in wan_file.to_original(merge_lora(adapted).state_dict()).items()},
              str(expected))

    report = comfyui.run_comfyui(_SCRIPT, str(model), str(expected), str(lora))
    print(json.dumps(report, indent=1))
    assert report["model"] == "WAN21" and report["config"] == config_class
    assert report["missing"] == [] and report["unread"] == [] and report["weights_equal"]
    assert report["not_loaded"] == [] and report["not_applied"] == []
    assert report["patched"] == report["lora_modules"] == len(layers)
    # Patched, ComfyUI changes exactly the weights sdtrain's merge changes, by as much.
    assert report["changed"] == sorted(wan_file.original_module_path(path) + ".weight" for path in layers)
    assert report["max_weight_diff"] < 1e-5
