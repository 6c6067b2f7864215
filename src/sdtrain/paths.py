"""Where sdtrain keeps what it can rebuild: the per-machine cache (autotune's timings, single-file config
folders), and the files a run folder shares between the trainer and the report. A leaf: it imports nothing of
sdtrain, so any layer may ask it."""

from __future__ import annotations

import os
import re
from pathlib import Path

CACHE_ENV = "SDTRAIN_CACHE_DIR"
FIRST_BATCH = Path("samples") / "first_batch.png"
"""In a run folder: its first batch as the model received it (written at the first step, shown by the report)."""
EVENTS = "events.jsonl"
"""In a run folder: what happened to it, a JSON object a line as it happens (start, save, validation, stop, error,
end), read by the run view (`sdtrain.runview`), which follows it live."""
TRAIN_LOG = "train.log"
"""In a run folder: the log lines of its trainer (main rank), every start appended."""
STOP_REQUEST = "stop"
"""In a run folder: asks its trainer to save and stop after the step in progress, as SIGTERM does."""
LOCK = ".sdtrain.lock"
"""In a run folder: held (flock) by the one trainer writing it."""
CHECKPOINTS = "checkpoints"
_CHECKPOINT_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_folders(run_dir: Path) -> list[Path]:
    """A run folder's complete checkpoints (those whose meta.json, written last, is there), oldest first."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _CHECKPOINT_NAME.match(p.name)) and (p / "meta.json").is_file()]
    return [p for _, p in sorted(found)]


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sdtrain"
