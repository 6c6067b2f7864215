"""The run view every reader of a run folder shares (the report, the UI): what a run is and where it stands, from
the folder alone, whoever started it; what happened to it, as it happens; and a stop asked for without a signal."""

from __future__ import annotations

import json
from pathlib import Path

from sdtrain import runview
from sdtrain.cli.main import main
from sdtrain.paths import STOP_REQUEST
from sdtrain.run import run_dir_lock
from sdtrain.train.logger import RunLogger

from .conftest import TINY, config_path, same_checkpoints


def _events(run: Path) -> list[tuple[str, int]]:
    return [(e["event"], e["step"]) for e in runview.read_events(run)]


def test_a_finished_run_reads_as_one_row_with_its_events_and_log(diffusion_run):
    row = runview.summary(diffusion_run, root=diffusion_run.parent)
    assert (row.name, row.stage, row.mode, row.status, row.step, row.max_steps) == \
        ("diffusion", "diffusion", "full", "finished", 4, 4)
    assert row.loss is not None and row.images_per_second > 0 and row.samples > 0
    assert row.last_save is not None and row.disk_bytes > 0 and row.problem is None
    assert json.dumps(row.to_json())  # what an API returns
    assert _events(diffusion_run) == [("start", 0), ("save", 2), ("validation", 2), ("save", 4), ("validation", 4),
                                      ("end", 4)]
    assert runview.read_events(diffusion_run, after=4)[0]["index"] == 4
    assert (diffusion_run / "train.log").is_file()
    assert runview.find_runs(diffusion_run.parent) == [diffusion_run]


def test_status_comes_from_the_lock_the_checkpoints_and_the_last_event(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("stage: diffusion\nmode: [controlnet, lora]\ntrain: {max_steps: 10}\n")
    assert runview.summary(run).status == "new" and runview.summary(run).mode == "controlnet+lora"
    with run_dir_lock(run):
        assert runview.summary(run).status == "running"
    (run / "events.jsonl").write_text('{"event": "start", "step": 0}\n{"event": "error", "step": 3, "message": "x"}\n'
                                      '{"event": "sa')  # a line half written as the run is read
    assert runview.summary(run).status == "failed"
    # A damaged metrics file: its readable lines count, the rest is one line of what could not be read.
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo\n{"step": 3, "loss": 0.25}\n')
    row = runview.summary(run)
    assert (row.step, row.loss) == (3, 0.25)
    assert runview.read_metrics(run / "metrics.jsonl").unreadable == 1


def test_a_stop_asked_for_in_the_run_folder_saves_and_the_same_command_resumes_bitwise(tmp_path, shapes_dir,
                                                                                       monkeypatch, caplog):
    caplog.set_level("INFO", logger="sdtrain")  # as the CLI's own logging shows it
    common = [str(config_path("autoencoder.yaml")), *TINY, f"data.shards={shapes_dir}", "train.max_steps=4",
              "checkpoint.every=100"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main(["train", *common, f"run_dir={straight}"]) == 0

    logged = RunLogger.log

    def log_then_ask(self, step, samples, metrics):  # a reader asks while step 2 is logged
        logged(self, step, samples, metrics)
        if step == 2:
            runview.request_stop(self.run_dir)

    with monkeypatch.context() as patched:
        patched.setattr(RunLogger, "log", log_then_ask)
        assert main(["train", *common, f"run_dir={stopped}", "logging.every=1"]) != 0
    assert runview.summary(stopped).status == "stopped" and not (stopped / STOP_REQUEST).exists()
    assert _events(stopped)[-1] == ("stop", 2)
    assert any(f"run {stopped}: autoencoder stage" in line for line in runview.log_tail(stopped))
    assert main(["train", *common, f"run_dir={stopped}", "logging.every=1"]) == 0
    assert runview.summary(stopped).status == "finished"
    assert [e for e, _ in _events(stopped) if e != "validation"] == ["start", "save", "stop", "start", "save", "end"]
    same_checkpoints(straight / "checkpoints" / "step_00000004", stopped / "checkpoints" / "step_00000004")
