"""Qwen-Image 2.1's LoRA file in ComfyUI's own loader (slow, with a local ComfyUI that has the model;
tests/comfyui.py): every key of diffusers' file a run writes (``transformer.`` names, the feed-forward's gate and up
projections included, which ComfyUI keeps fused) maps onto ComfyUI's QwenImage21 model and becomes a patch."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from diffusers import QwenImage21Transformer2DModel

from sdtrain.loaders.adapters import add_lora
from sdtrain.loaders.writers import KOHYA_WEIGHTS, LORA_WEIGHTS, save_trained_parts

from . import comfyui

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out"]

_SCRIPT = comfyui.PREAMBLE + comfyui.LOAD_LORA + textwrap.dedent('''
    settings, *lora_paths = sys.argv[1:]
    import comfy.model_base, comfy.model_patcher, comfy.supported_models
    collect_messages()
    config = comfy.supported_models.QwenImage21({"image_model": "qwen_image21", **json.loads(settings)})
    model = comfy.model_base.QwenImage21(config, device="cpu")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    report = {"model": type(model).__name__}
    for path in lora_paths:
        entry = report[path.rsplit("/", 1)[1]] = {}
        load_lora(patcher, path, entry)
    print("REPORT " + json.dumps(report))
''')


@pytest.mark.slow
@comfyui.needs_comfyui
@comfyui.needs_model("QwenImage21")
def test_comfyui_maps_every_key_of_the_diffusers_lora_file(tmp_path):
    settings = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, context_in_dim=32)
    torch.manual_seed(0)
    adapted = QwenImage21Transformer2DModel(in_channels=64, out_channels=64, axes_dims_rope=(4, 6, 6), **settings)
    add_lora(adapted, {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False},
             "lora.target_modules")
    adapted_modules = [n for n, m in adapted.named_modules() if hasattr(m, "lora_A")]
    save_trained_parts({"transformer": adapted}, {"task": {"family": "qwen-image-2.1", "lora": True}}, tmp_path)
    files = [tmp_path / LORA_WEIGHTS, tmp_path / KOHYA_WEIGHTS]
    report = comfyui.run_comfyui(_SCRIPT, json.dumps({**settings, "axes_dims_rope": [4, 6, 6]}), *map(str, files))
    print(json.dumps(report, indent=1))
    entry = report[LORA_WEIGHTS]
    assert entry["not_loaded"] == [] and entry["lora_modules"] == len(adapted_modules) == 2 * len(TARGETS)
    assert entry["patched"] == len(adapted_modules)
