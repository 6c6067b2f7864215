"""Synthetic data: fixed random batches shaped like the loader's, for start-up measurements that must not
touch the real data (its position is part of the resumable state); and synthetic shards, for benchmarks
that run the real loader."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sdtrain.config import DataConfig
from sdtrain.data.encoded import (
    CONDITIONING_IMAGE,
    LATENT_MEAN,
    LATENT_STD,
    SOURCE_IMAGE,
    TEXT_FIELDS,
    describe_encoding,
    empty_caption_file,
    npy_bytes,
)
from sdtrain.data.shapes import render_shapes_sample
from sdtrain.data.shards import ShardWriter
from sdtrain.utils import atomic_write_bytes


class SyntheticBatches:
    """One fixed random batch per rank, served forever: the data side of the step costs nothing.

    `encoded` batches look like pre-encoded shards: latents (and, for a frozen text encoder, text
    embeddings) instead of pixels, so the step skips the encoders as it would on such shards.
    """

    def __init__(self, config: DataConfig, task: Any, seed: int, rank: int, encoded: bool = False):
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        size, count = config.resolution, config.batch_size
        self.shards: list = []
        self.num_samples = 0
        self.encoding = {"synthetic": True} if encoded else None
        self.batch: dict[str, Any] = {
            "captions": ["synthetic"] * count,
            "keys": [f"synthetic-{i}" for i in range(count)],
        }
        captions = task.caption_tokenizer
        if captions is not None:
            # Every position a caption's: a caption longer than any tokenizer keeps, tokenized as the loader does
            # (in the family's prompt template, with its attention mask), so the text encoders do a real caption's
            # most work.
            longest = max(tokenizer.model_max_length for tokenizer in captions.tokenizers)
            self.batch["captions"] = [" ".join(["synthetic"] * longest)] * count
            self.batch.update(captions(self.batch["captions"]))
        self.batch["size_ids"] = torch.tensor([[size, size, 0, 0, size, size]] * count)
        if task.text_embeddings:  # the shards' embeddings, or a mode's prompts encoded once
            for key, shape in text_shapes(task).items():
                self.batch[key] = torch.randn(count, *shape, generator=generator)
        # The images a sample may carry beside its own (a ControlNet's map, an edit's source), for the modes that
        # read them: encoded shards keep them too.
        self.batch["conditioning_pixels"] = torch.rand(count, 3, size, size, generator=generator)
        self.batch["source_pixels"] = torch.rand(count, 3, size, size, generator=generator) * 2 - 1
        frames = clip_frames(config, task)
        if not encoded:
            self.batch["pixel_values"] = torch.rand(count, 3, *frames, size, size, generator=generator) * 2 - 1
            return
        self.batch["latent_mean"] = torch.randn(count, *latent_shape(size, task, frames), generator=generator)
        self.batch["latent_std"] = torch.full_like(self.batch["latent_mean"], 0.1)

    def next(self) -> dict[str, Any]:
        return self.batch

    def close(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}


def write_synthetic_shards(out: Path, config: DataConfig, task: Any, samples: int, encoded: bool,
                           seed: int = 0) -> Path:
    """Shards the training loader reads as it reads a user's: captioned shape images as JPEG at the
    configured resolution, or, `encoded`, what `sdtrain prepare encode` writes for this task's frozen VAE
    (and text encoder): latent distributions, text embeddings, the empty caption's embedding and the
    manifest's `encoding` entry. A benchmark on them runs the real loader, its workers included."""
    rng = np.random.default_rng(seed)
    shard_samples = 256
    encoding = _encoding(config, task) if encoded else None
    with ShardWriter(out, samples_per_shard=shard_samples, prefix="synthetic",
                     extra={"source": "synthetic", **({"encoding": encoding} if encoding else {})}) as writer:
        for index in range(samples):
            image, caption, _ = render_shapes_sample(rng, config.resolution)
            sample: dict[str, Any] = {"__key__": f"{index:08d}", "txt": caption}
            if encoding is None:
                sample["jpg"] = _image_bytes(image, "JPEG", quality=90)
            else:
                sample |= _encoded_fields(encoding, task, rng, clip_frames(config, task))
            if task.encodes_images():  # a ControlNet's map and an edit's source, the image of another sample
                companion = _image_bytes(render_shapes_sample(rng, config.resolution)[0], "PNG")
                sample |= {CONDITIONING_IMAGE: companion, SOURCE_IMAGE: companion}
            writer.write(sample)
    if encoding is not None and encoding["text_encoder"] is not None:
        for field, shape in text_shapes(task).items():
            empty = rng.standard_normal(shape).astype(np.float16)
            atomic_write_bytes(out / empty_caption_file(field), npy_bytes(empty))
    return out


def _image_bytes(image: Any, image_format: str, **settings: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **settings)
    return buffer.getvalue()


def _encoding(config: DataConfig, task: Any) -> dict[str, Any]:
    text_encoders = {} if task.text_encoder_runs() else {name: task.sources.get(name)
                                                           for name in task.family.components.text_encoders}
    return describe_encoding(task.sources.get("vae"), text_encoders, config.resolution, task.family.codec,
                             task.vae.config, task.tokenizer, "float16", task.long_text_length)


def text_shapes(task: Any) -> dict[str, tuple[int, ...]]:
    """The shape of one sample's text conditioning, each field the task's family encodes."""
    configs = {name: module.config for name, module in task.text_encoders.items()}
    return task.family.conditioner.text_shapes(configs, [tokenizer.model_max_length for tokenizer in task.tokenizers])


def clip_frames(config: DataConfig, task: Any) -> tuple[int, ...]:
    """(``data.frames``,) for a family whose codec reads clips, () for one of still images: the frame axis of its
    pixels."""
    return (config.frames,) if task.family.codec.clip_frames(task.vae.config) is not None else ()


def latent_shape(size: int, task: Any, frames: tuple[int, ...]) -> tuple[int, ...]:
    """The latents' shape of one sample of `size` px (and `frames`, a clip's): (C, h, w), or (C, t, h, w)."""
    vae, codec = task.vae.config, task.family.codec
    side = size // codec.downsampling(vae)
    time = tuple((count - 1) // codec.clip_frames(vae) + 1 for count in frames)
    return (codec.channels(vae), *time, side, side)


def _encoded_fields(encoding: dict[str, Any], task: Any, rng: np.random.Generator, frames: tuple[int, ...] = ()
                    ) -> dict[str, bytes]:
    shape = latent_shape(encoding["resolution"], task, frames)
    fields = {LATENT_MEAN: npy_bytes(rng.standard_normal(shape).astype(np.float16)),
              LATENT_STD: npy_bytes(np.full(shape, 0.1, dtype=np.float16))}
    if encoding["text_encoder"] is not None:
        for field, shape in text_shapes(task).items():
            fields[TEXT_FIELDS[field]] = npy_bytes(rng.standard_normal(shape).astype(np.float16))
    return fields
