"""The ControlNet file a ControlNet run exports (OUT/controlnet/diffusion_pytorch_model.safetensors) in ComfyUI's own
Load ControlNet Model (slow, with a local ComfyUI; tests/comfyui.py): every key placed, none left over or missing,
the weights ComfyUI holds the file's. ComfyUI reads the UNet's sizes off the released models' tables, so a tiny
one's are given to it from its shapes; its conditioning encoder is the released one (three halvings, for the 8x
VAEs), which sdtrain builds for such a VAE."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from sdtrain.models.families.unet import controlnet_from_unet

from . import comfyui

_SCRIPT = comfyui.PREAMBLE + textwrap.dedent('''
    path, settings_json = sys.argv[1:3]
    import comfy.controlnet, comfy.model_detection
    collect_messages()
    settings = json.loads(settings_json)
    detect = comfy.model_detection.unet_config_from_diffusers_unet
    def detect_tiny(state_dict, dtype=None):
        # ComfyUI matches the released UNets only; a tiny one's sizes, from the config sdtrain wrote.
        return detect(state_dict, dtype) or dict(settings, dtype=dtype)
    comfy.model_detection.unet_config_from_diffusers_unet = detect_tiny
    written = load_file(path)
    control = comfy.controlnet.load_controlnet(path)
    state = control.control_model.state_dict()
    report = {"loaded": type(control).__name__, "keys": len(state), "file_keys": len(written),
              "problems": sorted(m for m in messages if "leftover" in m or "missing" in m or "unexpected" in m)}
    # The zero convolutions and the conditioning encoder's output, under ComfyUI's names, hold the file's weights.
    report["same"] = all(torch.equal(state[theirs], written[ours]) for ours, theirs in (
        ("controlnet_mid_block.weight", "middle_block_out.0.weight"),
        ("controlnet_down_blocks.0.weight", "zero_convs.0.0.weight"),
        ("controlnet_cond_embedding.conv_out.weight", "input_hint_block.14.weight")))
    print("REPORT " + json.dumps(report))
''')


@pytest.mark.slow
@comfyui.needs_comfyui
def test_comfyui_loads_every_key_of_the_exported_controlnet(tmp_path):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8,
                                norm_num_groups=32, sample_size=8)
    controlnet = controlnet_from_unet(unet, 8)
    with torch.no_grad():  # trained: nothing left at zero
        for parameter in controlnet.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    controlnet.save_pretrained(tmp_path / "controlnet", safe_serialization=True)
    # What ComfyUI's tables hold for SD 1.5, at this UNet's sizes.
    settings = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
                "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 32,
                "num_res_blocks": [1, 1], "transformer_depth": [1, 0], "channel_mult": [1, 2],
                "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 32,
                "num_heads": 8, "transformer_depth_output": [0, 0, 1, 1], "use_temporal_attention": False,
                "use_temporal_resblock": False}
    report = comfyui.run_comfyui(_SCRIPT, str(tmp_path / "controlnet" / "diffusion_pytorch_model.safetensors"),
                                 json.dumps(settings))
    print(json.dumps(report, indent=1))
    assert report["loaded"] == "ControlNet" and report["problems"] == [] and report["same"]
    assert report["keys"] == report["file_keys"]
