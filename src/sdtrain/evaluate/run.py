"""`sdtrain evaluate`: generate images for a prompt set, split over every rank, and score them.

The prompts are cut into blocks of ``batch`` consecutive ones, dealt to the ranks in turn, and prompt i is
generated with seed + i, so the images (batch-mates and rounding included) are the same whatever the
number of ranks; the metrics' sums are added over ranks by torchmetrics and the
adherence results gathered, so the numbers are those of one process scoring everything.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from sdtrain.errors import UserError
from sdtrain.evaluate.metrics import (
    ReferenceStats,
    clip_metric,
    fid_metric,
    images_to_unit,
    reference_stats,
    use_reference,
)

log = logging.getLogger(__name__)

METRICS = ("fid", "clip", "adherence")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


@dataclass
class EvalSettings:
    metrics: list[str]
    num: int | None = None
    steps: int = 50
    guidance: float = 8.0
    seed: int = 0
    batch: int = 8
    inception: str | None = None
    clip: str | None = None
    reference: str | None = None
    scheduler: str = "ddim"
    size: int | None = None
    """Side of the generated images in pixels; None: the pipeline's default (Flux.1's is 1024 px whatever the model
    trained on)."""
    extra: dict[str, Any] = field(default_factory=dict)


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line, or a TSV/CSV with a ``caption`` column (MLPerf's captions file)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--prompts: {path} not found; pass a text file (one prompt per line) or a TSV with a "
                        "caption column")
    if path.suffix.lower() in (".tsv", ".csv"):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
        if not rows or "caption" not in rows[0]:
            raise UserError(f"{path}: no 'caption' column; name the column of prompts 'caption'")
        return [row["caption"].strip() for row in rows if row["caption"].strip()]
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def _square(image: Image.Image, side: int) -> Image.Image:
    """Shorter side to `side`, centre crop: how reference images meet generated ones."""
    image = image.convert("RGB")
    scale = side / min(image.size)
    image = image.resize((max(side, round(image.width * scale)), max(side, round(image.height * scale))),
                         Image.BICUBIC)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    return image.crop((left, top, left + side, top + side))


def reference_images(source: str | Path, resolution: int) -> Iterator[Image.Image]:
    """Images of a folder (recursively) or of WebDataset shards, squared to `resolution`."""
    source = Path(source)
    if source.is_dir() and any(p.suffix.lower() in IMAGE_SUFFIXES for p in source.rglob("*")):
        for path in sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
            with Image.open(path) as image:
                yield _square(image, resolution)
        return
    import io

    from sdtrain.data.order import read_shard, resolve_shards

    try:
        shards = resolve_shards(str(source))
    except UserError as exc:
        raise UserError(f"{source}: neither a folder of images nor shards ({exc})") from None
    for shard in shards:
        for raw in read_shard(shard.url):
            data = next((raw[k] for k in ("png", "jpg", "jpeg", "webp") if k in raw), None)
            if data is not None:
                with Image.open(io.BytesIO(data)) as image:
                    yield _square(image, resolution)


def _batches(items: Iterator[Image.Image], size: int) -> Iterator[list[Image.Image]]:
    batch: list[Image.Image] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def make_stats(source: str | Path, inception_path: str | None, out: Path, resolution: int = 512,
               batch: int = 16) -> ReferenceStats:
    """``evaluate stats``: the Inception statistics of a reference set, in MLPerf's npz form (mu, sigma)."""
    from sdtrain.evaluate.inception import load_fid_inception

    metric = fid_metric(load_fid_inception(inception_path))
    for images in _batches(reference_images(source, resolution), batch):
        metric.update(images_to_unit(images), real=True)
    stats = reference_stats(metric)
    stats.save(out)
    return stats


def _my_batches(count: int, batch: int, rank: int, world: int) -> list[list[int]]:
    """Blocks of ``batch`` consecutive prompt indices, dealt to the ranks in turn. An image's batch-mates
    are then the same on any number of ranks, and so is its floating-point rounding: the numbers do not
    depend on the world size."""
    blocks = [list(range(start, min(start + batch, count))) for start in range(0, count, batch)]
    return blocks[rank::world]


def _generate(pipe: Any, prompts: list[str], batches: list[list[int]], settings: EvalSettings) -> Iterator[
        tuple[list[int], list[Image.Image]]]:
    from sdtrain.generate import sample_images

    for chunk in batches:
        # Seed by the prompt's place in the whole set: the same image on any number of ranks.
        images = sample_images(pipe, [prompts[i] for i in chunk], seeds=[settings.seed + i for i in chunk],
                               steps=settings.steps, guidance=settings.guidance, batch=len(chunk),
                               size=settings.size)
        yield chunk, images


class Evaluator:
    """The metrics of one prompt set, built once (networks, reference statistics) and run on any pipeline:
    by `sdtrain evaluate` on a saved model, by the trainer on its current weights."""

    def __init__(self, prompts: list[str], settings: EvalSettings, device: torch.device, rank: int = 0,
                 world: int = 1):
        unknown = sorted(set(settings.metrics) - set(METRICS))
        if "val_loss" in unknown:
            raise UserError("metrics: val_loss is the training loss on held-out shards, measured in the training "
                            "loop (evaluation.metrics: [val_loss], evaluation.val_shards), not on a saved pipeline")
        if unknown:
            raise UserError(f"metrics: unknown {', '.join(unknown)}; choose from {', '.join(METRICS)}")
        self.prompts = prompts[: settings.num] if settings.num else prompts
        if not self.prompts:
            raise UserError("prompts: no prompts to evaluate")
        self.settings, self.device, self.rank, self.world = settings, device, rank, world
        self.fid = _fid_with_reference(settings, device, rank, world) if "fid" in settings.metrics else None
        self.clip = clip_metric(settings.clip, device) if "clip" in settings.metrics else None

    def __call__(self, pipe: Any) -> dict[str, Any]:
        """Every rank calls this together: torchmetrics adds the ranks' sums in each compute."""
        from sdtrain.distributed import gather_objects
        from sdtrain.models.pipeline import sampler_from

        settings, prompts = self.settings, self.prompts
        start = time.perf_counter()
        pipe.scheduler = sampler_from(pipe.scheduler, settings.scheduler)
        kept: list[tuple[int, np.ndarray]] = []
        for indices, images in _generate(pipe, prompts, _my_batches(len(prompts), settings.batch, self.rank,
                                                                    self.world), settings):
            unit = images_to_unit(images).to(self.device)
            if self.fid is not None:
                self.fid.update(unit, real=False)
            if self.clip is not None:
                self.clip.update((unit * 255).round().to(torch.uint8), [prompts[i] for i in indices])
            if "adherence" in settings.metrics:
                kept += [(i, np.asarray(image)) for i, image in zip(indices, images)]
        result: dict[str, Any] = {"images": len(prompts), "steps": settings.steps, "guidance": settings.guidance,
                                  "scheduler": settings.scheduler, "world_size": self.world}
        if self.fid is not None:
            result["fid"] = float(self.fid.compute())
            self.fid.reset()  # the generated sums only: the reference ones are kept (reset_real_features=False)
        if self.clip is not None:
            result["clip"] = float(self.clip.compute()) / 100  # MLPerf's scale: the cosine itself
            self.clip.reset()
        if "adherence" in settings.metrics:
            from sdtrain.evaluate.adherence import score_images

            pairs = sorted(p for part in gather_objects(kept) for p in part)
            scores = score_images([image for _, image in pairs], [prompts[i] for i, _ in pairs])
            result["adherence"] = {k: v for k, v in scores.items() if k != "per_image"}
        result["seconds"] = round(time.perf_counter() - start, 2)
        return result


def evaluate(model: str | Path, prompts: list[str], settings: EvalSettings, device: torch.device, rank: int = 0,
             world: int = 1) -> dict[str, Any]:
    """Generate an image per prompt (this rank's share) with a saved model, score them, and return the
    whole set's numbers."""
    from sdtrain.generate import load_pipeline

    evaluator = Evaluator(prompts, settings, device, rank, world)
    return {"model": str(model), **evaluator(load_pipeline(model, device=str(device)))}


def flat_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The numbers of a result as metric names: fid, clip, val_loss, adherence_<key>."""
    flat = {k: float(result[k]) for k in ("fid", "clip", "val_loss") if k in result}
    if "val_posterior" in result:  # which latent val_loss scored: MLPerf's reference samples the posterior
        flat["val_posterior_sampled"] = float(result["val_posterior"] == "sample")
    for key, value in result.get("adherence", {}).items():
        if isinstance(value, float):
            flat[f"adherence_{key}"] = value
    return flat


LOWER_IS_BETTER = ("fid", "val_loss")


def target_met(flat: dict[str, float], target: dict[str, float]) -> bool:
    """FID and val_loss must fall to their targets, every other metric rise to its own (MLPerf: fid 90, clip 0.15;
    Flux.1: val_loss 0.586)."""
    if not target:
        return False
    for key, goal in target.items():
        if key not in flat:
            return False
        if (flat[key] > goal) if key in LOWER_IS_BETTER else (flat[key] < goal):
            return False
    return True


def _fid_with_reference(settings: EvalSettings, device: torch.device, rank: int, world: int):
    from sdtrain.evaluate.inception import load_fid_inception

    if settings.reference is None:
        raise UserError("--reference: FID needs reference statistics (STATS.npz, e.g. MLPerf's "
                        "val2014_512x512_30k_stats.npz) or a folder of reference images")
    metric = fid_metric(load_fid_inception(settings.inception), device)
    if str(settings.reference).endswith(".npz"):
        use_reference(metric, ReferenceStats.load(settings.reference))
        return metric
    side = settings.extra.get("resolution", 512)
    for index, image in enumerate(reference_images(settings.reference, side)):
        if index % world == rank:
            metric.update(images_to_unit([image]).to(device), real=True)
    return metric


def write_result(result: dict[str, Any], out: Path | None) -> None:
    from sdtrain.utils import atomic_write_text

    if out is not None:
        atomic_write_text(Path(out), json.dumps(result, indent=1) + "\n")


def summary_line(result: dict[str, Any]) -> str:
    parts = [f"{result['images']} images"]
    if "fid" in result:
        parts.append(f"FID {result['fid']:.2f}")
    if "clip" in result:
        parts.append(f"CLIP {result['clip']:.4f}")
    if "adherence" in result:
        a = result["adherence"]
        parts.append("adherence: " + ", ".join(f"{k.replace('_accuracy', '')} {v:.0%}" for k, v in a.items()
                                               if k.endswith("accuracy") and v is not None))
    return f"{'; '.join(parts)} ({result['seconds']:.0f} s)"
