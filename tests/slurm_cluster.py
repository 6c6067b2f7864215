"""A throwaway one-node Slurm cluster on localhost for tests: munged, slurmctld and one slurmd.

Everything lives in a private folder under /tmp (short paths: munge and slurmd listen on Unix
sockets, whose paths are limited to about 100 characters); the controller and node ports are
picked free at start, so the cluster never touches /etc/slurm, /etc/munge or a running Slurm.

Every process the cluster starts carries the variable ``SDTRAIN_SLURM_CLUSTER=<its folder>`` in
its environment: the daemons get it from `start`, and jobs from the environment `sbatch` exports
(pass `cluster.env`). `stop` ends the daemons, then kills whatever still carries the variable
(job scripts, slurmstepd, srun, torchrun and its workers) and waits, bounded, until each is gone.

Readiness needs no fixed sleep: munged returns only once its socket listens (it daemonizes through
a pipe), and a one-task `srun` blocks until the controller answers and the node has registered;
while it waits, a daemon that exits (a bad config) fails the start at once, with the daemons' logs.
Non-root works too: the daemons then run as, and only run jobs of, the current user.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

MARKER = "SDTRAIN_SLURM_CLUSTER"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel")
# The daemons live in sbin, which a non-root PATH may lack.
_SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])


def find(program: str) -> str | None:
    return shutil.which(program, path=_SEARCH)


def missing_programs() -> list[str]:
    return [p for p in (*DAEMONS, *CLIENTS) if find(p) is None]


def _free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports that were free a moment ago (all held open together while picked)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _wait_gone(pid: int, timeout: float) -> bool:
    """True once the process `pid` (not necessarily our child) has ended, waiting at most `timeout` s."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:  # no pidfd (a kernel before 5.3): poll, still bounded
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        while Path(f"/proc/{pid}/environ").exists() and _state(pid) not in ("Z", "X", ""):
            if time.monotonic() > deadline:
                return False
            pause.wait(0.05)
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[0]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path.name}: none)"
    return f"--- {path.name} (last {lines} lines)\n" + "\n".join(text[-lines:])


class SlurmCluster:
    """`with SlurmCluster() as cluster: subprocess.run(["sbatch", ...], env=cluster.env)`."""

    node = "sdtrain0"
    partition = "debug"

    def __init__(self, cpus: int | None = None) -> None:
        missing = missing_programs()
        if missing:
            raise RuntimeError(f"Slurm programs not found: {', '.join(missing)}")
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self.root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
        self.root.chmod(0o755)  # munged wants its socket's folders searchable by all
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), MARKER: str(self.root)}
        self._daemons: list[subprocess.Popen] = []
        self._munged_pid: int | None = None
        self._log_files: list = []

    # -- start ------------------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        try:
            self._start_munged()
            self._write_conf()
            self._spawn("slurmctld", "-D", "-c")  # -c: no state from an earlier run
            self._spawn("slurmd", "-D", "-N", self.node)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munged(self) -> None:
        self.logs.mkdir()
        folder = self.root / "munge"
        folder.mkdir()
        key = folder / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        self.munge_socket = folder / "munge.socket"
        # --force: munged refuses a socket under world-writable /tmp otherwise. It forks, and its
        # first process exits only once the daemon's socket listens.
        result = subprocess.run(
            [find("munged"), "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={folder / 'munged.pid'}", f"--log-file={self.logs / 'munged.log'}",
             f"--seed-file={folder / 'munged.seed'}"],
            env=self.env, capture_output=True, text=True, timeout=60, cwd=self.root,
        )
        if result.returncode != 0:
            raise RuntimeError(f"munged failed to start: {result.stderr.strip()}\n{_tail(self.logs / 'munged.log')}")
        self._munged_pid = int((folder / "munged.pid").read_text().split()[0])

    def _write_conf(self) -> None:
        for name in ("state", "spool"):
            (self.root / name).mkdir()
        host = socket.gethostname().split(".")[0]  # slurmctld checks that it runs on SlurmctldHost
        ctld_port, slurmd_port = _free_ports(2)
        lines = [
            "ClusterName=sdtrain",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmUser={_user()}",
            f"SlurmdUser={_user()}",  # root normally; a non-root slurmd can run its own user's jobs
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it may start again (121 s
            # by default); the main scheduler loop then picks it up within sched_interval.
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "PropagateResourceLimits=NONE",
            "MailProg=/bin/true",
            "ReturnToService=2",
            # `sbatch --wait` polls every 2 s when MinJobAge is this low (its back-off towards 32 s
            # grows with MinJobAge), and 5 s still keeps a finished job's record past its next poll.
            "MinJobAge=5",
            "KillWait=5",  # SIGKILL 5 s after SIGTERM when a job is cancelled or requeued (30 by default)
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, program: str, *args: str) -> None:
        out = open(self.logs / f"{program}.out", "wb")  # noqa: SIM115 -- closed in stop()
        self._log_files.append(out)
        self._daemons.append(subprocess.Popen([find(program), *args], env=self.env, stdout=out,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              cwd=self.root, start_new_session=True))

    def _wait_ready(self, timeout: float = 60) -> None:
        # The clients retry while the controller is not up yet, and the job waits for the node to
        # register: once this srun has run, so can any job. Meanwhile a daemon that exits (a bad
        # config) fails the start at once rather than at the timeout.
        probe = subprocess.Popen([find("srun"), "--nodes=1", "--ntasks=1", "--job-name=ready", "true"],
                                 env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    probe.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                dead = [d.args[0] for d in self._daemons if d.poll() is not None]
                if dead or time.monotonic() > deadline:
                    why = f"{', '.join(dead)} exited" if dead else f"no job ran within {timeout} s"
                    raise RuntimeError(f"the Slurm test cluster did not start: {why}\n{self.describe()}")
        finally:
            if probe.poll() is None:
                probe.kill()
            _, err = probe.communicate()
        if probe.returncode != 0:
            raise RuntimeError(f"the Slurm test cluster could not run a job: {err.strip()}\n{self.describe()}")

    # -- use --------------------------------------------------------------------------------------

    def run(self, command: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout, **kwargs)

    def describe(self) -> str:
        """The daemons' recent log lines, for failure messages."""
        names = ("munged.log", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out")
        return "\n".join(_tail(self.logs / n) for n in names)

    # -- stop -------------------------------------------------------------------------------------

    def marked_pids(self) -> list[int]:
        """Live processes (not zombies) carrying this cluster's marker variable."""
        needle = f"{MARKER}={self.root}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:  # gone, or another user's
                continue
            if needle in environ.split(b"\0"):
                found.append(int(entry))
        return found

    def stop(self) -> None:
        for daemon in reversed(self._daemons):  # slurmd first: it launches no more steps
            if daemon.poll() is None:
                daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=15)
        self._daemons.clear()
        if self._munged_pid is not None:
            try:
                os.kill(self._munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if not _wait_gone(self._munged_pid, 15):
                os.kill(self._munged_pid, signal.SIGKILL)
                _wait_gone(self._munged_pid, 15)
            self._munged_pid = None
        # Jobs outlive slurmd by design: slurmstepd runs on its own. Kill what is left.
        for _ in range(5):
            pids = self.marked_pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in pids:
                _wait_gone(pid, 15)
        for f in self._log_files:
            f.close()
        self._log_files.clear()
        left = self.marked_pids()
        if left:
            raise RuntimeError(f"Slurm test cluster: processes still running after stop: {left}")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name
