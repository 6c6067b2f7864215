"""LyCORIS adapters (``lora.type``: DoRA, LoKr) on a tiny pretrained Stable Diffusion through the CLI: they start at
the base model, train, resume, and export diffusers' file (which `generate --lora` and diffusers' loaders apply as
training did, as does the merged pipeline) and kohya's (DoRA's magnitudes and LoKr's factors as ComfyUI applies
them: test_lycoris_comfyui, with a local ComfyUI)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdtrain.cli.main import main
from sdtrain.config import LoraConfig
from sdtrain.export import export_run
from sdtrain.loaders.adapters import add_lora, merge_lora
from sdtrain.loaders.writers import save_lora
from sdtrain.models import families
from sdtrain.train.modes.lora import lora_settings

from .conftest import TINY, config_path


def _lycoris(run: Path, pretrained: Path, shapes_dir: Path, kind: str, *extra: str) -> int:
    return main(["train", str(config_path("diffusion.yaml")), f"run_dir={run}", *TINY, f"data.shards={shapes_dir}",
                 f"model.pretrained={pretrained}", "model.vae=null", "mode=lora", f"lora.type={kind}",
                 "lora.rank=2", "lora.alpha=4", "validation.prompts=[]", "train.max_steps=2", "optim.lr=0.01",
                 "lora.save_merged=true", *extra])


def _image(pipe) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe("a red circle", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                output_type="np").images[0]


@pytest.mark.parametrize("kind", ["dora", "lokr"])
def test_an_adapter_exports_what_diffusers_and_generate_apply_as_the_merged_pipeline_draws(
        kind, tmp_path, pretrained, shapes_dir, monkeypatch):
    from diffusers import StableDiffusionPipeline

    from sdtrain.generate import load_adapters

    # LoKr's product of a random and a zero factor moves slower than LoRA's pair at the same rate.
    assert _lycoris(tmp_path / "run", pretrained, shapes_dir, kind, f"optim.lr={0.05 if kind == 'lokr' else 0.01}") == 0
    out = export_run(tmp_path / "run", tmp_path / "out")
    weights = load_file(str(out / "pytorch_lora_weights.safetensors"))
    marker = {"dora": ".lora_magnitude_vector", "lokr": ".lokr_w2"}[kind]
    assert any(marker in key for key in weights) and all(key.startswith("unet.") for key in weights)
    kohya = load_file(str(out / "lora_kohya.safetensors"))
    assert any(key.endswith({"dora": ".dora_scale", "lokr": ".lokr_w1"}[kind]) for key in kohya)

    def pipe():
        return StableDiffusionPipeline.from_pretrained(pretrained, local_files_only=True, safety_checker=None)

    base = _image(pipe())
    adapted = pipe()
    load_adapters(adapted, out, None, "trained")
    image = _image(adapted)
    assert np.abs(image - base).max() > 1e-3  # it learnt something, and diffusers applies it
    merged = _image(StableDiffusionPipeline.from_pretrained(out / "pipeline", local_files_only=True,
                                                            safety_checker=None))
    np.testing.assert_allclose(image, merged, atol=1e-4)  # as peft merges what trained
    assert main(["generate", "--model", str(pretrained), "--lora", str(out), "--prompt", "a red circle",
                 "--steps", "2", "--out", str(tmp_path / "images")]) == 0
    if kind == "lokr":  # kohya's LoKr file is ComfyUI's: diffusers refuses it, in one line
        assert main(["generate", "--model", str(pretrained), "--lora", str(out / "lora_kohya.safetensors"),
                     "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "no")]) == 2
    # The model card names the adapter and its code loads it as written (LoKr by load_lora_adapter).
    card = (out / "README.md").read_text()
    assert {"dora": "DoRA adapters", "lokr": "LoKr adapters"}[kind] in card
    if kind == "dora":  # which readers each kohya file is for, and that diffusers reads neither's magnitudes
        assert (out / "lora_kohya_lycoris.safetensors").is_file()
        assert "`lora_kohya_lycoris.safetensors` for LyCORIS" in card and "`lora_kohya.safetensors` for ComfyUI" in card
        assert "drops `dora_scale`" in card
    code = card.split("```python\n", 1)[1].split("```", 1)[0].replace('"path/to/pipeline"', repr(str(pretrained)))
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the card's own code, written by the export above


def test_lokr_starts_at_the_base_and_resumes_exactly(tmp_path, pretrained, shapes_dir):
    from .conftest import same_checkpoints

    assert _lycoris(tmp_path / "a", pretrained, shapes_dir, "lokr", "train.max_steps=3", "checkpoint.every=1") == 0
    assert _lycoris(tmp_path / "b", pretrained, shapes_dir, "lokr", "train.max_steps=2", "checkpoint.every=1") == 0
    assert _lycoris(tmp_path / "b", pretrained, shapes_dir, "lokr", "train.max_steps=3", "checkpoint.every=1") == 0
    same_checkpoints(tmp_path / "a" / "checkpoints" / "step_00000003", tmp_path / "b" / "checkpoints" / "step_00000003")


def test_lycoris_on_a_low_precision_base_or_lokr_on_the_text_encoder_is_one_line(tmp_path, pretrained, shapes_dir,
                                                                                 capsys):
    assert _lycoris(tmp_path / "a", pretrained, shapes_dir, "dora", "model.frozen_precision=bf16") == 2
    assert _lycoris(tmp_path / "b", pretrained, shapes_dir, "lokr", "lora.text_encoder=true") == 2
    assert _lycoris(tmp_path / "c", pretrained, shapes_dir, "loha") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 3 and "frozen_precision" in errors[0] and "lora.text_encoder" in errors[1]
    assert "lora.type" in errors[2]


def _dora_rule(reader: str, state: dict[str, torch.Tensor], key: str, base: torch.Tensor) -> torch.Tensor:
    """The weight a reader makes of kohya DoRA module `key` on `base`, by its documented rule: the updated weight
    W0 + dW (dW = up @ down * alpha / rank), each output row scaled by dora_scale over that row's norm, of W0 for
    ComfyUI (and Forge), of W0 + dW for LyCORIS (its wd_on_out)."""
    down, up = state[f"{key}.lora_down.weight"].flatten(1), state[f"{key}.lora_up.weight"].flatten(1)
    updated = base + (up @ down).reshape(base.shape) * state[f"{key}.alpha"] / down.shape[0]
    normed = base if reader == "comfyui" else updated
    norm = normed.flatten(1).norm(dim=1).reshape(-1, *[1] * (base.dim() - 1))
    return updated * state[f"{key}.dora_scale"] / norm


def _sd_pipe(pretrained: Path):
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(pretrained, local_files_only=True, safety_checker=None)


def _adapted_unet(pretrained: Path, kind: str, folder: Path):
    """A tiny SD UNet with adapters of `kind` on attention projections, convolutions and a 1x1 projection, every
    factor and magnitude moved from where it started as training moves them, its files written in `folder`."""
    unet = _sd_pipe(pretrained).unet
    config = LoraConfig(type=kind, rank=2, alpha=3, target_modules=["to_q", "to_out.0", "conv1", "proj_in"])
    add_lora(unet, lora_settings(config), "lora.target_modules")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in unet.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    save_lora({"unet": unet}, {"unet": unet.state_dict()}, folder, families.get("sd"))
    return unet


def _worst_after_loading(pretrained: Path, file: Path, expected: dict[str, torch.Tensor]) -> float:
    """How far diffusers' load_lora_weights of `file` into the UNet merges its weights from `expected`'s."""
    pipe = _sd_pipe(pretrained)
    pipe.load_lora_weights(file.parent, weight_name=file.name)
    merged = merge_lora(pipe.unet).state_dict()
    return max((merged[key] - value).abs().max().item() for key, value in expected.items())


def test_a_lora_on_attention_and_other_layers_loads_whole_in_diffusers(tmp_path, pretrained):
    """diffusers renames only attention projections' adapters: the file of a UNet adapted beyond them keeps peft's
    names, which diffusers' load_lora_weights reads whole."""
    unet = _adapted_unet(pretrained, "lora", tmp_path)
    expected = merge_lora(unet).state_dict()
    assert _worst_after_loading(pretrained, tmp_path / "pytorch_lora_weights.safetensors", expected) < 1e-5


def test_each_kohya_dora_file_gives_its_readers_the_merged_weights(tmp_path, pretrained, capsys):
    """Each reader's rule applied to the kohya DoRA file made for it gives peft's merged weight; diffusers, which
    reads neither file's magnitudes, is pointed to its own file."""
    trained, family = _adapted_unet(pretrained, "dora", tmp_path), families.get("sd")
    layers = {family.files.kohya_lora_name("unet", path, trained.config): path
              for path, module in trained.named_modules() if hasattr(module, "lora_magnitude_vector")}
    base = {key: trained.get_submodule(path).get_base_layer().weight.detach().clone() for key, path in layers.items()}
    merged = merge_lora(trained)
    expected = {key: merged.get_submodule(path).weight.detach() for key, path in layers.items()}
    assert any(w.dim() == 4 for w in expected.values()) and any(w.dim() == 2 for w in expected.values())
    # Each file gives its own reader peft's merge, and the other reader weights a tenth of the update off or more.
    for name, reader, other in (("lora_kohya.safetensors", "comfyui", "lycoris"),
                                ("lora_kohya_lycoris.safetensors", "lycoris", "comfyui")):
        state = load_file(str(tmp_path / name))
        assert {k.split(".")[0] for k in state} == set(layers)
        for key in layers:
            torch.testing.assert_close(_dora_rule(reader, state, key, base[key]), expected[key],
                                       atol=2e-6, rtol=0)
        off = max((_dora_rule(other, state, key, base[key]) - expected[key]).abs().max() for key in layers)
        assert off > 0.1 * max((expected[key] - base[key]).abs().max() for key in layers)
    # diffusers' own loader drops every dora_scale of a kohya file: generate --lora refuses one in a line naming
    # the file diffusers reads, which it merges to peft's weights.
    assert main(["generate", "--model", str(pretrained), "--lora", str(tmp_path / "lora_kohya.safetensors"),
                 "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "no")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "--lora" in line]
    assert len(errors) == 1 and "dora_scale" in errors[0] and "pytorch_lora_weights" in errors[0]
    whole = merged.state_dict()
    assert _worst_after_loading(pretrained, tmp_path / "lora_kohya_lycoris.safetensors", whole) > 1e-3
    assert _worst_after_loading(pretrained, tmp_path / "pytorch_lora_weights.safetensors", whole) < 1e-5
