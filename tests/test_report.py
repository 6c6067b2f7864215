"""`sdtrain report`: one self-contained HTML page per run, checked as text and in a real browser."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from PIL import Image

from sdtrain.cli import demo
from sdtrain.cli.main import main
from sdtrain.report import metric_groups, verdict, write_report
from sdtrain.runview import Metrics, read_metrics

CONFIG = {"stage": "diffusion", "mode": "full", "train": {"max_steps": 3000, "mixed_precision": "fp32"}}


def fake_run(path: Path, lines: list[dict | str], samples: list[int] = (), checkpoints: list[int] = ()) -> Path:
    """A run folder as training leaves it, written directly: the page reads files, not the trainer."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    (path / "metrics.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    for i, step in enumerate(samples):
        (path / "samples").mkdir(exist_ok=True)
        Image.new("RGB", (48, 24), (40 * i % 256, 90, 160)).save(path / "samples" / f"step_{step:08d}.png")
    for step in checkpoints:
        folder = path / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        meta = {"step": step, "samples": step * 4, "stage": "diffusion", "ema": True, "task": {"mode": "full"},
                "tuning": {"precision": "bf16", "checkpointing": False, "precision_source": "measured"}}
        (folder / "meta.json").write_text(json.dumps(meta))
    return path


def record(step: int, loss: float, **extra: float) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 1.0 + loss, "lr": 1e-4 * min(1, step / 100), "epoch": step // 500,
            "skipped_samples": 0, "filtered_samples": 0, "samples": 4 * step, "img_per_s": 20.0, **extra}


def long_run(path: Path) -> Path:
    """3000 steps, killed at 2000 and resumed from 1500, with a sparse evaluation metric and 16 grids."""
    first = [record(s, 2.0 * math.exp(-s / 400) + 0.01, **({"fid": 300 - s / 10} if s % 500 == 0 else {}))
             for s in range(10, 2010, 10)]
    resumed = [record(s, 0.5 * math.exp(-s / 400) + 0.01) for s in range(1510, 3010, 10)]
    evaluations = [{"step": 2500, "fid": 20.0}, {"step": 3000, "fid": 12.5}]  # logged after the steps they rate
    return fake_run(path, [*first, '{"step": 20', *resumed, *evaluations],
                    samples=list(range(200, 3001, 200)) + [100], checkpoints=[1500, 3000])


def assert_self_contained(page: str, folder: Path) -> None:
    assert not re.search(r"https?://", page), "the page must not reach the network"
    for src in re.findall(r'<img[^>]*\ssrc="([^"]*)"', page):
        assert src.startswith("data:image/") or (folder / src).is_file(), src[:80]


def plot_count(page: str) -> int:
    return len(re.findall(r'<svg class="plot"', page))


def test_report_of_a_trained_run(autoencoder_run, tmp_path, capsys):
    out = tmp_path / "page" / "report.html"
    assert main(["report", str(autoencoder_run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {out}"
    page = out.read_text()
    assert_self_contained(page, out.parent)
    groups = metric_groups(read_metrics(autoencoder_run / "metrics.jsonl").keys())
    assert [g.title for g in groups][:4] == ["Loss", "Learning rate", "Throughput", "Gradient norm"]
    assert {"reconstruction", "kl"} <= set(groups[0].keys)
    assert plot_count(page) == len(groups)
    # Two validation grids, and the first batch as the model received it.
    assert page.count("<img ") == 3 and page.index("step 4 &middot;") < page.index("step 2 &middot;")
    assert (autoencoder_run / "samples" / "first_batch.png").is_file() and 'alt="first training batch"' in page
    assert "autoencoder / full" in page and "4 of 4 (100%)" in page and "stage: autoencoder" in page
    assert not (autoencoder_run / "report.html").exists()


def test_resumed_run_keeps_the_last_value_per_step(tmp_path):
    run = long_run(tmp_path / "run")
    metrics = read_metrics(run / "metrics.jsonl")
    steps = [r["step"] for r in metrics.records]
    assert steps == list(range(10, 3010, 10))
    assert metrics.restarts == 1 and metrics.unreadable == 1
    at_1600 = metrics.records[steps.index(1600)]
    assert at_1600["loss"] == pytest.approx(0.5 * math.exp(-4) + 0.01)
    # An evaluation logged on its own line for a step training logged too: both kept.
    assert metrics.records[-1]["fid"] == 12.5 and metrics.records[-1]["loss"] > 0
    page = write_report(run).read_text()
    assert (run / "report.html").is_file() and not list(run.glob(".report.html.tmp*"))
    assert_self_contained(page, run)
    assert f"loss = {at_1600['loss']:.5g} at step 1,600" in page
    assert f"loss = {2.0 * math.exp(-4) + 0.01:.5g} at step 1,600" not in page
    assert "restarted 1 time(s)" in page and "1 unreadable line(s)" in page
    titles = [g.title for g in metric_groups(metrics.keys())]
    assert plot_count(page) == len(titles) and "fid" in titles and "<h3>Evaluation</h3>" in page
    assert "loss (log scale)" in page, "a loss falling over decades is read on a log scale"
    assert "Training works." in page and "Loss is falling" in page


def test_long_runs_show_the_newest_grids_and_the_first(tmp_path):
    page = write_report(long_run(tmp_path / "run")).read_text()
    shown = re.findall(r'<figure data-label="step ([\d,]+)"', page)
    assert shown == [f"{s:,}" for s in range(3000, 799, -200)] + ["100"]
    assert "Showing 13 of 16 grids: the 12 newest and the first." in page
    page = write_report(tmp_path / "run", tmp_path / "few.html", images=2).read_text()
    assert page.count("<img ") == 3


def test_a_single_step_and_a_run_without_metrics_still_render(tmp_path):
    one = fake_run(tmp_path / "one", [record(7, 0.9)])
    page = write_report(one).read_text()
    assert plot_count(page) == len(metric_groups(read_metrics(one / "metrics.jsonl").keys())) > 0
    assert "1 logged step(s), step 7." in page and "Too early to tell." in page
    empty = fake_run(tmp_path / "empty", [])
    page = write_report(empty).read_text()
    assert plot_count(page) == 0 and "No metrics logged yet" in page and "none yet" in page


@pytest.mark.parametrize(("losses", "level", "words"), [
    ([1.0, 0.9, 0.7, 0.5, 0.4, 0.3], "good", "falling"),
    ([0.3, 0.4, 0.5, 0.7, 0.9, 1.0], "bad", "rising"),
    ([0.5, 0.51, 0.49, 0.5, 0.5, 0.5], "warn", "flat"),
    ([1.0, 0.9, float("nan"), 0.5], "bad", "nan in loss at step 3"),
    ([1.0], "none", "too few"),
])
def test_verdict_reads_the_loss_trend(losses, level, words):
    judged = verdict(Metrics(records=[{"step": i + 1, "loss": v} for i, v in enumerate(losses)]))
    assert judged.level == level and words in judged.text


def test_not_a_run_is_one_clear_error(tmp_path, capsys):
    for path in (tmp_path, tmp_path / "missing"):
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("sdtrain report: error:") and str(path) in err and len(err.splitlines()) == 1
        assert "run_dir" in err


def test_demo_ends_with_the_report(tmp_path, monkeypatch, capsys):
    real_step = demo._step

    def step(cli, load, title: str, argv: list[str]) -> None:
        # The stages before the report are covered elsewhere; here they only leave what the demo reads.
        if argv[0] == "report":
            return real_step(cli, load, title, argv)
        if argv[0] == "train" and "diffusion" in argv[1]:
            fake_run(Path(next(a for a in argv if a.startswith("run_dir="))[8:]), [record(1, 1.0)])
        if argv[0] == "generate":
            out = Path(argv[argv.index("--out") + 1])
            out.mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(out / "grid.png")

    monkeypatch.setattr(demo, "_step", step)
    assert main(["demo", "--out", str(tmp_path)]) == 0
    report = tmp_path / "diffusion" / "report.html"
    assert report.is_file()
    assert f"training report:    {report}" in capsys.readouterr().out


def chromium() -> str:
    found = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if found is None:
        pytest.skip("no chromium on PATH: apt-get install chromium (.ci/run installs it)")
    return found


@pytest.mark.parametrize("kind", ["trained", "resumed"])
def test_the_page_renders_in_a_real_browser(kind, autoencoder_run, tmp_path):
    browser = chromium()
    run = autoencoder_run if kind == "trained" else long_run(tmp_path / "run")
    page_path = write_report(run, tmp_path / "report.html")
    page = page_path.read_text()
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start. The virtual time budget lets
    # the load event fire before the DOM is dumped.
    result = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000",
                             "--dump-dom", page_path.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    check = re.search(r'<p id="render-check"[^>]*data-status="(\w+)"[^>]*>([^<]*)<', result.stdout)
    assert check, "the page's load check did not run"
    plots, images = plot_count(page), page.count("<img ")
    assert plots > 0 and images > 0
    assert check.groups() == ("ok", f"Render check: {plots}/{plots} plots and {images}/{images} images rendered.")
