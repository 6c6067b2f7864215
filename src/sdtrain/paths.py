"""Where sdtrain keeps what it can rebuild: the per-machine cache (autotune's timings, single-file config
folders), and the files a run folder shares between the trainer and the report. A leaf: it imports nothing of
sdtrain, so any layer may ask it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SDTRAIN_CACHE_DIR"
FIRST_BATCH = Path("samples") / "first_batch.png"
"""In a run folder: its first batch as the model received it (written at the first step, shown by the report)."""


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sdtrain"
