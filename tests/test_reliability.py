"""What a run survives: damaged checkpoints, a second run on its folder, NaN steps."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdtrain.cli.main import main

from .conftest import TINY, config_path

AE = str(config_path("autoencoder.yaml"))


def _ae(run: Path, shapes_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["train", AE, f"run_dir={run}", f"data.shards={shapes_dir}", *TINY, f"train.max_steps={steps}",
            "checkpoint.every=1", "checkpoint.keep_last=5", "optim.schedule=constant", "validation.prompts=[]",
            *extra]


def _same_weights(a: Path, b: Path) -> bool:
    for name in ("model.safetensors", "ema.safetensors"):
        x, y = load_file(str(a / name)), load_file(str(b / name))
        if x.keys() != y.keys() or any(not torch.equal(x[k], y[k]) for k in x):
            return False
    return True


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    # Past the header, inside the tensor data: the file still parses, only the numbers change.
    for i in range(len(data) - 64, len(data) - 32):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage(checkpoint: Path, how: str) -> str:
    if how == "flipped":
        _flip_bytes(checkpoint / "model.safetensors")
        return "model.safetensors does not match the sha256"
    if how == "truncated":
        path = checkpoint / "ema.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return "ema.safetensors has"
    (checkpoint / "optimizer.pt").unlink()
    return "optimizer.pt is missing"


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, shapes_dir) -> Path:
    run = tmp_path_factory.mktemp("straight") / "ae"
    assert main(_ae(run, shapes_dir, 3)) == 0
    return run


@pytest.mark.parametrize("how", ["flipped", "truncated", "missing"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_previous(
        tmp_path, shapes_dir, straight_run, caplog, how):
    run = tmp_path / "ae"
    assert main(_ae(run, shapes_dir, 2)) == 0
    newest = run / "checkpoints" / "step_00000002"
    problem = _damage(newest, how)
    with caplog.at_level(logging.WARNING):
        assert main(_ae(run, shapes_dir, 3)) == 0
    assert problem in caplog.text and "falling back to the previous checkpoint" in caplog.text
    # Kept for inspection under a name no command reads as a checkpoint.
    assert (run / "checkpoints" / "step_00000002.damaged").is_dir()
    # Resumed from step 1 and trained steps 2 and 3 again: the same weights as a run never damaged.
    assert _same_weights(run / "checkpoints" / "step_00000003", straight_run / "checkpoints" / "step_00000003")


def test_checksums_are_recorded_for_every_file_and_sha256sum_agrees(straight_run):
    import hashlib

    checkpoint = straight_run / "checkpoints" / "step_00000003"
    files = json.loads((checkpoint / "meta.json").read_text())["files"]
    on_disk = {p.name for p in checkpoint.iterdir() if p.name != "meta.json"}
    assert set(files) == on_disk
    for name, recorded in files.items():
        data = (checkpoint / name).read_bytes()
        assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_export_generate_and_an_explicit_resume_refuse_a_damaged_checkpoint(tmp_path, shapes_dir, straight_run,
                                                                            capsys):
    import shutil

    run = tmp_path / "ae"
    shutil.copytree(straight_run, run)
    checkpoint = run / "checkpoints" / "step_00000003"
    _flip_bytes(checkpoint / "ema.safetensors")
    calls = {
        "export": ["export", str(run), "--out", str(tmp_path / "out")],
        "train": _ae(run, shapes_dir, 4, f"checkpoint.resume={checkpoint}"),
    }
    for command, argv in calls.items():
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"sdtrain {command}: error:"), err
        assert "step_00000003: damaged checkpoint: ema.safetensors does not match" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_second_run_on_a_busy_run_folder_refuses_with_one_line(tmp_path, shapes_dir, capsys):
    from sdtrain.run import run_dir_lock

    run = tmp_path / "ae"
    with run_dir_lock(run):
        assert main(_ae(run, shapes_dir, 1)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"run_dir {run} is in use by sdtrain train (pid {os.getpid()}" in err[0]
    assert not (run / "checkpoints").exists()  # the refused run wrote nothing
    # Released with the holder: the folder is free again.
    assert main(_ae(run, shapes_dir, 1)) == 0


def test_a_killed_run_does_not_leave_its_folder_locked(tmp_path, shapes_dir):
    run = tmp_path / "ae"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys; from sdtrain.run import run_dir_lock\n"
         f"with run_dir_lock({str(run)!r}):\n    print('held', flush=True); signal.pause()"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(_ae(run, shapes_dir, 1)) == 2
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert main(_ae(run, shapes_dir, 1)) == 0


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_a_nan_step_is_skipped_leaving_weights_ema_and_optimizer_untouched(tmp_path, shapes_dir, monkeypatch,
                                                                          caplog):
    run = tmp_path / "ae"
    monkeypatch.setenv("SDTRAIN_NAN_AT_STEPS", "3")
    with caplog.at_level(logging.WARNING):
        assert main(_ae(run, shapes_dir, 4, "logging.every=1")) == 0
    assert "step 3: loss or gradients not finite; update skipped (1 in a row, 1 this run)" in caplog.text
    before, after = run / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000003"
    assert _same_weights(before, after)
    old = torch.load(before / "optimizer.pt", weights_only=True)["state"]
    new = torch.load(after / "optimizer.pt", weights_only=True)["state"]
    assert all(torch.equal(old[k][s], new[k][s]) for k in old for s in old[k])
    # Training goes on after it, and the metrics count it.
    assert not _same_weights(after, run / "checkpoints" / "step_00000004")
    assert [m["skipped_steps"] for m in _metrics(run)] == [0, 0, 1, 1]


def test_too_many_bad_steps_in_a_row_stop_the_run_naming_its_last_good_checkpoint(tmp_path, shapes_dir,
                                                                                  monkeypatch, capsys):
    run = tmp_path / "ae"
    monkeypatch.setenv("SDTRAIN_NAN_AT_STEPS", "2,3,4")
    assert main(_ae(run, shapes_dir, 6, "train.max_bad_steps=3")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "step 4: loss or gradients not finite for 3 step(s) in a row (train.max_bad_steps=3)" in err
    assert "the last good checkpoint is" in err and "step_00000003" in err
    # Steps 2 and 3 were skipped, so their checkpoints hold step 1's weights: still good to resume from.
    assert _same_weights(run / "checkpoints" / "step_00000001", run / "checkpoints" / "step_00000003")


class _Payload:
    """Unpickling this creates the marker file: proof that a pickle ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _plant(path: Path, marker: Path) -> None:
    torch.save({"state": {}, "x": _Payload(marker)}, path)


def _refresh_checksums(checkpoint: Path) -> None:
    """Checksums that match planted files: the load itself must refuse them, not only the integrity check."""
    from sdtrain.checkpoint import file_digests

    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"] = file_digests(checkpoint)
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def test_a_pickle_payload_in_a_checkpoint_never_runs(tmp_path, shapes_dir, straight_run, capsys):
    import shutil

    marker = tmp_path / "pwned"
    for name in ("optimizer.pt", "trainer.pt"):
        run = tmp_path / name
        shutil.copytree(straight_run, run)
        checkpoint = run / "checkpoints" / "step_00000003"
        _plant(checkpoint / name, marker)
        _refresh_checksums(checkpoint)
        assert main(_ae(run, shapes_dir, 4)) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "step_00000003: cannot resume from this checkpoint" in err
    assert not marker.exists()


def test_pickled_weights_in_a_pretrained_folder_never_run(tmp_path, pretrained, shapes_dir, monkeypatch, capsys):
    import shutil

    marker = tmp_path / "pwned"
    folder = tmp_path / "pipeline"
    shutil.copytree(pretrained, folder)
    (folder / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    _plant(folder / "unet" / "diffusion_pytorch_model.bin", marker)
    monkeypatch.delenv("SDTRAIN_TRUST_PICKLE", raising=False)
    recipe = Path(__file__).resolve().parents[1] / "configs" / "finetune-full.yaml"
    train = ["train", str(recipe), f"run_dir={tmp_path / 'run'}",
             f"model.pretrained={folder}", f"data.shards={shapes_dir}", *TINY, "train.max_steps=1",
             "validation.prompts=[]"]
    generate = ["generate", "--model", str(folder), "--prompt", "a red circle", "--out", str(tmp_path / "out")]
    for argv in (train, generate):
        assert main(argv) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]  # after the loaders' progress bars
        assert last.startswith(f"sdtrain {argv[0]}: error:") and "pickled .bin weights" in last, last
    # Trusted, it is read with weights_only: the payload is refused all the same.
    monkeypatch.setenv("SDTRAIN_TRUST_PICKLE", "1")
    assert main(generate) != 0
    assert not marker.exists()



def test_a_pickle_payload_in_a_sharded_checkpoint_never_runs(tmp_path, shapes_dir, capsys):
    import io
    import pickle

    from sdtrain.checkpoint import read_weights
    from sdtrain.errors import UserError
    from sdtrain.sharded import SafePlanner

    run = tmp_path / "run"
    assert main(_ae(run, shapes_dir, 2, "checkpoint.format=sharded")) == 0
    checkpoint = run / "checkpoints" / "step_00000002"
    marker = tmp_path / "pwned"
    # DCP itself would unpickle .metadata with pickle.load.
    (checkpoint / "sharded" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _refresh_checksums(checkpoint)
    assert main(_ae(run, shapes_dir, 3, "checkpoint.format=sharded")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "step_00000002: cannot resume from this checkpoint" in err and "not part of a checkpoint" in err
    with pytest.raises(UserError, match="cannot read its model weights"):
        read_weights(checkpoint, "model")
    # ... and its non-tensor values (learning rates, betas) with torch.load(weights_only=False).
    planted = io.BytesIO()
    torch.save({"lr": _Payload(marker)}, planted)
    planted.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        SafePlanner().load_bytes(None, planted)
    assert not marker.exists()


def test_async_sharded_saves_hold_the_same_weights_as_full_ones(tmp_path, shapes_dir, straight_run):
    from sdtrain.checkpoint import read_weights

    run = tmp_path / "run"
    assert main(_ae(run, shapes_dir, 3, "checkpoint.format=sharded", "checkpoint.async_save=true")) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_0000000{i}" for i in (1, 2, 3)]
    for group in ("model", "ema"):
        full = load_file(str(straight_run / "checkpoints" / "step_00000003" / f"{group}.safetensors"))
        written = read_weights(run / "checkpoints" / "step_00000003", group)
        assert all(torch.equal(full[k], written[k]) for k in full)


@pytest.mark.parametrize("target", ["sharded/__0_0.distcp", "sharded/.metadata"])
def test_a_damaged_sharded_checkpoint_is_set_aside_and_the_run_resumes_from_the_previous(
        tmp_path, shapes_dir, straight_run, caplog, target):
    run = tmp_path / "run"
    assert main(_ae(run, shapes_dir, 2, "checkpoint.format=sharded")) == 0
    _flip_bytes(run / "checkpoints" / "step_00000002" / target)
    assert main(_ae(run, shapes_dir, 3, "checkpoint.format=sharded")) == 0
    assert f"{target} does not match the sha256" in caplog.text and "falling back" in caplog.text
    # A full and a sharded checkpoint of the same run hold the same weights, tensor for tensor.
    from sdtrain.checkpoint import read_weights

    for group in ("model", "ema"):
        full = load_file(str(straight_run / "checkpoints" / "step_00000003" / f"{group}.safetensors"))
        sharded = read_weights(run / "checkpoints" / "step_00000003", group)
        assert full.keys() == sharded.keys() and all(torch.equal(full[k], sharded[k]) for k in full)


def test_a_manifest_that_lies_about_counts_is_caught_by_verify_and_does_not_break_training(
        tmp_path, capsys, caplog):
    data = tmp_path / "data"
    assert main(["prepare", "shapes", "--out", str(data), "--num", "20", "--size", "32",
                 "--samples-per-shard", "10"]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["shards"][0]["samples"] += 3  # promises samples the shard does not hold
    manifest["shards"][1]["samples"] -= 4  # hides some it does
    manifest["total"] = sum(shard["samples"] for shard in manifest["shards"])
    (data / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["prepare", "verify", str(data)]) == 1
    assert "holds 10 samples, manifest says 13" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(_ae(run, data, 8, "checkpoint.every=0")) == 0
    assert "10 of the 13 samples the manifest lists are readable" in caplog.text
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 8 and last["skipped_samples"] > 0


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_a_read_only_run_folder_at_a_save_is_one_line_and_loses_nothing(tmp_path, shapes_dir, monkeypatch, capsys,
                                                                        layout):
    import errno

    from sdtrain import checkpoint, sharded

    run = tmp_path / "run"
    assert main(_ae(run, shapes_dir, 1, f"checkpoint.format={layout}")) == 0
    before = sorted(p.relative_to(run).as_posix() for p in (run / "checkpoints").rglob("*"))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    # As root, chmod does not stop a write; the error the file system would give is raised where it would be.
    monkeypatch.setattr(checkpoint, "save_file", read_only)
    monkeypatch.setattr(sharded.dcp, "save", read_only)
    capsys.readouterr()
    assert main(_ae(run, shapes_dir, 2, f"checkpoint.format={layout}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step_00000002: cannot write the checkpoint (Read-only file system)" in err[0], err
    assert "the newest checkpoint is still" in err[0] and "step_00000001" in err[0]
    assert sorted(p.relative_to(run).as_posix() for p in (run / "checkpoints").rglob("*")) == before
