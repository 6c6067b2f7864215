"""The short version of `make chaos`: every fault once, through the CLI, nothing lost."""

from __future__ import annotations

import pytest

from . import chaos


@pytest.mark.slow
def test_every_fault_once_loses_nothing(tmp_path, capsys):
    code = chaos.main(["--trials", "1", "--seed", "0", "--family", "flux", "--work", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "data lost: none" in out and "model family: flux" in out
    for fault in chaos.FAULTS:
        assert fault in out
