"""Pre-encoded shards: each sample also carries its VAE latent distribution and text embedding.

Training on them skips the VAE encoder (and, with a frozen text encoder, the text encoder) in every
step. Each input shard becomes one output shard with the same samples in the same order plus
``latent_mean.npy`` and ``latent_std.npy`` (the posterior, unscaled, so training can sample from
it) and ``text_emb.npy`` (one per line of a sample's caption field, stacked, so training still draws one caption
per read); ``empty_caption.npy`` beside the manifest is the embedding caption dropout substitutes. The
manifest's ``encoding`` entry says which weights and resolution produced them.

Several processes (any launcher: sdtrain reads rank and world size from the environment) share the
shards round-robin without talking to each other; a finished shard is skipped on a rerun, and the
process that finds every shard finished writes the manifest.
"""

from __future__ import annotations

import logging
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from sdtrain.config import DataConfig, ModelConfig
from sdtrain.data.decode import SampleDecoder, caption_lines
from sdtrain.data.encoded import (
    ALPHA,
    DTYPES,
    LATENT_MEAN,
    LATENT_STD,
    MASK,
    MASK_IMAGE,
    SIZE_IDS,
    TEXT_FIELDS,
    describe_encoding,
    empty_caption_file,
    npy_bytes,
)
from sdtrain.data.order import read_shard, resolve_shards
from sdtrain.data.shards import (
    ShardInfo,
    ShardWriter,
    count_tar_samples,
    read_manifest,
    sha256_file,
    write_manifest,
)
from sdtrain.errors import UserError
from sdtrain.loaders.components import load_component
from sdtrain.models import build, families
from sdtrain.models.tokenizer import CaptionTokenizer
from sdtrain.utils import atomic_write_bytes

log = logging.getLogger(__name__)


def output_name(index: int) -> str:
    return f"encoded-{index:06d}.tar"


class Encoder:
    """The frozen VAE (and text encoders) that turn decoded samples into what training consumes."""

    def __init__(self, vae_source: str, text_source: str | None, resolution: int | None, device: torch.device,
                 dtype: str = "float16", long_text_length: int | None = None, served: Any = None):
        """`long_text_length`: the tokens per caption of a long-context encoder (SD3's and Flux.1's T5, Z-Image's
        language model); None: what the model samples with (`build.long_text_length`). Training must use the same,
        which it checks against the manifest.
        `served`: the ModelConfig of the model the latents are for, whose scaling a VAE file that does not say its
        own takes (see load_component)."""
        self.device = device
        self.dtype = DTYPES[dtype]
        self.vae_source = build.pin_source(vae_source)
        family = families.for_model(served) if served is not None else families.detect(self.vae_source)
        self.vae = load_component("vae", self.vae_source, family=family, served=served).to(device).eval()
        self.codec = families.codec_of(self.vae, served)
        scale = self.codec.downsampling(self.vae.config)
        if resolution is None:
            # What the VAE was made for, as diffusers records it.
            if self.vae.config.get("sample_size") is None:
                raise UserError(f"{self.vae_source}: the VAE does not say which image size it was made for; pass "
                                "--resolution")
            resolution = int(self.vae.config.sample_size)
            log.info("encoding at %d px, the VAE's sample_size (--resolution sets another)", resolution)
        if resolution % scale:
            raise UserError(f"--resolution {resolution}: not a multiple of the VAE's downsampling factor {scale}")
        self.text_source = build.pin_source(text_source) if text_source else None
        self.family = families.detect(self.text_source) if self.text_source else None
        if self.family is not None and self.family.text_reads_source:
            log.info("%s: %s's text encoder reads each sample's source image beside its caption, so training "
                     "computes its conditioning: latents alone are encoded", self.text_source, self.family.title)
            self.family = self.text_source = None
        self.text_encoders: list[torch.nn.Module] = []
        tokenizers: list[Any] = []
        self.long_text_length = None
        if self.family is not None:
            # The model the embeddings are for: --model's, else the text encoder's own folder.
            model = ModelConfig(pretrained=served.pretrained if served and served.pretrained else self.text_source,
                                t5_text_length=long_text_length)
            for name, folder in zip(self.family.components.text_encoders, self.family.components.tokenizers):
                module = load_component(name, self.text_source, family=self.family)
                self.text_encoders.append(module.to(device).eval())
                t5 = folder in self.family.components.long_text_tokenizers
                length = build.long_text_length(model, self.family, self.text_source, folder) if t5 else None
                tokenizers.append(build.load_tokenizer(self.text_source, length, folder=folder))
                if t5:
                    self.long_text_length = length
        self.captions = CaptionTokenizer(tokenizers, self.family)
        self.resolution = resolution

    @property
    def tokenizer(self) -> Any | None:
        return self.captions.tokenizers[0] if self.captions.tokenizers else None

    @torch.no_grad()
    def latents(self, pixels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        posterior = self.codec.encode(self.vae, pixels.to(self.device))
        return posterior.mean.float().cpu().numpy(), posterior.std.float().cpu().numpy()

    @torch.no_grad()
    def text(self, captions: list[str]) -> dict[str, np.ndarray]:
        """The captions' text conditioning as the family's conditioner makes it, field -> array."""
        ids, masks = self.family.token_inputs(self.captions(captions), self.device)
        encoded = self.family.conditioner.encode_text(self.text_encoders, ids, captions, masks)
        return {field: value.float().cpu().numpy() for field, value in encoded.items()}

    def description(self) -> dict[str, Any]:
        sources = {name: self.text_source for name in self.family.components.text_encoders} if self.family else {}
        return describe_encoding(self.vae_source, sources, self.resolution, self.codec, self.vae.config, self.tokenizer,
                                 np.dtype(self.dtype).name, self.long_text_length)


def encode_dataset(src: str, out: Path, encoder: Encoder, batch_size: int = 32, rank: int = 0,
                   world_size: int = 1, caption_key: str = "txt", image_key: str = DataConfig.image_key
                   ) -> dict | None:
    """Encode this process's share of the shards of `src` into `out`; returns the manifest once complete."""
    shards = resolve_shards(src)
    out.mkdir(parents=True, exist_ok=True)
    # Transparency is kept as a mask of its own (alpha.npy) whether or not a run uses it (data.alpha_mask).
    config = DataConfig(shards=src, resolution=encoder.resolution, center_crop=True, random_flip=False,
                        caption_dropout=0.0, image_key=image_key, caption_key=caption_key, alpha_mask=True)
    # A codec of clips reads each clip (and each image, as a one-frame clip) whole.
    step = encoder.codec.clip_frames(encoder.vae.config)
    decoder = SampleDecoder(config, None, seed=0, clips=step is not None, frame_step=step or 1)
    for index in range(rank, len(shards), world_size):
        if (out / output_name(index)).exists():
            log.info("%s: already encoded, skipped", output_name(index))
            continue
        written, dropped = _encode_shard(shards[index].url, decoder, encoder, index, out, batch_size)
        log.info("%s -> %s: %d samples%s", shards[index].url, output_name(index), written,
                 f", {dropped} undecodable dropped" if dropped else "")
    if encoder.text_encoders:
        for field, value in encoder.text([""]).items():
            atomic_write_bytes(out / empty_caption_file(field), npy_bytes(value[0].astype(encoder.dtype)))
    missing = [output_name(i) for i in range(len(shards)) if not (out / output_name(i)).exists()]
    if missing:
        log.info("%d shards still being encoded by other processes; the last to finish writes the manifest",
                 len(missing))
        return None
    infos = []
    for index in range(len(shards)):
        path = out / output_name(index)
        infos.append(ShardInfo(path.name, count_tar_samples(path), sha256_file(path)))
    write_manifest(out, infos, extra={"source": src, "encoding": encoder.description()})
    return read_manifest(out)


def _embed(encoder: Encoder, lines: list[list[str]]) -> list[dict[str, np.ndarray]]:
    """Each sample's text conditioning from its captions, field -> array (several captions stacked on a first axis,
    in line order); empty without text encoders. Encoded a line at a time across the samples (every first caption
    in one call, then every second one), so no call holds more captions than the batch has samples."""
    if not encoder.text_encoders:
        return [{} for _ in lines]
    found: list[list[dict[str, np.ndarray]]] = [[] for _ in lines]
    for line in range(max(len(captions) for captions in lines)):
        holders = [i for i, captions in enumerate(lines) if len(captions) > line]
        encoded = encoder.text([lines[i][line] for i in holders])
        for row, i in enumerate(holders):
            found[i].append({field: values[row] for field, values in encoded.items()})
    return [{field: np.stack([one[field] for one in each]) if len(each) > 1 else each[0][field] for field in each[0]}
            for each in found]


def _latents_of(encoder: Encoder, pixels: list[torch.Tensor]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each sample's posterior mean and deviation: images encoded together; clips one at a time, as clips of
    several lengths share no batch and one clip already holds many frames."""
    if pixels[0].dim() == 3:
        mean, std = encoder.latents(torch.stack(pixels))
        return list(mean), list(std)
    encoded = [encoder.latents(clip[None]) for clip in pixels]
    return [mean[0] for mean, _ in encoded], [std[0] for _, std in encoded]


def _encode_shard(url: str, decoder: SampleDecoder, encoder: Encoder, index: int, out: Path,
                  batch_size: int) -> tuple[int, int]:
    raw = read_shard(url)
    written = dropped = 0
    with ShardWriter(out, samples_per_shard=max(1, len(raw)), prefix="encoded", start_index=index,
                     manifest=False) as writer:
        for start in range(0, len(raw), batch_size):
            chunk = raw[start:start + batch_size]
            decoded = [(sample, decoder(sample, (0, index, start + i))) for i, sample in enumerate(chunk)]
            usable = [(sample, d) for sample, d in decoded if d is not None]
            dropped += len(decoded) - len(usable)
            if not usable:
                continue
            mean, std = _latents_of(encoder, [d["pixel_values"] for _, d in usable])
            lines = [caption_lines(sample.get(decoder.config.caption_key, b"")) or [""] for sample, _ in usable]
            embeddings = _embed(encoder, lines)
            for i, (sample, decoded_sample) in enumerate(usable):
                fields = {k: v for k, v in sample.items() if not k.startswith("__")}
                fields[LATENT_MEAN] = npy_bytes(mean[i].astype(encoder.dtype))
                fields[LATENT_STD] = npy_bytes(std[i].astype(encoder.dtype))
                fields[SIZE_IDS] = npy_bytes(decoded_sample["size_ids"].numpy().astype(np.int32))
                if "mask" in decoded_sample:
                    grid = F.interpolate(decoded_sample["mask"][None], size=mean[i].shape[-2:], mode="area")[0]
                    fields[MASK if MASK_IMAGE in sample else ALPHA] = npy_bytes(grid.numpy().astype(np.float16))
                for field, value in embeddings[i].items():
                    fields[TEXT_FIELDS[field]] = npy_bytes(value.astype(encoder.dtype))
                writer.write({"__key__": sample["__key__"], **fields})
                written += 1
    if not written:  # still a finished shard: reruns skip it and the manifest counts it
        tmp = out / f".{output_name(index)}.tmp"
        with tarfile.open(tmp, "w"):
            pass
        os.replace(tmp, out / output_name(index))
    return written, dropped
