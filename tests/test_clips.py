"""Clips as a user sees them come out: previews and generated clips written as mp4 a player opens, grids and
reports showing a strip of each clip's frames, and the loss of clip latents reduced per sample."""

from __future__ import annotations

import av
import pytest
import torch
from PIL import Image

from sdtrain.train.tasks import _sample_dims, latent_mask
from sdtrain.utils import save_grid, save_images, still, to_pil


def _frames(count: int, size: tuple[int, int] = (33, 17)) -> list[Image.Image]:
    return [Image.new("RGB", size, (20 * index, 100, 0)) for index in range(count)]


def test_a_clip_is_written_as_an_mp4_with_every_frame_and_a_one_frame_clip_as_a_png(tmp_path):
    paths = save_images([_frames(9), _frames(1), _frames(1)[0]], ["a red square", "one", "two"], tmp_path)
    assert [path.suffix for path in paths] == [".mp4", ".png", ".png"]
    with av.open(str(paths[0])) as container:
        stream = container.streams.video[0]
        decoded = list(container.decode(stream))
    # Odd sides are cropped to even ones, which 4:2:0 chroma needs.
    assert (len(decoded), stream.width, stream.height) == (9, 32, 16)
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_a_grid_shows_each_clip_as_a_strip_of_its_first_to_last_frames(tmp_path):
    clip = _frames(9)
    strip = still(clip)
    assert strip.size == (4 * 33, 17)
    assert strip.getpixel((0, 0)) == clip[0].getpixel((0, 0))
    assert strip.getpixel((3 * 33, 0)) == clip[-1].getpixel((0, 0))
    pixels = torch.rand(2, 3, 5, 8, 8) * 2 - 1  # reconstructions of clips, as an autoencoder run validates them
    assert [len(frames) for frames in to_pil(pixels)] == [5, 5]
    with Image.open(save_grid(pixels, tmp_path / "grid.png", rows=1)) as grid:
        assert grid.size == (2 * 4 * 8 * 2, 8 * 2)


@pytest.mark.parametrize("frames", [1, 3])
def test_a_clip_mask_for_every_frame_or_one_for_all_counts_on_the_latents_grid(frames):
    latents = torch.zeros(2, 4, 3, 4, 4)
    mask = torch.ones(2, 1, *(() if frames == 1 else (frames,)), 8, 8)
    mask[0] = 0
    found = latent_mask({"mask": mask}, latents)
    assert found.shape == (2, 1, frames, 4, 4)
    assert _sample_dims(latents) == (1, 2, 3, 4)
    assert found[0].sum() == 0 and found[1].min() == 1
