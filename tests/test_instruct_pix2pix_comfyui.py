"""An InstructPix2Pix run's UNet as `export --single-file` writes it (Stable Diffusion's original layout), in
ComfyUI's own loader (slow, with a local ComfyUI; tests/comfyui.py): recognised as its InstructPix2Pix model by the
eight input channels, every key placed and holding the file's weights. ComfyUI recognises the released
architectures only, so the UNet is SD 1.5's at full size (random weights, widened as training widens it); it reads
no diffusers-layout SD 1.5 InstructPix2Pix UNet, which is why the single file is the one to give it."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from sdtrain.models.families import ldm_checkpoint
from sdtrain.models.families.unet import widen_unet

from . import comfyui

_SCRIPT = comfyui.PREAMBLE + comfyui.LOAD_MODEL + textwrap.dedent('''
    collect_messages()
    patcher, net, written, report = load_model(sys.argv[1])
    state = net.state_dict()
    # The file's UNet sits under the original layout's prefix.
    ours = {k.removeprefix("model.diffusion_model."): v for k, v in written.items()}
    report = {"model": report["model"], "in_channels": net.input_blocks[0][0].weight.shape[1],
              "missing": sorted(set(state) - set(ours))[:5], "unread": sorted(set(ours) - set(state))[:5],
              "same": all(torch.equal(state[k], ours[k].float()) for k in state if k in ours),
              "warnings": [m[:300] for m in messages if m.startswith(("unet missing", "unet unexpected", "left over"))]}
    print("REPORT " + json.dumps(report))
''')


@pytest.mark.slow
@comfyui.needs_comfyui
def test_comfyui_loads_the_exported_instruct_pix2pix_unet_as_its_own_model(tmp_path):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    # SD 1.5's UNet (diffusers' config of runwayml's), fp16 on disk as released.
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
    widen_unet(unet)
    with torch.no_grad():  # trained: the source's inputs away from zero
        unet.conv_in.weight[:, 4:].normal_(std=0.01)
    ldm_checkpoint.save(tmp_path / "ip2p.safetensors", unet=unet, half=True)
    report = comfyui.run_comfyui(_SCRIPT, str(tmp_path / "ip2p.safetensors"))
    print(json.dumps(report, indent=1))
    assert report["model"] == "SD15_instructpix2pix" and report["in_channels"] == 8
    assert report["missing"] == report["unread"] == report["warnings"] == [] and report["same"]
