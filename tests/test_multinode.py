"""Two torchrun "nodes" in two network namespaces joined by a veth pair: c10d rendezvous, gloo over the veth.

This is the multi-node launch of a cluster on one machine: each node sees only its own address, and both
write to the same run folder, as nodes on a shared filesystem do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from sdtrain.checkpoint import list_checkpoints

from .conftest import TINY, config_path

RDZV_PORT = 29400  # each namespace has its own ports, so a fixed one cannot collide with anything else
TIME_LIMIT = 300.0
STEPS, BATCH = 3, 4  # BATCH is data.batch_size in TINY


@dataclass(frozen=True)
class Node:
    netns: str
    ifname: str
    addr: str


@dataclass
class Cluster:
    nodes: list[Node]
    processes: list[subprocess.Popen] = field(default_factory=list)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _stop(process: subprocess.Popen) -> None:
    """Kill a node's torchrun and its workers (it leads its own session) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


@pytest.fixture
def two_nodes() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = f"sdt{os.getpid()}"  # interface names are limited to 15 characters
    nodes = [Node(f"{tag}-node{i}", f"{tag}v{i}", f"10.123.0.{i + 1}") for i in range(2)]
    cluster = Cluster(nodes)
    created: list[str] = []

    def setup(*args: str) -> None:
        result = _ip(*args)
        if result.returncode != 0:
            pytest.skip(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")

    try:
        for node in nodes:
            setup("netns", "add", node.netns)
            created.append(node.netns)
        a, b = nodes
        setup("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        for node in nodes:
            setup("link", "set", node.ifname, "netns", node.netns)
            setup("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
            setup("-n", node.netns, "link", "set", "lo", "up")
            setup("-n", node.netns, "link", "set", node.ifname, "up")
        yield cluster
    finally:
        for process in cluster.processes:
            _stop(process)
        for netns in created:
            # Anything still inside (a worker that left its session) goes too, or the namespace would outlive us.
            pids = _ip("netns", "pids", netns).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", netns)  # takes its end of the veth pair, and with it the pair, along


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"


@pytest.mark.dist
@pytest.mark.slow  # the default suite's 15 minutes; the one-node torchrun tests run by default
def test_two_nodes_in_network_namespaces_train_together(tmp_path, shapes_dir, autoencoder_run, two_nodes):
    run = tmp_path / "run"
    master = two_nodes.nodes[0]
    overrides = [f"run_dir={run}", f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", *TINY,
                 "validation.prompts=[]", f"train.max_steps={STEPS}", "checkpoint.every=0", "logging.every=1",
                 "parallel.backend=gloo", "parallel.timeout_minutes=3"]
    logs = []
    for rank, node in enumerate(two_nodes.nodes):
        command = [
            "ip", "netns", "exec", node.netns,
            "env", f"GLOO_SOCKET_IFNAME={node.ifname}", "OMP_NUM_THREADS=1",
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1", "--max_restarts", "0",
            "--rdzv_backend", "c10d", "--rdzv_id", f"sdtrain-multinode-{os.getpid()}",
            "--rdzv_endpoint", f"{master.addr}:{RDZV_PORT}",
            "--rdzv_conf", f"is_host={'true' if rank == 0 else 'false'},join_timeout=120",
            "--local_addr", node.addr,
            "-m", "sdtrain", "train", str(config_path("diffusion.yaml")), *overrides,
        ]
        log = tmp_path / f"node{rank}.log"
        logs.append(log)
        with open(log, "w") as out:  # a file, not a pipe: a node blocked on a full pipe would stall both
            two_nodes.processes.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                                        stdin=subprocess.DEVNULL, start_new_session=True))

    deadline = time.monotonic() + TIME_LIMIT
    timed_out = False
    for process in two_nodes.processes:
        try:
            process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    codes = [p.returncode for p in two_nodes.processes]
    if timed_out or codes != [0, 0]:
        for process in two_nodes.processes:
            _stop(process)
        report = "\n".join(f"--- node {i} ({p.args[3]}), exit {p.returncode}:\n{_tail(log)}"
                           for i, (p, log) in enumerate(zip(two_nodes.processes, logs)))
        reason = f"timed out after {TIME_LIMIT:.0f} s" if timed_out else "a node failed"
        pytest.fail(f"{reason}\n{report}")

    out0, out1 = (log.read_text(errors="replace") for log in logs)
    # Each node ran one rank of a world of two, joined over the veth.
    assert "rank 0 of 2 (torchrun, backend gloo)" in out0, out0[-3000:]
    assert "rank 1 of 2 (torchrun, backend gloo)" in out1, out1[-3000:]
    assert [p.name for p in list_checkpoints(run)] == [f"step_{STEPS:08d}"]
    final = run / "checkpoints" / f"step_{STEPS:08d}"
    state = torch.load(final / "trainer.pt", weights_only=True)
    assert len(state["ranks"]) == 2 and state["step"] == STEPS
    assert json.loads((final / "meta.json").read_text())["samples"] == STEPS * BATCH * 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["samples"] == STEPS * BATCH * 2  # two ranks' batches per step
    assert not list((run / "checkpoints").glob(".step_*"))  # no half-written or stale folders left
