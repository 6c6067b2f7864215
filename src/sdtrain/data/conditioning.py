"""Conditioning images computed from a sample's own image, for users who have no maps of their own
(``sdtrain prepare folder --conditioning canny``): Canny edge maps by OpenCV's detector, with the thresholds the
ControlNet authors' canny annotator and diffusers' ControlNet examples use (100 and 200), white edges on black in
three channels, at the image's size and upright. OpenCV is optional: ``pip install 'sdtrain[control]'``."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from sdtrain.data.images import rgb_image
from sdtrain.errors import UserError

CONDITIONINGS = ("canny",)
"""The maps `prepare` can compute."""
CANNY_THRESHOLDS = (100, 200)
"""Canny's hysteresis thresholds (a weak and a strong gradient): the ControlNet annotator's."""


def require(kind: str) -> None:
    """One line before anything is read when `kind` is unknown or its library is missing."""
    if kind not in CONDITIONINGS:
        raise UserError(f"--conditioning: {kind!r} is not one of {', '.join(CONDITIONINGS)}")
    try:
        import cv2  # noqa: F401
    except ImportError as exc:
        raise UserError("--conditioning canny computes edges with OpenCV, which is not installed: pip install "
                        "'sdtrain[control]' (opencv-python-headless)") from exc


def canny_map(image: bytes, thresholds: tuple[int, int] = CANNY_THRESHOLDS) -> bytes:
    """The PNG bytes of the Canny edge map of the image in `image` (any format PIL reads; turned upright, any
    transparency on black): white (255) edges on black, RGB, the image's size."""
    import cv2

    with Image.open(io.BytesIO(image)) as img:
        img.load()
        rgb = rgb_image(img, (0, 0, 0)).image
    edges = cv2.Canny(np.asarray(rgb.convert("L")), *thresholds)
    out = io.BytesIO()
    Image.fromarray(np.repeat(edges[:, :, None], 3, axis=2)).save(out, format="PNG", compress_level=6)
    return out.getvalue()
