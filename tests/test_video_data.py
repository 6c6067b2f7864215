"""Clips (video) as data: `prepare folder` cutting videos into windows by a frame rule, the loader reading them for a
model of clips (and refusing them for one of still images), and `data preview` showing them as strips."""

from __future__ import annotations

import dataclasses
import io
import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from sdtrain.cli.main import main
from sdtrain.config import DataConfig
from sdtrain.data.encoded import LATENT_MEAN, LATENT_STD, npy_bytes
from sdtrain.data.pipeline import TrainBatches
from sdtrain.data.preview import STRIP_GAP, preview_data, strip
from sdtrain.data.shards import ShardWriter, read_manifest, sha256_file
from sdtrain.data.video import read_clip
from sdtrain.errors import UserError

SIZE = (40, 24)
"""The test videos' frame size: two grey bands whose levels say the frame's number over a square moving below them."""


def frame_pixels(number: int, size: tuple[int, int] = SIZE) -> np.ndarray:
    """Source frame `number`: two flat grey bands, levels 16 times its number's last and first base-16 digit (steps
    that survive conversions and compression), a white square at a place of its own in the bottom half, and a red
    marker in the top-left corner (to tell a flip)."""
    width, height = size
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:6] = 16 * (number % 16)
    pixels[6:12] = 16 * (number // 16)
    x = (2 * number) % (width - 8)
    pixels[height // 2 + 2: height // 2 + 10, x: x + 8] = 255
    pixels[:4, :6] = (255, 0, 0)
    return pixels


LOSSLESS = {"libx264": {"crf": "0"}, "libvpx-vp9": {"lossless": "1"}, "ffv1": {}}
"""Each codec's lossless setting: each frame's grey levels read back as they were written."""


def write_video(path: Path, frames: int = 60, fps: int = 30, size: tuple[int, int] = SIZE, codec: str = "libx264",
                rotation: int = 0) -> Path:
    """A video of `frames` frames (`frame_pixels`) at `fps`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as output:
        stream = output.add_stream(codec, rate=fps, options=LOSSLESS[codec])
        stream.width, stream.height = size
        # H.264's 4:2:0 needs even sides; FFV1 takes any.
        stream.pix_fmt = "yuv444p" if codec == "ffv1" else "yuv420p"
        if rotation:
            stream.set_display_rotation(rotation)
        for number in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(number, size), format="rgb24")
            frame.pts = number
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return path


def write_audio(path: Path) -> Path:
    """A file with a sound stream and no video."""
    with av.open(str(path), "w") as output:
        stream = output.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate, frame.pts = 8000, 0
        output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return path


def png(colour: str, size: tuple[int, int] = (20, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def prepare(capsys: pytest.CaptureFixture, src: Path, out: Path, *options: str) -> list[str]:
    assert main(["prepare", "folder", str(src), "--out", str(out), *options]) == 0
    return capsys.readouterr().out.splitlines()


def samples(out: Path) -> dict[str, dict]:
    manifest = read_manifest(out)
    assert manifest is not None
    return {s["__key__"]: s for s in wds.WebDataset([str(out / s["name"]) for s in manifest["shards"]],
                                                    shardshuffle=False)}


def numbers(clip: bytes) -> list[int]:
    """The source frame each frame of a clip member shows (read from its grey bands)."""
    def level(frame: np.ndarray, rows: slice) -> int:
        return round(float(frame[rows, 10:, 1].mean()) / 16)

    frames = [np.asarray(frame) for frame in read_clip(clip, 10**8)]
    return [level(frame, slice(2, 5)) + 16 * level(frame, slice(8, 11)) for frame in frames]


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2 s video at 30 fps with its caption."""
    src = tmp_path_factory.mktemp("clip")
    write_video(src / "walk.mp4")
    (src / "walk.txt").write_text("a square walks")
    return src


@pytest.mark.parametrize(("options", "keys", "starts"), [
    ((), ["walk"], [0]),
    (("--frame-rule", "chunk"), ["walk_w000", "walk_w001", "walk_w002"], [0, 9, 18]),
    (("--frame-rule", "uniform", "--windows", "3"), ["walk_w000", "walk_w001", "walk_w002"], [0, 11, 23]),
    (("--frame-rule", "slide", "--frame-stride", "7"), ["walk_w000", "walk_w001", "walk_w002", "walk_w003"],
     [0, 7, 14, 21]),
])
def test_each_frame_rule_gives_its_windows_under_its_keys(clip_folder: Path, tmp_path: Path, capsys, options,
                                                           keys: list[str], starts: list[int]) -> None:
    # 2 s at 16 fps: 32 frames, cut into windows of 9.
    lines = prepare(capsys, clip_folder, tmp_path / "out", "--frames", "9", *options)
    written = samples(tmp_path / "out")
    assert sorted(written) == keys
    assert lines[1].startswith(f"clips: 1 videos cut into {len(keys)} windows of 9 frames at 16 fps")
    for key, start in zip(keys, starts, strict=True):
        meta = json.loads(written[key]["json"])
        assert meta["frames"] == 9 and meta["fps"] == 16 and meta["file_name"] == "walk.mp4"
        assert meta["start"] == start / 16
        assert meta.get("window") == (None if key == "walk" else keys.index(key))
        assert meta["source"] == {"width": 40, "height": 24, "fps": 30, "frames": 60, "duration": 2, "codec": "h264"}
        assert (meta["width"], meta["height"]) == SIZE
        assert written[key]["txt"] == b"a square walks"
        # Output frame k shows the source frame nearest k / 16 s (the earlier of two as near).
        expected = [min(range(60), key=lambda j, k=k: (abs(Fraction(j, 30) - Fraction(k, 16)), j))
                    for k in range(start, start + 9)]
        assert numbers(written[key]["mp4"]) == expected
    assert read_manifest(tmp_path / "out")["clips"]["frames"] == 9


def test_fps_resampling_drops_or_repeats_frames_and_zero_keeps_them(clip_folder: Path, tmp_path: Path,
                                                                    capsys) -> None:
    prepare(capsys, clip_folder, tmp_path / "kept", "--frames", "9", "--fps", "0")
    kept = samples(tmp_path / "kept")["walk"]
    assert numbers(kept["mp4"]) == list(range(9))
    assert json.loads(kept["json"])["fps"] == 30
    prepare(capsys, clip_folder, tmp_path / "faster", "--frames", "9", "--fps", "60")
    assert numbers(samples(tmp_path / "faster")["walk"]["mp4"]) == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    prepare(capsys, clip_folder, tmp_path / "slower", "--frames", "5", "--fps", "5", "--frame-rule", "chunk")
    slower = samples(tmp_path / "slower")  # 10 frames: every sixth source frame
    assert [numbers(slower[key]["mp4"]) for key in sorted(slower)] == [[0, 6, 12, 18, 24], [30, 36, 42, 48, 54]]


def test_window_lengths_follow_the_frame_step(clip_folder: Path, tmp_path: Path, capsys) -> None:
    assert main(["prepare", "folder", str(clip_folder), "--out", str(tmp_path / "out"), "--frames", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--frames 10: not 1 + a multiple of --frame-step 4" in err and "use 9 or 13" in err
    prepare(capsys, clip_folder, tmp_path / "out", "--frames", "10", "--frame-step", "1")
    assert len(numbers(samples(tmp_path / "out")["walk"]["mp4"])) == 10


def test_unreadable_cut_short_silent_and_too_short_videos_are_skipped_and_named(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    whole = write_video(src / "good.mp4").read_bytes()
    (src / "half.mp4").write_bytes(whole[: len(whole) // 2])
    (src / "junk.mov").write_bytes(b"not a video at all " * 50)
    webm = write_video(tmp_path / "cut.webm", codec="libvpx-vp9").read_bytes()
    (src / "cut.webm").write_bytes(webm[: len(webm) // 2])
    write_video(src / "brief.mkv", frames=6)
    write_audio(src / "sound.mkv")
    for name in ("good", "half", "junk", "cut", "brief", "sound"):
        (src / f"{name}.txt").write_text(name)
    lines = prepare(capsys, src, tmp_path / "out", "--frames", "9")
    assert lines == [
        f"written: 1 samples in 1 shards to {tmp_path / 'out'}",
        "clips: 1 videos cut into 1 windows of 9 frames at 16 fps (--frame-rule head)",
        "skipped (video the decoder cannot read: corrupt, truncated or not a video): 2: half.mp4, junk.mov",
        "skipped (video that ends before the length its file declares (cut short)): 1: cut.webm",
        "skipped (file without a video stream): 1: sound.mkv",
        "skipped (video shorter than one window (--frames at --fps)): 1: brief.mkv",
    ]
    assert read_manifest(tmp_path / "out")["skipped"] == {"video_unreadable": 2, "video_truncated": 1, "no_video": 1,
                                                          "too_short": 1}


def test_a_video_damaged_part_way_keeps_the_windows_before_the_damage(tmp_path: Path, capsys) -> None:
    data = bytearray(write_video(tmp_path / "src" / "hurt.mp4").read_bytes())
    for i in range(len(data) * 6 // 10, len(data) * 6 // 10 + 300):
        data[i] ^= 0x5A
    (tmp_path / "src" / "hurt.mp4").write_bytes(bytes(data))
    (tmp_path / "src" / "hurt.txt").write_text("hurt")
    lines = prepare(capsys, tmp_path / "src", tmp_path / "out", "--frames", "5", "--frame-rule", "chunk")
    kept = sorted(samples(tmp_path / "out"))
    assert kept and kept == [f"hurt_w{i:03d}" for i in range(len(kept))] and len(kept) < 6
    assert lines[-1] == "skipped (video damaged or cut short part-way, the windows before the damage kept): 1: hurt.mp4"


def test_metadata_rows_name_videos_and_reshard_keeps_their_windows(clip_folder: Path, tmp_path: Path,
                                                                    capsys) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "clips").mkdir()
    (src / "clips" / "walk.mp4").write_bytes((clip_folder / "walk.mp4").read_bytes())
    (src / "red.png").write_bytes(png("red"))
    (src / "metadata.jsonl").write_text('{"file_name": "clips/walk.mp4", "text": "a walk", "mood": "calm"}\n'
                                        '{"file_name": "red.png", "text": "red"}\n')
    prepare(capsys, src, tmp_path / "out", "--frames", "9", "--frame-rule", "chunk")
    written = samples(tmp_path / "out")
    assert sorted(written) == ["clips/walk_w000", "clips/walk_w001", "clips/walk_w002", "red"]
    meta = json.loads(written["clips/walk_w001"]["json"])
    assert meta["mood"] == "calm" and meta["file_name"] == "clips/walk.mp4"
    assert written["clips/walk_w001"]["txt"] == b"a walk"
    assert main(["prepare", "reshard", str(tmp_path / "out"), "--out", str(tmp_path / "even"),
                 "--samples-per-shard", "2", "--min-width", "30"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["filtered (min_width=30): 1"]  # the 20 px image
    resharded = samples(tmp_path / "even")
    assert sorted(resharded) == ["clips/walk_w000", "clips/walk_w001", "clips/walk_w002"]
    assert resharded["clips/walk_w002"]["mp4"] == written["clips/walk_w002"]["mp4"]


def test_the_command_line_defaults_are_the_librarys() -> None:
    from sdtrain.cli import prepare as cli
    from sdtrain.data import video

    assert (cli.VIDEO_EXTENSIONS, cli.FRAME_RULES, cli.DEFAULT_FRAMES, cli.DEFAULT_FPS, cli.DEFAULT_FRAME_STEP,
            cli.DEFAULT_WINDOWS) == (video.VIDEO_EXTENSIONS, video.FRAME_RULES, video.DEFAULT_FRAMES,
                                     video.DEFAULT_FPS, video.DEFAULT_FRAME_STEP, video.DEFAULT_WINDOWS)


def test_the_pixel_limit_refuses_a_video_from_its_header(clip_folder: Path, tmp_path: Path, capsys) -> None:
    lines = prepare(capsys, clip_folder, tmp_path / "out", "--frames", "9", "--max-pixels", "959")
    assert lines[-1] == "skipped (video frames over 959 pixels): 1: walk.mp4"


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Videos (one of odd sides, one a copy, one turned a quarter by its display rotation) beside images."""
    src = tmp_path_factory.mktemp("mixed")
    write_video(src / "a.mp4")
    write_video(src / "odd.mkv", frames=40, size=(41, 25), codec="ffv1")
    write_video(src / "turned.mov", frames=40, rotation=90)
    (src / "copy.mp4").write_bytes((src / "a.mp4").read_bytes())
    (src / "red.png").write_bytes(png("red"))
    (src / "blue.png").write_bytes(png("blue", (30, 20)))
    for name in ("a", "odd", "turned", "copy", "red", "blue"):
        (src / f"{name}.txt").write_text(f"caption of {name}")
    return src


def test_images_beside_videos_are_kept_as_they_are_and_reruns_write_the_same_bytes(mixed_folder: Path,
                                                                                      tmp_path: Path,
                                                                                      capsys) -> None:
    lines = prepare(capsys, mixed_folder, tmp_path / "one", "--frames", "5", "--frame-rule", "chunk")
    assert "skipped (video with the same bytes as an earlier one): 1: copy.mp4 (same as a.mp4)" in lines
    written = samples(tmp_path / "one")
    assert written["red"]["png"] == (mixed_folder / "red.png").read_bytes()
    assert sorted(written) == ["a_w000", "a_w001", "a_w002", "a_w003", "a_w004", "a_w005", "blue", "odd_w000",
                               "odd_w001", "odd_w002", "odd_w003", "red", "turned_w000", "turned_w001", "turned_w002",
                               "turned_w003"]
    odd = json.loads(written["odd_w001"]["json"])
    assert (odd["width"], odd["height"]) == (41, 25)  # stored padded to even sides, cropped back by the loader
    assert read_clip(written["odd_w001"]["mp4"], 10**8, (41, 25))[0].size == (41, 25)
    turned = json.loads(written["turned_w000"]["json"])
    assert (turned["width"], turned["height"], turned["decode"]) == (24, 40, {"rotation": 90})
    assert read_clip(written["turned_w000"]["mp4"], 10**8)[0].size == (24, 40)

    prepare(capsys, mixed_folder, tmp_path / "two", "--frames", "5", "--frame-rule", "chunk")
    first, second = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert [s["sha256"] for s in first["shards"]] == [s["sha256"] for s in second["shards"]]
    assert sha256_file(tmp_path / "one" / "shard-000000.tar") == sha256_file(tmp_path / "two" / "shard-000000.tar")


@pytest.fixture(scope="module")
def clip_shards(mixed_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The mixed folder prepared twice, as windows of 5 and of 9 frames: with its images, three frame counts."""
    root = tmp_path_factory.mktemp("shards")
    for frames in ("5", "9"):
        assert main(["prepare", "folder", str(mixed_folder), "--out", str(root / f"f{frames}"), "--frames", frames,
                     "--frame-rule", "chunk", "--samples-per-shard", "4"]) == 0
    return f"{root}/f*/shard-*.tar"


def clip_config(shards: str, **kwargs) -> DataConfig:
    return DataConfig(**{"shards": shards, "resolution": 16, "batch_size": 2, "num_workers": 0, "caption_dropout": 0.0,
                         "center_crop": False, "random_flip": True, **kwargs})


def take(loader: TrainBatches, count: int) -> list[dict]:
    return [loader.next() for _ in range(count)]


def placed(frame: Image.Image, size_ids: torch.Tensor, flip: bool) -> np.ndarray:
    """`frame` resized to cover 16 px and cropped where `size_ids` say (they mirror the crop's left when flipped)."""
    height, width, top, left = (int(v) for v in size_ids[:4])
    scale = max(16 / width, 16 / height)
    resized = frame.resize((max(16, round(width * scale)), max(16, round(height * scale))), Image.Resampling.BICUBIC)
    if flip:
        left = resized.width - left - 16
    crop = resized.crop((left, top, left + 16, top + 16))
    crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else crop
    return np.asarray(crop, np.float32) / 127.5 - 1.0


def test_clip_batches_hold_one_frame_count_each_frame_placed_as_the_first(clip_shards: str) -> None:
    loader = TrainBatches(clip_config(clip_shards), None, seed=0, clips=True)
    counts, flips = set(), set()
    frames_of: dict[tuple[str, int], list[Image.Image]] = {}  # both folders hold a key of each video's first window
    for batch in take(loader, 12):
        pixels = batch["pixel_values"]
        assert pixels.dim() == 5 and pixels.shape[:2] == (2, 3) and pixels.shape[3:] == (16, 16)
        assert pixels.min() >= -1 and pixels.max() <= 1
        counts.add(pixels.shape[2])
        for key, clip, size_ids in zip(batch["keys"], pixels, batch["size_ids"], strict=True):
            if pixels.shape[2] == 1:
                assert key in ("red", "blue")
                continue
            count = pixels.shape[2]
            if (key, count) not in frames_of:
                folder = f"f{count}"
                shards = sorted(Path(clip_shards.split("/f*")[0], folder).glob("*.tar"))
                raw = next(s for s in wds.WebDataset([str(p) for p in shards], shardshuffle=False)
                           if s["__key__"] == key)
                meta = json.loads(raw["json"])
                frames_of[key, count] = read_clip(raw["mp4"], 10**8, (meta["width"], meta["height"]))
            got = clip.permute(1, 2, 3, 0).numpy()
            # One flip and one crop for every frame: the whole clip matches one placement.
            matches = [flip for flip in (False, True)
                       if all(np.abs(got[t] - placed(f, size_ids, flip)).max() < 1e-5
                              for t, f in enumerate(frames_of[key, count]))]
            assert len(matches) == 1, key
            flips.add(matches[0])
    loader.close()
    assert counts == {1, 5, 9}
    assert flips == {False, True}


def test_a_resumed_clip_loader_gives_the_batches_of_an_uninterrupted_one(clip_shards: str) -> None:
    config = clip_config(clip_shards, batch_size=3)
    straight = take(TrainBatches(config, None, seed=4, clips=True), 14)
    first = TrainBatches(dataclasses.replace(config, num_workers=1), None, seed=4, clips=True)
    head = take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    assert state["pending"]  # samples waited in buckets of other frame counts
    first.close()
    resumed = TrainBatches(config, None, seed=4, clips=True)
    resumed.load_state_dict([state])
    tail = take(resumed, 9)
    assert [b["keys"] for b in head + tail] == [b["keys"] for b in straight]
    for a, b in zip(straight, head + tail, strict=True):
        assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["size_ids"], b["size_ids"])


def test_clips_in_the_data_of_a_model_of_still_images_are_one_line(clip_shards: str) -> None:
    loader = TrainBatches(clip_config(clip_shards), None, seed=0)
    with pytest.raises(UserError) as raised:
        take(loader, 12)
    message = str(raised.value)
    assert "\n" not in message and "is a clip (video)" in message and "model.family: wan" in message
    assert message.split("sample ", 1)[1].split(" ")[0].rstrip("0123456789").endswith("_w")
    with pytest.raises(UserError, match=r"clip of (5|9) frames, and this model reads 1 \+ a multiple of 8"):
        take(TrainBatches(clip_config(clip_shards), None, seed=0, clips=True, frame_step=8), 12)


def test_encoded_clips_batch_by_their_latent_frames(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, samples_per_shard=5, extra={"encoding": {"resolution": 16}}) as writer:
        for i in range(12):
            frames = (1, 2, 3)[i % 3]
            latents = npy_bytes(np.full((4, frames, 2, 2), i, np.float16))
            writer.write({"__key__": f"s{i:02d}", "txt": f"caption {i}", LATENT_MEAN: latents, LATENT_STD: latents})
    loader = TrainBatches(clip_config(str(tmp_path), batch_size=2), None, seed=0, encoded=True, clips=True)
    seen = set()
    for batch in take(loader, 6):
        assert batch["latent_mean"].dim() == 5
        frames = batch["latent_mean"].shape[2]
        assert all(int(key[1:]) % 3 == frames - 1 for key in batch["keys"])
        seen.add(frames)
    assert seen == {1, 2, 3}


def test_the_preview_shows_a_clip_as_a_strip_of_its_frames(clip_shards: str, tmp_path: Path) -> None:
    clip = torch.arange(9.0).view(1, 9, 1, 1).expand(3, 9, 4, 6)
    shown = strip(clip)
    assert shown.shape == (3, 4, 5 * 6 + 4 * STRIP_GAP)
    assert [float(shown[0, 0, i * (6 + STRIP_GAP)]) for i in range(5)] == [0, 2, 4, 6, 8]
    assert torch.equal(strip(clip[:, 0]), clip[:, 0])
    result = preview_data(clip_config(clip_shards), 0, 6, tmp_path / "preview.png")
    assert Path(result["grid"]).is_file() and result["skipped"] == 0
