"""The Inception-v3 network that FID is defined on, in the variant of the TensorFlow graph FID was first
computed with (``pt_inception-2015-12-05``, the weights pytorch-fid and the MLPerf reference load).

torchvision's ``inception_v3`` is the usual source of this network, but torchvision cannot be installed
beside the torch sdtrain pins, so the layers are declared here, with the module names of pytorch-fid's
port so its weight file loads as is. Only the 2048-wide pool features are computed: the classifier is
not part of FID. Weights are never downloaded: pass the path of the file.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sdtrain.errors import UserError, first_line

FID_WEIGHTS = "pt_inception-2015-12-05-6726825d.pth"
FID_WEIGHTS_URL = "https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/" + FID_WEIGHTS


class BasicConv2d(nn.Module):
    def __init__(self, inputs: int, outputs: int, **conv: int | tuple[int, int]):
        super().__init__()
        self.conv = nn.Conv2d(inputs, outputs, bias=False, **conv)
        self.bn = nn.BatchNorm2d(outputs, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _average_pool(x: torch.Tensor) -> torch.Tensor:
    # TensorFlow's average pooling leaves the padding out of the mean.
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    def __init__(self, inputs: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(inputs, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(inputs, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(inputs, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(inputs, pool_features, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([
            self.branch1x1(x),
            self.branch5x5_2(self.branch5x5_1(x)),
            self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
            self.branch_pool(_average_pool(x)),
        ], 1)


class InceptionB(nn.Module):
    def __init__(self, inputs: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(inputs, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(inputs, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([
            self.branch3x3(x),
            self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
            F.max_pool2d(x, kernel_size=3, stride=2),
        ], 1)


class InceptionC(nn.Module):
    def __init__(self, inputs: int, channels_7x7: int):
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(inputs, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(inputs, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(inputs, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(inputs, 192, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        double = x
        for layer in (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                      self.branch7x7dbl_5):
            double = layer(double)
        return torch.cat([
            self.branch1x1(x),
            self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x))),
            double,
            self.branch_pool(_average_pool(x)),
        ], 1)


class InceptionD(nn.Module):
    def __init__(self, inputs: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(inputs, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(inputs, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seven = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([self.branch3x3_2(self.branch3x3_1(x)), seven, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class InceptionE(nn.Module):
    """The last two blocks; the TensorFlow graph pools the second one's side branch with a max, not a mean."""

    def __init__(self, inputs: int, max_pool: bool):
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = BasicConv2d(inputs, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(inputs, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(inputs, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(inputs, 192, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        single = self.branch3x3_1(x)
        double = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        pooled = F.max_pool2d(x, kernel_size=3, stride=1, padding=1) if self.max_pool else _average_pool(x)
        return torch.cat([
            self.branch1x1(x),
            self.branch3x3_2a(single), self.branch3x3_2b(single),
            self.branch3x3dbl_3a(double), self.branch3x3dbl_3b(double),
            self.branch_pool(pooled),
        ], 1)


class FIDInception(nn.Module):
    """Images in, 2048 pool features out. Takes uint8 images in [0, 255] or floats in [0, 1], any size
    (resized to 299x299 bilinearly, as pytorch-fid does), so it plugs into torchmetrics' FID."""

    num_features = 2048

    def __init__(self) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, max_pool=False)
        self.Mixed_7c = InceptionE(2048, max_pool=True)
        self.eval().requires_grad_(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
        x = 2 * x - 1
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e", "7a", "7b", "7c"):
            x = getattr(self, f"Mixed_{name}")(x)
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


def load_fid_inception(path: str | Path | None) -> FIDInception:
    """The network with the weights at `path` (the classifier's weights in the file are ignored)."""
    if path is None:
        raise UserError(f"FID needs the Inception weights {FID_WEIGHTS} (published at {FID_WEIGHTS_URL}); "
                        "download it once and pass its path with --inception or evaluation.inception")
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: Inception weights not found; pass the path of {FID_WEIGHTS}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:  # the published file is a plain state dict of tensors, which weights_only reads safely
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch and safetensors raise many types for a damaged file
        raise UserError(f"{path}: not a readable weight file ({first_line(exc)})") from exc
    network = FIDInception()
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    missing, unexpected = network.load_state_dict(state, strict=False)
    if missing or unexpected:
        first = (missing or unexpected)[0]
        raise UserError(f"{path}: not the FID Inception weights ({len(missing)} tensors missing, "
                        f"{len(unexpected)} unexpected, e.g. {first}); pass {FID_WEIGHTS}")
    return network
