"""Qwen-Image's files in ComfyUI's own loaders (slow, with a local ComfyUI; tests/comfyui.py): the transformer file
`export --single-file` writes loads as ComfyUI's QwenImage model with every weight, and both LoRA files a run writes
(diffusers' ``transformer.`` names and kohya's ``lora_unet_``), of Qwen-Image or of its edit models (whose
transformer ComfyUI loads as the same model), load with no key left, patching the weights sdtrain's adapters merge
into."""

from __future__ import annotations

import copy
import json
import textwrap

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from safetensors.torch import save_file

from sdtrain.loaders.adapters import add_lora, merge_lora
from sdtrain.loaders.writers import KOHYA_WEIGHTS, LORA_WEIGHTS, save_trained_parts
from sdtrain.models.families.qwenimage import QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS, SHAPE_KEYS
from sdtrain.models.single_file.write import layout_metadata, write_tensors

from . import comfyui

TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "to_out.0", "to_add_out", "img_mlp.net.2", "txt_mlp.net.2"]

_SCRIPT = comfyui.PREAMBLE + comfyui.LOAD_LORA + comfyui.LOAD_MODEL + textwrap.dedent('''
    model_path, expected_path, *lora_paths = sys.argv[1:]
    import comfy.model_detection
    collect_messages()

    # ComfyUI builds Qwen-Image at the released widths (24 heads of 128, Qwen2.5-VL-7B's 3584 text features, RoPE
    # axes 16/56/56) whatever the file holds: a tiny model needs its own, from the shapes and our metadata.
    with safe_open(model_path, framework="pt") as f:
        settings = json.loads(f.metadata()["transformer_config"])
    detect = comfy.model_detection.detect_unet_config
    def detect_tiny(state_dict, key_prefix, metadata=None):
        config = detect(state_dict, key_prefix, metadata=metadata)
        if config and config.get("image_model") == "qwen_image":
            shape = lambda key: state_dict[key_prefix + key].shape
            head = shape("transformer_blocks.0.attn.norm_q.weight")[0]
            config.update(attention_head_dim=head, num_attention_heads=shape("img_in.weight")[0] // head,
                          joint_attention_dim=shape("txt_in.weight")[1],
                          out_channels=shape("proj_out.weight")[0] // 4, axes_dims_rope=settings["axes_dims_rope"])
        return config
    comfy.model_detection.detect_unet_config = detect_tiny

    patcher, net, written, report = load_model(model_path)
    expected = load_file(expected_path)
    for path in lora_paths:
        entry = report[path.rsplit("/", 1)[1]] = {}
        patcher_copy = patcher.clone()
        lora, key_map, patches, modules = load_lora(patcher_copy, path, entry)
        apply(patcher_copy, patches, entry)
        patched = net.state_dict()
        changed = sorted(k for k in patched if k in expected and not torch.equal(patched[k], written[k]))
        entry["changed"] = changed
        entry["max_weight_diff"] = max((patched[k] - expected[k]).abs().max().item() for k in expected)
        patcher_copy.unpatch_model()
    print("REPORT " + json.dumps(report))
''')


@pytest.mark.slow
@comfyui.needs_comfyui
@comfyui.needs_model("QwenImage")
@pytest.mark.parametrize("family", [QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS], ids=lambda family: family.name)
def test_comfyui_loads_the_transformer_file_and_every_key_of_both_lora_files(tmp_path, family):
    torch.manual_seed(0)
    base = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                       attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48,
                                       axes_dims_rope=[8, 12, 12])
    with torch.no_grad():
        for parameter in base.parameters():
            parameter.normal_(0, 0.02)
    model = tmp_path / "qwen-image.safetensors"
    write_tensors(model, base.state_dict(), torch.float32, layout_metadata(dict(base.config), "qwen-image", SHAPE_KEYS))
    adapted = copy.deepcopy(base)
    add_lora(adapted, {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False},
             "lora.target_modules")
    adapted_weights = sorted(f"{n}.weight" for n, m in adapted.named_modules() if hasattr(m, "lora_A"))
    save_trained_parts({"transformer": adapted}, {"task": {"family": family.name, "lora": True}}, tmp_path)
    save_file({k: v.contiguous() for k, v in merge_lora(adapted).state_dict().items()},
              str(tmp_path / "expected.safetensors"))

    files = [tmp_path / LORA_WEIGHTS, tmp_path / KOHYA_WEIGHTS]
    report = comfyui.run_comfyui(_SCRIPT, str(model), str(tmp_path / "expected.safetensors"), *map(str, files))
    print(json.dumps(report, indent=1))
    assert report["model"] == "QwenImage"
    assert report["missing"] == [] and report["unread"] == [] and report["weights_equal"]
    for file in files:
        entry = report[file.name]
        assert entry["not_loaded"] == [] and entry["not_applied"] == [], file.name
        assert entry["patched"] == entry["lora_modules"] == len(adapted_weights) == 2 * len(TARGETS), file.name
        # Patched, ComfyUI changes exactly the weights sdtrain's merge changes, by as much.
        assert entry["changed"] == adapted_weights, file.name
        assert entry["max_weight_diff"] < 1e-5, file.name
