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


def test_forks_of_a_large_process_count_each_page_once():
    held = torch.ones(320 * 2**20)  # 1.25 GiB: a trainer's weights
    alone = tree_bytes()
    read_end, write_end = os.pipe()
    children = []
    for _ in range(2):  # two loader workers forked from the trainer: each maps all of the trainer's pages
        child = os.fork()
        if child == 0:
            os.close(write_end)
            os.read(read_end, 1)
            os._exit(0)
        children.append(child)
    try:
        os.close(read_end)
        forked = tree_bytes()
        held.mul_(2)  # the trainer rewrites its weights: the workers now hold the old pages between them
        rewritten = tree_bytes()
    finally:
        os.write(write_end, b"xx")
        os.close(write_end)
        for child in children:
            os.waitpid(child, 0)
    assert forked - alone < 100 * 2**20  # pages shared by three processes, counted once
    assert 1.1 * 2**30 < rewritten - forked < 1.4 * 2**30  # the copies the forks forced, once more (not twice)
