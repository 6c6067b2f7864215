"""Running ComfyUI's own loaders on what sdtrain writes (slow tests): a local ComfyUI checkout with its own venv
runs a script in a subprocess, which prints one ``REPORT <json>`` line for the test to assert on."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

COMFY_DIR, COMFY_PYTHON = Path("/tmp/comfyui"), Path("/tmp/comfyenv/bin/python")
needs_comfyui = pytest.mark.skipif(not COMFY_PYTHON.exists() or not COMFY_DIR.is_dir(),
                                   reason=f"no ComfyUI at {COMFY_DIR} with a venv at {COMFY_PYTHON.parent.parent}")


def needs_model(name: str) -> pytest.MarkDecorator:
    """Skip unless the local ComfyUI knows the model class `name` (comfy.supported_models), which older checkouts
    predate."""
    models = COMFY_DIR / "comfy" / "supported_models.py"
    known = models.is_file() and f"class {name}(" in models.read_text()
    return pytest.mark.skipif(not known, reason=f"the ComfyUI at {COMFY_DIR} has no {name} model (it predates it)")

PREAMBLE = textwrap.dedent('''
    import json, logging, sys
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    # ComfyUI takes a GPU unless told otherwise, before its model management is first imported.
    import comfy.cli_args
    comfy.cli_args.args.cpu = True

    # What ComfyUI logs from collect_messages() on (after the script's imports, whose own warnings are not the
    # loaders'), in ``messages``.
    messages = []
    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
    def collect_messages():
        logging.getLogger().addHandler(Collect(level=logging.INFO))
        logging.getLogger().setLevel(logging.INFO)
''')
"""The start of every script: the CPU, and ``collect_messages()`` to call once its imports are done."""

FLUX_TINY_DETECT = textwrap.dedent('''
    # ComfyUI takes Flux.1's sizes as given (width 3072 in 24 heads, T5's 4096, 16 latent channels, rope axes
    # 16/56/56); a tiny model needs its own: from the shapes, and the axes from our metadata.
    import comfy.model_detection
    def flux_tiny_detection(model_path):
        with safe_open(model_path, framework="pt") as f:
            metadata = f.metadata()
        axes = json.loads(metadata["transformer_config"])["axes_dims_rope"]
        detect = comfy.model_detection.detect_unet_config
        def detect_tiny(state_dict, key_prefix, metadata=None):
            config = detect(state_dict, key_prefix, metadata=metadata)
            if config and config.get("image_model") == "flux":
                shape = lambda key: state_dict[key_prefix + key].shape
                norm = next(k for k in state_dict if k.endswith("norm.query_norm.scale"))
                width, patch = shape("img_in.weight")[0], config["patch_size"]
                config.update(hidden_size=width, num_heads=width // state_dict[norm].shape[0],
                              context_in_dim=shape("txt_in.weight")[1],
                              out_channels=shape("final_layer.linear.weight")[0] // (patch * patch),
                              axes_dim=list(axes))
            return config
        comfy.model_detection.detect_unet_config = detect_tiny
        return metadata
''')
"""``flux_tiny_detection(model_path)``: makes ComfyUI read a tiny Flux transformer file at its own sizes; returns
the file's metadata."""


LOAD_LORA = textwrap.dedent('''
    def load_lora(patcher, lora_path, report, clip=None):
        """What Load LoRA does (comfy.sd.load_lora_for_models) with the file at lora_path for the model (and
        `clip`'s text encoder): the file's tensors, ComfyUI's key map and its patches, what loaded in `report`."""
        import comfy.lora, comfy.utils
        lora = comfy.utils.load_torch_file(lora_path)
        key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
        if clip is not None:
            key_map = comfy.lora.model_lora_keys_clip(clip, key_map)
        messages.clear()
        patches = comfy.lora.load_lora(lora, key_map)
        modules = {k.rsplit(".lora_", 1)[0].removesuffix(".alpha") for k in lora}
        report.update(lora_keys=len(lora), lora_modules=len(modules), patched=len(patches),
                      not_loaded=sorted(m for m in messages if "not loaded" in m))
        return lora, key_map, patches, modules
''')
"""``load_lora(patcher, lora_path, report, clip=None)``: ComfyUI's Load LoRA on a loaded model; returns (the file's
tensors, the key map, the patches, the file's module names)."""


LOAD_MODEL = textwrap.dedent('''
    def load_model(model_path):
        """What Load Diffusion Model does with the file at model_path, in fp32: the patcher, its network, the file's
        tensors, and a report of what loaded (ComfyUI's model and config classes, the network's weights the file
        lacks or holds beyond it, whether those it holds are the file's)."""
        import comfy.sd
        patcher = comfy.sd.load_diffusion_model(model_path, model_options={"dtype": torch.float32})
        net = patcher.model.diffusion_model
        written = load_file(model_path)
        state = net.state_dict()
        report = {"model": type(patcher.model).__name__, "config": type(patcher.model.model_config).__name__,
                  "missing": sorted(set(state) - set(written)), "unread": sorted(set(written) - set(state)),
                  "weights_equal": all(torch.equal(state[k], written[k]) for k in state if k in written)}
        return patcher, net, written, report

    def apply(patcher, patches, report):
        """Add `patches` (comfy.lora.load_lora's) to the model and patch its weights; what was not applied in
        `report`."""
        added = set(patcher.add_patches(patches, 1.0))
        report["not_applied"] = sorted(str(k) for k in patches if k not in added)
        patcher.patch_model()
''')
"""``load_model(model_path)`` -> (patcher, net, written, report): ComfyUI's Load Diffusion Model on a file;
``apply(patcher, patches, report)``: its LoRA patches applied."""


def run_comfyui(script: str, *args: str) -> dict[str, Any]:
    """Run `script` (PREAMBLE first) in ComfyUI's venv with `args` as sys.argv[1:]; its REPORT, parsed."""
    done = subprocess.run([str(COMFY_PYTHON), "-c", script, *args], cwd=COMFY_DIR, capture_output=True, text=True,
                          timeout=600, env={"PYTHONPATH": str(COMFY_DIR), "PATH": "/usr/bin:/bin",
                                            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])
