"""`sdtrain benchmark train CONFIG [key=value ...]`: images/s, step and all-reduce time on synthetic batches."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from sdtrain.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("benchmark", help="measure training speed on synthetic data")
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="WHAT")
    train = kinds.add_parser(
        "train", help="the training step of a config: images/s, step time, all-reduce time, peak memory",
        description="Times the config's training step on fixed random batches. Run it plainly, under torchrun "
                    "(every rank takes part), or with --nproc to compare process counts on this machine.")
    train.add_argument("config", type=Path, help="the training YAML config")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    train.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    train.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    train.add_argument("--nproc", help="comma-separated process counts to compare under torchrun, e.g. 1,2")
    train.add_argument("--encoded", action="store_true",
                       help="batches as pre-encoded shards give them: latents (and text embeddings for a frozen text "
                            "encoder) instead of pixels")
    train.add_argument("--out", type=Path, help="also write the result as JSON here")
    train.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sdtrain import benchmark
    from sdtrain.config import load_config
    from sdtrain.distributed import destroy, detect_topology

    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be at least 1 and --warmup at least 0")
    if args.nproc:
        try:
            counts = [int(n) for n in args.nproc.split(",")]
        except ValueError:
            raise UserError(f"--nproc {args.nproc}: expected process counts such as 1,2") from None
        overrides = benchmark.benchmark_overrides(args.config, args.overrides, run_dir="unused")
        results = benchmark.compare_processes(args.config, [o for o in overrides if not o.startswith("run_dir=")],
                                              counts, args.steps, args.warmup, args.encoded)
        print(benchmark.format_results(results))
        if args.out:
            benchmark.write_result(args.out, results)
        return 0

    topology = detect_topology()
    scratch = None
    run_dir = None
    if not topology.distributed:
        scratch = tempfile.TemporaryDirectory(prefix="sdtrain-benchmark-")
        run_dir = scratch.name
    config = load_config(args.config, benchmark.benchmark_overrides(args.config, args.overrides, run_dir))
    try:
        result = benchmark.run_benchmark(config, args.steps, args.warmup, args.encoded)
    finally:
        destroy()
        if scratch is not None:
            scratch.cleanup()
    if result is not None:
        print(benchmark.format_results([result]))
        print(json.dumps(result))
        if args.out:
            benchmark.write_result(args.out, result)
    return 0 if result is not None or os.environ.get("RANK", "0") != "0" else 1
