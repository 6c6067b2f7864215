"""The format of pre-encoded shards (written by `sdtrain prepare encode`), shared by writer and loader."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from sdtrain.data.shards import MANIFEST_NAME, read_manifest

EMPTY_CAPTION = "empty_caption.npy"
LATENT_MEAN, LATENT_STD, TEXT_EMB = "latent_mean.npy", "latent_std.npy", "text_emb.npy"
SIZE_IDS = "size_ids.npy"
"""A sample's original height and width, crop top and left, and encoded height and width (SDXL's size ids)."""
MASK, ALPHA = "mask.npy", "alpha.npy"
"""A sample's loss mask at the latents' resolution (float16, 1 counts, 0 does not): from its ``mask.png``, and from
its image's transparency (used with data.alpha_mask)."""
MASK_IMAGE = "mask.png"
"""A sample's loss mask as an image (white counts, black does not): from ``{key}.mask.png`` beside the image."""
CONDITIONING_IMAGE = "cond.png"
"""A sample's conditioning image (a ControlNet's map: edges, depth, a layout), the image's size: from
``{key}.cond.png`` beside the image, or computed by ``prepare --conditioning``."""
SOURCE_IMAGE = "src.png"
"""A sample's source image for editing (what the image was made from: InstructPix2Pix's input), the image's size:
from ``{key}.src.png`` beside the image."""
TEXT_FIELDS = {"text_emb": TEXT_EMB, "text_pooled": "text_pooled.npy", "text_mask": "text_mask.npy"}
"""Text conditioning a sample may carry, batch key -> sample field: the sequence the denoiser attends to, a
family's pooled vector (SDXL's), and which positions of the sequence are the caption's (1) rather than padding
(0), for a family whose denoiser reads only those (Z-Image's)."""
TEXT_FIELD_DIMS = {"text_emb": 2, "text_pooled": 1, "text_mask": 1}
"""Dimensions of one caption's text conditioning; a sample with several captions (lines of its caption field)
carries them stacked on one more, first axis, in line order."""


def empty_caption_file(field: str) -> str:
    """The file beside the manifest holding the empty caption's `field`, which caption dropout substitutes."""
    return EMPTY_CAPTION if field == "text_emb" else f"empty_caption.{field}.npy"
DTYPES = {"float16": np.float16, "float32": np.float32}


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def describe_encoding(vae_source: str | None, text_sources: dict[str, str | None], resolution: int, codec: Any,
                      vae_config: Any, tokenizer: Any | None, dtype: str, long_text_length: int | None = None
                      ) -> dict[str, Any]:
    """The manifest's `encoding` entry: which weights and settings produced the latents and embeddings
    (`codec`: the latent codec that reads the VAE, `families.codec_of`; `text_sources`: each text encoder's,
    by component name; empty when the shards hold no embeddings;
    `long_text_length`: the tokens per caption of a long-context encoder's states, T5's or a language model's;
    the manifest keeps T5's name for it)."""
    return {
        "vae": vae_source,
        "text_encoder": None,
        **text_sources,
        "resolution": resolution,
        "latent_channels": codec.channels(vae_config),
        # How the latents are normalised for the denoiser (an AutoencoderKL's scaling and shift, or a mean and
        # deviation per channel), as the VAE's config says it.
        **{key: vae_config[key] for key in ("scaling_factor", "shift_factor", "latents_mean", "latents_std")
           if vae_config.get(key) is not None},
        "max_text_length": tokenizer.model_max_length if tokenizer is not None else None,
        "t5_text_length": long_text_length,
        "dtype": dtype,
    }


def dataset_encoding(spec: str) -> tuple[dict[str, Any], Path] | None:
    """The `encoding` entry of the manifest of the folder `spec` names (directly or through its shards)."""
    folder = Path(spec) if os.path.isdir(spec) else Path(spec).parent
    if not (folder / MANIFEST_NAME).is_file():
        return None
    manifest = read_manifest(folder) or {}
    encoding = manifest.get("encoding")
    return (encoding, folder) if isinstance(encoding, dict) else None
