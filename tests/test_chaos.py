"""The short version of `make chaos`: every fault once, through the CLI, nothing lost."""

from __future__ import annotations

from . import chaos


def test_every_fault_once_loses_nothing(tmp_path, capsys):
    code = chaos.main(["--trials", "1", "--seed", "1", "--work", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "data lost: none" in out
    for fault in chaos.FAULTS:
        assert fault in out
