"""FID and CLIP score as MLPerf's Stable Diffusion benchmark defines them, through torchmetrics.

FID compares Inception pool features of generated images with reference statistics (mean and covariance,
the ``mu``/``sigma`` npz files MLPerf ships for COCO-2014); CLIP score is the cosine of image and caption
embeddings, which torchmetrics reports times 100 (MLPerf's target 0.15 is 15 there; sdtrain reports
MLPerf's scale). Both metrics keep sums that torchmetrics adds up over ranks, so every rank scores its own
share of the images and the result equals one process scoring them all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sdtrain.errors import UserError
from sdtrain.evaluate.inception import FIDInception


@dataclass
class ReferenceStats:
    """Inception feature statistics of a reference image set."""

    mu: np.ndarray
    sigma: np.ndarray
    count: int

    def save(self, path: Path) -> Path:
        import io

        from sdtrain.utils import atomic_write_bytes  # deferred: PIL, for a save only

        buffer = io.BytesIO()
        np.savez(buffer, mu=self.mu, sigma=self.sigma, count=np.array(self.count))
        atomic_write_bytes(Path(path), buffer.getvalue())
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> ReferenceStats:
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                mu, sigma = data["mu"], data["sigma"]
                # MLPerf's files carry no count; covariances from a few thousand images are what they hold.
                count = int(data["count"]) if "count" in data else 0
        except (OSError, KeyError, ValueError) as exc:
            raise UserError(f"{path}: not a statistics file with mu and sigma ({exc}); make one with "
                            "`sdtrain evaluate stats IMAGES --out STATS.npz`") from exc
        if mu.ndim != 1 or sigma.shape != (mu.shape[0], mu.shape[0]):
            raise UserError(f"{path}: mu {mu.shape} and sigma {sigma.shape} do not go together")
        return cls(mu.astype(np.float64), sigma.astype(np.float64), count)


def fid_metric(inception: FIDInception, device: torch.device | str = "cpu"):
    """torchmetrics' FID on this Inception network, fed float images in [0, 1] (N, 3, H, W)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    metric = FrechetInceptionDistance(feature=inception, normalize=True, reset_real_features=False)
    return metric.to(device)


def use_reference(metric, stats: ReferenceStats) -> None:
    """Load reference statistics as the metric's real-image sums, so FID needs no reference images."""
    count = stats.count or 2  # any count gives back mu and sigma exactly; it only weighs merging
    mu = torch.as_tensor(stats.mu, dtype=torch.float64, device=metric.device)
    sigma = torch.as_tensor(stats.sigma, dtype=torch.float64, device=metric.device)
    metric.real_features_sum = mu * count
    metric.real_features_cov_sum = sigma * (count - 1) + count * torch.outer(mu, mu)
    metric.real_features_num_samples = torch.tensor(count, device=metric.device)


def reference_stats(metric, real: bool = True) -> ReferenceStats:
    """The mean and covariance a metric has accumulated (over every rank, once synced)."""
    prefix = "real" if real else "fake"
    count = int(getattr(metric, f"{prefix}_features_num_samples"))
    if count < 2:
        raise UserError(f"FID statistics need at least 2 images, got {count}")
    total = getattr(metric, f"{prefix}_features_sum").double()
    mu = total / count
    sigma = (getattr(metric, f"{prefix}_features_cov_sum").double() - count * torch.outer(mu, mu)) / (count - 1)
    return ReferenceStats(mu.cpu().numpy(), sigma.cpu().numpy(), count)


def fid_between(a: ReferenceStats, b: ReferenceStats) -> float:
    """The Fréchet distance of two feature distributions, by torchmetrics' own formula."""
    from torchmetrics.image.fid import _compute_fid

    return float(_compute_fid(torch.from_numpy(a.mu), torch.from_numpy(a.sigma), torch.from_numpy(b.mu),
                              torch.from_numpy(b.sigma)))


def clip_metric(clip_path: str | Path | None, device: torch.device | str = "cpu"):
    """torchmetrics' CLIP score with a local transformers CLIP (MLPerf uses OpenCLIP ViT-H-14, published in
    this layout as laion/CLIP-ViT-H-14-laion2B-s32B-b79K); never downloaded."""
    from torchmetrics.multimodal.clip_score import CLIPScore
    from transformers import CLIPModel, CLIPProcessor

    if clip_path is None:
        raise UserError("the CLIP score needs a CLIP model folder (MLPerf: laion/CLIP-ViT-H-14-laion2B-s32B-b79K "
                        "in transformers' layout); download it once and pass its path with --clip")
    folder = Path(clip_path)
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder}: not a transformers CLIP folder (no config.json); pass the folder of a CLIPModel")

    def load():
        model = CLIPModel.from_pretrained(folder, local_files_only=True).eval()
        return _ProjectedFeatures(model), CLIPProcessor.from_pretrained(folder, local_files_only=True)

    return CLIPScore(model_name_or_path=load).to(device)


class _ProjectedFeatures(torch.nn.Module):
    """transformers 5's ``get_*_features`` return model outputs (the projection in ``pooler_output``) where
    torchmetrics expects the embedding tensors; this hands it the tensors under either version."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config

    @staticmethod
    def _embedding(output) -> torch.Tensor:
        return output if isinstance(output, torch.Tensor) else output.pooler_output

    def get_image_features(self, *args, **kwargs) -> torch.Tensor:
        return self._embedding(self.model.get_image_features(*args, **kwargs))

    def get_text_features(self, *args, **kwargs) -> torch.Tensor:
        return self._embedding(self.model.get_text_features(*args, **kwargs))


def images_to_unit(images: Iterable) -> torch.Tensor:
    """PIL images or uint8 arrays as a float batch in [0, 1], (N, 3, H, W)."""
    arrays = [np.asarray(image.convert("RGB") if hasattr(image, "convert") else image) for image in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0
