"""A stand-in for `sdtrain.runview` while it is not in this tree: the interface the UI codes against, read from
the same files, installed only by the UI's tests (`install()` does nothing where the real module imports)."""

from __future__ import annotations

import fcntl
import json
import sys
import types
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class RunSummary:
    name: str
    path: Path
    stage: str | None
    family: str | None
    mode: str | None
    status: str
    step: int | None
    max_steps: int | None
    samples: int | None
    loss: float | None
    images_per_second: float | None
    last_save: float | None
    disk_bytes: int
    problem: str | None

    def to_json(self) -> dict:
        return {**asdict(self), "path": str(self.path)}


def find_runs(root: Path) -> list[Path]:
    found = [p.parent for depth in range(1, 4) for p in Path(root).glob("/".join(["*"] * depth) + "/config.yaml")]
    return sorted(found, key=lambda p: p.name)


def _locked(run: Path) -> bool:
    path = run / ".sdtrain.lock"
    if not path.exists():
        return False
    with open(path) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def load_run(run: Path):
    import yaml

    from sdtrain.report import read_metrics

    text = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else None
    config = (yaml.safe_load(text) if text else None) or {}
    samples = sorted(((int(p.stem.split("_")[1]), p) for p in (run / "samples").glob("step_*.png")), reverse=True)
    checkpoints = []
    for folder in sorted((run / "checkpoints").glob("step_*")):
        try:
            checkpoints.append((folder, json.loads((folder / "meta.json").read_text())))
        except (OSError, ValueError):
            checkpoints.append((folder, None))
    return types.SimpleNamespace(path=run, config_text=text, config=config, metrics=read_metrics(run / "metrics.jsonl"),
                                 samples=samples, checkpoints=checkpoints)


def summary(run: Path) -> RunSummary:
    view = load_run(run)
    records = view.metrics.records
    last = records[-1] if records else {}
    max_steps = (view.config.get("train") or {}).get("max_steps")
    saved = view.checkpoints[-1][1] if view.checkpoints else None
    if _locked(run):
        status = "running"
    elif not records:
        status = "new"
    else:
        status = "finished" if saved and saved.get("step") == max_steps else "stopped"
    problem = f"metrics.jsonl: {view.metrics.unreadable} unreadable line(s)" if view.metrics.unreadable else None
    return RunSummary(run.name, run, view.config.get("stage"), (view.config.get("model") or {}).get("family"), None,
                      status, last.get("step"), max_steps, last.get("samples"), last.get("loss"),
                      last.get("img_per_s"),
                      view.checkpoints[-1][0].stat().st_mtime if view.checkpoints else None,
                      sum(p.stat().st_size for p in run.rglob("*") if p.is_file()), problem)


def events(run: Path, after: int = 0) -> list[dict]:
    path = run / "events.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [{**json.loads(line), "index": i} for i, line in enumerate(lines) if i >= after and line.strip()]


def log_tail(run: Path, lines: int = 200) -> list[str]:
    path = run / "train.log"
    return path.read_text().splitlines()[-lines:] if path.is_file() else []


def request_stop(run: Path) -> None:
    (run / "stop").write_text("stop\n")


def environment() -> list[tuple[str, str]]:
    return [("Python", sys.version.split()[0])]


def install() -> None:
    try:
        import sdtrain.runview  # noqa: F401
    except ImportError:
        import sdtrain

        module = sys.modules[__name__]
        sys.modules["sdtrain.runview"] = module
        sdtrain.runview = module
