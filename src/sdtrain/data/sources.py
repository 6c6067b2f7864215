"""Finding shards wherever they are: a folder, a glob, a brace pattern, or a remote folder's manifest (opening
them is sdtrain.data.remote's)."""

from __future__ import annotations

import glob
import os

import webdataset as wds

from sdtrain.data.remote import is_remote
from sdtrain.data.shards import read_manifest


def expand_spec(spec: str) -> list[str]:
    """The shard URLs a spec names: a folder (its manifest's shards, else every .tar in it), a glob (its
    .tar files) or a brace pattern, local or remote."""
    if is_remote(spec):
        return list(wds.shardlists.expand_urls(spec))
    if os.path.isdir(spec):
        manifest = read_manifest(spec)
        if manifest is not None:
            # The manifest, not the folder listing, says what the dataset is: stale shards of an
            # earlier run may still lie beside it.
            return [os.path.join(spec, entry["name"]) for entry in manifest["shards"]]
        return sorted(glob.glob(os.path.join(glob.escape(spec), "*.tar")))
    if any(ch in spec for ch in "*?["):
        # Only tars: img2dataset leaves .parquet and _stats.json files beside its shards.
        return sorted(p for p in glob.glob(spec) if p.endswith(".tar") and os.path.isfile(p))
    return list(wds.shardlists.expand_urls(spec))
