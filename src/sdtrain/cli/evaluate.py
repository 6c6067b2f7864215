"""`sdtrain evaluate MODEL --prompts FILE --metrics fid,clip,adherence ...` and
`sdtrain evaluate stats IMAGES|SHARDS --out STATS.npz`."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "evaluate", help="score a model: FID, CLIP score, shapes prompt adherence (or `evaluate stats`)",
        description="Generates an image per prompt, split over the ranks of torchrun/Slurm/mpirun, and scores them "
                    "(MLPerf: DDIM, 50 steps, guidance 8). `sdtrain evaluate stats SOURCE --out STATS.npz` writes "
                    "the Inception statistics of reference images instead.")
    parser.add_argument("model", help="a pipeline folder, single-file checkpoint or diffusion run, or a Hugging Face "
                        "Hub id (org/name[@REVISION]); or `stats`")
    parser.add_argument("source", nargs="?", help="with `stats`: a folder of images or WebDataset shards")
    parser.add_argument("--prompts", type=Path, help="one prompt per line, or a TSV/CSV with a caption column; "
                        "default with adherence alone: the shapes demo's prompt set")
    parser.add_argument("--metrics", default="fid,clip", help="comma-separated: fid, clip, adherence")
    parser.add_argument("--reference", help="FID reference: STATS.npz (mu, sigma) or a folder/shards of images")
    parser.add_argument("--inception", help=f"the FID Inception weights file ({'pt_inception-2015-12-05'}...)")
    parser.add_argument("--clip", help="a transformers CLIP model folder (MLPerf: CLIP-ViT-H-14-laion2B)")
    parser.add_argument("--num", type=int, help="evaluate the first N prompts (adherence: a set of N, pairs "
                        "a quarter of it and at least 18 where N allows)")
    parser.add_argument("--pairs", type=int, help="adherence: how many of the N prompts name two shapes")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance", type=float, default=8.0)
    parser.add_argument("--scheduler", default="ddim", choices=["euler", "ddim", "dpmpp"])
    parser.add_argument("--seed", type=int, default=0, help="prompt i is generated with seed + i")
    parser.add_argument("--batch", type=int, default=8, help="images generated together, each from its own seed")
    parser.add_argument("--resolution", type=int, default=512, help="side reference images are squared to")
    parser.add_argument("--size", type=int, default=None,
                        help="side of the generated images (default: a run's training resolution, else the "
                        "pipeline's default: Flux.1's is 1024 whatever it trained on)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, help="write the result (JSON; STATS.npz with `stats`) here")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sdtrain.errors import UserError

    if args.model == "stats":
        from sdtrain.evaluate.run import make_stats

        if args.source is None or args.out is None:
            raise UserError("evaluate stats: pass the reference images and --out, e.g. "
                            "`sdtrain evaluate stats coco_val/ --out coco_stats.npz --inception FILE`")
        stats = make_stats(args.source, args.inception, args.out, args.resolution, args.batch)
        print(f"wrote {args.out}: Inception statistics of {stats.count} images")
        return 0
    if args.source is not None:
        raise UserError(f"evaluate: unexpected argument {args.source}; only `evaluate stats` takes a source")
    return _evaluate(args)


def _evaluate(args: argparse.Namespace) -> int:
    from sdtrain.distributed import detect_topology, init_distributed
    from sdtrain.errors import UserError
    from sdtrain.evaluate.run import EvalSettings, evaluate, read_prompts, summary_line, write_result
    from sdtrain.generate import local_model, training_size
    from sdtrain.run import resolve_device

    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    if args.pairs is not None and (args.prompts is not None or metrics != ["adherence"]):
        raise UserError("--pairs: only the built-in adherence prompt set has pairs; drop --pairs, or --prompts and "
                        "the other metrics")
    if args.prompts is not None:
        prompts = read_prompts(args.prompts)
    elif metrics == ["adherence"]:
        from sdtrain.evaluate.adherence import adherence_prompt_set

        try:
            prompts = adherence_prompt_set(args.num, args.pairs)
        except ValueError as exc:
            raise UserError(f"--pairs: {exc}; lower --pairs or raise --num") from None
    else:
        raise UserError("--prompts: pass the captions to generate (MLPerf: the 30k COCO-2014 captions TSV)")
    if args.steps < 1 or args.batch < 1:
        raise UserError("--steps and --batch must be at least 1")
    model = local_model(args.model)[0]  # a Hub id: its folder in the Hugging Face cache, fetched if not cached
    topology = detect_topology()
    device = resolve_device(args.device, topology.local_rank)
    init_distributed(topology, device)
    settings = EvalSettings(metrics, num=args.num, steps=args.steps, guidance=args.guidance, seed=args.seed,
                            batch=args.batch, inception=args.inception, clip=args.clip, reference=args.reference,
                            scheduler=args.scheduler, size=args.size or training_size(model),
                            extra={"resolution": args.resolution})
    result = evaluate(model, prompts, settings, device, topology.rank, topology.world_size)
    if topology.is_main:
        write_result(result, args.out)
        print(summary_line(result))
    return 0
