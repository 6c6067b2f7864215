"""Memory of a process tree: what the benchmark and the memory estimate count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
            assert child.pid in descendants(sys.modules["os"].getpid())
            with_child = tree_bytes()
            peak.phase("training")
        finally:
            child.communicate("")
    assert with_child - alone > 180 * 2**20
    # The child's memory was part of the first phase's peak, and of the second's first sample.
    assert peak.peak("loading") >= alone + 180 * 2**20
    assert peak.peak() == max(peak.peaks.values())
