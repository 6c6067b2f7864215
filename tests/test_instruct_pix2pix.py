"""InstructPix2Pix training (``mode: instruct_pix2pix``, configs/instruct-pix2pix.yaml) on a tiny pretrained Stable
Diffusion with a folder of edits (each edited image beside its source, ``KEY.src.png``, its caption the
instruction): the UNet widened to read the source's latents (new inputs starting at zero), validated with the last
batch's sources, exported as a folder diffusers' own InstructPix2Pix pipeline edits with."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from sdtrain.checkpoint import latest_checkpoint
from sdtrain.cli.main import main
from sdtrain.export import export_run
from sdtrain.models import families

from .conftest import TINY, config_path, run_card

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
    # The model card lists an editor, and its code loads the export with the pipeline its model_index.json names,
    # then gives it the image to edit (one step).
    data, made = run_card(out, sample={"num_inference_steps": 1})
    assert data.pipeline_tag == "image-to-image" and made["image"].size == (32, 32)
    pipe = made["pipe"]
    assert type(pipe) is StableDiffusionInstructPix2PixPipeline
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == type(pipe).__name__
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


@pytest.fixture(scope="module")
def released_editor(tmp_path_factory, pretrained) -> Path:
    """A folder laid out as timbrooks/instruct-pix2pix is: a StableDiffusionInstructPix2PixPipeline saved by plain
    diffusers, its UNet reading 8 channels (the latents and the source's)."""
    from diffusers import StableDiffusionInstructPix2PixPipeline, StableDiffusionPipeline, UNet2DConditionModel

    base = StableDiffusionPipeline.from_pretrained(pretrained, safety_checker=None, local_files_only=True)
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config({**base.unet.config, "in_channels": 8})
    editor = StableDiffusionInstructPix2PixPipeline(**{**base.components, "unet": unet},
                                                    requires_safety_checker=False)
    out = tmp_path_factory.mktemp("released") / "instruct-pix2pix"
    editor.save_pretrained(out)
    return out


def _edit_with(model: Path, source: Path, out: Path) -> None:
    assert main(["generate", "--model", str(model), "--image", str(source), "--prompt", "make it blue",
                 "--steps", "1", "--out", str(out)]) == 0
    assert len(list(out.glob("*.png"))) == 2


def _fine_tune(run: Path, model: Path, edits: Path, config: str = "instruct-pix2pix.yaml", *extra: str) -> int:
    return main(["train", str(CONFIGS / config), f"run_dir={run}", f"model.pretrained={model}", *TINY,
                 f"data.shards={edits}", "train.max_steps=1", "validation.prompts=[]", "ema.enabled=false", *extra])


def _reads(run: Path) -> int:
    return load_file(str(latest_checkpoint(run) / "model.safetensors"))["unet.conv_in.weight"].shape[1]


def test_a_released_editor_fine_tunes_without_widening_and_other_modes_refuse_it(
        tmp_path, released_editor, edits, capsys):
    run = tmp_path / "run"
    assert _fine_tune(run, released_editor, edits) == 0 and _reads(run) == 8
    capsys.readouterr()
    # Fine-tuned as a text-to-image model, it would be fed the latents alone: one line, naming the mode that fits.
    assert _fine_tune(tmp_path / "full", released_editor, edits, "finetune-full.yaml") == 2
    error = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert len(error) == 1 and "mode instruct_pix2pix" in error[0] and "8 input channels" in error[0]


def test_lora_adapters_on_a_released_editor_train_with_its_sources_and_load_in_diffusers_editing_pipeline(
        tmp_path, released_editor, pretrained, edits, capsys):
    """``mode: [instruct_pix2pix, lora]``: adapters on a denoiser that already edits, fed each sample's source as it
    was trained to read it; the adapters' file loads whole in diffusers' InstructPix2Pix pipeline on that editor.
    On a UNet that reads its latents alone, the inputs it would gain for the source could not train: one line."""
    from diffusers import StableDiffusionInstructPix2PixPipeline

    def fine_tune(run: Path, model: Path) -> int:
        return _fine_tune(run, model, edits, "instruct-pix2pix.yaml", "mode=[instruct_pix2pix,lora]", "optim.lr=0.01",
                          "validation.prompts=[make it blue]", "validation.steps=1")

    run = tmp_path / "run"
    assert fine_tune(run, released_editor) == 0
    weights = load_file(str(latest_checkpoint(run) / "model.safetensors"))
    assert weights and all(".lora_" in k for k in weights)  # the editor's own weights stay its own
    assert (run / "samples" / "step_00000001.png").is_file()  # drawn from the last batch's sources
    out = export_run(run, tmp_path / "out")
    pipe = StableDiffusionInstructPix2PixPipeline.from_pretrained(released_editor, safety_checker=None,
                                                                  local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    source = Image.open(next(iter(sorted((edits.parent / "images").glob("*.src.png")))))

    def edit() -> np.ndarray:
        return pipe("make it blue", image=source, num_inference_steps=2, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images[0]

    before = edit()
    pipe.load_lora_weights(out)
    assert len([k for k in pipe.unet.state_dict() if ".lora_" in k]) == len(weights)
    assert np.abs(edit() - before).max() > 0
    card = (out / "README.md").read_text()
    assert "StableDiffusionInstructPix2PixPipeline" in card and "to edit an image" in card

    capsys.readouterr()
    assert fine_tune(tmp_path / "unwidened", pretrained) == 2
    error = [line for line in capsys.readouterr().err.strip().splitlines() if "error:" in line]
    assert len(error) == 1 and "train that first" in error[0], error


@pytest.mark.slow
def test_a_released_editors_fine_tune_and_its_export_fine_tuned_again_edit(tmp_path, released_editor, edits):
    source = next(iter(sorted((edits.parent / "images").glob("*.src.png"))))
    first, again = tmp_path / "first", tmp_path / "again"
    assert _fine_tune(first, released_editor, edits) == 0
    exported = export_run(first, tmp_path / "out")
    _edit_with(exported, source, tmp_path / "edited")
    assert _fine_tune(again, exported, edits) == 0 and _reads(again) == 8
    _edit_with(export_run(again, tmp_path / "out-again"), source, tmp_path / "edited-again")


def test_a_unet_that_reads_neither_the_latents_nor_the_latents_and_a_source_is_refused():
    from diffusers import UNet2DConditionModel

    from sdtrain.errors import UserError
    from sdtrain.models.families.unet import widen_unet

    tiny = {"block_out_channels": (8, 16), "layers_per_block": 1, "norm_num_groups": 8, "cross_attention_dim": 8,
            "attention_head_dim": 2, "sample_size": 8, "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D")}
    inpainting = UNet2DConditionModel(in_channels=9, **tiny)  # the noisy latents, the mask and the masked image
    with pytest.raises(UserError, match="reads 9 input channels"):
        widen_unet(inpainting)
    plain = UNet2DConditionModel(**tiny)
    widen_unet(plain)
    widen_unet(plain)  # widened once: read as an editor
    assert plain.config.in_channels == plain.conv_in.in_channels == 8


def _png(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, format="PNG")
    return out.getvalue()


def _edit_shard(path: Path, count: int, without_source: tuple[int, ...] = ()) -> Path:
    """`count` edits of one 8x8 image, each keyed by its index; those in `without_source` without a KEY.src.png."""
    members = {"png": _png((200, 30, 30)), "txt": b"make it red", "src.png": _png((30, 30, 200))}
    with tarfile.open(path, "w") as tar:
        for index in range(count):
            for ext, data in members.items():
                if ext == "src.png" and index in without_source:
                    continue
                info = tarfile.TarInfo(f"{index:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def _drops(tmp_path: Path, count: int, q: float, without_source: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Each sample of a shipped-config InstructPix2Pix run's batches: whether its caption was dropped, whether its
    source latents are zero, its key."""
    from diffusers import AutoencoderKL

    from sdtrain.config import load_config
    from sdtrain.data.pipeline import TrainBatches
    from sdtrain.train.modes.instruct_pix2pix import InstructPix2PixPart

    shard = _edit_shard(tmp_path / "edits.tar", count, without_source)
    config = load_config(CONFIGS / "instruct-pix2pix.yaml", [
        "run_dir=unused", "model.pretrained=unused", f"data.shards={shard}", "data.resolution=8",
        "data.batch_size=500", "data.num_workers=0", "data.random_flip=false", f"instruct_pix2pix.source_dropout={q}"])
    part = InstructPix2PixPart(config, families.get("sd"))
    # The smallest VAE: what is measured is which samples' latents are zero.
    vae = AutoencoderKL(block_out_channels=(8,), layers_per_block=1, norm_num_groups=8).eval()
    loader = TrainBatches(part.data_config(config.data), None, seed=0)
    caption, source, keys = [], [], []
    try:
        for _ in range(count // 500):
            batch = loader.next()
            latents = part.denoiser_extra(batch, vae, None)
            caption.append(torch.tensor([c == "" for c in batch["captions"]]))
            source.append(latents.flatten(1).abs().amax(1) == 0)
            keys += batch["keys"]
    finally:
        loader.close()
    return {"caption": torch.cat(caption), "source": torch.cat(source), "keys": keys}


@pytest.mark.parametrize("count, q", [(2000, 0.25), pytest.param(20000, 0.05, marks=pytest.mark.slow)])
def test_one_draw_per_sample_drops_the_caption_the_source_or_both_as_the_recipe_does(tmp_path, count, q):
    """The paper's and diffusers' train_instruct_pix2pix.py: q of the samples without their caption alone, q without
    their source alone, q without both (the prediction image_guidance_scale subtracts), not q squared."""
    drops = _drops(tmp_path, count, q)
    both = (drops["caption"] & drops["source"]).float().mean().item()
    caption_only = (drops["caption"] & ~drops["source"]).float().mean().item()
    source_only = (~drops["caption"] & drops["source"]).float().mean().item()
    for share in (both, caption_only, source_only):
        assert abs(share - q) < 0.1 * q, (both, caption_only, source_only)


def test_a_sample_without_its_source_edits_no_image_and_editing_by_reference_refuses_it(tmp_path):
    from sdtrain.config import DataConfig
    from sdtrain.data.pipeline import TrainBatches
    from sdtrain.errors import UserError
    from sdtrain.train.tasks import sources_of

    drops = _drops(tmp_path, 500, 0.0, without_source=(3, 7))
    assert sorted(key for key, zero in zip(drops["keys"], drops["source"].tolist()) if zero) == ["000003", "000007"]

    loader = TrainBatches(DataConfig(shards=str(tmp_path / "edits.tar"), resolution=8, batch_size=500,
                                     num_workers=0), None, seed=0)
    try:
        batch = loader.next()
    finally:
        loader.close()
    with pytest.raises(UserError, match="edit.reference: no source image .* for (000003, 000007|000007, 000003),"):
        sources_of(batch)


def test_a_caption_dropout_beside_the_source_dropout_is_one_line():
    from sdtrain.config import load_config
    from sdtrain.errors import UserError
    from sdtrain.train.modes.instruct_pix2pix import InstructPix2PixPart

    config = load_config(CONFIGS / "instruct-pix2pix.yaml", ["run_dir=unused", "model.pretrained=unused",
                                                             "data.shards=unused", "data.caption_dropout=0.05"])
    with pytest.raises(UserError, match="remove data.caption_dropout"):
        InstructPix2PixPart(config, families.get("sd")).data_config(config.data)
