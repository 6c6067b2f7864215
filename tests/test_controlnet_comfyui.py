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


_TRANSFORMER_SCRIPT = comfyui.PREAMBLE + textwrap.dedent('''
    path, axes_json = sys.argv[1:3]
    import comfy.controlnet, comfy.model_detection
    detect = comfy.model_detection.detect_unet_config
    def detect_tiny(state_dict, key_prefix, metadata=None):
        # ComfyUI takes Flux.1's sizes as released; a tiny ControlNet's, from its shapes and config.
        config = detect(state_dict, key_prefix, metadata=metadata)
        if config and config.get("image_model") == "flux":
            norm = next(k for k in state_dict if k.endswith("norm.query_norm.scale"))
            width = state_dict["img_in.weight"].shape[0]
            config.update(hidden_size=width, num_heads=width // state_dict[norm].shape[0],
                          context_in_dim=state_dict["txt_in.weight"].shape[1],
                          in_channels=state_dict["img_in.weight"].shape[1] // 4,
                          out_channels=state_dict["img_in.weight"].shape[1] // 4, axes_dim=json.loads(axes_json),
                          vec_in_dim=state_dict["vector_in.in_layer.weight"].shape[1])
        return config
    comfy.model_detection.detect_unet_config = detect_tiny
    collect_messages()
    # The loader tells keys of the file its model has no place for at debug level.
    logging.getLogger().handlers[-1].setLevel(logging.DEBUG)
    logging.getLogger().setLevel(logging.DEBUG)
    written = load_file(path)
    control = comfy.controlnet.load_controlnet(path)
    state = control.control_model.state_dict()
    report = {"loaded": type(control.control_model).__module__ + "." + type(control.control_model).__name__,
              "keys": len(state), "file_keys": len(written),
              "problems": sorted(m[:300] for m in messages if "leftover" in m or "missing" in m or "unexpected" in m
                                 or "size mismatch" in m),
              # The zero layers ComfyUI adds the ControlNet's work through hold the file's weights.
              "same": all(torch.equal(state[k], written[k]) for k in written
                          if k.startswith(("controlnet_blocks.", "controlnet_single_blocks.")) and k in state)}
    print("REPORT " + json.dumps(report))
''')


@pytest.mark.slow
@comfyui.needs_comfyui
@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_comfyui_loads_every_key_of_an_exported_transformer_controlnet(family, tmp_path):
    """SD3's and Flux.1's ControlNet folders (diffusers' layout, as InstantX's released ones) in ComfyUI's Load
    ControlNet Model: its MMDiT and InstantX readers, every key placed. ComfyUI sizes SD3's MMDiT by 64-wide heads,
    one per block, as released; the tiny transformer here is built so."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from sdtrain.models import families

    torch.manual_seed(0)
    if family == "sd3":
        transformer = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=64,
            num_attention_heads=1, joint_attention_dim=96, caption_projection_dim=64, pooled_projection_dim=64,
            pos_embed_max_size=16)
    else:
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=[4, 6, 6])
    controlnet = families.get(family).controlnet.from_denoiser(transformer, 8)
    with torch.no_grad():  # trained: nothing left at zero
        for parameter in controlnet.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    controlnet.save_pretrained(tmp_path / "controlnet", safe_serialization=True)
    report = comfyui.run_comfyui(_TRANSFORMER_SCRIPT,
                                 str(tmp_path / "controlnet" / "diffusion_pytorch_model.safetensors"),
                                 json.dumps(list(transformer.config.get("axes_dims_rope", []))))
    print(json.dumps(report, indent=1))
    expected = {"sd3": "comfy.cldm.mmdit.ControlNet", "flux": "comfy.ldm.flux.controlnet.ControlNetFlux"}[family]
    assert report["loaded"] == expected and report["problems"] == [] and report["same"]
