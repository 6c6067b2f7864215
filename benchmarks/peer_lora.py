"""Side-by-side LoRA training throughput and peak memory: sdtrain against diffusers' DreamBooth LoRA scripts.

    .venv/bin/python benchmarks/peer_lora.py --diffusers PATH/TO/diffusers --family flux,sdxl --size tiny \
        --steps 20 --out runs/bench-peer-lora/results.json --work runs/bench-peer-lora

PATH is a diffusers source checkout; only its ``examples/dreambooth/train_dreambooth_lora_flux.py`` (Flux.1) and
``examples/dreambooth/train_dreambooth_lora_sdxl.py`` (SDXL) are used, run where they lie against the diffusers
*installed* in this environment. Nothing of diffusers is copied here. The measuring (stepclock.py, the process
tree's peaks, the table and the JSON) is benchmarks/peer.py's, imported. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import peer  # noqa: E402 - benchmarks/peer.py, beside this file

REPO = peer.REPO
STEPCLOCK = peer.STEPCLOCK
EXAMPLES = {
    "flux": Path("examples") / "dreambooth" / "train_dreambooth_lora_flux.py",
    "sdxl": Path("examples") / "dreambooth" / "train_dreambooth_lora_sdxl.py",
}
# sdtrain's curated LoRA recipe of each family, the base of every sdtrain run's config.
RECIPES = {"flux": REPO / "configs" / "flux-lora.yaml", "sdxl": REPO / "configs" / "sdxl-lora.yaml"}
INSTANCE_PROMPT = "a photo of sks shapes"
RANK = 16

# Per family and size: the sdtrain preset the pipeline is built from, the overrides of its parts, the image side,
# the default batch, the T5 length (Flux) and the BPE vocabulary of the CLIP tokenizer.
# - tiny: the presets the tests train (tests' tiny widths), 64 px, T5 32 tokens.
# - partial: the released widths with few blocks. Flux: Flux.1-dev's transformer (3072 wide, 24 heads of 128,
#   guidance embedding) with 1 double and 2 single blocks (687.1M), Flux's VAE, CLIP-L's width with 2 layers, a
#   T5 of T5-XXL's width (4096, d_ff 10240, 64 heads) with 1 layer, 512 T5 tokens (the script's default). SDXL:
#   the SDXL 1.0 UNet's levels and widths (320/640/1280, heads of 64, text_time) with 1/2/4 transformer layers
#   per level instead of 1/2/10 (1,316.3M of 2,567.5M), the SDXL VAE, both text towers at their widths (768;
#   1280 with its 1280 projection) with 2 layers each. 256 px, batch 1.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "flux": {
        "tiny": {"preset": "tiny", "overrides": {}, "resolution": 64, "batch": 4, "t5_length": 32, "vocab": 600},
        "partial": {"preset": "flux-dev",
                    "overrides": {"transformer_overrides": {"num_layers": 1, "num_single_layers": 2},
                                  "text_encoder_overrides": {"num_hidden_layers": 2},
                                  "text_encoder_2_overrides": {"num_layers": 1}},
                    "resolution": 256, "batch": 1, "t5_length": 512, "vocab": 1024},
    },
    "sdxl": {
        "tiny": {"preset": "tiny", "overrides": {}, "resolution": 64, "batch": 4, "vocab": 600},
        "partial": {"preset": "sdxl",
                    "overrides": {"unet_overrides": {"transformer_layers_per_block": [1, 2, 4]},
                                  "text_encoder_overrides": {"num_hidden_layers": 2},
                                  "text_encoder_2_overrides": {"num_hidden_layers": 2}},
                    "resolution": 256, "batch": 1, "vocab": 1024},
    },
}
# The modules the scripts put adapters on by default (Flux: every attention projection and both streams' MLPs of
# the double blocks, the single blocks' attention projections; SDXL: the UNet's attention projections); sdtrain
# is given the same list.
TARGETS = {
    "flux": ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
             "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
             "ff_context.net.2"],
    "sdxl": ["to_k", "to_q", "to_v", "to_out.0"],
}
PEER_MODES = ("online", "cached")
SDTRAIN_MODES = ("dreambooth", "dreambooth-cached", "encoded")


def log(msg: str) -> None:
    print(f"[bench-peer-lora {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- assets


def size_settings(args: argparse.Namespace, family: str, size: str) -> dict[str, Any]:
    spec = json.loads(json.dumps(SIZES[family][size]))
    overrides = spec["overrides"]
    if size == "partial" and args.blocks:
        counts = [int(n) for n in args.blocks.split(",")]
        if family == "flux":
            overrides["transformer_overrides"] = {"num_layers": counts[0], "num_single_layers": counts[1]}
        else:
            overrides["unet_overrides"] = {"transformer_layers_per_block": counts}
    if family == "flux" and args.t5_length:
        spec["t5_length"] = args.t5_length
    spec["instance_prompt"] = args.instance_prompt
    return spec


def t5_tokenizer(captions: list[str], out: Path, max_length: int) -> Any:
    """A small T5 (Unigram) tokenizer, built from a vocabulary list by transformers' T5Tokenizer (no
    SentencePiece model needed): every word of the captions whole, then their characters. The script loads
    ``tokenizer_2/`` with T5TokenizerFast, which a CLIP (BPE) folder does not satisfy."""
    from transformers import T5Tokenizer

    words = sorted({w for c in captions for w in c.split()})
    chars = sorted({ch for c in captions for ch in c if not ch.isspace()})
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0) for w in words] + [(ch, -5.0) for ch in chars]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)
    tokenizer.save_pretrained(str(out))
    return T5Tokenizer.from_pretrained(str(out), local_files_only=True)


def build_assets(family: str, work: Path, num_images: int, settings: dict[str, Any]) -> None:
    """The instance images and a random-weight pipeline folder of `family`, built with sdtrain's own functions
    (render_shapes_sample, train_clip_tokenizer, build_vae, build_text_encoder, build_denoiser,
    build_noise_scheduler, the family's assemble), as the tests build theirs. Runs in a child process
    (``peer_lora.py _build``)."""
    import numpy as np
    import torch

    from sdtrain.config import DiffusionConfig, ModelConfig
    from sdtrain.data.shapes import render_shapes_sample
    from sdtrain.models import build, families
    from sdtrain.models.tokenizer import train_clip_tokenizer

    res = settings["resolution"]
    prompt = settings["instance_prompt"]
    # instance/: the images alone (the script opens every file of --instance_data_dir as an image);
    # images/: the same files (hard links) with metadata.jsonl captioning each with the instance prompt, what
    # `sdtrain prepare folder` reads.
    instance, images = work / "instance", work / "images"
    for folder in (instance, images):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    captions = [prompt]
    with open(images / "metadata.jsonl", "w") as meta:
        for i in range(num_images):
            rng = np.random.Generator(np.random.PCG64([0, i]))
            image, caption, _ = render_shapes_sample(rng, res, 2 if rng.random() < 0.5 else 1)
            name = f"{i:08d}.png"
            image.save(instance / name)
            os.link(instance / name, images / name)
            meta.write(json.dumps({"file_name": name, "text": prompt}) + "\n")
            captions.append(caption)

    torch.manual_seed(0)
    spec = families.get(family)
    clip = train_clip_tokenizer(captions, work / "tokenizer", vocab_size=settings["vocab"], max_length=77)
    overrides = json.loads(json.dumps(settings["overrides"]))
    if family == "flux":
        t5 = t5_tokenizer(captions, work / "tokenizer_2", settings["t5_length"])
        tokenizers = [clip, t5]
        # The T5 has the tokenizer's vocabulary, not T5-XXL's 32,128 rows (flux-dev's preset names them).
        overrides.setdefault("text_encoder_2_overrides", {})["vocab_size"] = len(t5)
    else:
        tokenizers = [clip, clip]
    model = ModelConfig(family=family, preset=settings["preset"], **overrides)
    vae = build.build_vae(model)
    text_encoders = {name: build.build_text_encoder(model, tok, name)
                     for name, tok in zip(spec.components.text_encoders, tokenizers)}
    latent = res // spec.codec.downsampling(vae.config)
    denoiser = build.build_denoiser(model, vae.config.latent_channels, latent, text_encoders=text_encoders)
    scheduler = build.build_noise_scheduler(DiffusionConfig(), model)
    pipe = spec.sampling.assemble({"vae": vae, **text_encoders, spec.components.denoiser: denoiser}, tokenizers,
                                  scheduler)
    out = work / "pipeline"
    shutil.rmtree(out, ignore_errors=True)
    pipe.save_pretrained(out)
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in
              (("denoiser", denoiser), ("vae", vae), *text_encoders.items())}
    print(json.dumps({"parameters": counts, "latent_size": latent, "denoiser": spec.components.denoiser,
                      "latent_channels": vae.config.latent_channels}))


def ensure_assets(args: argparse.Namespace, family: str, size: str, work: Path, env: dict[str, str]
                  ) -> dict[str, Any]:
    settings = size_settings(args, family, size)
    batch = batch_of(args, family, size)
    # A DreamBooth-sized instance set: --images, rounded up to whole batches (no short last batch in the script).
    num_images = -(-max(args.images, batch) // batch) * batch
    key = {"family": family, "settings": settings, "num_images": num_images, "version": 1}
    return peer.built_once(Path(__file__), work, key, [family, str(work), str(num_images), json.dumps(settings)], env,
                           f"{family} {size}", f"a random-weight pipeline and {num_images} instance images at "
                           f"{settings['resolution']} px", stale_files=("sdtrain-data.json",))


def batch_of(args: argparse.Namespace, family: str, size: str) -> int:
    return args.batch or SIZES[family][size]["batch"]


# ------------------------------------------------------------------------------------------------ runs


def peer_command(args: argparse.Namespace, family: str, work: Path, run_dir: Path, settings: dict[str, Any],
                 batch: int, precision: str, checkpointing: bool, optimizer: str, cache_latents: bool) -> list[str]:
    mp = {"fp32": "no", "bf16": "bf16"}[precision]
    cmd = [*peer.accelerate_launch(args.threads, mp), str(Path(args.diffusers).resolve() / EXAMPLES[family]),
           "--pretrained_model_name_or_path", str(work / "pipeline"),
           "--instance_data_dir", str(work / "instance"), "--instance_prompt", settings["instance_prompt"],
           "--resolution", str(settings["resolution"]), "--center_crop",
           "--train_batch_size", str(batch), "--max_train_steps", str(args.steps),
           "--rank", str(RANK),
           "--learning_rate", "1e-4", "--lr_scheduler", "constant", "--lr_warmup_steps", "0",
           "--adam_weight_decay", "1e-4", "--max_grad_norm", "1.0",
           "--dataloader_num_workers", str(args.workers),
           "--mixed_precision", mp, "--seed", "0", "--checkpointing_steps", str(10**9),
           "--output_dir", str(run_dir)]
    if family == "flux":
        # alpha = rank, as the SDXL script fixes it and sdtrain's recipe sets it (the Flux script's default is 4).
        cmd += ["--lora_alpha", str(RANK), "--max_sequence_length", str(settings["t5_length"]),
                "--guidance_scale", "3.5", "--weighting_scheme", "none"]
        if cache_latents:
            cmd.append("--cache_latents")
    if checkpointing:
        cmd.append("--gradient_checkpointing")
    if optimizer == "adamw8bit":
        cmd.append("--use_8bit_adam")
    return cmd


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def sdtrain_config(args: argparse.Namespace, family: str, work: Path, run_dir: Path, settings: dict[str, Any],
                   batch: int, precision: str, checkpointing: bool, optimizer: str, mode: str) -> Path:
    """sdtrain's LoRA recipe of the family (configs/flux-lora.yaml, sdxl-lora.yaml) with what makes it the
    script's run: the same pipeline, images, resolution (square, centre crop, no flip, no aspect buckets), batch,
    steps, loader workers, seed; LoRA rank 16, alpha 16 on the script's modules, text encoders frozen; AdamW
    (or 8-bit AdamW) lr 1e-4, betas 0.9/0.999, weight decay 1e-4, eps 1e-8, constant, no warmup, clipping at 1.0;
    no caption dropout; frozen weights in fp32; no EMA; posterior samples; Flux: sigmas uniform and unshifted
    (the script's weighting "none" on the scheduler's unshifted table), guidance 3.5, T5 length as the script's;
    SDXL: no min-SNR; gradient checkpointing as the script; one checkpoint at the end, metrics at the last step,
    no TensorBoard, no validation. Mode ``dreambooth``: sdtrain's DreamBooth mode with LoRA (dreambooth.lora),
    the instance prompt, no class prompt (no prior preservation), on the image shards; ``dreambooth-cached`` the
    same with dreambooth.cache_latents (the images VAE-encoded once before training). Mode ``encoded``: LoRA on
    the shards of `sdtrain prepare encode` (latents and the instance prompt's embeddings computed once)."""
    import yaml

    recipe = yaml.safe_load(RECIPES[family].read_text())
    diffusion: dict[str, Any] = {"sample_latents": True}
    if family == "flux":
        diffusion |= {"timestep_sampling": "uniform", "flow": {"shift": 1.0, "loss_weighting": "none",
                                                               "guidance": 3.5}}
    else:
        diffusion |= {"ddpm": {"snr_gamma": 0.0, "noise_offset": 0.0}}
    model: dict[str, Any] = {"family": family, "pretrained": str(work / "pipeline"), "frozen_precision": "fp32",
                             "offload_frozen": False}
    if family == "flux":
        model["t5_text_length"] = settings["t5_length"]
    overrides: dict[str, Any] = {
        "run_dir": str(run_dir),
        "seed": 0,
        "data": {"shards": str(work / ("encoded" if mode == "encoded" else "shards")),
                 "resolution": settings["resolution"], "batch_size": batch, "num_workers": args.workers,
                 "caption_dropout": 0.0, "center_crop": True, "random_flip": False, "aspect_buckets": False,
                 "use_encoded": mode == "encoded"},
        "model": model,
        "lora": {"rank": RANK, "alpha": RANK, "dropout": 0.0, "target_modules": TARGETS[family],
                 "text_encoder": False},
        "diffusion": diffusion,
        "optim": {"name": optimizer, "lr": 1.0e-4, "betas": [0.9, 0.999], "weight_decay": 1.0e-4, "eps": 1.0e-8,
                  "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0},
        "ema": {"enabled": False},
        "train": {"max_steps": args.steps, "grad_accum": 1, "gradient_checkpointing": checkpointing,
                  "device": "cpu"},
        "checkpoint": {"every": 0, "keep_last": 1},
        "logging": {"every": args.steps, "progress": True, "tensorboard": False},
        "validation": {"prompts": []},
    }
    if mode.startswith("dreambooth"):
        overrides |= {"mode": "dreambooth",
                      "dreambooth": {"instance_prompt": settings["instance_prompt"], "class_prompt": "", "lora": True,
                                     "cache_latents": mode == "dreambooth-cached"}}
    config = merge(recipe, overrides)
    path = run_dir.with_suffix(".yaml")
    header = (f"# sdtrain's {RECIPES[family].relative_to(REPO)} with benchmarks/peer_lora.py's settings for the "
              f"{mode} run beside diffusers' {EXAMPLES[family].name}\n")
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    config["train"]["mixed_precision"] = peer.sdtrain_precision(path, precision)
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    from sdtrain.config import load_config

    load_config(path)  # fail here, with sdtrain's own message, rather than in the child
    return path


def runs_of(args: argparse.Namespace, family: str) -> list[tuple[str, str, str | None]]:
    """(tool, peer mode or None, sdtrain mode or None) of each run of one setting, peers first."""
    runs: list[tuple[str, str, str | None]] = []
    for mode in args.peer_modes:
        if mode == "cached" and family != "flux":
            continue  # the SDXL script has no --cache_latents
        runs.append(("peer" if mode == "online" else "peer-cached", mode, None))
    runs += [(f"sdtrain-{m}", "", m) for m in args.modes]
    return runs


def peer_of_row(row: dict[str, Any]) -> str | None:
    """The peer run an sdtrain run is compared with: the script as run by default for sdtrain's DreamBooth mode
    (both encode every image every step); the script with --cache_latents for sdtrain's DreamBooth mode with
    cached latents and for sdtrain on encoded shards when there is one (Flux), else the default run."""
    if row["tool"].startswith("peer"):
        return None
    if row["tool"] in ("sdtrain-encoded", "sdtrain-dreambooth-cached") and row.get("peer_cached_ran"):
        return "peer-cached"
    return "peer"


GROUP = [("family", "family", str), ("size", "size", str), ("precision", "precision", str),
         ("ckpt", "checkpointing", lambda v: "on" if v else "off"), ("optimizer", "optimizer", str)]
EXTRA = [("train tree peak GiB", "train_tree_peak_gib"), ("end tree peak GiB", "end_tree_peak_gib")]


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--diffusers", type=Path, required=True,
                   help="a diffusers source checkout (with examples/dreambooth/train_dreambooth_lora_{flux,sdxl}.py)")
    p.add_argument("--family", default="flux,sdxl", help="flux, sdxl, or both (comma list; default both)")
    p.add_argument("--size", default="tiny", help="tiny, partial, or both (comma list); default tiny")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    p.add_argument("--skip", type=int, default=None,
                   help="first steps left out of the timing (default: a fifth of --steps, 1 to 5)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: tiny 4, partial 1)")
    p.add_argument("--images", type=int, default=8,
                   help="instance images (default 8, rounded up to whole batches); both tools loop over them")
    p.add_argument("--precision", default="fp32", help="fp32, bf16, or both (comma list); default fp32")
    p.add_argument("--checkpointing", choices=("off", "on", "both"), default="off",
                   help="gradient checkpointing of the denoiser in both tools (default off)")
    p.add_argument("--optimizer", default="adamw",
                   help="adamw and/or adamw8bit (comma list; the script's --use_8bit_adam, sdtrain's "
                        "optim.name=adamw8bit; bitsandbytes); default adamw")
    p.add_argument("--peer-modes", default="online,cached",
                   help="peer runs: online (the script as is: VAE every step) and/or cached (Flux only: "
                        "--cache_latents); default both")
    p.add_argument("--sdtrain-modes", default="dreambooth,dreambooth-cached,encoded",
                   help="sdtrain runs: dreambooth (its DreamBooth mode with LoRA on the image shards: the VAE "
                        "every step, the prompt encoded once), dreambooth-cached (the same with "
                        "dreambooth.cache_latents) and/or encoded (LoRA on `prepare encode` shards); default all")
    p.add_argument("--blocks", default=None,
                   help="partial size only: Flux double,single blocks (default 1,2); SDXL transformer layers per "
                        "level (default 1,2,4; the released UNet: 1,2,10)")
    p.add_argument("--t5-length", type=int, default=None,
                   help="Flux: T5 tokens per prompt in both tools (default: tiny 32, partial 512)")
    p.add_argument("--instance-prompt", default=INSTANCE_PROMPT, help=f"default {INSTANCE_PROMPT!r}")
    p.add_argument("--workers", type=int, default=0, help="data loader workers for both tools (default 0, the "
                                                          "scripts' default)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")),
                   help="OMP_NUM_THREADS for both tools (default: $OMP_NUM_THREADS or 2)")
    p.add_argument("--timeout", type=float, default=None, help="seconds after which a run is killed")
    p.add_argument("--keep-outputs", action="store_true", help="keep each run's output folder")
    p.add_argument("--out", type=Path, default=Path("runs/bench-peer-lora/results.json"), help="results JSON")
    p.add_argument("--work", type=Path, default=Path("runs/bench-peer-lora"),
                   help="work folder (assets, runs, logs)")
    args = p.parse_args(argv)

    def listed(value: str, both: list[str]) -> list[str]:
        return both if value == "both" else [v for v in value.split(",") if v]

    args.families = listed(args.family, ["flux", "sdxl"])
    args.sizes = listed(args.size, ["tiny", "partial"])
    args.precisions = listed(args.precision, ["fp32", "bf16"])
    args.optimizers = listed(args.optimizer, ["adamw", "adamw8bit"])
    args.peer_modes = listed(args.peer_modes, list(PEER_MODES))
    args.modes = listed(args.sdtrain_modes, list(SDTRAIN_MODES))
    for value, allowed, flag in ((args.families, ("flux", "sdxl"), "--family"),
                                 (args.sizes, ("tiny", "partial"), "--size"),
                                 (args.precisions, ("fp32", "bf16"), "--precision"),
                                 (args.optimizers, ("adamw", "adamw8bit"), "--optimizer"),
                                 (args.peer_modes, PEER_MODES, "--peer-modes"),
                                 (args.modes, SDTRAIN_MODES, "--sdtrain-modes")):
        bad = [v for v in value if v not in allowed]
        if bad:
            p.error(f"{flag}: {', '.join(bad)} not one of {', '.join(allowed)}")
    if args.blocks and len(args.families) > 1:
        p.error("--blocks: give one --family (its meaning differs between flux and sdxl)")
    if args.blocks:
        try:
            counts = [int(n) for n in args.blocks.split(",")]
        except ValueError:
            p.error(f"--blocks {args.blocks}: expected counts such as 1,2")
        if len(counts) != (2 if args.families == ["flux"] else 3):
            p.error("--blocks: flux takes double,single; sdxl three levels, e.g. 1,2,4")
    if args.steps < 2:
        p.error("--steps: at least 2 (the first step is never timed)")
    args.checkpointings = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    if args.skip is None:
        args.skip = max(1, min(5, args.steps // 5))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The scripts read --instance_data_dir themselves: no `datasets`; peft for their adapters.
    use_standin = peer.check_peer_imports(args.diffusers, tuple(EXAMPLES[f] for f in args.families),
                                          ("accelerate", "diffusers", "transformers", "peft"))
    if "adamw8bit" in args.optimizers and importlib.util.find_spec("bitsandbytes") is None:
        raise SystemExit("--optimizer adamw8bit needs bitsandbytes in this environment (pip install bitsandbytes)")
    work_root = args.work.resolve()
    work_root.mkdir(parents=True, exist_ok=True)
    env, peer_env = peer.tool_environments(args.threads, use_standin)
    if use_standin:
        log(f"torchvision is not importable here: the diffusers scripts get the stand-in {peer.STANDIN}/torchvision "
            "first on their PYTHONPATH; sdtrain runs without it")
    import diffusers

    for family in args.families:
        log(f"peer ({family}): {args.diffusers / EXAMPLES[family]} against the installed diffusers "
            f"{diffusers.__version__} ({Path(diffusers.__file__).parent})")

    timing = (peer.TIMING + "; train tree peak = the tree peak until the clock held every step, end tree peak = "
              "after it (final save, the script's reload of the pipeline)")
    results: dict[str, Any] = {**peer.results_header(args, env, use_standin, args.workers, timing),
                               "setups": {}, "runs": []}
    save = peer.saver(args.out, results)

    for family, size in itertools.product(args.families, args.sizes):
        work = work_root / family / size
        logs = work / "logs"
        assets = ensure_assets(args, family, size, work, env)
        settings = assets["key"]["settings"]
        batch = batch_of(args, family, size)
        setup = f"{family}-{size}"
        results["setups"][setup] = {"assets": assets, "batch": batch, "resolution": settings["resolution"]}
        counts = ", ".join(f"{name} {n / 1e6:.1f}M" for name, n in assets["parameters"].items())
        log(f"{family} {size}: {counts} at {settings['resolution']} px, batch {batch}, "
            f"{assets['key']['num_images']} instance images"
            + (f", T5 {settings['t5_length']} tokens" if family == "flux" else ""))
        if args.modes:
            results["setups"][setup]["sdtrain_data"] = peer.prepare_sdtrain_data(
                work, settings, env, "encoded" in args.modes, logs)
        save()
        runs = runs_of(args, family)
        cached_ran = any(tool == "peer-cached" for tool, _, _ in runs)
        for precision, checkpointing, optimizer in itertools.product(args.precisions, args.checkpointings,
                                                                     args.optimizers):
            for tool, peer_mode, mode in runs:
                name = f"{tool}-{precision}-ckpt{'on' if checkpointing else 'off'}-{optimizer}"
                run_dir = work / "runs" / name
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                clock = work / "runs" / f"{name}.clock"
                if mode is None:
                    cmd = peer_command(args, family, work, run_dir, settings, batch, precision, checkpointing,
                                       optimizer, peer_mode == "cached")
                    run_env, desc = peer_env, "Steps"
                else:
                    cfg = sdtrain_config(args, family, work, run_dir, settings, batch, precision, checkpointing,
                                         optimizer, mode)
                    cmd = [sys.executable, str(STEPCLOCK), "-m", "sdtrain", "train", str(cfg)]
                    run_env, desc = env, "train"
                run_env = {**run_env, "STEPCLOCK_FILE": str(clock), "STEPCLOCK_TOTAL": str(args.steps),
                           "STEPCLOCK_DESC": desc}
                measured = peer.run_measured(f"{family} {size} {name}", cmd, run_env, logs / f"{name}.log", clock,
                                             args.steps, args.timeout, phases=True)
                row = {"family": family, "size": size, "precision": precision, "checkpointing": checkpointing,
                       "optimizer": optimizer, "workers": args.workers, "tool": tool, "batch": batch,
                       "resolution": settings["resolution"], "peer_cached_ran": cached_ran, **measured}
                row |= peer.steady_rate(clock, batch, args.skip, measured["start_time"])
                if mode is not None:
                    row["sdtrain_metrics_img_per_s"] = peer.sdtrain_reported(run_dir)
                    row["sdtrain_mixed_precision"] = peer.sdtrain_precision(run_dir.with_suffix(".yaml"), precision)
                    row["config"] = str(run_dir.with_suffix(".yaml"))
                row["command"] = cmd
                results["runs"].append(row)
                save()
                log(f"{family} {size} {name}: {row.get('img_per_s', 'n/a')} img/s "
                    f"({row.get('img_per_s_median', 'n/a')} from the median step) over {row.get('steps_timed', 0)} "
                    f"steps, peak {row['peak_gib']:.2f} GiB (tree {row['tree_peak_gib']:.2f}, until the last step "
                    f"{row['train_tree_peak_gib']:.2f}), wall {row['wall_s']:.0f} s")
                if not args.keep_outputs:
                    shutil.rmtree(run_dir, ignore_errors=True)
    print()
    peer.print_table(results["runs"], group=GROUP, peer_of=peer_of_row, extra=EXTRA)
    print(f"\nresults: {args.out.resolve()}")
    return 0 if all(r["returncode"] == 0 for r in results["runs"]) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_build":
        build_assets(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        sys.exit(main())
