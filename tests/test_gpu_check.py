"""`make gpu-check` between GPUs: its dry run on the CPU goes through every step of the script (the CUDA tests,
skipped with their reason, and each benchmark case at tiny size), and every case it runs on a GPU loads as a
config, so the script is ready whenever a card is at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402 - a script beside the package, not part of it


# Slow (90-120 s, the default suite's longest): a GPU session runs `make gpu-check` itself first.
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `make gpu-check` runs the real thing")
def test_the_dry_run_goes_through_every_step_and_writes_its_results(tmp_path):
    out = tmp_path / "gpu-check"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("no CUDA: dry run")
    results = json.loads((out / "results.json").read_text())
    assert results["dry_run"] and results["matmul_peak_tflops"] > 0
    tests = results["tests"]
    # Every CUDA test was collected and skipped with the reason, none failed to import.
    assert tests["skipped"] >= 10 and tests["passed"] == tests["failed"] == 0 and "error" not in tests
    assert any("CUDA" in reason for reason in tests["skip_reasons"])
    # The compile test (inductor minutes on a cold cache) runs after the benchmark cases, with the time they leave.
    assert results["late_tests"]["skipped"] == 1 and "error" not in results["late_tests"]
    names = [case.name for case in gpu_check.dry_cases()]
    assert set(names) == {case.name for case in gpu_check.cuda_cases(80)}
    assert [case["name"] for case in results["benchmarks"]] == names
    for case in results["benchmarks"]:
        assert case["ok"], case.get("error")
        assert case["images_per_s"] > 0 and 0 < case["mfu"] < 1 and case["s_per_step"] > 0
        assert set(case["attention_kernels"]) <= {"flash", "efficient", "cudnn"}  # what the step ran
    # The tuned path's loss curve is its eager twin's, step by step, within the stated tolerance.
    twins = {case.name for case in gpu_check.dry_cases() if case.twin}
    tuned = [case for case in results["benchmarks"] if case["name"] in twins]
    assert len(tuned) == 3 and all(case["follows"]["ok"] and case["follows"]["steps"] >= 3 for case in tuned)
    assert all(case["benchmark"]["precision_choice"]["channels_last_source"] in ("measured", "cache") for case in tuned)
    # The markdown table comes last, a row per case.
    table = done.stdout[done.stdout.index("| case |"):]
    assert all(f"| {name} |" in table for name in names)


@pytest.mark.parametrize("memory_gib", [79.2, 139.8])
def test_every_gpu_case_is_a_config_that_loads(memory_gib):
    from sdtrain.benchmark import benchmark_overrides
    from sdtrain.config import load_config

    for case in gpu_check.cuda_cases(memory_gib):
        path = gpu_check.CONFIGS / case.config
        config = load_config(path, benchmark_overrides(path, case.overrides, "/runs/gpu-check"))
        assert config.train.mixed_precision == "bf16", case.name
    double, single = gpu_check._flux_depth(memory_gib)
    # The transformer's weights, gradients and AdamW state in under half the card; the blocks one to two as released.
    assert single == 2 * double and (double * gpu_check.FLUX_DOUBLE_BLOCK + single * gpu_check.FLUX_SINGLE_BLOCK) \
        * 16 < 0.5 * memory_gib * 2**30


def test_the_wheels_are_what_the_cuda_image_lacks_at_the_versions_tested_here(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path / "wheels")
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda command, **_: calls.append(command)
                        or subprocess.CompletedProcess(command, 0))
    assert gpu_check.download_wheels() == 0
    (command,) = calls
    assert "--no-deps" in command and command[command.index("--python-version") + 1] == gpu_check.WHEEL_PYTHON
    import importlib.metadata

    assert f"diffusers=={importlib.metadata.version('diffusers')}" in command
    assert {c.split("==")[0] for c in command if "==" in c} == set(gpu_check.CARRIED)


def test_a_crashed_case_runs_again_with_synchronous_launches_naming_the_failing_call(tmp_path):
    """A CUDA fault surfaces at a later call unless every launch is synchronous: a crashed case runs once more with
    CUDA_LAUNCH_BLOCKING=1, and the call that raised there is recorded."""
    script = tmp_path / "crash.py"
    script.write_text("import os\n\ndef attention():\n"
                      "    raise RuntimeError('CUDA error: an illegal memory access was encountered, blocking='\n"
                      "                       + os.environ['CUDA_LAUNCH_BLOCKING'])\n\nattention()\n")
    rerun = gpu_check._blocking_rerun([sys.executable, str(script)], tmp_path / "crash.log", 60)
    assert rerun["status"] == 1 and "blocking=1" in rerun["log_tail"]
    assert rerun["failing_call"].startswith("attention (crash.py:4): raise RuntimeError")


def test_a_tuned_case_follows_its_eager_twin_only_within_the_tolerance():
    eager = {"losses": [1.0, 0.9, 0.8], "mixed_precision": "fp32"}
    close = gpu_check.follows({"losses": [1.0, 0.9002, 0.8], "mixed_precision": "fp32"}, eager)
    assert close["ok"] and close["steps"] == 3 and close["max_relative_difference"] == pytest.approx(2e-4 / 0.9)
    assert not gpu_check.follows({"losses": [1.0, 0.91, 0.8], "mixed_precision": "fp32"}, eager)["ok"]
    assert gpu_check.follows({"losses": [1.0, 0.91, 0.8], "mixed_precision": "bf16"}, eager)["ok"]  # bf16's rounding
    assert not gpu_check.follows({"losses": [], "mixed_precision": "fp32"}, eager)["ok"]  # nothing compared
    # A NaN is what a broken kernel gives, on either side; a curve cut short compares only part of the run.
    assert not gpu_check.follows({"losses": [1.0, float("nan"), 0.8], "mixed_precision": "bf16"}, eager)["ok"]
    assert not gpu_check.follows({"losses": [1.0, 0.9, 0.8], "mixed_precision": "bf16"},
                                 {"losses": [1.0, float("inf"), 0.8], "mixed_precision": "fp32"})["ok"]
    assert not gpu_check.follows({"losses": [1.0, 0.9], "mixed_precision": "fp32"}, eager)["ok"]
