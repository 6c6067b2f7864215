"""InstructPix2Pix training (``mode: instruct_pix2pix``, configs/instruct-pix2pix.yaml) on a tiny pretrained Stable
Diffusion with a folder of edits (each edited image beside its source, ``KEY.src.png``, its caption the
instruction): the UNet widened to read the source's latents (new inputs starting at zero), validated with the last
batch's sources, exported as a folder diffusers' own InstructPix2Pix pipeline edits with."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from sdtrain.checkpoint import latest_checkpoint
from sdtrain.cli.main import main
from sdtrain.export import export_run
from sdtrain.models import families

from .conftest import TINY, config_path

CONFIGS = config_path("diffusion.yaml").parents[1]


def test_the_unet_learns_to_edit_and_exports_what_diffusers_instruct_pix2pix_pipeline_edits_with(
        tmp_path, pretrained, edits):
    from diffusers import StableDiffusionInstructPix2PixPipeline

    run = tmp_path / "run"
    assert main(["train", str(CONFIGS / "instruct-pix2pix.yaml"), f"run_dir={run}", *TINY,
                 f"model.pretrained={pretrained}", f"data.shards={edits}", "train.max_steps=2", "optim.lr=0.01",
                 "validation.prompts=[make it blue]", "validation.steps=2", "ema.enabled=false"]) == 0
    weights = load_file(str(latest_checkpoint(run) / "model.safetensors"))
    conv_in = weights["unet.conv_in.weight"]
    assert conv_in.shape[1] == 8 and conv_in[:, 4:].abs().max() > 0  # the source's inputs, trained from zero
    assert (run / "samples" / "step_00000002.png").is_file()  # drawn from the last batch's sources

    out = export_run(run, tmp_path / "out")
    pipe = StableDiffusionInstructPix2PixPipeline.from_pretrained(out, safety_checker=None, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.unet.config.in_channels == 8
    torch.testing.assert_close(pipe.unet.conv_in.weight, conv_in, rtol=0, atol=0)
    source = Image.open(next(iter(sorted((edits.parent / "images").glob("*.src.png")))))
    edited = pipe("make it blue", image=source, num_inference_steps=2, output_type="np",
                  generator=torch.Generator().manual_seed(0)).images[0]
    assert edited.shape == (32, 32, 3) and np.isfinite(edited).all()
    source.save(tmp_path / "source.png")
    assert main(["generate", "--model", str(out), "--image", str(tmp_path / "source.png"), "--prompt", "make it blue",
                 "--steps", "2", "--out", str(tmp_path / "images")]) == 0
    assert len(list((tmp_path / "images").glob("*.png"))) == 2  # the edit and its grid
    card = (out / "README.md").read_text()  # the card's code loads the editing pipeline and gives it an image
    assert "StableDiffusionInstructPix2PixPipeline.from_pretrained" in card and "image=load_image(" in card
    # One file in SD's layout (ComfyUI's InstructPix2Pix model) edits as well.
    assert main(["export", str(run), str(tmp_path / "ip2p.safetensors"), "--single-file"]) == 0
    assert main(["generate", "--model", str(tmp_path / "ip2p.safetensors"), "--image", str(tmp_path / "source.png"),
                 "--prompt", "make it blue", "--steps", "1", "--out", str(tmp_path / "from-file")]) == 0


def test_data_without_sources_is_one_line(tmp_path, pretrained, shapes_dir, capsys):
    assert main(["train", str(CONFIGS / "instruct-pix2pix.yaml"), f"run_dir={tmp_path / 'run'}", *TINY,
                 f"model.pretrained={pretrained}", f"data.shards={shapes_dir}", "train.max_steps=1"]) == 2
    error = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert len(error) == 1 and "KEY.src.png" in error[0]


def test_editing_by_reference_on_a_family_without_it_is_one_line(tmp_path, pretrained, edits, capsys):
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'run'}", *TINY,
                 f"model.pretrained={pretrained}", f"data.shards={edits}", "train.max_steps=1",
                 "edit.reference=true"]) == 2
    assert main(["train", str(CONFIGS / "textual-inversion.yaml"), f"run_dir={tmp_path / 'ti'}", *TINY,
                 f"model.pretrained={pretrained}", f"data.shards={edits}", "edit.reference=true",
                 "textual_inversion.initializer_token=red"]) == 2
    error = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    hosts = ", ".join(family.title for family in families.FAMILIES.values() if family.reference is not None)
    assert len(error) == 2 and "edit.reference" in error[0] and f"{hosts} do" in error[0] and "Flux.1" in hosts
    assert "mode full or lora" in error[1]
