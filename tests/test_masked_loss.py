"""Loss masks: an image's transparency (data.alpha_mask) or a {key}.mask.png beside it weights the loss in latent
space, after the image's own crop and flip, in every mode and family, from images and from encoded shards."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrain.cli.main import main
from sdtrain.config import DataConfig
from sdtrain.data.decode import SampleDecoder
from sdtrain.data.pipeline import TrainBatches
from sdtrain.data.shards import ShardWriter, tar_samples
from sdtrain.train.tasks import DiffusionTask, latent_mask

from .conftest import TINY, config_path, resumes_bitwise_after_kill_9


def _png(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def cut_out(seed: int = 0) -> Image.Image:
    """A 32x32 RGBA cut-out: an opaque textured block on the left half, clear (stored black) on the right."""
    rgb = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    alpha = np.zeros((32, 32), dtype=np.uint8)
    alpha[:, :16] = 255
    return Image.fromarray(np.dstack([rgb, alpha]), "RGBA")


def test_the_mask_follows_the_image_through_its_crop_and_flip():
    raw = {"__key__": "c", "png": _png(cut_out()), "txt": b"a cut-out"}
    config = DataConfig(shards="x", resolution=32, caption_dropout=0.0, alpha_mask=True, random_flip=True)
    decoder = SampleDecoder(config, None, seed=0)
    seen = set()
    for epoch in range(8):
        sample = decoder(raw, (epoch, 0, 0))
        mask, pixels = sample["mask"][0], sample["pixel_values"]
        flipped = bool(mask[:, 0].max() == 0)
        seen.add(flipped)
        clear = (slice(None), slice(None), slice(0, 16) if flipped else slice(16, 32))
        assert mask[clear[1:]].max() == 0 and mask.sum() == 16 * 32
        assert torch.equal(pixels[clear], torch.ones_like(pixels[clear]))  # composited on white
    assert seen == {True, False}
    assert "mask" not in SampleDecoder(DataConfig(shards="x", resolution=32, caption_dropout=0.0), None, 0)(
        raw, (0, 0, 0))  # alpha_mask off: no mask


def test_the_masked_loss_is_the_mean_over_what_the_mask_counts_and_ignores_the_rest():
    output = torch.randn(2, 4, 8, 8, requires_grad=True)
    target = torch.randn(2, 4, 8, 8)
    mask = torch.zeros(2, 1, 8, 8)
    mask[0, :, :, :4] = 1  # the first sample counts its left half; the second nothing
    family = SimpleNamespace(denoising=SimpleNamespace(denoise=lambda *args: output))
    task = SimpleNamespace(family=family, denoiser=None,
                           objective=SimpleNamespace(prediction=lambda out, noisy, t: out, weight=lambda loss, t: loss))
    loss = DiffusionTask.denoising_loss_at(task, output, torch.zeros(2), target, {}, mask)
    assert torch.allclose(loss[0], (output[0, :, :, :4] - target[0, :, :, :4]).pow(2).mean())
    assert loss[1] == 0
    loss.sum().backward()
    assert output.grad[0, :, :, 4:].abs().max() == 0 and output.grad[1].abs().max() == 0
    assert output.grad[0, :, :, :4].abs().min() > 0
    # Pixel masks are averaged down to the latents' grid.
    pixel = torch.zeros(1, 1, 32, 32)
    pixel[..., :16] = 1
    grid = latent_mask({"mask": pixel}, torch.zeros(1, 4, 4, 4))
    assert grid.shape == (1, 1, 4, 4) and torch.equal(grid[0, 0, :, :2], torch.ones(4, 2))


def _mask_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "masked"
    folder.mkdir()
    for i in range(4):
        rgb = Image.fromarray(np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8))
        rgb.save(folder / f"p{i}.png")
        (folder / f"p{i}.txt").write_text(f"photo {i}")
        mask = Image.new("L", (32, 32), 0)
        mask.paste(255, (0, 0, 16, 32))
        mask.save(folder / f"p{i}.mask.png")
    Image.new("RGB", (32, 32)).save(folder / "wrong.png")
    (folder / "wrong.txt").write_text("a photo whose mask is of another size")
    Image.new("L", (16, 16), 255).save(folder / "wrong.mask.png")
    return folder


def test_prepare_keeps_a_mask_beside_its_image_and_skips_one_of_another_size(tmp_path, capsys, caplog):
    out = tmp_path / "shards"
    assert main(["prepare", "folder", str(_mask_folder(tmp_path)), "--out", str(out)]) == 0
    samples = [s for tar in out.glob("*.tar") for s in tar_samples(str(tar), lambda exc: False)]
    assert sorted(s["__key__"] for s in samples) == ["p0", "p1", "p2", "p3"]  # masks are not images of their own
    assert all("mask.png" in s for s in samples)
    assert "skipped (mask of another size than its image): 1" in capsys.readouterr().out
    assert any("wrong.mask.png: 16x16, not the 32x32 of its image" in r.getMessage() for r in caplog.records)
    batch = TrainBatches(DataConfig(shards=str(out), resolution=32, batch_size=4, num_workers=0,
                                    caption_dropout=0.0), None, seed=0).next()
    assert batch["mask"].shape == (4, 1, 32, 32) and batch["mask"][:, :, :, 16:].max() == 0


def _stickers(tmp_path: Path) -> Path:
    out = tmp_path / "stickers"
    with ShardWriter(out, samples_per_shard=4) as writer:
        for i in range(8):
            writer.write({"__key__": f"s{i}", "png": _png(cut_out(i)), "txt": f"sticker {i}"})
    return out


def _full_fine_tune(run: Path, pretrained: Path, shards: Path, *extra: str) -> list[str]:
    return ["train", str(config_path("diffusion.yaml").parents[1] / "finetune-full.yaml"), f"run_dir={run}", *TINY,
            "data.batch_size=2", "validation.prompts=[]", "evaluation.every_samples=0",
            f"model.pretrained={pretrained}", f"data.shards={shards}", "train.max_steps=3", "checkpoint.every=1",
            "data.alpha_mask=true", *extra]


# Slow: the masked loss, the mask's crop and flip and encoded masks are tested by default above and below; a resume
# carries no mask state of its own (the loader redraws each sample's mask from its place).
@pytest.mark.slow
def test_a_masked_fine_tune_resumes_bitwise_after_kill_9(tmp_path, pretrained):
    shards = _stickers(tmp_path)
    resumes_bitwise_after_kill_9(lambda run: _full_fine_tune(run, pretrained, shards), tmp_path)


def test_encoded_shards_carry_the_mask_at_the_latents_grid_for_runs_that_ask_for_it(tmp_path, pretrained):
    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(_stickers(tmp_path)), "--model", str(pretrained), "--out", str(encoded),
                 "--resolution", "32"]) == 0
    assert json.loads((encoded / "manifest.json").read_text())["encoding"]["resolution"] == 32

    def batch(alpha_mask: bool) -> dict:
        config = DataConfig(shards=str(encoded), resolution=32, batch_size=4, num_workers=0, caption_dropout=0.0,
                            alpha_mask=alpha_mask)
        return TrainBatches(config, None, seed=0, encoded=True).next()

    assert "mask" not in batch(False)
    masked = batch(True)
    assert masked["mask"].shape[-2:] == masked["latent_mean"].shape[-2:]
    side = masked["mask"].shape[-1]
    assert masked["mask"][..., : side // 2].min() == 1 and masked["mask"][..., side // 2:].max() == 0
