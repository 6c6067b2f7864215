"""Clips as a user sees them come out: previews and generated clips written as mp4 a player opens, grids and
reports showing a strip of each clip's frames, and the loss of clip latents reduced per sample."""

from __future__ import annotations

from pathlib import Path

import av
import pytest
import torch
import webdataset as wds
from PIL import Image

from sdtrain.data.encoded import load_npy
from sdtrain.train.tasks import _sample_dims, latent_mask
from sdtrain.utils import save_grid, save_images, still, to_pil

from .conftest import resumes_bitwise_after_kill_9


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


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """Two captioned videos and a still image, prepared into clips of 5 frames at 8 fps (and a one-frame clip)."""
    from sdtrain.cli.main import main

    from .test_video_data import write_video

    src = tmp_path_factory.mktemp("videos")
    for name, caption, frames in (("walk", "a square walks", 40), ("run", "a square runs", 44)):
        write_video(src / f"{name}.mp4", frames=frames, fps=16, size=(40, 32))
        (src / f"{name}.txt").write_text(caption)
    Image.new("RGB", (40, 32), "red").save(src / "still.png")
    (src / "still.txt").write_text("a red field")
    out = tmp_path_factory.mktemp("clips")
    assert main(["prepare", "folder", str(src), "--out", str(out), "--frames", "5", "--fps", "8",
                 "--frame-rule", "chunk"]) == 0
    return out


def test_a_clip_run_from_scratch_resumes_bitwise_after_kill_9(clips, tmp_path, tiny_scratch_command):
    resumes_bitwise_after_kill_9(lambda run: tiny_scratch_command("wan", run, 3, f"data.shards={clips}",
                                                                  "checkpoint.every=1", "data.caption_dropout=0.25",
                                                                  "model.t5_text_length=16"), tmp_path)


def test_videos_in_a_folder_train_a_wan_model_that_draws_clips_and_a_lora_diffusers_and_comfyui_read(
        clips, tmp_path, tiny_scratch_command):
    """What a user runs from the README: a folder of videos (and a still image) with captions prepared into clips,
    Wan 2.1 trained from scratch on them with validation clips written as mp4, exported as a WanPipeline folder that
    `generate` draws clips from, then a LoRA on that folder whose files diffusers and ComfyUI's names both hold."""
    from diffusers import WanPipeline
    from safetensors import safe_open

    from sdtrain.cli.main import main

    run = tmp_path / "run"
    assert main(tiny_scratch_command("wan", run, 2, f"data.shards={clips}", "validation.prompts=[a square walks]",
                                     "validation.steps=2", "model.t5_text_length=16")) == 0
    validation = sorted((run / "samples").glob("step_*/*.mp4"))
    assert validation, "no validation clip"
    with av.open(str(validation[-1])) as container:
        assert sum(1 for _ in container.decode(video=0)) == 5  # the run's clips' length

    export = tmp_path / "export"
    assert main(["export", str(run), "--out", str(export)]) == 0
    assert isinstance(WanPipeline.from_pretrained(export), WanPipeline)
    drawn = tmp_path / "drawn"
    assert main(["generate", "--model", str(export), "--prompt", "a square runs", "--frames", "9", "--steps", "2",
                 "--out", str(drawn)]) == 0
    with av.open(str(next(drawn.glob("*.mp4")))) as container:
        assert sum(1 for _ in container.decode(video=0)) == 9

    # The LoRA trains on the clips' latents and text embeddings, encoded once: each clip whole, by latent frames.
    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(clips), "--model", str(export), "--out", str(encoded), "--resolution",
                 "32", "--t5-text-length", "16"]) == 0
    latents = {sample["__key__"]: load_npy(sample["latent_mean.npy"]).shape
               for shard in sorted(encoded.glob("*.tar")) for sample in wds.WebDataset(str(shard), shardshuffle=False)}
    assert sorted(set(latents.values())) == [(16, 1, 8, 8), (16, 2, 8, 8)]  # the still image; the 5-frame clips
    lora = tmp_path / "lora"
    assert main(["train", "src/sdtrain/configs/wan-lora.yaml", f"model.pretrained={export}", f"data.shards={encoded}",
                 "data.use_encoded=true", "model.t5_text_length=16",
                 f"run_dir={lora}", "data.resolution=32", "data.aspect_buckets=false", "data.num_workers=0",
                 "train.max_steps=2", "train.mixed_precision=fp32", "lora.rank=2", "logging.tensorboard=false",
                 "logging.progress=false"]) == 0
    adapters = tmp_path / "adapters"
    assert main(["export", str(lora), "--out", str(adapters)]) == 0
    with safe_open(str(adapters / "lora_kohya.safetensors"), framework="pt") as file:
        names = list(file.keys())
    assert names and all(name.startswith("diffusion_model.blocks.") for name in names)
    pipe = WanPipeline.from_pretrained(export)
    pipe.load_lora_weights(adapters)
    assert pipe.get_active_adapters()


def test_clips_given_to_a_family_of_still_images_stop_the_run_in_one_line_naming_a_clip(clips, tmp_path, capsys,
                                                                                         tiny_scratch_command):
    from sdtrain.cli.main import main

    assert main(tiny_scratch_command("sd", tmp_path / "run", 1, f"data.shards={clips}")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "_w00" in errors[0] and "wan" in errors[0], errors


def test_a_mask_beside_a_video_weighs_every_frame_of_each_window_through_the_loader_and_encoding(tmp_path,
                                                                                               tiny_scratch_command):
    """``walk.mask.png`` beside ``walk.mp4``: each window keeps it, the loader places it as the frames are placed
    (1, H, W: every frame's), `prepare encode` stores it on the latents' grid, and a run trains on it; a mask of
    another size skips its video by name."""
    from sdtrain.cli.main import main
    from sdtrain.config import DataConfig
    from sdtrain.data.pipeline import TrainBatches

    from .test_video_data import write_video

    src = tmp_path / "videos"
    write_video(src / "walk.mp4", frames=40, fps=16, size=(40, 32))
    (src / "walk.txt").write_text("a square walks")
    mask = Image.new("L", (40, 32), 0)
    mask.paste(255, (0, 0, 20, 32))  # the left half counts
    mask.save(src / "walk.mask.png")
    write_video(src / "odd.mp4", frames=44, fps=16, size=(40, 32))
    (src / "odd.txt").write_text("a square runs")
    Image.new("L", (20, 16), 255).save(src / "odd.mask.png")
    shards = tmp_path / "clips"
    assert main(["prepare", "folder", str(src), "--out", str(shards), "--frames", "5", "--fps", "8",
                 "--frame-rule", "chunk"]) == 0
    batches = TrainBatches(DataConfig(shards=str(shards), resolution=32, batch_size=2, num_workers=0), None, 0,
                           clips=True, frame_step=4)
    batch = batches.next()
    batches.close()
    assert batch["pixel_values"].shape == (2, 3, 5, 32, 32) and batch["mask"].shape == (2, 1, 32, 32)
    assert batch["mask"][:, :, :, :4].min() == 1 and batch["mask"][:, :, :, -4:].max() == 0  # centre crop of 40
    assert all(key.startswith("walk") for key in batch["keys"])  # odd.mp4's mask is not its size: skipped
    run = tmp_path / "run"
    assert main(tiny_scratch_command("wan", run, 1, f"data.shards={shards}", "model.t5_text_length=16")) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(shards), "--model", str(tmp_path / "export"), "--out", str(encoded),
                 "--resolution", "32", "--t5-text-length", "16"]) == 0
    masks = [load_npy(sample["mask.npy"]) for shard in sorted(encoded.glob("*.tar"))
             for sample in wds.WebDataset(str(shard), shardshuffle=False)]
    assert masks and all(mask.shape == (1, 8, 8) and mask[0, :, 0].min() == 1 for mask in masks)
