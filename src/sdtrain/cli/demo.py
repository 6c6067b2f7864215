"""`sdtrain demo --out DIR`: the whole path on the embedded shapes dataset, as a script of the CLI.

Each stage is the same command a user would type, so the demo doubles as a worked example.
"""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
import functools
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sdtrain.train.threads import LoadWatch


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="prepare, train, export and sample the embedded shapes demo")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument("--num", type=int, default=4000, help="dataset size")
    parser.add_argument("--autoencoder-steps", type=int, default=None, help="override the config's max_steps")
    parser.add_argument("--diffusion-steps", type=int, default=None, help="override the config's max_steps")
    parser.add_argument("--adherence-prompts", type=int, default=162, help="prompts the final adherence score "
                        "generates")
    parser.add_argument("--adherence-pairs", type=int, default=108,
                        help="how many of them name two shapes, a third in each phrasing (108: one image moves a "
                        "phrasing's score by 2.8 points)")
    parser.add_argument("--sample-steps", type=int, default=SAMPLE_STEPS,
                        help="sampling steps of every image the demo draws: validation grids, the sample grid and "
                             "the adherence score (default %(default)s; fewer for a quick check that all runs)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="finish within about this many minutes: each stage trains on a time budget "
                        "(train.max_minutes), its steps and learning-rate schedule planned from its own pace as it "
                        "runs; the budgets are in each run's config.yaml and the planned steps in its checkpoints, "
                        "and a rerun keeps them (default: the configs' fixed steps)")
    parser.add_argument("--family", choices=sorted(DIFFUSION_CONFIGS), default="sd",
                        help="the model family trained from scratch: sd (a UNet, the default) or flux (a Flux.1 "
                        "transformer trained by flow matching, with CLIP and T5 text encoders)")
    parser.set_defaults(run=run)


GUIDANCE = 7
TWO_SHAPE_FRACTION = "0.25"
SAMPLE_STEPS = 30
# The demo configs' data.resolution: latents are encoded, and images generated, at it.
RESOLUTION = "64"
# Each family's stage-2 config; its autoencoder is the same demo config built as that family's (Flux.1: 16 latent
# channels and a latent shift).
DIFFUSION_CONFIGS = {"sd": "diffusion.yaml", "flux": "flux.yaml"}


def config_path(name: str) -> Path:
    return Path(str(resources.files("sdtrain") / "configs" / "demo" / name))


def _steps_overrides(steps: int) -> list[str]:
    """A stage's step count and its warmup."""
    from sdtrain.cli.demo_budget import warmup_steps

    return [f"train.max_steps={steps}", f"optim.warmup_steps={warmup_steps(steps)}"]


def _step(cli: Callable[[list[str]], int], load: LoadWatch, title: str, argv: list[str]) -> None:
    import torch

    # The commands run in this process, one after another: each starts on the cores other processes left during the
    # command before (a training run then moves its threads itself, train.threads: auto).
    torch.set_num_threads(load.threads())
    print(f"\n== {title}\n$ sdtrain {' '.join(argv)}", flush=True)
    code = cli(argv)
    if code:
        raise SystemExit(code)


def run(args: argparse.Namespace) -> int:
    import torch

    from sdtrain.train.threads import LoadWatch

    load = LoadWatch()
    try:
        return _run(args, load)
    finally:
        torch.set_num_threads(load.most)


def _run(args: argparse.Namespace, load: LoadWatch) -> int:
    import torch

    from sdtrain.data.shapes import caption_prompts

    out: Path = args.out
    started = time.perf_counter()
    data, ae_run, sd_run = out / "data", out / "autoencoder", out / "diffusion"
    latents, pipeline, samples = out / "latents", out / "pipeline", out / "samples"
    step = functools.partial(_step, args.cli, load)
    # One image in four shows a pair: a model that sees mostly pairs draws two shapes for one-shape prompts until
    # late in training (at the same 1,320 steps of 16: colour 33%, 57%, 72% and shape 22%, 44%, 48% with three,
    # two and one image in four a pair).
    step("1/8 write the shapes dataset", ["prepare", "shapes", "--out", str(data), "--num", str(args.num),
                                           "--two-shape-fraction", TWO_SHAPE_FRACTION])
    ae = ["train", str(config_path("autoencoder.yaml")), f"run_dir={ae_run}", f"data.shards={data}",
          f"model.family={args.family}"]
    sd_config = config_path(DIFFUSION_CONFIGS[args.family])
    budget = None
    if args.minutes is not None:
        from sdtrain.cli.demo_budget import plan_budget

        torch.set_num_threads(load.threads())
        budget = plan_budget(args, started + 60 * args.minutes, data, (ae_run, sd_run),
                             (config_path("autoencoder.yaml"), sd_config), [f"model.family={args.family}"])
    if args.autoencoder_steps:
        ae += _steps_overrides(args.autoencoder_steps)
    elif budget is not None:
        ae += budget.autoencoder
    step("2/8 train the autoencoder", ae)
    # Encoding once instead of every step: the diffusion stage's images are centre crops without flips,
    # so the latents are exactly what it would compute. The text encoder trains, so no text embeddings.
    step("3/8 encode the dataset with the autoencoder",
          ["prepare", "encode", str(data), "--model", str(ae_run), "--out", str(latents), "--resolution", RESOLUTION,
           "--dtype", "float32", "--no-text"])
    sd = ["train", str(sd_config), f"run_dir={sd_run}", f"data.shards={latents}",
          f"model.components.vae.source={ae_run}"]
    if args.diffusion_steps:
        sd += _steps_overrides(args.diffusion_steps)
    elif budget is not None:
        sd += budget.diffusion()
    if args.sample_steps != SAMPLE_STEPS:
        sd += [f"validation.steps={args.sample_steps}", f"evaluation.steps={args.sample_steps}"]
    step("4/8 train the text encoders and the transformer" if args.family == "flux" else
          "4/8 train the text encoder and UNet", sd)
    step("5/8 export a diffusers pipeline", ["export", str(sd_run), "--out", str(pipeline)])
    prompts = out / "prompts.txt"
    prompts.write_text("\n".join(caption_prompts()) + "\n")
    # Guidance 7 rather than 4: scored on one demo model, single shapes went from 93% to 98% right in
    # colour and 87% to 98% in kind, and pairs from 22% to 28%; 2.5 was worse on all three.
    step("6/8 generate from the prompts",
          ["generate", "--model", str(pipeline), "--prompts", str(prompts), "--out", str(samples),
           "--steps", str(args.sample_steps), "--guidance", str(GUIDANCE), "--seed", "0", "--size", RESOLUTION])
    grid = out / "samples.png"
    (samples / "grid.png").replace(grid)
    # The same sampler settings as the grid: the score says how often those images show their prompt.
    adherence = out / "adherence.json"
    step("7/8 score prompt adherence (colour, shape, both shapes of a pair)",
          ["evaluate", str(pipeline), "--metrics", "adherence", "--num", str(args.adherence_prompts),
           "--pairs", str(min(args.adherence_pairs, args.adherence_prompts)),
           "--steps", str(args.sample_steps), "--guidance", str(GUIDANCE), "--scheduler", "euler", "--batch", "18",
           "--size", RESOLUTION,
           "--out", str(adherence)])
    step("8/8 write the diffusion run's report", ["report", str(sd_run)])
    minutes = (time.perf_counter() - started) / 60
    print(f"\ndemo finished in {minutes:.1f} min")
    print(f"  samples grid:       {grid}")
    print(f"  prompt adherence:   {adherence}")
    pipeline_class = "FluxPipeline" if args.family == "flux" else "StableDiffusionPipeline"
    print(f"  diffusers pipeline: {pipeline}  ({pipeline_class}.from_pretrained)")
    print(f"  runs:               {ae_run}, {sd_run}  (metrics.jsonl, tensorboard/, checkpoints/, samples/)")
    print(f"  training report:    {sd_run / 'report.html'}  (open in a browser: loss, samples over time, setup)")
    return 0
