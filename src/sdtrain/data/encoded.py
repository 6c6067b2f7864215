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
DTYPES = {"float16": np.float16, "float32": np.float32}


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def describe_encoding(vae_source: str | None, text_source: str | None, resolution: int, vae_config: Any,
                      tokenizer: Any | None, dtype: str) -> dict[str, Any]:
    """The manifest's `encoding` entry: which weights and settings produced the latents and embeddings."""
    return {
        "vae": vae_source,
        "text_encoder": text_source,
        "resolution": resolution,
        "latent_channels": vae_config.latent_channels,
        "scaling_factor": float(vae_config.scaling_factor),
        "max_text_length": tokenizer.model_max_length if tokenizer is not None else None,
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
