"""`make gpu-check`: sdtrain's CUDA paths checked and the seed's figures measured in one run, sized for the minutes a
GPU is at hand (at most 8 on an H100 or H200).

1. The packages a bare CUDA image lacks are installed offline from the wheels `make gpu-wheels` fetched
   (``.gpu-wheels/``, carried with the tree), if any is missing.
2. The bf16 matmul peak of this device, measured, for MFU.
3. ``pytest -m cuda`` (tests/test_cuda.py): one test per CUDA path.
4. ``sdtrain benchmark train`` at real architecture with random weights: SD2-base at 512 px online and on encoded
   latents (MosaicML's and MLPerf's settings), the MLPerf Flux.1-schnell transformer at the depth that fits the
   card, Flux.1-dev LoRA at 1024 px over bf16 and fp8 bases, SDXL LoRA at 1024 px: images/s, s/step, MFU against
   the measured peak and peak GPU memory.

Writes ``OUT/results.json`` (default runs/gpu-check) and prints a markdown table last. Every case has its own time
limit and a failing or slow one is recorded, never fatal, so one run reports everything it could measure.

Without CUDA it says "no CUDA: dry run" first and runs the same steps at tiny sizes on the CPU (under 3 minutes),
so the script is exercised between the chances to run it on a GPU (tests/test_gpu_check.py).

`python benchmarks/gpu_check.py wheels` downloads the wheels into ``.gpu-wheels/`` (what `make gpu-wheels` runs).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "src" / "sdtrain" / "configs"
WHEELS = ROOT / ".gpu-wheels"
CARRIED = ("diffusers", "webdataset", "omegaconf", "braceexpand", "importlib_metadata")
"""sdtrain's requirements the CUDA image does not hold (it has torch, transformers, peft, safetensors, tokenizers,
torchmetrics, tensorboard, pyyaml, pillow, numpy, pytest), at the versions installed where the wheels are fetched."""
WHEEL_PYTHON = "3.12"
"""The CUDA image's Python: the wheels are fetched for it (all of them are pure Python)."""

FLUX_DOUBLE_BLOCK = 340e6
FLUX_SINGLE_BLOCK = 141e6
"""Parameters of one Flux.1 double-stream and single-stream block at the released width (3072)."""


@dataclass
class Case:
    name: str
    what: str
    config: str
    overrides: list[str]
    encoded: bool = False
    family: str = "sd"
    """The model family, for the dry run's tiny stand-in."""
    steps: int = 10
    warmup: int = 3
    timeout: int = 150
    # A full-size model's checkpoint (weights, EMA, AdamW state: 14 GB for SD2) takes longer to write than the
    # steps take to time, and says nothing of the GPU.
    flags: list[str] = field(default_factory=lambda: ["--no-save", "--peak-seconds", "0.5"])
    twin: str | None = None
    """The eager case this one is the tuned path of: its losses must follow the twin's (`follows`)."""
    min_seconds: int = 10
    """Not started with less of the budget left (a compile cut off halfway measures nothing)."""


def _flux_depth(memory_gib: float) -> tuple[int, int]:
    """Double and single blocks (one to two, as released) whose weights, gradients and AdamW state (16 bytes a
    parameter) take at most 45% of the card, leaving the rest to activations."""
    budget = 0.45 * memory_gib * 2**30 / 16
    double = max(1, int(budget // (FLUX_DOUBLE_BLOCK + 2 * FLUX_SINGLE_BLOCK)))
    return min(double, 19), min(2 * double, 38)


# The text encoders of an encoded benchmark never run (the shards hold their states): T5-XXL is built one layer deep,
# its width (what the transformer reads) as released, so the benchmark does not write 19 GB of random weights.
SHALLOW_T5 = "model.components.text_encoder_2.overrides={num_layers: 1}"


def cuda_cases(memory_gib: float) -> list[Case]:
    double, single = _flux_depth(memory_gib)
    sd2 = ["model.preset=sd2", "data.resolution=512", "data.batch_size=32", "ema.enabled=true",
           "train.mixed_precision=bf16", "train.gradient_checkpointing=false", "data.num_workers=8"]
    flux_lora = ["model.pretrained=null", "model.family=flux", "model.preset=flux-dev", "data.resolution=1024",
                 "data.aspect_buckets=false", "data.batch_size=1", "train.mixed_precision=bf16", SHALLOW_T5,
                 "model.t5_text_length=512", "train.gradient_checkpointing=true"]
    wan = ["model.pretrained=null", "model.family=wan", "data.resolution=624", "data.frames=81",
           "data.aspect_buckets=false", "data.batch_size=1", "train.mixed_precision=bf16",
           "model.frozen_precision=bf16", "model.t5_text_length=512",
           "model.components.text_encoder.overrides={num_layers: 1}",
           "train.gradient_checkpointing=true"]
    lora_1024 = ["model.pretrained=null", "data.resolution=1024", "data.aspect_buckets=false", "data.batch_size=1",
                 "train.mixed_precision=bf16", "model.frozen_precision=bf16", "model.t5_text_length=512",
                 "train.gradient_checkpointing=true"]
    one_gpu = dict(encoded=True, steps=5, warmup=2)
    # Cheapest and most asked first: a case the time budget does not reach is listed as not run. SimpleTuner's H100
    # LoRA steps at 1024 px: SDXL 0.61 s, Z-Image 0.24 s, Qwen-Image 1.20 s (checkpointing).
    return [
        Case("sd2-512-online", "SD2-base UNet, 512 px, batch 32, EMA, bf16, VAE in the step (MosaicML: 48.2 img/s "
             "per H100)", "sd2-256.yaml", sd2),
        Case("sd2-512-encoded", "the same on pre-encoded latents (MLPerf SD2: about 137.6 img/s per H100)",
             "sd2-256.yaml", sd2, encoded=True),
        Case("sdxl-lora-1024", "SDXL LoRA, 1024 px, batch 1, bf16, encoded (SimpleTuner H100: 0.61 s/step)",
             "sdxl-lora.yaml",
             ["model.pretrained=null", "model.family=sdxl", "model.preset=sdxl", "data.resolution=1024",
              "data.aspect_buckets=false", "data.batch_size=1", "train.mixed_precision=bf16",
              "model.tokenizer_vocab_size=49408"], family="sdxl", **one_gpu),
        Case("z-image-lora-1024", "Z-Image LoRA rank 16, 1024 px, batch 1, bf16 base, checkpointing, encoded "
             "(SimpleTuner H100: 0.24 s/step)", "lora.yaml",
             [*lora_1024, "model.family=z-image", "model.preset=z-image", "lora.rank=16"], family="z-image",
             **one_gpu),
        Case("flux-dev-lora-bf16", "Flux.1-dev LoRA rank 16, 1024 px, batch 1, bf16 base, encoded", "flux-lora.yaml",
             [*flux_lora, "model.frozen_precision=bf16"], family="flux", **one_gpu),
        Case("flux2-klein-lora-1024", "Flux.2 klein-4B LoRA rank 16, 1024 px, batch 1, bf16 base, checkpointing, "
             "encoded", "flux2-lora.yaml",
             [*lora_1024, "model.family=flux2-klein", "model.preset=flux2-klein-4b", "lora.rank=16"],
             family="flux2-klein", **one_gpu),
        Case("qwen-image-lora-1024", "Qwen-Image LoRA rank 16, 1024 px, batch 1, bf16 base, checkpointing, encoded "
             "(SimpleTuner H100: 1.20 s/step)", "lora.yaml",
             [*lora_1024, "model.family=qwen-image", "model.preset=qwen-image", "lora.rank=16"],
             family="qwen-image", **one_gpu),
        Case("sd3-lora-1024", "SD3-medium LoRA rank 16, 1024 px, batch 1, bf16 base, checkpointing, encoded",
             "sd3-lora.yaml", [*lora_1024, "model.family=sd3", "model.preset=sd3-medium", "lora.rank=16"],
             family="sd3", **one_gpu),
        Case("flux-schnell-256", f"MLPerf Flux.1-schnell transformer, {double} double + {single} single blocks (of "
             "19 + 38, what fits the card), 256 px, batch 16, bf16, full training, encoded",
             "mlperf-flux1-schnell-256.yaml",
             ["parallel.strategy=ddp", "data.batch_size=16",
              f"model.components.transformer.overrides={{num_layers: {double}, num_single_layers: {single}}}",
              SHALLOW_T5, "train.gradient_checkpointing=auto"],
             encoded=True, family="flux"),
        Case("flux-dev-lora-fp8", "Flux.1-dev LoRA over an fp8 base", "flux-lora.yaml",
             [*flux_lora, "model.frozen_precision=fp8"], family="flux", **one_gpu),
        # Wan 2.1 at 480p x 81 frames (the release's 5 s at 16 fps), square at 480x832's area: SimpleTuner reports
        # about 1.4 s/step for the 1.3B LoRA and 7.2 s/step for the 14B one with checkpointing on an H100.
        Case("wan-1.3b-lora-480p-81", "Wan 2.1 T2V 1.3B LoRA rank 16, 624 px x 81 frames, batch 1, bf16, encoded",
             "wan-lora.yaml", [*wan, "model.preset=wan2.1-t2v-1.3b"], family="wan", **one_gpu),
        Case("wan-14b-lora-480p-81", "Wan 2.1 T2V 14B LoRA rank 16, 624 px x 81 frames, batch 1, bf16 base, "
             "checkpointing, encoded", "wan-lora.yaml", [*wan, "model.preset=wan2.1-t2v-14b"], encoded=True,
             family="wan", steps=3, warmup=1, timeout=240),
        # The tuned path (train.tuned) last: compiling a real UNet's blocks takes minutes of the budget, which the
        # families' cases come before. Goals on an H200: >= 70 img/s online, >= 150 encoded at >= 40% MFU.
        Case("sd2-512-encoded-tuned", "sd2-512-encoded on the tuned path (train.tuned: compiled blocks, channels_last "
             "if faster, cuDNN algorithm search)", "sd2-256.yaml", [*sd2, "train.tuned=true"], encoded=True,
             timeout=300, min_seconds=150, twin="sd2-512-encoded"),
        Case("sd2-512-online-tuned", "sd2-512-online on the tuned path", "sd2-256.yaml", [*sd2, "train.tuned=true"],
             timeout=240, min_seconds=90, twin="sd2-512-online"),
        Case("sd2-512-encoded-graphs", "sd2-512-encoded-tuned with CUDA graphs (train.cuda_graphs)", "sd2-256.yaml",
             [*sd2, "train.tuned=true", "train.cuda_graphs=true"], encoded=True, timeout=180, min_seconds=90,
             twin="sd2-512-encoded"),
    ]


def dry_cases() -> list[Case]:
    """The same cases at tiny sizes on the CPU: the script's every path, in seconds each; the tuned ones take the
    tuned path as it is on a CPU (no compilation there: minutes on a cold cache for steps about as fast;
    tests/test_train.py holds compiled blocks to eager ones) and are held to their eager twins' losses."""
    tiny = ["model.preset=tiny", "data.resolution=32", "data.batch_size=2", "data.num_workers=0",
            "train.mixed_precision=fp32", "train.gradient_checkpointing=false", "model.tokenizer_vocab_size=1024"]
    small = {"steps": 1, "warmup": 0, "timeout": 120, "flags": ["--no-save", "--peak-seconds", "0.1"]}
    cases = []
    for case in cuda_cases(80):
        family = case.family
        kept = [o for o in case.overrides if o.startswith(("model.frozen_precision", "model.pretrained", "ema.",
                                                           "data.aspect_buckets", "train.tuned", "train.cuda_graphs"))]
        overrides = [*kept, f"model.family={family}", *tiny,
                     *(["model.t5_text_length=8"] if family not in ("sd", "sdxl") else []),
                     *(["data.frames=5"] if family == "wan" else []),
                     *(["parallel.strategy=ddp"] if case.name == "flux-schnell-256" else [])]
        cases.append(Case(case.name, f"tiny stand-in for: {case.what}", case.config, overrides, case.encoded,
                          twin=case.twin, **small))
    return cases


# --------------------------------------------------------------------------------------------------- wheels


def download_wheels() -> int:
    """The CARRIED packages, at the versions installed here, as wheels for the CUDA image's Python."""
    WHEELS.mkdir(exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", WHEEL_PYTHON, "--dest", str(WHEELS), *pins]
    print("fetching", " ".join(pins))
    done = subprocess.run(command)
    if done.returncode == 0:
        size = sum(p.stat().st_size for p in WHEELS.glob("*.whl"))
        print(f"{len(list(WHEELS.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {WHEELS}")
    return done.returncode


def install_missing() -> list[str]:
    """Install the CARRIED packages this Python lacks from the carried wheels, without network."""
    missing = [name for name in CARRIED if importlib.util.find_spec(name) is None]
    if not missing:
        return []
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu-check: {', '.join(missing)} missing and no wheels in {WHEELS}; run `make gpu-wheels` "
                         "on a machine with network first and carry .gpu-wheels with the tree")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", *wheels],
                   check=True)
    return missing


# --------------------------------------------------------------------------------------------------- measuring


def device_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts |= {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                  "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda,
                  "capability": ".".join(map(str, torch.cuda.get_device_capability(0)))}
    else:
        facts |= {"device": "cpu", "memory_gib": None, "threads": torch.get_num_threads()}
    return facts


def matmul_peak_tflops(cuda: bool) -> float:
    """The bf16 matmul rate of this device: the best of several timed products of square matrices."""
    import torch

    side, repeats = (8192, 10) if cuda else (512, 3)
    device = "cuda" if cuda else "cpu"
    a = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    b = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / repeats)
    return 2 * side**3 / best / 1e12


def _env() -> dict[str, str]:
    """The children import sdtrain from this tree, installed or not; they write their output as it comes, and
    dump every thread's Python stack on SIGABRT, so a case stopped at its time limit says where it was."""
    paths = [str(ROOT / "src"), str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, paths))}


def _run_logged(command: list[str], log: Path, timeout: float,
                env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run `command` with its output going to `log`; past `timeout` seconds, stop it with SIGABRT (its stacks are
    dumped first), then kill it. The exit status (None when stopped) and the output's last 60 lines."""
    with log.open("w") as sink:
        child = subprocess.Popen(command, cwd=ROOT, env={**_env(), **(env or {})}, stdout=sink,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status: int | None = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
            os.killpg(child.pid, signal.SIGABRT)
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    # faulthandler ends its dump with a list of every extension module: one line of thousands of characters.
    lines = [line for line in log.read_text(errors="replace").strip().splitlines()
             if not line.startswith("Extension modules:")]
    return status, "\n".join(lines[-60:])


def pytest_runtest_logreport(report: Any) -> None:
    """pytest's hook, when the CUDA tests load this module as a plugin (-p gpu_check): each test's outcome is
    appended to the file GPU_CHECK_REPORTS names the moment it is known, so the tests finished before a time limit
    stopped the run keep their outcome and failure text."""
    path = os.environ.get("GPU_CHECK_REPORTS")
    if path and (report.failed or report.skipped or report.when == "call"):
        entry = {"test": report.nodeid.split("::")[-1], "when": report.when, "outcome": report.outcome,
                 "message": (report.longreprtext or "")[-3000:]}
        with open(path, "a") as sink:
            sink.write(json.dumps(entry) + "\n")


def run_tests(out: Path, timeout: int, select: str | None = None, name: str = "cuda-tests") -> dict[str, Any]:
    reports = out / f"{name}.jsonl"
    reports.unlink(missing_ok=True)
    # Each test gets a limit of its own (pytest-timeout, where installed): one that hangs is reported with its
    # stack and the rest still run.
    per_test = ["--timeout", "120"] if importlib.util.find_spec("pytest_timeout") else []
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", "-p", "gpu_check",
               *per_test, *(["-k", select] if select else []), "tests/test_cuda.py"]
    start = time.perf_counter()
    status, tail = _run_logged(command, out / f"{name}.log", timeout,
                               {"GPU_CHECK_REPORTS": str(reports), "NCCL_DEBUG": "WARN",
                                "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    result: dict[str, Any] = {"seconds": round(time.perf_counter() - start, 1), "passed": 0, "failed": 0,
                              "skipped": 0, "failures": [], "skip_reasons": []}
    outcomes: dict[str, dict[str, str]] = {}
    for line in reports.read_text().splitlines() if reports.is_file() else []:
        entry = json.loads(line)
        if outcomes.get(entry["test"], {}).get("outcome") != "failed":  # a failure in any phase is the test's
            outcomes[entry["test"]] = entry
    for name, entry in outcomes.items():
        if entry["outcome"] == "failed":
            result["failed"] += 1
            result["failures"].append({"test": name, "message": entry["message"]})
        elif entry["outcome"] == "skipped":
            result["skipped"] += 1
            reason = entry["message"].rsplit("Skipped: ", 1)[-1].strip(" ')\n")
            if reason not in result["skip_reasons"]:
                result["skip_reasons"].append(reason)
        else:
            result["passed"] += 1
    if status is None:
        result["error"] = f"stopped at its limit of {timeout} s, {len(outcomes)} tests done:\n{tail}"
    elif status not in (0, 1, 5):  # 1: some failed; 5: none selected
        result["error"] = f"pytest exit {status}:\n{tail}"
    return result


def run_case(case: Case, scratch: Path, seconds_left: float) -> dict[str, Any]:
    out = scratch / f"{case.name}.json"
    command = [sys.executable, "-m", "sdtrain", "benchmark", "train", str(CONFIGS / case.config), *case.overrides,
               f"run_dir={scratch / case.name}", "--steps", str(case.steps), "--warmup", str(case.warmup),
               "--out", str(out), *(["--encoded"] if case.encoded else []), *case.flags]
    record: dict[str, Any] = {"name": case.name, "what": case.what,
                              "command": " ".join(["sdtrain", *command[3:]]).replace(str(scratch), "SCRATCH")}
    timeout = int(min(case.timeout, seconds_left))
    if timeout < min(case.min_seconds, case.timeout):
        return {**record, "ok": False, "seconds": 0, "error": "not run: the time budget (--budget) was spent"}
    start = time.perf_counter()
    status, tail = _run_logged(command, scratch / f"{case.name}.log", timeout)
    failure = None if status == 0 and out.is_file() else \
        (f"timed out after {timeout} s" if status is None else f"exit {status}: {tail.splitlines()[-1:]}")
    record["log_tail"] = tail
    record["seconds"] = round(time.perf_counter() - start, 1)
    if failure is not None:
        if status is not None:  # a crash, not a time limit: once more with every launch synchronous
            record["blocking_rerun"] = _blocking_rerun(command, scratch / f"{case.name}-blocking.log",
                                                       min(timeout, seconds_left - (time.perf_counter() - start)))
        return {**record, "ok": False, "error": failure}
    result = json.loads(out.read_text())
    step_s = result["step_ms"] / 1000
    return {**record, "ok": True, "images_per_s": result["images_per_s"], "s_per_step": step_s,
            "mfu": result["mfu"], "batch_size": result["batch_size"], "resolution": result["resolution"],
            "mixed_precision": result["mixed_precision"], "gradient_checkpointing": result["gradient_checkpointing"],
            "trainable_parameters": result["trainable_parameters"],
            "attention_kernels": result.get("attention_kernels"),
            "device_peak_memory_gib": result.get("device_peak_memory_gib"),
            "host_peak_memory_gib": result["peak_memory_gib"], "benchmark": result}


TUNED_TOLERANCE = {"fp32": 1e-3, "bf16": 3e-2}
"""How far (relatively) a tuned case's loss at a step may be from its eager twin's at the same step: compiled kernels
fuse and reorder sums, channels_last and cuDNN's searched algorithms sum in other orders; bf16 rounds each of those
differences to 8 bits."""


def follows(tuned: dict[str, Any], eager: dict[str, Any]) -> dict[str, Any]:
    """Whether the tuned benchmark's losses, step by step, are its eager twin's within TUNED_TOLERANCE: as many steps,
    every loss finite (a NaN is what a broken kernel gives)."""
    mine, theirs = tuned.get("losses") or [], eager.get("losses") or []
    differences = [abs(t - e) / max(abs(e), 1e-12) for t, e in zip(mine, theirs)]
    worst = max(differences, default=float("inf"))
    finite = all(math.isfinite(value) for value in [*mine, *theirs, *differences])
    tolerance = TUNED_TOLERANCE[tuned["mixed_precision"]]
    return {"steps": len(differences), "max_relative_difference": worst if finite else float("nan"),
            "tolerance": tolerance, "ok": bool(mine) and len(mine) == len(theirs) and finite and worst <= tolerance}


def _blocking_rerun(command: list[str], log: Path, timeout: float) -> dict[str, Any]:
    """A crashed case run again with CUDA_LAUNCH_BLOCKING=1: the error is then raised by the call that launched the
    failing kernel, not by a later one; its traceback's last frame of torch or sdtrain code is recorded."""
    if timeout < 10:
        return {"error": "not run: the time budget (--budget) was spent"}
    status, tail = _run_logged(command, log, timeout, env={"CUDA_LAUNCH_BLOCKING": "1"})
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', tail)
    last = frames[-1] if frames else None
    return {"status": status, "log_tail": tail,
            "failing_call": f"{last[2]} ({Path(last[0]).name}:{last[1]}): {last[3]}" if last else None}


# --------------------------------------------------------------------------------------------------- report


def table(results: dict[str, Any]) -> str:
    lines = [f"gpu-check on {results['facts']['device']} (torch {results['facts']['torch']}), "
             f"{results['date']}, commit {results['commit']}: bf16 matmul peak "
             f"{results['matmul_peak_tflops']:.3g} TFLOP/s" + (" (dry run)" if results["dry_run"] else ""), ""]
    tests = results["tests"]
    lines.append(f"pytest -m cuda: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped "
                 f"({tests['seconds']} s)")
    lines += [f"- FAILED {f['test']}: {f['message'][:200]}" for f in tests["failures"]]
    if results.get("late_tests", {}).get("error"):
        lines.append(f"- late tests ({LATE_TESTS}): {results['late_tests']['error'].splitlines()[0]}")
    bisect = results.get("kernel_bisect")
    if bisect:
        lines += ["", "kernel bisect (benchmarks/flux_kernel_bisect.py):"]
        lines += [f"- {c.get('kind')} / {c.get('backend')}: " + ("ok" if c.get("ok") else f"FAILED {c.get('tail')}")
                  for c in bisect.get("cases", [])] or [f"- {bisect.get('error')}"]
    lines += ["", "| case | img/s | s/step | MFU | GPU peak GiB | host peak GiB | note |",
              "|---|---|---|---|---|---|---|"]
    for case in results["benchmarks"]:
        if case["ok"]:
            gpu = case["device_peak_memory_gib"]
            attention = ", ".join(case.get("attention_kernels") or []) or "math"
            follows = case.get("follows")
            losses = "" if follows is None else \
                (f"; losses {'follow' if follows['ok'] else 'DO NOT follow'} the eager twin's over {follows['steps']} "
                 f"steps ({follows['max_relative_difference']:.1e} apart at most, tolerance {follows['tolerance']:g})")
            lines.append(f"| {case['name']} | {case['images_per_s']:.3g} | {case['s_per_step']:.3g} | "
                         f"{case['mfu']:.1%} | {'-' if gpu is None else f'{gpu:.1f}'} | "
                         f"{case['host_peak_memory_gib']:.1f} | {case['what']}; attention: {attention}{losses} |")
        else:
            blocking = (case.get("blocking_rerun") or {}).get("failing_call")
            lines.append(f"| {case['name']} | - | - | - | - | - | FAILED: {case['error'].splitlines()[-1][:120]}"
                         f"{f'; with CUDA_LAUNCH_BLOCKING=1 in {blocking[:120]}' if blocking else ''} |")
    return "\n".join(lines)


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


# Compiling a real model's blocks takes inductor minutes on a cold cache: that test runs after the benchmark cases,
# with whatever time they leave, so a short lease still measures the table.
LATE_TESTS = "compiled"
# What a case's log says when a kernel broke rather than the step (a sticky CUDA error).
CUDA_FAULTS = ("illegal memory access", "CUBLAS_STATUS_EXECUTION_FAILED", "CUDA error")


def run_bisect(out: Path, seconds_left: float) -> dict[str, Any]:
    """benchmarks/flux_kernel_bisect.py, after a Flux case broke a kernel: attention in Flux's layout and one
    real-width block under each attention backend, each in its own process; one JSON line per case."""
    timeout = int(min(300, seconds_left))
    if timeout < 30:
        return {"ok": False, "error": "not run: the time budget (--budget) was spent"}
    command = [sys.executable, str(ROOT / "benchmarks" / "flux_kernel_bisect.py")]
    status, tail = _run_logged(command, out / "kernel-bisect.log", timeout)
    cases = [json.loads(line) for line in tail.splitlines() if line.startswith("{")]
    return {"ok": status == 0, "cases": cases, **({} if status == 0 else {"error": tail.splitlines()[-1:]})}


def check(out: Path, only: list[str], skip_tests: bool, budget: float, tests: str | None = None) -> dict[str, Any]:
    import torch

    deadline = time.perf_counter() + budget
    cuda = torch.cuda.is_available()
    if not cuda:
        print("no CUDA: dry run (the same steps at tiny sizes on the CPU)", flush=True)
    installed = install_missing() if cuda else []
    out.mkdir(parents=True, exist_ok=True)
    facts = device_facts()
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "commit": _commit(), "dry_run": not cuda, "facts": facts,
        "installed_from_wheels": installed, "matmul_peak_tflops": matmul_peak_tflops(cuda)}
    print(f"{facts['device']}: bf16 matmul {results['matmul_peak_tflops']:.1f} TFLOP/s", flush=True)
    results["tests"] = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "seconds": 0} if skip_tests else \
        run_tests(out, timeout=int(min(240 if cuda else 120, budget / 2)), select=tests or f"not {LATE_TESTS}")
    print(f"cuda tests: {results['tests']['passed']} passed, {results['tests']['failed']} failed, "
          f"{results['tests']['skipped']} skipped", flush=True)
    cases = cuda_cases(facts["memory_gib"]) if cuda else dry_cases()
    results["benchmarks"] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for case in cases:
            if only and case.name not in only:
                continue
            record = run_case(case, Path(scratch), deadline - time.perf_counter())
            twin = next((done for done in results["benchmarks"] if done["name"] == case.twin), None)
            if case.twin and record["ok"]:
                # A tuned case is checked against its twin or not passed: its speed alone says nothing.
                record["follows"] = follows(record["benchmark"], twin["benchmark"]) if twin and twin["ok"] else \
                    {"ok": False, "error": f"its eager twin {case.twin} did not run"}
                record["ok"] = record["follows"]["ok"]
                if not record["ok"]:
                    record["error"] = "losses do not follow the eager twin's" if twin and twin["ok"] else \
                        record["follows"]["error"]
            print(f"{case.name}: " + (f"{record['images_per_s']:.3g} img/s" if record["ok"] else "FAILED")
                  + f" ({record['seconds']} s)", flush=True)
            results["benchmarks"].append(record)
            (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")  # what is done survives a kill
    broken = [case["name"] for case in results["benchmarks"] if not case["ok"] and case["name"].startswith("flux")
              and any(fault in case.get("log_tail", "") for fault in CUDA_FAULTS)]
    if broken and cuda:
        print(f"{', '.join(broken)}: a CUDA kernel broke; bisecting it (benchmarks/flux_kernel_bisect.py)", flush=True)
        results["kernel_bisect"] = run_bisect(out, deadline - time.perf_counter())
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    if not skip_tests and tests is None:
        left = int(deadline - time.perf_counter())
        late = run_tests(out, timeout=left, select=LATE_TESTS, name="cuda-tests-late") if left >= 60 else \
            {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "seconds": 0,
             "error": f"not run: {left} s of the budget left"}
        print(f"late cuda tests ({LATE_TESTS}): {late['passed']} passed, {late['failed']} failed", flush=True)
        results["late_tests"] = late
        for key in ("passed", "failed", "skipped"):
            results["tests"][key] += late[key]
        results["tests"]["failures"] += late["failures"]
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=("check", "wheels"), default="check")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    parser.add_argument("--only", action="append", default=[], metavar="CASE", help="run only this benchmark case")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument("--tests", metavar="EXPR", help="run only the CUDA tests pytest's -k EXPR selects")
    parser.add_argument("--budget", type=float, default=540,
                        help="seconds for the whole check (default 540: under 10 minutes with a machine's start); the "
                             "CUDA tests get at most 240 of them, and benchmark cases that would start later are not "
                             "run")
    args = parser.parse_args(argv)
    if args.what == "wheels":
        return download_wheels()
    start = time.perf_counter()
    results = check(args.out, args.only, args.skip_tests, args.budget, args.tests)
    print(f"\n{table(results)}\n\n{time.perf_counter() - start:.0f} s in all; {args.out / 'results.json'}")
    failed = results["tests"]["failed"] or not all(case["ok"] for case in results["benchmarks"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
