"""`make chaos`: inject faults into real sdtrain commands, many times, and prove nothing is lost.

Every trial runs the CLI in a subprocess exactly as a user would, on a tiny autoencoder of a model family drawn by
the seed (SD3's and Flux.1's have 16 latent channels and a latent shift), and compares what
the faulted runs end with against one uninterrupted reference run, byte for byte:

- kill9-train: SIGKILL at a random moment of a training run (checkpoints are saved every step, so many
  kills land inside a save), then the same command again, until it finishes;
- kill9-train-sharded: the same with sharded checkpoints (torch.distributed.checkpoint), whose weights
  must end equal, tensor for tensor, to the reference run's full checkpoint;
- kill9-prepare, kill9-encode: SIGKILL during `prepare shapes` / `prepare encode`, then the same command;
- damaged-checkpoint: bytes flipped in, or half cut from, or a file deleted from the newest checkpoint
  (full or sharded);
- disk-full: the next save cannot write (a file-size limit, as a full disk fails a write);
- nan-steps: NaN losses at random steps; the run skips them and finishes;
- second-run: a second `sdtrain train` on the folder of a live run (hung after a random step).

    python -m tests.chaos --trials 5 [--seed 0] [--work DIR]

prints one row per fault: trials, outcome, data lost (must be none), and the kill points. The default test
run includes a one-trial version (tests/test_chaos.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sdtrain.models import families

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo" / "autoencoder.yaml"
STEPS = 12
TINY = ["data.resolution=32", "data.batch_size=4", "data.num_workers=0", "logging.progress=false",
        "logging.tensorboard=false", "train.mixed_precision=fp32", "train.gradient_checkpointing=false",
        "validation.prompts=[]", "checkpoint.every=1", "checkpoint.keep_last=3", "optim.schedule=constant",
        "logging.every=1"]


@dataclass
class Outcome:
    fault: str
    trials: int = 0
    recovered: int = 0
    lost: list[str] = field(default_factory=list)
    points: list[str] = field(default_factory=list)
    """Where each fault struck, e.g. 'kill at 3.1 s (step 2, mid-save)'."""

    @property
    def ok(self) -> bool:
        return not self.lost and self.recovered == self.trials


def sdtrain(*args: str, env: dict[str, str] | None = None, limit_file_bytes: int | None = None,
            start: bool = False) -> subprocess.CompletedProcess | subprocess.Popen:
    environ = {**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}

    def limits() -> None:
        if limit_file_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    command = [sys.executable, "-m", "sdtrain", *args]
    if start:
        return subprocess.Popen(command, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=limits)
    return subprocess.run(command, env=environ, capture_output=True, text=True, preexec_fn=limits)


FAMILIES = tuple(name for name, family in families.FAMILIES.items() if not family.edits_only)
"""The model families a chaos run draws from: every registered one that draws from captions, as the chaos data
is (a family whose models only edit needs source images beside them); each builds its own autoencoder (SD3's and
Flux.1's 16 channels)."""


def train_args(run: Path, data: Path, *extra: str, family: str = "sd") -> list[str]:
    return ["train", str(CONFIG), f"run_dir={run}", f"data.shards={data}", *TINY, f"train.max_steps={STEPS}",
            f"model.family={family}", *extra]


def digest_tree(folder: Path, pattern: str = "*") -> dict[str, str]:
    """sha256 of every non-hidden file directly in `folder` matching `pattern`."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.glob(pattern)) if p.is_file() and not p.name.startswith(".")}


def checkpoint_digests(checkpoint: Path) -> dict[str, str]:
    """sha256 of every file of a checkpoint, the shards of a sharded one included."""
    return {**digest_tree(checkpoint), **digest_tree(checkpoint / "sharded")}


def final_weights(run: Path) -> dict[str, str]:
    """sha256 of the final checkpoint's weight files, or of its weights tensor by tensor if it is sharded."""
    final = run / "checkpoints" / f"step_{STEPS:08d}"
    if not final.is_dir():
        return {}
    return tensor_digests(final) if (final / "sharded").is_dir() else digest_tree(final, "*.safetensors")


def tensor_digests(checkpoint: Path) -> dict[str, str]:
    """sha256 of the model and EMA weights read back whole, by key: equal for a full and a sharded checkpoint
    of the same weights."""
    from sdtrain.checkpoint import read_weights

    digests = {}
    for group in ("model", "ema"):
        digest = hashlib.sha256()
        for key, tensor in sorted(read_weights(checkpoint, group).items()):
            digest.update(key.encode())
            digest.update(tensor.contiguous().cpu().numpy().tobytes())
        digests[group] = digest.hexdigest()
    return digests


def _state(run: Path) -> str:
    """What a kill interrupted: the newest complete step, and whether a save was under way."""
    folder = run / "checkpoints"
    steps = sorted(p.name for p in folder.glob("step_*") if (p / "meta.json").is_file()) if folder.is_dir() else []
    saving = folder.is_dir() and any(folder.glob(".step_*.tmp-*"))
    newest = steps[-1].removeprefix("step_").lstrip("0") or "0" if steps else "none"
    return f"newest step {newest}{', mid-save' if saving else ''}"


def _shards(folder: Path) -> str:
    """How far a killed prepare got: whole shards, and whether one was being written."""
    whole = len(list(folder.glob("*.tar"))) if folder.is_dir() else 0
    partial = folder.is_dir() and any(p.name.startswith(".") for p in folder.iterdir())
    return f"{whole} shards written{', one under way' if partial else ''}"


def run_until_done(args: list[str], done: Callable[[], bool], attempts: int = 5) -> bool:
    for _ in range(attempts):
        result = sdtrain(*args)
        if result.returncode == 0 and done():
            return True
    return False


def kill_at_random(args: list[str], rng: random.Random, seconds: float) -> str:
    """Start the command, SIGKILL it at a random moment of the `seconds` an uninterrupted run takes (past
    the first quarter, which is interpreter start-up); say when it struck."""
    proc = sdtrain(*args, start=True)
    delay = rng.uniform(0.25 * seconds, 0.95 * seconds)
    try:
        proc.wait(timeout=delay)  # finished before the kill: that trial ends with nothing to recover
        return f"finished before {delay:.1f} s"
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return f"{delay:.1f} s"
    finally:
        proc.stderr.close()


class Chaos:
    def __init__(self, work: Path, seed: int, family: str | None = None):
        self.work = work
        self.rng = random.Random(seed)
        drawn = self.rng.choice(FAMILIES)
        self.family = family or drawn
        self.data = work / "data"
        self.reference = work / "reference"
        self.count = 0

    def fresh(self, name: str) -> Path:
        self.count += 1
        path = self.work / f"{name}-{self.count}"
        shutil.rmtree(path, ignore_errors=True)
        return path

    def setup(self) -> None:
        """The uninterrupted runs every trial is compared with, and how long each takes."""
        self.expected_prepared, self.prepare_seconds = self.reference_run(self.prepare_args(self.data),
                                                                           lambda: digest_tree(self.data))
        self.expected, self.train_seconds = self.reference_run(self.train_args(self.reference),
                                                               lambda: final_weights(self.reference))
        self.expected_tensors = tensor_digests(self.reference / "checkpoints" / f"step_{STEPS:08d}")
        encoded = self.work / "encoded-reference"
        self.expected_encoded, self.encode_seconds = self.reference_run(self.encode_args(encoded),
                                                                        lambda: digest_tree(encoded))

    def train_args(self, run: Path, *extra: str) -> list[str]:
        return train_args(run, self.data, *extra, family=self.family)

    @staticmethod
    def reference_run(args: list[str], result: Callable[[], dict[str, str]]) -> tuple[dict[str, str], float]:
        started = time.perf_counter()
        done = sdtrain(*args)
        assert done.returncode == 0, done.stderr
        return result(), time.perf_counter() - started

    @staticmethod
    def prepare_args(out: Path) -> list[str]:
        # Enough samples that writing them takes a few seconds to strike into, the training set besides.
        return ["prepare", "shapes", "--out", str(out), "--num", "1200", "--size", "32", "--samples-per-shard", "100"]

    def encode_args(self, out: Path) -> list[str]:
        return ["prepare", "encode", str(self.data), "--model", str(self.reference), "--out", str(out),
                "--resolution", "32", "--dtype", "float32", "--no-text"]

    @staticmethod
    def record(outcome: Outcome, ok: bool, failure: str) -> None:
        if ok:
            outcome.recovered += 1
        else:
            outcome.lost.append(failure)

    def compare(self, outcome: Outcome, what: str, got: dict[str, str], expected: dict[str, str]) -> None:
        self.record(outcome, got == expected, f"{what}: differs from the uninterrupted run")

    def train_to(self, run: Path, stop: int, *extra: str) -> Path:
        """Train `run` to step `stop` uninterrupted; its checkpoint there."""
        done = sdtrain(*self.train_args(run, *extra), f"train.max_steps={stop}")
        assert done.returncode == 0, done.stderr
        return run / "checkpoints" / f"step_{stop:08d}"

    # One method per fault; each runs one trial and records it.

    def expected_for(self, layout: str) -> dict[str, str]:
        return self.expected_tensors if layout == "sharded" else self.expected

    def kill9_train(self, outcome: Outcome, layout: str = "full") -> None:
        run = self.fresh(f"kill9-train-{layout}")
        args = self.train_args(run, f"checkpoint.format={layout}")
        point = kill_at_random(args, self.rng, self.train_seconds)
        outcome.points.append(f"{point} ({_state(run)})")
        done = run_until_done(args, lambda: bool(final_weights(run)))
        self.compare(outcome, run.name, final_weights(run) if done else {}, self.expected_for(layout))

    def kill9_train_sharded(self, outcome: Outcome) -> None:
        self.kill9_train(outcome, "sharded")

    def kill9_prepare(self, outcome: Outcome) -> None:
        out = self.fresh("kill9-prepare")
        self.kill_and_rerun(outcome, out, self.prepare_args(out), self.prepare_seconds, self.expected_prepared)

    def kill9_encode(self, outcome: Outcome) -> None:
        out = self.fresh("kill9-encode")
        self.kill_and_rerun(outcome, out, self.encode_args(out), self.encode_seconds, self.expected_encoded)

    def kill_and_rerun(self, outcome: Outcome, out: Path, args: list[str], seconds: float,
                       expected: dict[str, str]) -> None:
        """A prepare command killed at random, then run again: its shards must end as an uninterrupted run's."""
        outcome.points.append(f"{kill_at_random(args, self.rng, seconds)} ({_shards(out)})")
        result = sdtrain(*args)
        self.compare(outcome, out.name, digest_tree(out) if result.returncode == 0 else {}, expected)

    def damaged_checkpoint(self, outcome: Outcome) -> None:
        run = self.fresh("damaged")
        stop = self.rng.randint(2, STEPS - 1)
        layout = self.rng.choice(["full", "sharded"])
        newest = self.train_to(run, stop, f"checkpoint.format={layout}")
        how = self.rng.choice(["flipped", "truncated", "missing"])
        files = ["model.safetensors", "ema.safetensors", "optimizer.pt"] if layout == "full" else \
            ["sharded/__0_0.distcp", "sharded/.metadata"]
        target = newest / self.rng.choice([*files, "trainer.pt"])
        data = target.read_bytes()
        if how == "flipped":
            at = self.rng.randrange(len(data) // 2, len(data))
            target.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
        elif how == "truncated":
            target.write_bytes(data[: len(data) // 2])
        else:
            target.unlink()
        outcome.points.append(f"{how} {target.relative_to(newest)} of {layout} step {stop}")
        result = sdtrain(*self.train_args(run, f"checkpoint.format={layout}"))
        warned = "damaged" in result.stderr and "falling back" in result.stderr
        if not warned:
            outcome.lost.append(f"{run.name}: no warning about the damaged checkpoint")
        self.compare(outcome, run.name, final_weights(run) if result.returncode == 0 else {},
                     self.expected_for(layout))

    def disk_full(self, outcome: Outcome) -> None:
        run = self.fresh("disk-full")
        stop = self.rng.randint(1, STEPS - 1)
        layout = self.rng.choice(["full", "sharded"])
        previous = self.train_to(run, stop, f"checkpoint.format={layout}")
        before = checkpoint_digests(previous)
        # A limit below the size of the weights: the next save fails as it would on a full disk.
        full = sdtrain(*self.train_args(run, f"checkpoint.format={layout}"), limit_file_bytes=256 * 1024)
        lines = full.stderr.strip().splitlines()
        clear = full.returncode == 2 and "cannot write the checkpoint" in (lines[-1] if lines else "")
        leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
        outcome.points.append(f"{layout} save after step {stop}")
        if not clear:
            outcome.lost.append(f"{run.name}: no one-line error (exit {full.returncode}: {lines[-1:]})")
        if leftovers or checkpoint_digests(previous) != before:
            outcome.lost.append(f"{run.name}: the previous checkpoint changed or a partial one was left: {leftovers}")
        result = sdtrain(*self.train_args(run, f"checkpoint.format={layout}"))
        self.compare(outcome, run.name, final_weights(run) if result.returncode == 0 else {},
                     self.expected_for(layout))

    def nan_steps(self, outcome: Outcome) -> None:
        run = self.fresh("nan")
        steps = sorted(self.rng.sample(range(1, STEPS + 1), 2))
        result = sdtrain(*self.train_args(run), env={"SDTRAIN_NAN_AT_STEPS": ",".join(map(str, steps))})
        outcome.points.append(f"NaN at steps {steps}")
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if result.returncode == 0 \
            else []
        skipped = lines[-1].get("skipped_steps") if lines else None
        self.record(outcome, result.returncode == 0 and skipped == len(steps),
                    f"{run.name}: exit {result.returncode}, skipped_steps {skipped}")

    def second_run(self, outcome: Outcome) -> None:
        run = self.fresh("second-run")
        args = self.train_args(run)
        stall = self.rng.randint(1, STEPS - 1)
        # The first run hangs after a random step, holding the folder, as a live run would.
        first = sdtrain(*args, env={"SDTRAIN_STALL_AT_STEP": str(stall)}, start=True)
        try:
            for line in first.stderr:
                if "stops responding" in line:
                    break
            second = sdtrain(*args)
            refused = second.returncode == 2 and "is in use by" in second.stderr.strip().splitlines()[-1]
            outcome.points.append(f"second start during step {stall + 1} of the first: "
                                  f"{'refused' if refused else 'NOT refused'}")
            if not refused:
                outcome.lost.append(f"{run.name}: a second run started on a live run's folder")
        finally:
            first.terminate()
            first.wait()
            first.stderr.close()
        # The first run, restarted after its end, finishes as if nothing had happened.
        done = run_until_done(args, lambda: bool(final_weights(run)))
        self.compare(outcome, run.name, final_weights(run) if done else {}, self.expected)


FAULTS: dict[str, Callable[[Chaos, Outcome], None]] = {
    "kill9-train": Chaos.kill9_train,
    "kill9-train-sharded": Chaos.kill9_train_sharded,
    "kill9-prepare": Chaos.kill9_prepare,
    "kill9-encode": Chaos.kill9_encode,
    "damaged-checkpoint": Chaos.damaged_checkpoint,
    "disk-full": Chaos.disk_full,
    "nan-steps": Chaos.nan_steps,
    "second-run": Chaos.second_run,
}


def run_chaos(trials: int, seed: int, work: Path, faults: list[str] | None = None, family: str | None = None
              ) -> list[Outcome]:
    chaos = Chaos(work, seed, family)
    how = "chosen" if family else f"drawn from {', '.join(FAMILIES)} by the seed"
    print(f"model family: {chaos.family} ({how})")
    chaos.setup()
    outcomes = []
    for name in faults or list(FAULTS):
        outcome = Outcome(name)
        for _ in range(trials):
            outcome.trials += 1
            FAULTS[name](chaos, outcome)
        outcomes.append(outcome)
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    rows = [("fault", "trials", "outcome", "data lost", "where it struck")]
    for o in outcomes:
        rows.append((o.fault, str(o.trials), "recovered" if o.ok else f"FAILED {o.trials - o.recovered}",
                     "none" if not o.lost else "; ".join(o.lost), "; ".join(o.points)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="trials of each fault")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill moments and damage")
    parser.add_argument("--fault", action="append", choices=list(FAULTS), help="only these faults (repeatable)")
    parser.add_argument("--work", type=Path, help="keep the runs here, emptied first (default: a temporary folder)")
    parser.add_argument("--family", choices=list(FAMILIES), help="this model family (default: drawn by the seed)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sdtrain-chaos-") as temporary:
        work = args.work or Path(temporary)
        # A reference left by an earlier run (older code, other data) would be compared against, not rebuilt.
        shutil.rmtree(work, ignore_errors=True)
        started = time.perf_counter()
        outcomes = run_chaos(args.trials, args.seed, work, args.fault, args.family)
        print(table(outcomes))
        print(f"{sum(o.trials for o in outcomes)} trials in {time.perf_counter() - started:.0f} s; "
              f"data lost: {'none' if all(o.ok for o in outcomes) else 'YES'}")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
