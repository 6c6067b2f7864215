"""What the UI runs: `sdtrain train`, `sdtrain export` and `sdtrain prepare folder` as child processes, queued: CPU
jobs a few at a time, GPU jobs whenever the GPUs they were given are free.

Every command is an argument list built here from checked parts (a config file the UI wrote inside the run
folder, the run folder, `key=value` overrides): no user text reaches a shell. Children run in sessions of their
own, so stopping or restarting the UI leaves them training; each run folder's `ui-job.json` records what the UI
ran there, which a restarted UI reads back (queued jobs queue again, live ones keep their slot).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

JOB_FILE = "ui-job.json"
CONFIG_FILE = "ui-config.yaml"
CHILD_LOG = "ui-child.log"
EXPORT_DIR = "export"
# The trainer's exit status after a clean stop (sdtrain.train.trainer.Preempted): saved, resumable.
STOPPED_EXIT = 75
_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*=[^\n\r\x00]*$")
_ERROR_PREFIX = re.compile(r"^sdtrain \w+: error: ")
# Seconds a `--check` may take: it reads the models' config files, fetching a Hub model's if not cached.
CHECK_TIMEOUT_S = 300
# Seconds a data preview may take: it decodes the first samples (from a remote bucket, perhaps), no model.
PREVIEW_TIMEOUT_S = 300
PREVIEW_FILE = "ui-preview.png"
# Keys that say where a run writes: the UI sets them, so a form cannot point a run outside the root.
_RESERVED = ("run_dir",)


class Refused(Exception):
    """A request the UI will not carry out; the message is one line naming what to change."""


# ---------------------------------------------------------------------------------------------- commands
# Module-level so tests can swap in harmless children.


def train_command(config: Path, run: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "sdtrain", "train", str(config), f"run_dir={run}", *overrides]


def check_command(config: Path, run: Path, overrides: list[str]) -> list[str]:
    return [*train_command(config, run, overrides), "--check"]


def export_command(run: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "sdtrain", "export", str(run), str(out)]


def prepare_command(source: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "sdtrain", "prepare", "folder", source, "--out", str(out)]


def preview_command(config: Path, out: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "sdtrain", "data", "preview", str(config), "--out", str(out), *overrides]


def distributed(argv: list[str], processes: int) -> list[str]:
    """`python -m sdtrain ...` under torchrun, one process a GPU, as docs/scale-out.md launches it; one GPU runs
    it as it is."""
    head = [sys.executable, "-m", "sdtrain"]
    if processes < 2 or argv[:3] != head:
        return argv
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
            "-m", "sdtrain", *argv[3:]]


def check_overrides(overrides: Any) -> list[str]:
    if overrides is None:
        return []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise Refused("overrides: pass a list of key=value strings, e.g. [\"train.max_steps=100\"]")
    cleaned = [o.strip() for o in overrides if o.strip()]
    for item in cleaned:
        if not _OVERRIDE.match(item):
            raise Refused(f"override {json.dumps(item[:80])}: write key=value, the key dotted (train.max_steps=100)")
        if item.split("=", 1)[0] in _RESERVED:
            raise Refused(f"override {json.dumps(item[:80])}: the run's folder is its name under the root; "
                          "set the name")
    return cleaned


def is_override(item: str) -> bool:
    return bool(_OVERRIDE.match(item))


def check_yaml(text: str) -> None:
    """The config text is a YAML mapping; else one line saying where it is not."""
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise Refused(f"config: {where}{problem}; fix the YAML") from None
    if not isinstance(parsed, dict):
        raise Refused("config: the YAML is not a mapping of sections (stage:, model:, data:, ...)")


def run_check(config: Path, run: Path, overrides: list[str]) -> tuple[bool, list[str]]:
    """`sdtrain train CONFIG --check` in a child: (ok, its lines), each problem one line without its prefix."""
    try:
        done = subprocess.run(check_command(config, run, overrides), capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL, env=child_environment())
    except subprocess.TimeoutExpired:
        return False, [f"the config check took over {CHECK_TIMEOUT_S} s; is a Hub model still downloading?"]
    except OSError as exc:
        return False, [f"the config check could not start: {exc.strerror}"]
    if done.returncode == 0:
        return True, [line for line in done.stdout.splitlines() if line.strip()][-1:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    problems = [_ERROR_PREFIX.sub("", line).removeprefix(f"{config}: ") for line in lines if _ERROR_PREFIX.match(line)]
    return False, problems or [f"the config check failed: {lines[-1] if lines else f'exit {done.returncode}'}"]


def run_preview(config: Path, out: Path, overrides: list[str]) -> tuple[bool, str]:
    """`sdtrain data preview` in a child: (ok, its one line: what it wrote, or why not)."""
    try:
        done = subprocess.run(preview_command(config, out, overrides), capture_output=True, text=True,
                              timeout=PREVIEW_TIMEOUT_S, stdin=subprocess.DEVNULL, env=child_environment())
    except subprocess.TimeoutExpired:
        return False, f"the data preview took over {PREVIEW_TIMEOUT_S} s; are the shards on a slow remote?"
    except OSError as exc:
        return False, f"the data preview could not start: {exc.strerror}"
    if done.returncode == 0 and out.is_file():
        return True, ([line for line in done.stdout.splitlines() if line.strip()] or ["written"])[-1]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    # The config is a scratch file the user never named: its path would only hide the key in the line.
    problems = [_ERROR_PREFIX.sub("", line).removeprefix(f"{config}: ") for line in lines if _ERROR_PREFIX.match(line)]
    return False, (problems or lines or [f"exit {done.returncode}"])[0]


def child_environment(gpus: list[int] | None = None) -> dict[str, str]:
    # The token lets a browser in; a training run has no use for it.
    env = {k: v for k, v in os.environ.items() if k != "SDTRAIN_UI_TOKEN"}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


# ---------------------------------------------------------------------------------------------- the queue


@dataclass
class Job:
    run: Path
    kind: str
    """train, resume, export or prepare."""
    argv: list[str]
    gpus: list[int] = field(default_factory=list)
    """The GPUs it is given (CUDA_VISIBLE_DEVICES); none: a CPU job, which --parallel counts."""
    state: str = "queued"
    """queued, running, done, stopped, failed or cancelled."""
    created: float = field(default_factory=time.time)
    started: float | None = None
    ended: float | None = None
    pid: int | None = None
    returncode: int | None = None
    message: str | None = None
    stop_requested: bool = False
    process: subprocess.Popen | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "process"}
        return {**data, "run": str(self.run), "argv": list(self.argv)}

    @property
    def live(self) -> bool:
        return self.state in ("queued", "running")


class Queue:
    """Jobs started in the order they came, polled by a background thread: CPU jobs `parallel` at a time, GPU jobs
    as soon as no running job holds one of their GPUs."""

    def __init__(self, root: Path, parallel: int = 1):
        self.root = Path(root).resolve()
        self.parallel = max(int(parallel), 1)
        self.jobs: list[Job] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restore()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sdtrain-ui-queue", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop polling; the children run on (a restarted UI finds them by their lock and their job files)."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.poll()
            except Exception:  # one bad job (a full disk, say) must not stop the queue for every other
                log.exception("sdtrain ui: the job queue could not poll")

    # ------------------------------------------------------------------------------------------ asking

    def job_for(self, run: Path) -> Job | None:
        with self._lock:
            found = [job for job in self.jobs if job.run == run]
        return found[-1] if found else None

    def last_command(self, run: Path) -> list[str] | None:
        """The train command the UI last ran for `run` (this UI or an earlier one): resuming repeats it."""
        record = _read_job_file(run)
        argv = record.get("train_argv") if record else None
        return argv if isinstance(argv, list) and all(isinstance(a, str) for a in argv) else None

    def last_gpus(self, run: Path) -> list[int]:
        """The GPUs the UI last trained `run` on: resuming takes the same ones."""
        gpus = (_read_job_file(run) or {}).get("train_gpus")
        return gpus if isinstance(gpus, list) and all(isinstance(g, int) for g in gpus) else []

    # ------------------------------------------------------------------------------------------ changing

    def submit(self, run: Path, kind: str, argv: list[str], gpus: list[int] | None = None) -> Job:
        with self._lock:
            current = self.job_for(run)
            if current and current.live:
                raise Refused(f"run '{run.name}' already has a {current.state} {current.kind} job; stop it first")
            job = Job(run=run, kind=kind, argv=argv, gpus=list(gpus or []))
            self.jobs.append(job)
            self._record(job)
        self.poll()
        return job

    def cancel(self, run: Path) -> Job | None:
        """A queued job leaves the queue; a running one is signalled to stop (it saves first)."""
        with self._lock:
            job = self.job_for(run)
            if not job or not job.live:
                return None
            if job.state == "queued":
                job.state, job.ended, job.message = "cancelled", time.time(), "taken off the queue"
                self._record(job)
            elif job.process is not None and job.process.poll() is None:
                # The trainer saves and exits on SIGTERM as on RUN/stop; its own session, so only it hears it.
                job.stop_requested = True
                with contextlib.suppress(ProcessLookupError):
                    job.process.send_signal(signal.SIGTERM)
            return job

    def poll(self) -> None:
        with self._lock:
            for job in self.jobs:
                if job.state == "running":
                    self._reap(job)
            busy = sum(1 for job in self.jobs if job.state == "running" and not job.gpus)
            held = {gpu for job in self.jobs if job.state == "running" for gpu in job.gpus}
            for job in self.jobs:
                if job.state != "queued":
                    continue
                if job.gpus:
                    # A waiting job keeps its GPUs from later ones, so a job of several GPUs is not starved by a
                    # stream of one-GPU jobs.
                    if not held & set(job.gpus):
                        self._launch(job)
                    held |= set(job.gpus)
                elif busy < self.parallel:
                    self._launch(job)
                    busy += job.state == "running"

    def _launch(self, job: Job) -> None:
        job.started = time.time()
        try:
            with open(job.run / CHILD_LOG, "a") as out:
                out.write(f"---- sdtrain ui {time.strftime('%Y-%m-%d %H:%M:%S')}: {job.kind}: "
                          f"{' '.join(job.argv)}\n")
                out.flush()
                job.process = subprocess.Popen(job.argv, stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True,
                                               env=child_environment(job.gpus))
        except OSError as exc:
            job.state, job.ended, job.message = "failed", time.time(), f"could not start: {exc.strerror or exc}"
        else:
            job.state, job.pid = "running", job.process.pid
        self._record(job)

    def _reap(self, job: Job) -> None:
        if job.process is None:  # adopted from an earlier UI: running while its process lives
            if not _alive(job.pid):
                job.state, job.ended = "done", time.time()
                job.message = "ended while the UI was away; the run's status says how"
                self._record(job)
            return
        code = job.process.poll()
        if code is None:
            return
        job.returncode, job.ended = code, time.time()
        job.state = "done" if code == 0 else "stopped" if code == STOPPED_EXIT else "failed"
        job.message = None if code == 0 else _last_error(job.run / CHILD_LOG) or f"exit status {code}"
        if code == -signal.SIGTERM and job.stop_requested:
            # Stopped while it loaded, before the trainer listens for the signal: nothing trained, nothing lost.
            job.state, job.message = "stopped", "stopped before training began"
        self._record(job)

    # ------------------------------------------------------------------------------------------ persisting

    def _record(self, job: Job) -> None:
        record = _read_job_file(job.run) or {}
        record.update(job.to_json())
        if job.kind in ("train", "resume"):
            record["train_argv"], record["train_gpus"] = job.argv, job.gpus
        try:
            tmp = job.run / (JOB_FILE + ".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            tmp.replace(job.run / JOB_FILE)
        except OSError as exc:
            log.warning("sdtrain ui: cannot write %s: %s", job.run / JOB_FILE, exc)

    def _restore(self) -> None:
        """Jobs an earlier UI left: queued ones queue again in their order, live children keep their slot."""
        found = []
        for depth in range(1, 4):
            for path in self.root.glob("/".join(["*"] * depth) + "/" + JOB_FILE):
                record = _read_job_file(path.parent)
                if record and record.get("state") in ("queued", "running") and isinstance(record.get("argv"), list):
                    found.append((record.get("created") or 0, path.parent, record))
        for _, run, record in sorted(found, key=lambda item: item[0]):
            gpus = record.get("gpus") if isinstance(record.get("gpus"), list) else []
            job = Job(run=run, kind=str(record.get("kind") or "train"), argv=[str(a) for a in record["argv"]],
                      gpus=[g for g in gpus if isinstance(g, int)], state=record["state"],
                      created=record.get("created") or time.time(),
                      started=record.get("started"), pid=record.get("pid"))
            if job.state == "running" and not _alive(job.pid):
                job.state, job.message = "done", "ended while the UI was away; the run's status says how"
                self._record(job)
                continue
            self.jobs.append(job)


def _read_job_file(run: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((run / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _last_error(path: Path) -> str | None:
    """The child's last `sdtrain ...: error:` line (its one-line reason), else its last line."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(handle.tell() - 16384, 0))
            lines = [line for line in handle.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    errors = [line for line in lines if _ERROR_PREFIX.match(line)]
    return (errors or lines or [None])[-1]
