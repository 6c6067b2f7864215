"""A user's image as it is meant to be seen: upright, on a chosen background, in 8-bit RGB, its first frame.

``img.convert("RGB")`` alone gets real-world files wrong: a phone photo stores its pixels sideways with an EXIF
orientation tag; a transparent PNG usually stores its clear pixels as black, so dropping alpha paints the background
black; a 16-bit greyscale PNG is clipped to white; an animated GIF or WebP is whatever frame is current. The loader
(`decode.SampleDecoder`) and `prepare` both go through `rgb_image`, so what trains, what is encoded and what the
shards' metadata describe agree.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageOps

try:  # Pillow's wheels carry LittleCMS; a build without it converts CMYK by formula
    from PIL import ImageCms
except ImportError:  # pragma: no cover
    ImageCms = None

EXIF_ORIENTATION = 0x0112
_TRANSPOSED = {5, 6, 7, 8}
"""EXIF orientations that swap width and height (a quarter turn, with or without a mirror)."""
_WIDE_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N", "F"}
"""Single-channel modes of more than 8 bits: scaled to 8 bits rather than clipped, as ``convert`` would."""
_NAMED = {"white": (255, 255, 255), "black": (0, 0, 0), "grey": (128, 128, 128), "gray": (128, 128, 128)}


def parse_background(value: str) -> tuple[int, int, int] | None:
    """``data.background``: a colour name (white, black, grey), ``#rrggbb`` (or ``rrggbb``), or ``random`` (None:
    drawn per sample). Raises ValueError for anything else."""
    value = value.strip().lower()
    if value == "random":
        return None
    if value in _NAMED:
        return _NAMED[value]
    # On a command line `#` starts a YAML comment, so the hex digits alone are taken too.
    digits = value.removeprefix("#")
    if len(digits) == 6 and all(c in "0123456789abcdef" for c in digits):
        return tuple(int(digits[i:i + 2], 16) for i in (0, 2, 4))  # type: ignore[return-value]
    raise ValueError(value)


@dataclass
class Described:
    """What decoding an image does to it, read from its header: recorded per sample by `prepare`."""

    width: int
    """Width as seen, after the EXIF orientation is applied."""
    height: int
    mode: str
    orientation: int = 1
    transparent: bool = False
    frames: int = 1

    def notes(self) -> dict[str, Any]:
        """The non-default facts, for the sample's metadata (``decode``)."""
        notes: dict[str, Any] = {}
        if self.orientation != 1:
            notes["orientation"] = self.orientation
        if self.mode not in ("RGB", "L"):
            notes["mode"] = self.mode
        if self.transparent:
            notes["alpha"] = True
        if self.frames > 1:
            notes["frames"] = self.frames
        return notes


def describe(img: Image.Image) -> Described:
    """What `rgb_image` will do with `img`, from its header alone (no pixel decoded)."""
    try:
        orientation = int(img.getexif().get(EXIF_ORIENTATION, 1))
    except (ValueError, TypeError, OSError):  # a malformed EXIF block is ignored, as viewers do
        orientation = 1
    orientation = orientation if 1 <= orientation <= 8 else 1
    width, height = img.size
    if orientation in _TRANSPOSED:
        width, height = height, width
    transparent = img.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in img.info
    return Described(width, height, img.mode, orientation, transparent, int(getattr(img, "n_frames", 1) or 1))


@dataclass
class RGB:
    image: Image.Image
    """8-bit RGB, upright, transparency composited on the background."""
    alpha: Image.Image | None
    """The transparency as an 8-bit mask ("L", 255 opaque) in the same orientation, None when fully opaque."""
    notes: dict[str, Any] = field(default_factory=dict)


def rgb_image(img: Image.Image, background: tuple[int, int, int]) -> RGB:
    """`img` (opened, any mode) as `RGB`: its first frame, turned upright by its EXIF orientation, converted to
    8-bit RGB by what its mode means (CMYK through its embedded ICC profile when it has one; 16-bit and 32-bit
    greyscale scaled, not clipped; palette transparency kept), with any transparency composited on `background`."""
    described = describe(img)
    if described.frames > 1:
        img.seek(0)
    if described.orientation != 1:
        img = ImageOps.exif_transpose(img)
    mode = img.mode
    if mode in _WIDE_MODES:
        img = _eight_bit(img)
    elif mode == "CMYK":
        img = _cmyk_to_rgb(img)
    elif mode == "1":
        img = img.convert("L")
    elif described.transparent or mode in ("P", "PA"):
        img = img.convert("RGBA") if described.transparent else img.convert("RGB")
    alpha = None
    if img.mode in ("RGBA", "LA", "La", "RGBa"):
        img = img.convert("RGBA")
        alpha = img.getchannel("A")
        if alpha.getextrema() == (255, 255):
            alpha = None
        canvas = Image.new("RGB", img.size, background)
        canvas.paste(img.convert("RGB"), mask=img.getchannel("A"))
        img = canvas
    elif img.mode != "RGB":
        img = img.convert("RGB")
    return RGB(img, alpha, described.notes())


def _eight_bit(img: Image.Image) -> Image.Image:
    """A single-channel image of more than 8 bits as 8-bit greyscale: 16-bit values (0-65535) scaled by 1/257;
    floats taken as 0-1 when they stay within it, else as 0-255."""
    values = np.asarray(img, dtype=np.float64)
    if img.mode == "F":
        top = 1.0 if values.size and np.nanmax(values) <= 1.0 else 255.0
        values = values * (255.0 / top)
    elif values.size and values.max() > 255:
        values = values / 257.0
    return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L")


def _cmyk_to_rgb(img: Image.Image) -> Image.Image:
    """CMYK to sRGB through the image's own ICC profile (what print files and some phone exports carry); Pillow's
    naive formula without one."""
    profile = img.info.get("icc_profile")
    if profile and ImageCms is not None:
        try:
            source = ImageCms.ImageCmsProfile(io.BytesIO(profile))
            return ImageCms.profileToProfile(img, source, ImageCms.createProfile("sRGB"), outputMode="RGB")
        except (OSError, ValueError, ImageCms.PyCMSError):  # a broken profile: the formula
            pass
    return img.convert("RGB")
