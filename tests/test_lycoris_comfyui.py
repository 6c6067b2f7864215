"""DoRA's and LoKr's adapters in the kohya file sdtrain writes, applied by ComfyUI's own LoRA code (slow, with a local
ComfyUI; tests/comfyui.py): every key read, and each patched weight the one peft merges from what trained, on the
UNet's attention projections and convolutions alike."""

from __future__ import annotations

import copy
import json
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from sdtrain.config import LoraConfig
from sdtrain.loaders.adapters import add_lora, merge_lora
from sdtrain.loaders.writers import kohya_state
from sdtrain.models import families
from sdtrain.train.modes.lora import lora_settings

from . import comfyui

_SCRIPT = comfyui.PREAMBLE + textwrap.dedent('''
    lora_path, base_path, expected_path = sys.argv[1:4]
    import comfy.lora
    collect_messages()
    lora, base, expected = load_file(lora_path), load_file(base_path), load_file(expected_path)
    names = {key.split(".")[0] for key in lora}
    patches = comfy.lora.load_lora(lora, {name: name for name in names})
    worst = 0.0
    for name in names:
        weight = comfy.lora.calculate_weight([(1.0, patches[name], 1.0, None, None)], base[name].clone(), name)
        worst = max(worst, (weight - expected[name]).abs().max().item())
    print("REPORT " + json.dumps({"modules": len(names), "patched": len(patches), "worst": worst,
                                  "problems": [m for m in messages if "not loaded" in m or "Failed" in m]}))
''')


@pytest.mark.slow
@comfyui.needs_comfyui
@pytest.mark.parametrize("kind", ["dora", "lokr"])
def test_comfyui_applies_the_kohya_file_as_peft_merges_it(kind, tmp_path):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8,
                                norm_num_groups=32, sample_size=8)
    family = families.get("sd")
    config = LoraConfig(type=kind, rank=2, alpha=3, target_modules=["to_q", "to_out.0", "conv1", "proj_in"])
    add_lora(unet, lora_settings(config), "lora.target_modules")
    with torch.no_grad():  # trained: every factor and magnitude away from where it started
        for name, parameter in unet.named_parameters():
            if "lora_" in name or "lokr_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    weights = {"unet": unet.state_dict()}
    state = kohya_state({"unet": unet}, weights, family)
    save_file(state, str(tmp_path / "kohya.safetensors"))
    # Each adapted layer's base and merged weight under its kohya name.
    layers = {path: family.files.kohya_lora_name("unet", path, unet.config)
              for path, module in unet.named_modules() if hasattr(module, "get_base_layer") and "." in path}
    layers = {path: name for path, name in layers.items() if any(k.startswith(name + ".") for k in state)}
    base = {name: unet.get_submodule(path).get_base_layer().weight.detach().clone().contiguous()
            for path, name in layers.items()}
    merged = merge_lora(copy.deepcopy(unet))
    expected = {name: merged.get_submodule(path).weight.detach().contiguous() for path, name in layers.items()}
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(expected, str(tmp_path / "expected.safetensors"))
    report = comfyui.run_comfyui(_SCRIPT, *(str(tmp_path / f) for f in ("kohya.safetensors", "base.safetensors",
                                                                        "expected.safetensors")))
    print(json.dumps(report, indent=1))
    convolutions = [path for path in layers if "conv1" in path]
    assert report["modules"] == len(layers) and report["patched"] == len(layers) and convolutions
    assert report["problems"] == [] and report["worst"] < 1e-5
