"""Side-by-side training throughput and peak memory: sdtrain against diffusers' text-to-image example.

    .venv/bin/python benchmarks/peer.py --diffusers PATH/TO/diffusers --size tiny --steps 40 \
        --ema both --precision fp32,bf16 --out runs/bench-peer/results.json --work runs/bench-peer

PATH is a diffusers source checkout; only its ``examples/text_to_image/train_text_to_image.py`` is used,
run against the diffusers *installed* in this environment. Nothing of diffusers is copied here. See
benchmarks/README.md for what is measured and how.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STEPCLOCK = HERE / "stepclock.py"
STANDIN = HERE / "torchvision_standin"
EXAMPLE = Path("examples") / "text_to_image" / "train_text_to_image.py"

# Per size: where the architecture comes from (sdtrain's own configs, read with its config loader) and
# the default batch. tiny = the demo's stage-2 setting (tiny UNet and text encoder, the demo's 8x
# autoencoder architecture, 64 px, 16-token captions); sd2 = configs/sd2-256.yaml (the real SD2-base
# UNet and SD VAE at 256 px).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"config": "configs/demo/diffusion.yaml", "vae_config": "configs/demo/autoencoder.yaml", "batch": 32},
    "sd2": {"config": "configs/sd2-256.yaml", "vae_config": None, "batch": 2},
}
SDTRAIN_MODES = ("online", "encoded")


def log(msg: str) -> None:
    print(f"[bench-peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- assets


def size_settings(size: str, sd2_text_layers: int | None) -> dict[str, Any]:
    """Architecture and data settings of a size, read from sdtrain's configs with sdtrain's loader."""
    from sdtrain.config import load_config

    spec = SIZES[size]
    dummy = ["run_dir=unused", "data.shards=unused", "model.components.vae.source=unused"]
    cfg = load_config(REPO / spec["config"], dummy)
    vae_model = load_config(REPO / spec["vae_config"], dummy).model if spec["vae_config"] else cfg.model
    text_overrides = cfg.model.overrides("text_encoder")
    if size == "sd2" and sd2_text_layers:
        text_overrides["num_hidden_layers"] = sd2_text_layers
    return {
        "preset": cfg.model.preset,
        "vae_preset": vae_model.preset,
        "vae_overrides": vae_model.overrides("vae"),
        "unet_overrides": cfg.model.overrides("unet"),
        "text_encoder_overrides": text_overrides,
        "vocab_size": cfg.model.tokenizer_vocab_size,
        "max_text_length": cfg.model.max_text_length or 77,
        "resolution": cfg.data.resolution,
        "prediction_type": cfg.diffusion.ddpm.prediction_type or "epsilon",
    }


def build_assets(size: str, work: Path, num_images: int, settings: dict[str, Any]) -> None:
    """The image folder (PNG + metadata.jsonl) and a random-weight pipeline folder, built with sdtrain's
    own functions. Runs in a child process (``peer.py _build``) so the harness stays small."""
    import numpy as np
    import torch

    from sdtrain.config import ComponentConfig, DdpmConfig, DiffusionConfig, ModelConfig
    from sdtrain.data.shapes import render_shapes_sample
    from sdtrain.models import families
    from sdtrain.models.build import build_noise_scheduler, build_text_encoder, build_unet, build_vae
    from sdtrain.models.pipeline import assemble_pipeline
    from sdtrain.models.tokenizer import train_clip_tokenizer

    res = settings["resolution"]
    images = work / "images"
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir(parents=True)
    captions = []
    with open(images / "metadata.jsonl", "w") as meta:
        for i in range(num_images):
            # The same per-sample generator as sdtrain's shapes dataset (sdtrain prepare shapes).
            rng = np.random.Generator(np.random.PCG64([0, i]))
            image, caption, _ = render_shapes_sample(rng, res, 2 if rng.random() < 0.5 else 1)
            name = f"{i:08d}.png"
            image.save(images / name)
            meta.write(json.dumps({"file_name": name, "text": caption}) + "\n")
            captions.append(caption)

    torch.manual_seed(0)
    tokenizer = train_clip_tokenizer(captions, work / "tokenizer", vocab_size=settings["vocab_size"],
                                     max_length=settings["max_text_length"])
    model = ModelConfig(preset=settings["preset"], components={
        "text_encoder": ComponentConfig(overrides=settings["text_encoder_overrides"]),
        "unet": ComponentConfig(overrides=settings["unet_overrides"])})
    vae = build_vae(ModelConfig(preset=settings["vae_preset"],
                                components={"vae": ComponentConfig(overrides=settings["vae_overrides"])}))
    text_encoder = build_text_encoder(model, tokenizer)
    latent = res // families.SD.codec.downsampling(vae.config)
    unet = build_unet(model, vae.config.latent_channels, latent, text_encoder.config.hidden_size)
    scheduler = build_noise_scheduler(DiffusionConfig(ddpm=DdpmConfig(prediction_type=settings["prediction_type"])))
    pipe = assemble_pipeline(vae, text_encoder, tokenizer, unet, scheduler)
    out = work / "pipeline"
    shutil.rmtree(out, ignore_errors=True)
    pipe.save_pretrained(out)
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in
              (("unet", unet), ("vae", vae), ("text_encoder", text_encoder))}
    print(json.dumps({"parameters": counts, "latent_size": latent,
                      "text_hidden_size": text_encoder.config.hidden_size,
                      "text_layers": text_encoder.config.num_hidden_layers}))


def ensure_assets(args: argparse.Namespace, size: str, work: Path, env: dict[str, str]) -> dict[str, Any]:
    settings = size_settings(size, args.sd2_text_layers)
    # One image per sample trained on (capped), so neither tool starts a second epoch in a short run.
    num_images = max(16, 2 * batch_of(args, size), min(args.max_images, args.steps * batch_of(args, size)))
    key = {"settings": settings, "num_images": num_images, "version": 1}
    return built_once(Path(__file__), work, key, [size, str(work), str(num_images), json.dumps(settings)], env, size,
                      f"a random-weight pipeline and {num_images} images at {settings['resolution']} px")


def built_once(script: Path, work: Path, key: dict[str, Any], build_args: list[str], env: dict[str, str],
               label: str, what: str, stale_files: tuple[str, ...] = ()) -> dict[str, Any]:
    """The assets `key` describes, in `work`: reused when its assets.json records that key, else built by
    `script _build BUILD_ARGS` in a child process (whose last stdout line is a JSON of facts about them), after
    removing what older assets made (the shards, the encoded shards, `stale_files`)."""
    stamp = work / "assets.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        log(f"{label}: reusing the assets in {work}")
        return json.loads(stamp.read_text())
    for stale in ("shards", "encoded"):
        shutil.rmtree(work / stale, ignore_errors=True)
    for name in stale_files:
        (work / name).unlink(missing_ok=True)
    stamp.unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log(f"{label}: building {what}")
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(script.resolve()), "_build", *build_args], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"building the {label} assets failed")
    info = {"key": key, **json.loads(proc.stdout.strip().splitlines()[-1]), "build_s": round(time.time() - t0, 1)}
    stamp.write_text(json.dumps(info, indent=1))
    return info


def batch_of(args: argparse.Namespace, size: str) -> int:
    return args.batch or SIZES[size]["batch"]


# ------------------------------------------------------------------------------------------ measuring


def read_mem_available_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def run_measured(name: str, cmd: list[str], env: dict[str, str], logfile: Path, clock: Path | None,
                 total: int, timeout: float | None, phases: bool = False) -> dict[str, Any]:
    """Run ``cmd`` as a fresh child; return its exit code, wall time and two peaks.

    - peak_gib: from ``os.wait4`` on that child: Linux reports the largest resident set of the child and
      of the descendants it waited for (accelerate's launcher waits for the training process), so it is
      per run, unlike RUSAGE_CHILDREN. The largest single process: loader workers are not added.
    - tree_peak_gib: the whole process tree (launcher, trainer, loader workers, fork server) sampled
      while it runs by sdtrain's ``memory.TreePeak``, each page counted once: what the machine sees.
    - with ``phases`` (and a ``clock``), also the tree peak split at the moment the clock is seen to hold all
      ``total`` steps (polled every 0.5 s): train_tree_peak_gib (start, loading and every step) and
      end_tree_peak_gib (what runs after the last step: final save, export, a reload of the pipeline).
    """
    if clock is not None:
        clock.unlink(missing_ok=True)
    logfile.parent.mkdir(parents=True, exist_ok=True)
    log(f"{name}: {' '.join(cmd)}")
    log(f"{name}: log {logfile}; MemAvailable {read_mem_available_gib():.1f} GiB")
    load_before = os.getloadavg()[0]
    t0 = time.time()
    from sdtrain.memory import TreePeak

    with open(logfile, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        tree = TreePeak(proc.pid, interval=0.25).__enter__()
        last_report = t0
        status, usage = 0, None
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if phases and clock is not None and tree.peaks.get("end") is None and clock.exists() \
                        and len(clock.read_text().splitlines()) >= total:
                    tree.phase("end")
                now = time.time()
                if timeout and now - t0 > timeout:
                    log(f"{name}: timeout after {timeout:.0f} s, killing process group {proc.pid}")
                    os.killpg(proc.pid, signal.SIGKILL)
                if now - last_report > 60:
                    done = len(clock.read_text().splitlines()) if clock is not None and clock.exists() else 0
                    log(f"{name}: {now - t0:.0f} s, {done}/{total} steps")
                    last_report = now
                time.sleep(0.5)
        except BaseException:
            # The child has its own session (so a terminal's Ctrl-C does not reach it): end it here.
            os.killpg(proc.pid, signal.SIGKILL)
            os.waitpid(proc.pid, 0)
            raise
        finally:
            tree.stop()
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - t0
    result = {"returncode": proc.returncode, "wall_s": round(wall, 2), "start_time": t0,
              "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "cpu_user_s": round(usage.ru_utime, 1), "cpu_system_s": round(usage.ru_stime, 1),
              "peak_gib": round(usage.ru_maxrss / 2**20, 3), "tree_peak_gib": round(tree.peak() / 2**30, 3),
              "log": str(logfile)}
    if phases:
        train = max((v for k, v in tree.peaks.items() if k != "end"), default=0)
        result["train_tree_peak_gib"] = round(train / 2**30, 3)
        result["end_tree_peak_gib"] = round(tree.peaks["end"] / 2**30, 3) if "end" in tree.peaks else None
    if proc.returncode != 0:
        tail = logfile.read_text(errors="replace").splitlines()[-15:]
        log(f"{name}: FAILED with exit code {proc.returncode}; last lines of {logfile}:\n    " + "\n    ".join(tail))
    return result


def steady_rate(clock: Path, batch: int, skip: int, start_time: float) -> dict[str, Any]:
    """Throughput over the steps after the first ``skip``, from the step ends t_k that stepclock.py records.

    - img_per_s: batch x (N - skip) / (t_N - t_skip), the steady-state mean;
    - img_per_s_median: batch / median step time over those steps, which a stall caused by other load on
      the machine moves less;
    - cpu_ms_per_img: CPU time of the training process (all its threads, not loader workers) per image
      over those steps.
    The first steps (optimizer state, first touch of memory, loader start-up) and everything after the
    last step (final save, export) are excluded."""
    ends: dict[int, tuple[float, float]] = {}
    if clock.exists():
        for line in clock.read_text().splitlines():
            t, n, cpu = line.split()
            ends[int(n)] = (float(t), float(cpu))
    if not ends:
        return {"steps_timed": 0}
    n_last = max(ends)
    skip = min(skip, n_last - 1)
    out: dict[str, Any] = {"steps_done": n_last}
    if 1 in ends:
        out["first_step_s"] = round(ends[1][0] - start_time, 2)
    if skip < 1 or skip not in ends:
        out["steps_timed"] = 0
        return out
    steps = [ends[k][0] - ends[k - 1][0] for k in range(skip + 1, n_last + 1) if k in ends and k - 1 in ends]
    span = ends[n_last][0] - ends[skip][0]
    images = batch * (n_last - skip)
    out.update(steps_timed=n_last - skip, skipped=skip, timed_s=round(span, 3),
               img_per_s=round(images / span, 4),
               step_times_s=[round(s, 4) for s in steps],
               cpu_ms_per_img=round(1000 * (ends[n_last][1] - ends[skip][1]) / images, 3))
    if steps:
        out["median_step_s"] = round(statistics.median(steps), 4)
        out["img_per_s_median"] = round(batch / statistics.median(steps), 4)
    return out


# ------------------------------------------------------------------------------------------------ runs


def accelerate_launch(threads: int, mixed_precision: str) -> list[str]:
    """``accelerate launch`` on the CPU, one process, ``mixed_precision`` (no, bf16), with stepclock.py as the
    script it runs: the example's path and arguments follow."""
    launcher = Path(sys.executable).with_name("accelerate")
    launch = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
    return [*launch, "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision",
            mixed_precision, "--dynamo_backend", "no", "--num_cpu_threads_per_process", str(threads), str(STEPCLOCK)]


def peer_command(args: argparse.Namespace, size: str, work: Path, run_dir: Path, ema: bool, precision: str,
                 resolution: int) -> list[str]:
    mp = {"fp32": "no", "bf16": "bf16"}[precision]
    cmd = [*accelerate_launch(args.threads, mp),
           str(Path(args.diffusers).resolve() / EXAMPLE),
           "--pretrained_model_name_or_path", str(work / "pipeline"),
           "--train_data_dir", str(work / "images"),
           "--cache_dir", str(work / "hf-datasets-cache"),
           "--resolution", str(resolution), "--center_crop", "--image_interpolation_mode", "bicubic",
           "--train_batch_size", str(batch_of(args, size)), "--max_train_steps", str(args.steps),
           "--learning_rate", "1e-4", "--lr_scheduler", "constant", "--lr_warmup_steps", "0",
           "--max_grad_norm", "1.0", "--dataloader_num_workers", str(args.workers),
           "--mixed_precision", mp, "--seed", "0", "--checkpointing_steps", str(10**9),
           "--output_dir", str(run_dir)]
    if ema:
        cmd.append("--use_ema")
    return cmd


_PRECISION_VALUE: dict[str, str] = {}


def sdtrain_precision(config_path: Path, precision: str) -> str:
    """The value sdtrain's config accepts for ``precision``: fp32 is tried as ``fp32`` first, then ``no``."""
    if precision == "bf16":
        return "bf16"
    if "fp32" not in _PRECISION_VALUE:
        from sdtrain.config import load_config
        from sdtrain.errors import UserError

        try:
            load_config(config_path, ["train.mixed_precision=fp32"])
            _PRECISION_VALUE["fp32"] = "fp32"
        except UserError:
            _PRECISION_VALUE["fp32"] = "no"
        log(f"sdtrain takes train.mixed_precision={_PRECISION_VALUE['fp32']} for fp32")
    return _PRECISION_VALUE["fp32"]


def sdtrain_config(args: argparse.Namespace, size: str, work: Path, run_dir: Path, ema: bool, precision: str,
                   mode: str, settings: dict[str, Any]) -> Path:
    """A diffusion-stage config matching the peer's run: the same pipeline, data, batch, steps, optimizer
    settings (AdamW 1e-4, betas 0.9/0.999, wd 0.01, clip 1.0, constant LR, no warmup), frozen text encoder,
    no caption dropout, no min-SNR, posterior samples, EMA decay 0.9999 (the example's), one checkpoint at
    the end, metrics only at the last step, no TensorBoard."""
    import yaml

    config = {
        "stage": "diffusion",
        "run_dir": str(run_dir),
        "seed": 0,
        "data": {"shards": str(work / ("encoded" if mode == "encoded" else "shards")),
                 "resolution": settings["resolution"], "batch_size": batch_of(args, size),
                 "num_workers": args.workers, "caption_dropout": 0.0, "center_crop": True, "random_flip": False,
                 "use_encoded": mode == "encoded"},
        "model": {"preset": settings["preset"], "pretrained": str(work / "pipeline"),
                  "max_text_length": settings["max_text_length"]},
        "diffusion": {"train_text_encoder": False, "ddpm": {"snr_gamma": 0.0}, "sample_latents": True},
        "optim": {"lr": 1.0e-4, "betas": [0.9, 0.999], "weight_decay": 0.01, "eps": 1.0e-8, "warmup_steps": 0,
                  "schedule": "constant", "grad_clip": 1.0},
        "ema": {"enabled": ema, "decay": 0.9999},
        "train": {"max_steps": args.steps, "grad_accum": 1, "gradient_checkpointing": False, "device": "cpu"},
        "checkpoint": {"every": 0, "keep_last": 1},
        "logging": {"every": args.steps, "progress": True, "tensorboard": False},
    }
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    config["train"]["mixed_precision"] = sdtrain_precision(path, precision)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    from sdtrain.config import load_config

    load_config(path)  # fail here, with sdtrain's own message, rather than in the child
    return path


def benchmark_reported(report: Path) -> dict[str, Any]:
    """What `sdtrain benchmark train` reported: its img/s (median step) and the peaks it measured itself."""
    if not report.is_file():
        return {"steps_timed": 0}
    result = json.loads(report.read_text())
    return {"img_per_s": round(result["images_per_s"], 4), "img_per_s_median": round(result["images_per_s"], 4),
            "steps_timed": result["steps_timed"], "first_step_s": round(result["first_step_ms"] / 1000, 2),
            "reported_peak_gib": round(result["peak_memory_gib"], 3),
            "reported_loading_peak_gib": round(result["loading_peak_memory_gib"], 3),
            "reported_save_peak_gib": round(result.get("save_peak_memory_gib", 0), 3),
            "reported_mixed_precision": result["mixed_precision"]}


def sdtrain_reported(run_dir: Path) -> float | None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return round(lines[-1]["img_per_s"], 4) if lines and "img_per_s" in lines[-1] else None


def prepare_sdtrain_data(work: Path, settings: dict[str, Any], env: dict[str, str], need_encoded: bool,
                         logs: Path) -> dict[str, Any]:
    info: dict[str, Any] = {}
    stamp = work / "sdtrain-data.json"
    if stamp.is_file():
        info = json.loads(stamp.read_text())
    sdtrain = [sys.executable, "-m", "sdtrain"]
    if not (work / "shards" / "manifest.json").is_file():
        res = run_measured("sdtrain prepare folder", [*sdtrain, "prepare", "folder", str(work / "images"), "--out",
                                                      str(work / "shards")], env, logs / "prepare-folder.log",
                           None, 0, None)
        if res["returncode"] != 0:
            raise SystemExit("sdtrain prepare folder failed")
        info["prepare_folder_s"] = res["wall_s"]
    if need_encoded and not (work / "encoded" / "manifest.json").is_file():
        res = run_measured("sdtrain prepare encode", [*sdtrain, "prepare", "encode", str(work / "shards"), "--model",
                                                      str(work / "pipeline"), "--out", str(work / "encoded"),
                                                      "--resolution", str(settings["resolution"]), "--device", "cpu"],
                           env, logs / "prepare-encode.log", None, 0, None)
        if res["returncode"] != 0:
            raise SystemExit("sdtrain prepare encode failed")
        info["prepare_encode_s"] = res["wall_s"]
        info["prepare_encode_peak_gib"] = res["peak_gib"]
    stamp.write_text(json.dumps(info, indent=1))
    return info


# ------------------------------------------------------------------------------------------ reporting


# The leading columns of print_table: (header, row field, how its value is shown); rows with equal values in
# them form a group, whose sdtrain rows are compared with its peer row.
GROUP_COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("size", "size", str), ("ema", "ema", lambda v: "on" if v else "off"), ("precision", "precision", str),
    ("workers", "workers", lambda v: "" if v is None else str(v))]


def print_table(rows: list[dict[str, Any]], group: list[tuple[str, str, Callable[[Any], str]]] | None = None,
                peer_of: Callable[[dict[str, Any]], str | None] | None = None,
                extra: list[tuple[str, str]] | None = None) -> None:
    """The runs as a table. `group`: the leading columns (GROUP_COLUMNS by default); `peer_of(row)`: the tool
    name of the peer run a row's ratio is taken against in its group, None for a peer row (default: every row
    but ``peer`` against ``peer``; another name is shown beside the ratio); `extra`: (header, field) columns of
    GiB figures added after the peaks."""
    group = GROUP_COLUMNS if group is None else group
    extra = extra or []
    if peer_of is None:
        def peer_of(r: dict[str, Any]) -> str | None:
            return None if r["tool"] == "peer" else "peer"
    head = [h for h, _, _ in group] + ["tool", "img/s", "img/s (median step)", "CPU ms/img", "first step s",
                                       "peak GiB", "tree peak GiB", *(h for h, _ in extra), "reported peak GiB",
                                       "sdtrain/peer (img/s, median)"]

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(r.get(field) for _, field, _ in group)

    peers = {(key(r), r["tool"]): r for r in rows if peer_of(r) is None}

    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else ""

    table = []
    for r in rows:
        peer_tool = peer_of(r)
        peer = peers.get((key(r), peer_tool)) if peer_tool is not None else None
        ratio = ""
        if peer and r.get("img_per_s") and peer.get("img_per_s"):
            ratio = f"{r['img_per_s'] / peer['img_per_s']:.2f}"
            if r.get("img_per_s_median") and peer.get("img_per_s_median"):
                ratio += f", {r['img_per_s_median'] / peer['img_per_s_median']:.2f}"
            if peer_tool != "peer":
                ratio += f" (vs {peer_tool})"
        rate = num(r.get("img_per_s"), ".3f") or ("FAILED" if r["returncode"] else "n/a")
        table.append([fmt(r.get(field)) for _, field, fmt in group] + [
                      r["tool"], rate,
                      num(r.get("img_per_s_median"), ".3f"), num(r.get("cpu_ms_per_img"), ".1f"),
                      num(r.get("first_step_s"), ".1f"), num(r["peak_gib"], ".2f"),
                      num(r.get("tree_peak_gib"), ".2f"), *(num(r.get(field), ".2f") for _, field in extra),
                      num(r.get("reported_peak_gib"), ".2f"), ratio])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths))
    print(line)
    print("-" * len(line))
    for row in table:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


# ------------------------------------------------------------------------------------------------ main


def check_peer_imports(diffusers_path: Path, examples: tuple[Path, ...] = (EXAMPLE,),
                       modules: tuple[str, ...] = ("accelerate", "datasets", "diffusers", "transformers")) -> bool:
    """The peer needs accelerate and datasets (or the given `modules`) in this environment; torchvision gets a
    stand-in. Returns whether it needs the stand-in."""
    for relative in examples:
        if not (diffusers_path / relative).is_file():
            raise SystemExit(f"--diffusers {diffusers_path}: no {relative} there; pass a diffusers source checkout")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"the diffusers example needs {', '.join(missing)} in this environment; install with:\n"
              f"  {Path(sys.executable).with_name('pip')} install {' '.join(missing)}", file=sys.stderr)
        raise SystemExit(2)
    real_torchvision = False
    if importlib.util.find_spec("torchvision") is not None:
        probe = subprocess.run([sys.executable, "-c", "import torchvision.transforms"], capture_output=True)
        real_torchvision = probe.returncode == 0
    return not real_torchvision


def tool_environments(threads: int, use_standin: bool) -> tuple[dict[str, str], dict[str, str]]:
    """The environment of sdtrain's runs and of the peer's: this one with the thread counts and offline
    switches set, the peer's with the torchvision stand-in first on its PYTHONPATH when `use_standin`."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", HF_HUB_DISABLE_TELEMETRY="1", WANDB_MODE="disabled")
    env.pop("PYTHONPATH", None)
    peer_env = dict(env)
    if use_standin:
        peer_env["PYTHONPATH"] = str(STANDIN)
    return env, peer_env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--diffusers", type=Path, required=True,
                   help="a diffusers source checkout (with examples/text_to_image/train_text_to_image.py)")
    p.add_argument("--size", default="tiny", help="tiny, sd2, or both (comma list); default tiny")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    p.add_argument("--skip", type=int, default=None,
                   help="first steps left out of the timing (default: a fifth of --steps, 1 to 5)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: tiny 32, sd2 2)")
    p.add_argument("--ema", choices=("both", "on", "off"), default="both")
    p.add_argument("--precision", default="fp32", help="fp32, bf16, or both (comma list); default fp32")
    p.add_argument("--sdtrain-modes", default="online,encoded",
                   help="sdtrain runs: online (images, VAE and text encoder every step) and/or encoded "
                        "(shards from sdtrain prepare encode); default both")
    p.add_argument("--workers", default="1",
                   help="data loader workers for both tools; a comma list runs each count (default 1)")
    p.add_argument("--benchmark", action="store_true",
                   help="after each sdtrain run, `sdtrain benchmark train` on the same config (and --encoded for "
                        "the encoded mode), to compare what it reports with the run")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")),
                   help="OMP_NUM_THREADS for both tools (default: $OMP_NUM_THREADS or 2)")
    p.add_argument("--sd2-text-layers", type=int, default=None,
                   help="layers of the sd2 size's CLIP text encoder (default: the preset's 23, hidden size 1024)")
    p.add_argument("--max-images", type=int, default=4096, help="images in the folder at most (default 4096)")
    p.add_argument("--timeout", type=float, default=None, help="seconds after which a run is killed")
    p.add_argument("--keep-outputs", action="store_true", help="keep each run's checkpoints and saved pipelines")
    p.add_argument("--out", type=Path, default=Path("runs/bench-peer/results.json"), help="results JSON")
    p.add_argument("--work", type=Path, default=Path("runs/bench-peer"), help="work folder (assets, runs, logs)")
    args = p.parse_args(argv)
    sizes = ["tiny", "sd2"] if args.size == "both" else args.size.split(",")
    precisions = ["fp32", "bf16"] if args.precision == "both" else args.precision.split(",")
    modes = args.sdtrain_modes.split(",") if args.sdtrain_modes else []
    for value, allowed, flag in ((sizes, SIZES, "--size"), (precisions, ("fp32", "bf16"), "--precision"),
                                 (modes, SDTRAIN_MODES, "--sdtrain-modes")):
        bad = [v for v in value if v not in allowed]
        if bad:
            p.error(f"{flag}: {', '.join(bad)} not one of {', '.join(allowed)}")
    if args.steps < 2:
        p.error("--steps: at least 2 (the first step is never timed)")
    try:
        args.worker_counts = [int(w) for w in str(args.workers).split(",")]
    except ValueError:
        p.error(f"--workers {args.workers}: expected counts such as 0,1,2")
    args.sizes, args.precisions, args.modes = sizes, precisions, modes
    args.emas = {"both": [False, True], "on": [True], "off": [False]}[args.ema]
    if args.skip is None:
        args.skip = max(1, min(5, args.steps // 5))
    return args


TIMING = ("images/s = batch x (steps - skip) / (end of last step - end of step `skip`), from the wall time each "
          "tool's per-step progress-bar update was called (benchmarks/stepclock.py); img_per_s_median = batch / "
          "median step time over the same steps; cpu_ms_per_img = CPU time of the training process over those "
          "steps per image; peak = ru_maxrss of the run's process tree from os.wait4 (the largest single process, "
          "loader workers not added); tree peak = every process of the run sampled every 0.25 s, each page "
          "counted once (sdtrain.memory.TreePeak)")


def results_header(args: argparse.Namespace, env: dict[str, str], use_standin: bool, workers: Any,
                   timing: str) -> dict[str, Any]:
    """What a results JSON says about how it was measured: the command, both diffusers (the scripts' checkout,
    the installed package they run against), torchvision, the allocator and thread settings, steps and timing."""
    import diffusers

    return {
        "command": [sys.executable, *sys.argv],
        "diffusers_checkout": str(args.diffusers.resolve()),
        "diffusers_installed": diffusers.__version__,
        "torchvision": "stand-in" if use_standin else "real",
        "environment": {k: v for k, v in env.items() if k.startswith(("THP_", "MALLOC_", "OMP_", "MKL_", "KMP_"))},
        "steps": args.steps, "skip": args.skip, "workers": workers,
        "timing": timing,
    }


def saver(out: Path, results: dict[str, Any]) -> Callable[[], None]:
    """A function writing `results` to `out` (made absolute, its folder created) as it stands when called."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(results, indent=1) + "\n")

    return save


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_standin = check_peer_imports(args.diffusers)
    work_root = args.work.resolve()
    work_root.mkdir(parents=True, exist_ok=True)

    env, peer_env = tool_environments(args.threads, use_standin)
    if use_standin:
        log(f"torchvision is not importable here: the diffusers example gets the stand-in {STANDIN}/torchvision "
            "(Compose, Resize, CenterCrop, RandomCrop, RandomHorizontalFlip, Lambda, ToTensor, Normalize, "
            "InterpolationMode) first on its PYTHONPATH; sdtrain runs without it")
    import diffusers

    log(f"peer: {args.diffusers / EXAMPLE} against the installed diffusers {diffusers.__version__} "
        f"({Path(diffusers.__file__).parent})")

    results: dict[str, Any] = {
        **results_header(args, env, use_standin, args.worker_counts, TIMING),
        "sizes": {}, "runs": [],
    }
    save = saver(args.out, results)

    for size in args.sizes:
        work = work_root / size
        logs = work / "logs"
        assets = ensure_assets(args, size, work, env)
        settings = assets["key"]["settings"]
        res = settings["resolution"]
        batch = batch_of(args, size)
        results["sizes"][size] = {"assets": assets, "batch": batch, "resolution": res}
        log(f"{size}: UNet {assets['parameters']['unet'] / 1e6:.1f}M, VAE {assets['parameters']['vae'] / 1e6:.1f}M, "
            f"text encoder {assets['parameters']['text_encoder'] / 1e6:.1f}M (hidden "
            f"{assets['text_hidden_size']}, {assets['text_layers']} layers) at {res} px, batch {batch}")
        if args.modes:
            results["sizes"][size]["sdtrain_data"] = prepare_sdtrain_data(work, settings, env, "encoded" in args.modes,
                                                                          logs)
        save()
        for workers, precision, ema in itertools.product(args.worker_counts, args.precisions, args.emas):
            variant = argparse.Namespace(**{**vars(args), "workers": workers})
            runs = [("peer", None)] + [(f"sdtrain-{m}", m) for m in args.modes]
            if args.benchmark:
                runs += [(f"benchmark-{m}", m) for m in args.modes]
            for tool, mode in runs:
                name = f"{tool}-ema{'on' if ema else 'off'}-{precision}-w{workers}"
                run_dir = work / "runs" / name
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                clock = work / "runs" / f"{name}.clock"
                report = None
                if mode is None:
                    cmd = peer_command(variant, size, work, run_dir, ema, precision, res)
                    run_env, desc = peer_env, "Steps"
                else:
                    cfg = sdtrain_config(variant, size, work, run_dir, ema, precision, mode, settings)
                    cmd = [sys.executable, str(STEPCLOCK), "-m", "sdtrain", "train", str(cfg)]
                    run_env, desc = env, "train"
                    if tool.startswith("benchmark"):
                        report = run_dir.with_suffix(".json")
                        cmd = [sys.executable, "-m", "sdtrain", "benchmark", "train", str(cfg), f"run_dir={run_dir}",
                               "--steps", str(args.steps - args.skip), "--warmup", str(args.skip),
                               "--peak-seconds", "0.5", "--out", str(report),
                               *(["--encoded"] if mode == "encoded" else [])]
                run_env = {**run_env, "STEPCLOCK_FILE": str(clock), "STEPCLOCK_TOTAL": str(args.steps),
                           "STEPCLOCK_DESC": desc}
                measured = run_measured(f"{size} {name}", cmd, run_env, logs / f"{name}.log", clock,
                                        args.steps, args.timeout)
                row = {"size": size, "ema": ema, "precision": precision, "workers": workers, "tool": tool,
                       "batch": batch, "resolution": res, **measured}
                if report is not None:
                    row |= benchmark_reported(report)
                else:
                    row |= steady_rate(clock, batch, args.skip, measured["start_time"])
                if mode is not None and report is None:
                    row["sdtrain_metrics_img_per_s"] = sdtrain_reported(run_dir)
                    row["sdtrain_mixed_precision"] = sdtrain_precision(run_dir.with_suffix(".yaml"), precision)
                row["command"] = cmd
                results["runs"].append(row)
                save()
                log(f"{size} {name}: {row.get('img_per_s', 'n/a')} img/s ({row.get('img_per_s_median', 'n/a')} "
                    f"from the median step) over {row.get('steps_timed', 0)} steps, "
                    f"peak {row['peak_gib']:.2f} GiB (tree {row['tree_peak_gib']:.2f}), wall {row['wall_s']:.0f} s")
                if not args.keep_outputs:
                    shutil.rmtree(run_dir, ignore_errors=True)
    print()
    print_table(results["runs"])
    print(f"\nresults: {args.out.resolve()}")
    return 0 if all(r["returncode"] == 0 for r in results["runs"]) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_build":
        build_assets(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        sys.exit(main())
