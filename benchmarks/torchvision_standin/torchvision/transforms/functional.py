"""torchvision.transforms.functional: crop, to_tensor and normalize for PIL images and tensors."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image


def crop(img: Image.Image, top: int, left: int, height: int, width: int) -> Image.Image:
    if (left, top, width, height) == (0, 0, *img.size):
        return img
    return img.crop((left, top, left + width, top + height))


def to_tensor(pic: Image.Image) -> torch.Tensor:
    """A CxHxW float tensor in [0, 1] (8-bit images), as torchvision's ToTensor gives."""
    array = np.array(pic, copy=True)
    if array.ndim == 2:
        array = array[:, :, None]
    tensor = torch.from_numpy(array).permute(2, 0, 1).contiguous()
    return tensor.float().div(255) if tensor.dtype == torch.uint8 else tensor.float()


def normalize(tensor: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    mean_t = torch.as_tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=tensor.dtype).view(-1, 1, 1)
    return (tensor - mean_t) / std_t


def pil_to_tensor(pic: Image.Image) -> torch.Tensor:
    """A CxHxW tensor of the image's own dtype (transformers' image_utils imports this name)."""
    array = np.array(pic, copy=True)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()
