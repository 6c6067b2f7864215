"""Clips (video) as training data: a video file read with PyAV, resampled to one frame rate, cut into windows of
frames by a stated rule, each window stored as a shard member; and that member read back by the loader.

PyAV is the decoder because its wheels bundle FFmpeg and depend on no torch release (torchcodec's wheels are each
built against one torch version, so upgrading torch could break reading data), and it reads every container and
codec FFmpeg does (.mp4, .mov, .webm, .mkv; H.264, HEVC, VP9, AV1, ProRes...).

**Resampling.** A clip is first brought to `fps` frames a second by its timestamps: output frame k shows the source
frame whose time is nearest to k / fps seconds after the first frame's (of two equally near, the earlier). Faster
sources drop frames, slower ones repeat them, a variable frame rate is evened out, and timestamps rounded by their
container (webm's milliseconds) change nothing. A clip of duration d (its last frame's time plus one frame) has
``round(d * fps)`` frames. ``fps`` 0 keeps every source frame as it is.

**Windows.** The resampled clip is cut into windows of `frames` frames (``FrameRule``; musubi-tuner's video datasets
offer the same modes, so a dataset set up there translates):

- ``head``: the first window only,
- ``chunk``: consecutive windows [0, N), [N, 2N), ...; the frames left at the end are dropped,
- ``slide``: windows starting every `stride` frames (they overlap when the stride is below N),
- ``uniform``: `windows` windows whose starts are spread evenly from the first frame to the last start that still
  fits (fewer when the clip is too short for them all to differ).

A clip shorter than one window gives none. Video models take frame counts of one rule (Wan: 4n + 1, one latent frame
for the first frame and one per 4 after it): ``step`` checks `frames` against it.

**Storage.** Each window is an H.264 stream (libx264 at CRF 12, 4:2:0; ``X264_OPTIONS``) in an MP4 member (``mp4``).
H.264 keeps the exact frame count and every decoder reads it; at CRF 12 it is visually lossless, its error well below
what the source's own compression left, at a fraction of what a lossless codec (FFV1, x264's lossless mode, which few
players read) takes to keep sensor noise bit for bit. 4:2:0 is what nearly every source already is. Frames are
converted with BT.709 in limited range and the stream is tagged so, which the loader's decoder (and any player) reads
back. The encoder runs on one thread with FFmpeg's bitexact flags and the frame numbers as timestamps: the same frames
give the same bytes on every run. 4:2:0 needs even sides: an odd side is padded by repeating its last row or column,
and the loader crops back to the width and height the sample's json gives. Frames are turned upright by the source's
display rotation (phone videos) before anything else, as images are by their EXIF orientation.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import av
import numpy as np
from PIL import Image

from sdtrain.errors import UserError, first_line

VIDEO_EXTENSIONS = (".mp4", ".mov", ".webm", ".mkv")
CLIP_FIELD = "mp4"
"""The shard member holding a clip (one window of frames)."""
FRAME_RULES = ("head", "chunk", "slide", "uniform")
DEFAULT_FRAMES = 81
"""Wan's clip length: 5 seconds at its 16 frames a second."""
DEFAULT_FPS = 16.0
DEFAULT_FRAME_STEP = 4
DEFAULT_WINDOWS = 4
X264_OPTIONS = {"crf": "12", "preset": "medium", "x264-params": "mbtree=0"}
"""How windows are encoded (see the module docstring). Macroblock-tree rate control is off: with it, x264 (as PyAV's
wheels bundle it) encoded the same frames to other bytes about once in twenty clips, even on one thread; without it,
never in our trials, at a few percent more size."""
TRUNCATED_SHARE = 0.9
"""A video whose frames end before this share of the length its container declares broke off (a download cut short):
webm and mkv files keep playing up to the break, so nothing else would tell."""


class ClipSkipped(Exception):
    """A video that gives no window: `reason` names why, as the prepare report counts it."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class FrameRule:
    """How clips become windows of frames (see the module docstring); each field is the `prepare folder` option
    named in its errors."""

    frames: int = DEFAULT_FRAMES
    fps: float = DEFAULT_FPS
    rule: str = "head"
    windows: int = DEFAULT_WINDOWS
    stride: int | None = None
    """``slide``: frames from one window's start to the next's; None: the window's length (windows touch)."""
    step: int = DEFAULT_FRAME_STEP

    def __post_init__(self) -> None:
        if self.rule not in FRAME_RULES:
            raise UserError(f"--frame-rule: {self.rule!r} is not one of {', '.join(FRAME_RULES)}")
        if self.step < 1:
            raise UserError(f"--frame-step: must be at least 1, got {self.step}")
        if self.frames < 1:
            raise UserError(f"--frames: must be at least 1, got {self.frames}")
        if (self.frames - 1) % self.step:
            below = 1 + (self.frames - 1) // self.step * self.step
            raise UserError(f"--frames {self.frames}: not 1 + a multiple of --frame-step {self.step} (as Wan's 4n + 1 "
                            f"frames); use {below} or {below + self.step}")
        if not (self.fps >= 0 and math.isfinite(self.fps)):
            raise UserError(f"--fps: must be a frame rate (or 0 to keep the source's frames), got {self.fps}")
        if self.windows < 1:
            raise UserError(f"--windows: must be at least 1, got {self.windows}")
        if self.stride is not None and self.stride < 1:
            raise UserError(f"--frame-stride: must be at least 1, got {self.stride}")

    @property
    def rate(self) -> Fraction | None:
        """The frame rate clips are brought to, exactly (23.976 is 2997/125); None keeps the source's frames."""
        return Fraction(str(self.fps)).limit_denominator(1_000_000) if self.fps else None

    @property
    def several(self) -> bool:
        """Whether the rule may cut a clip into several windows (their keys then carry the window's number)."""
        return self.rule != "head"

    def starts(self, length: int) -> list[int]:
        """The first frame of each window of a resampled clip of `length` frames; none when it is shorter than one."""
        last = length - self.frames
        if last < 0:
            return []
        if self.rule == "head":
            return [0]
        if self.rule == "chunk":
            return list(range(0, last + 1, self.frames))
        if self.rule == "slide":
            return list(range(0, last + 1, self.stride or self.frames))
        if self.windows == 1:
            return [0]
        return list(dict.fromkeys(i * last // (self.windows - 1) for i in range(self.windows)))

    def describe(self) -> dict[str, Any]:
        """The rule as the manifest records it."""
        described: dict[str, Any] = {"frames": self.frames, "fps": json_number(self.fps) if self.fps else "source",
                                     "frame_rule": self.rule, "frame_step": self.step}
        if self.rule == "uniform":
            described["windows"] = self.windows
        if self.rule == "slide":
            described["frame_stride"] = self.stride or self.frames
        return described


@dataclass(frozen=True)
class Timeline:
    """When a video's frames are shown, read from its packets without decoding them."""

    first: Fraction
    """Seconds at which the first frame is shown."""
    end: Fraction
    """Seconds at which the last frame stops being shown."""
    frames: int
    rate: Fraction
    """The source's average frame rate."""

    @property
    def duration(self) -> Fraction:
        return self.end - self.first

    def length(self, rate: Fraction | None) -> int:
        """Frames once resampled to `rate` (None: the source's own)."""
        return self.frames if rate is None else math.floor(self.duration * rate + Fraction(1, 2))


@dataclass(frozen=True)
class Window:
    """One window of a clip, encoded: its number among the clip's windows, its first frame (in resampled frames) and
    the time of that frame in the source (seconds), and the member's bytes."""

    index: int
    start: int
    time: float
    data: bytes


@dataclass(frozen=True)
class Picture:
    """A video's first frame, upright, and what its stream says: enough to describe it before decoding the rest."""

    image: Image.Image
    rotation: int
    codec: str


def json_number(value: float | Fraction) -> int | float:
    """A rate or time as a sample's json records it: an integer where it is one, else rounded to a microsecond."""
    value = float(value)
    return int(value) if value.is_integer() else round(value, 6)


class VideoFile:
    """A video file's bytes, opened afresh for each pass over them (PyAV containers read forward only)."""

    def __init__(self, data: bytes):
        self.data = data
        with self._open() as (_, stream):
            context = stream.codec_context
            self.width, self.height = int(context.width), int(context.height)
        if self.width < 1 or self.height < 1:
            raise ClipSkipped("video_unreadable", "no frame size in its header")

    def _open(self) -> _Opened:
        return _Opened(self.data)

    def timeline(self) -> Timeline:
        """When the frames are shown, from the packets (nothing decoded). Raises ClipSkipped: no frames
        (``video_unreadable``), or fewer than the container declares (``video_truncated``)."""
        with self._open() as (container, stream):
            stamps: list[int | None] = []
            try:
                for packet in container.demux(stream):
                    # Empty packets flush the demuxer; discarded ones fall before an edit list's start.
                    if packet.size and not packet.is_discard:
                        stamps.append(packet.pts if packet.pts is not None else packet.dts)
            except av.FFmpegError as exc:
                raise ClipSkipped("video_unreadable", first_line(exc)) from None
            declared = _declared(container, stream)
            base = stream.time_base or Fraction(1, 1)
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if not stamps:
            raise ClipSkipped("video_unreadable", "no frames")
        if any(stamp is None for stamp in stamps):
            # No timestamps: frames at an even rate from the start.
            stamps, base = list(range(len(stamps))), Fraction(1, rate) if rate else Fraction(1, 25)
        times = sorted(Fraction(stamp) * base for stamp in stamps)
        if not rate:
            rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 25
        rate = Fraction(rate)
        timeline = Timeline(times[0], times[-1] + 1 / rate, len(times), rate)
        if declared and timeline.duration < TRUNCATED_SHARE * declared:
            raise ClipSkipped("video_truncated", f"frames end at {float(timeline.duration):.2f} s of the "
                                                 f"{float(declared):.2f} s it declares")
        return timeline

    def picture(self) -> Picture:
        """The first frame, upright (decoding nothing after it)."""
        with self._open() as (_, stream):
            try:
                frame = next(_decoded(stream), None)
            except av.FFmpegError as exc:
                raise ClipSkipped("video_unreadable", first_line(exc)) from None
            if frame is None:
                raise ClipSkipped("video_unreadable", "no frame decodes")
            return Picture(Image.fromarray(_upright(frame)), _rotation(frame), stream.codec_context.name)

    def windows(self, rule: FrameRule, timeline: Timeline, starts: list[int]) -> Iterator[Window]:
        """The windows starting at `starts` (``rule.starts``), each encoded as it completes; decoding stops after the
        last. Raises ClipSkipped: a frame does not decode (``video_unreadable``), or fewer frames decode than the
        packets promised (``video_truncated``)."""
        rate = rule.rate
        ends = [start + rule.frames for start in starts]
        # Frames of windows still to finish, ready to encode, by resampled frame number: a window's worth at a time
        # unless windows overlap.
        held: dict[int, av.VideoFrame] = {}
        pending = list(zip(range(len(starts)), starts, ends))

        def wanted(tick: int) -> bool:
            return any(start <= tick < end for _, start, end in pending)

        filled = 0
        previous: tuple[av.VideoFrame, list[av.VideoFrame | None]] | None = None

        def fill(upto: int) -> Iterator[Window]:
            """Resampled frames `filled`..`upto` - 1 show the previous source frame."""
            nonlocal filled
            assert previous is not None
            frame, ready = previous
            for tick in range(filled, upto):
                if wanted(tick):
                    if ready[0] is None:  # converted once, however often it repeats
                        ready[0] = _encodable(frame)
                    held[tick] = ready[0]
                filled = tick + 1
                while pending and pending[0][2] == filled:
                    index, start, end = pending.pop(0)
                    yield Window(index, start, float(timeline.first + Fraction(start) / (rate or timeline.rate)),
                                 encode_clip([held[t] for t in range(start, end)], rate or timeline.rate))
                    keep = pending[0][1] if pending else filled
                    for old in [t for t in held if t < keep]:
                        del held[old]

        shown = timeline.first
        with self._open() as (_, stream):
            try:
                for number, frame in enumerate(_decoded(stream)):
                    known = frame.pts is not None and frame.time_base
                    time = frame.time_base * frame.pts if known else number / timeline.rate
                    if previous is not None:
                        # The previous frame is the nearest up to halfway to this one.
                        halfway = (shown + time) / 2 - timeline.first
                        yield from fill(number if rate is None else max(filled, math.floor(halfway * rate) + 1))
                    if not pending:
                        return
                    previous, shown = (frame, [None]), time
            except av.FFmpegError as exc:
                raise ClipSkipped("video_unreadable", first_line(exc)) from None
            if previous is not None:
                yield from fill(timeline.length(rate))
        if pending:
            raise ClipSkipped("video_truncated", f"{filled} frames decode, {timeline.length(rate)} expected")


class _Opened:
    """A container over bytes and its first video stream, closed on exit; ClipSkipped where there is none."""

    def __init__(self, data: bytes):
        self.data = data
        self.container: Any = None

    def __enter__(self) -> tuple[Any, Any]:
        try:
            self.container = av.open(io.BytesIO(self.data), metadata_errors="ignore")
        except (av.FFmpegError, UnicodeDecodeError) as exc:
            raise ClipSkipped("video_unreadable", first_line(exc)) from None
        if not self.container.streams.video:
            self.container.close()
            raise ClipSkipped("no_video")
        return self.container, self.container.streams.video[0]

    def __exit__(self, *_: Any) -> None:
        self.container.close()


def _declared(container: Any, stream: Any) -> Fraction | None:
    """The length a container declares for its video: the stream's own, else the container's when the video is its
    only stream (with sound beside it, the longer of the two)."""
    if stream.duration and stream.time_base:
        return stream.duration * stream.time_base
    if container.duration and len(container.streams) == 1:
        return Fraction(container.duration, av.time_base)
    return None


def _decoded(stream: Any) -> Iterator[av.VideoFrame]:
    """The stream's frames in the order they are shown."""
    for packet in stream.container.demux(stream):
        yield from packet.decode()


def _rotation(frame: av.VideoFrame) -> int:
    """Quarter turns counterclockwise that show the frame upright."""
    return round((frame.rotation or 0) / 90) % 4


def _upright(frame: av.VideoFrame) -> np.ndarray:
    """A decoded frame as 8-bit RGB (height, width, 3), in its own colour matrix and range, turned upright."""
    rgb = frame.to_ndarray(format="rgb24", src_color_range=frame.color_range or None)
    turns = _rotation(frame)
    return np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb


def _encodable(frame: av.VideoFrame) -> av.VideoFrame:
    """A decoded frame as the encoder takes it: upright, even-sided (its last row or column repeated), 4:2:0 BT.709."""
    rgb = _upright(frame)
    pad = ((0, rgb.shape[0] % 2), (0, rgb.shape[1] % 2), (0, 0))
    if any(p[1] for p in pad):
        rgb = np.pad(rgb, pad, mode="edge")
    return av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(
        format="yuv420p", dst_colorspace="ITU709", dst_color_range="MPEG")


def encode_clip(frames: list[av.VideoFrame], rate: Fraction) -> bytes:
    """Frames (``_encodable``'s, of one even size) as an MP4 member: H.264 at `rate` frames a second, the same bytes
    for the same frames (see the module docstring)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4", options={"fflags": "+bitexact"}) as output:
        stream = output.add_stream("libx264", rate=rate, options=dict(X264_OPTIONS))
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        context = stream.codec_context
        context.thread_count = 1
        context.colorspace, context.color_range = 1, 1  # BT.709, limited: what _encodable converted to
        context.color_primaries, context.color_trc = 1, 1
        for number, frame in enumerate(frames):
            frame.pts = number
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return buffer.getvalue()


def clip_size(data: bytes) -> tuple[int, int]:
    """The frame size a clip member's header gives (as stored: even sides), nothing decoded; ValueError for bytes that
    are no video."""
    try:
        video = VideoFile(data)
    except ClipSkipped as exc:
        raise ValueError(str(exc)) from None
    return video.width, video.height


def read_clip(data: bytes, max_pixels: int, size: tuple[int, int] | None = None) -> list[Image.Image]:
    """A clip member's frames as RGB images, cropped to `size` (the sample's json width and height: its frames before
    they were padded to even sides). ValueError for a member that is no clip or whose frames are over `max_pixels`,
    read from the header before decoding (a shard not made by `prepare` may hold a bomb)."""
    try:
        with _Opened(data) as (_, stream):
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > max_pixels:
                raise ValueError(f"clip frames of {width}x{height} pixels, over {max_pixels}")
            # One thread: the loader's workers decode side by side, and the trainer needs the cores.
            stream.codec_context.thread_count = 1
            frames = [Image.fromarray(frame.to_ndarray(format="rgb24")) for frame in _decoded(stream)]
    except (ClipSkipped, av.FFmpegError) as exc:
        raise ValueError(first_line(exc)) from None
    if not frames:
        raise ValueError("a clip without frames")
    if size is not None and size != frames[0].size and size[0] <= frames[0].width and size[1] <= frames[0].height:
        frames = [frame.crop((0, 0, *size)) for frame in frames]
    return frames
