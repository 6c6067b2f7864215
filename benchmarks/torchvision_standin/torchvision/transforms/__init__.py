"""torchvision.transforms, as far as diffusers' train_text_to_image.py needs it (PIL input only)."""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence
from typing import Any

from PIL import Image

from torchvision.transforms import functional


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


_PIL_FILTERS = {
    InterpolationMode.NEAREST: Image.Resampling.NEAREST,
    InterpolationMode.NEAREST_EXACT: Image.Resampling.NEAREST,
    InterpolationMode.BILINEAR: Image.Resampling.BILINEAR,
    InterpolationMode.BICUBIC: Image.Resampling.BICUBIC,
    InterpolationMode.BOX: Image.Resampling.BOX,
    InterpolationMode.HAMMING: Image.Resampling.HAMMING,
    InterpolationMode.LANCZOS: Image.Resampling.LANCZOS,
}


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    """(height, width) from an int or a one- or two-element sequence."""
    if isinstance(size, int):
        return size, size
    size = list(size)
    return (size[0], size[0]) if len(size) == 1 else (size[0], size[1])


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]):
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class Lambda:
    def __init__(self, fn: Callable[[Any], Any]):
        self.fn = fn

    def __call__(self, x: Any) -> Any:
        return self.fn(x)


class Resize:
    """An int resizes the shorter side to it, keeping the aspect (torchvision's rounding: int())."""

    def __init__(self, size: int | Sequence[int], interpolation: InterpolationMode = InterpolationMode.BILINEAR,
                 max_size: int | None = None, antialias: bool | None = True):
        self.size, self.interpolation = size, interpolation

    def __call__(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        if isinstance(self.size, int) or len(self.size) == 1:
            short = self.size if isinstance(self.size, int) else self.size[0]
            if min(w, h) == short:
                return img
            if w <= h:
                new_w, new_h = short, int(short * h / w)
            else:
                new_w, new_h = int(short * w / h), short
        else:
            new_h, new_w = _pair(self.size)
            if (new_w, new_h) == (w, h):
                return img
        return img.resize((new_w, new_h), _PIL_FILTERS[InterpolationMode(self.interpolation)])


class CenterCrop:
    def __init__(self, size: int | Sequence[int]):
        self.size = _pair(size)

    def __call__(self, img: Image.Image) -> Image.Image:
        th, tw = self.size
        w, h = img.size
        top, left = int(round((h - th) / 2.0)), int(round((w - tw) / 2.0))
        return functional.crop(img, top, left, th, tw)


class RandomCrop:
    def __init__(self, size: int | Sequence[int]):
        self.size = _pair(size)

    @staticmethod
    def get_params(img: Image.Image, output_size: tuple[int, int]) -> tuple[int, int, int, int]:
        w, h = img.size
        th, tw = output_size
        if h < th or w < tw:
            raise ValueError(f"Required crop size {(th, tw)} is larger than input image size {(h, w)}")
        return random.randint(0, h - th), random.randint(0, w - tw), th, tw

    def __call__(self, img: Image.Image) -> Image.Image:
        return functional.crop(img, *self.get_params(img, self.size))


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, img: Image.Image) -> Image.Image:
        return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if random.random() < self.p else img


class ToTensor:
    def __call__(self, pic: Image.Image) -> Any:
        return functional.to_tensor(pic)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float], inplace: bool = False):
        self.mean, self.std = list(mean), list(std)

    def __call__(self, tensor: Any) -> Any:
        return functional.normalize(tensor, self.mean, self.std)
