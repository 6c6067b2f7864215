"""Memory of a process tree: what the benchmark and the memory estimate count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdtrain.memory import TreePeak, descendants, tree_bytes

pytestmark = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")

CHILD = "import sys; held = bytearray(200 * 2**20); print('ready', flush=True); sys.stdin.read()"


def test_a_tree_counts_the_memory_of_the_processes_it_started():
    alone = tree_bytes()
    with TreePeak(phase="loading", interval=60) as peak:
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            assert (child.pid, os.getpid()) in descendants(os.getpid())
            with_child = tree_bytes()
            peak.phase("training")
        finally:
            child.communicate("")
    assert with_child - alone > 180 * 2**20
    # The child's memory was part of the first phase's peak, and of the second's first sample.
    assert peak.peak("loading") >= alone + 180 * 2**20
    assert peak.peak() == max(peak.peaks.values())


def test_a_fork_of_a_large_process_counts_only_the_pages_it_alone_holds():
    held = torch.ones(320 * 2**20)  # 1.25 GiB: a trainer's weights
    alone = tree_bytes()
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # a loader worker forked from the trainer: it maps all of the trainer's pages
        os.close(write_end)
        os.read(read_end, 1)
        os._exit(0)
    try:
        os.close(read_end)
        forked = tree_bytes()
        held.mul_(2)  # the trainer rewrites its weights: the worker now alone holds the old pages
        rewritten = tree_bytes()
    finally:
        os.write(write_end, b"x")
        os.close(write_end)
        os.waitpid(child, 0)
    assert forked - alone < 100 * 2**20  # shared pages are counted once, in the trainer
    assert rewritten - forked > 1.1 * 2**30  # and the copies the fork forced, once more
