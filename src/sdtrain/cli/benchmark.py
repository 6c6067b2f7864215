"""`sdtrain benchmark train CONFIG [key=value ...]`: images/s, MFU, step and all-reduce time and the memory of the
path `sdtrain train` runs; `sdtrain benchmark data`: the loader's rate beside the step's."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
import json
import tempfile
from pathlib import Path

from sdtrain.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("benchmark", help="measure training speed and memory")
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="WHAT")
    train = kinds.add_parser(
        "train", help="the training step of a config: images/s, MFU, step and all-reduce time, loading and training "
                      "peak memory",
        description="Runs what `sdtrain train` runs (model loading, the loader and its workers, the step, a save) "
                    "and times it, over the config's shards or shards it writes itself; memory is the peak of every "
                    "process of the run. Run it plainly, under torchrun (every rank takes part), or with --nproc to "
                    "compare process counts on this machine.")
    train.add_argument("config", type=Path, help="the training YAML config")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    train.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    train.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    train.add_argument("--nproc", help="comma-separated process counts to compare under torchrun, e.g. 1,2")
    train.add_argument("--encoded", action="store_true",
                       help="train on pre-encoded shards: latents (and text embeddings for a frozen text encoder) "
                            "instead of pixels; without data.shards it writes such shards for the model's own VAE")
    train.add_argument("--sweep", action="append", metavar="KEY=V1,V2",
                       help="run every combination of these values, each in its own process, one table row each "
                            "(repeat the flag), e.g. --sweep data.batch_size=1,2,4 --sweep ema.enabled=true,false")
    train.add_argument("--peak-seconds", type=float, default=2.0,
                       help="time spent measuring this machine's peak GFLOP/s for MFU, before and after (default 2)")
    train.add_argument("--no-save", dest="save", action="store_false",
                       help="skip timing a checkpoint save (for a full-size model it writes weights, EMA and "
                            "optimizer state: many GB)")
    train.add_argument("--plan", action="store_true",
                       help="load the model and print the memory planner's figures for the config (expected peak, "
                            "checkpointing, frozen weights' storage) without running a step: a clip size whose "
                            "step takes hours is planned in the time loading takes")
    train.add_argument("--out", type=Path, help="also write the result as JSON here")
    train.set_defaults(run=run)

    data = kinds.add_parser(
        "data", help="the loader's samples/s for a config, beside the training step's consumption rate",
        description="Reads the config's shards through the training loader (decode, crop, tokenize) with each "
                    "worker count, then times the training step, so the two rates can be compared. The loader "
                    "should deliver several times what training consumes.")
    data.add_argument("config", type=Path, help="the training YAML config (data.shards must name real data)")
    data.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    data.add_argument("--workers", default="0,2", help="comma-separated loader worker counts (default 0,2)")
    data.add_argument("--batches", type=int, default=50, help="batches timed per worker count (default 50)")
    data.add_argument("--train-steps", type=int, default=10, help="training steps timed; 0 skips (default 10)")
    data.add_argument("--out", type=Path, help="also write the result as JSON here")
    data.set_defaults(run=run_data)


def run(args: argparse.Namespace) -> int:
    from sdtrain import benchmark
    from sdtrain.config import load_config
    from sdtrain.distributed import barrier, destroy, detect_topology, exit_without_teardown, is_distributed
    from sdtrain.models.build import resolve_sources

    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be at least 1 and --warmup at least 0")
    if args.plan and (args.sweep or args.nproc):
        raise UserError("--plan plans one configuration in this process: drop --sweep and --nproc")
    if args.sweep and args.nproc:
        raise UserError("--sweep and --nproc: choose one; sweep under torchrun by giving the process count a key")
    if args.sweep:
        keys, results = benchmark.run_sweep(args.config, args.overrides, args.sweep, args.steps, args.warmup,
                                            args.encoded, args.peak_seconds)
        print(benchmark.format_results(results, keys))
        if args.out:
            benchmark.write_result(args.out, results)
        return 0
    if args.nproc:
        try:
            counts = [int(n) for n in args.nproc.split(",")]
        except ValueError:
            raise UserError(f"--nproc {args.nproc}: expected process counts such as 1,2") from None
        overrides = benchmark.benchmark_overrides(args.config, args.overrides, run_dir="unused")
        results = benchmark.compare_processes(args.config, [o for o in overrides if not o.startswith("run_dir=")],
                                              counts, args.steps, args.warmup, args.encoded, args.peak_seconds)
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
    config = resolve_sources(config)
    try:
        result = benchmark.run_benchmark(config, args.steps, args.warmup, args.encoded, args.peak_seconds,
                                         args.save, plan_only=args.plan)
    except BaseException:
        destroy()
        raise
    finally:
        if scratch is not None:
            scratch.cleanup()
    if result is not None:
        print(benchmark.format_plan(result) if args.plan else benchmark.format_results([result]))
        print(json.dumps(result))
        if args.out:
            benchmark.write_result(args.out, result)
    if is_distributed():
        barrier()  # the main rank has written its result
        exit_without_teardown(0)
    return 0


def run_data(args: argparse.Namespace) -> int:
    from sdtrain import benchmark
    from sdtrain.config import load_config
    from sdtrain.models.build import resolve_sources

    try:
        workers = [int(n) for n in args.workers.split(",")]
    except ValueError:
        raise UserError(f"--workers {args.workers}: expected worker counts such as 0,2") from None
    if args.batches < 1 or args.train_steps < 0:
        raise UserError("--batches must be at least 1 and --train-steps at least 0")
    with tempfile.TemporaryDirectory(prefix="sdtrain-benchmark-") as scratch:
        config = load_config(args.config, benchmark.benchmark_overrides(args.config, args.overrides, scratch))
        config = resolve_sources(config)
        result = benchmark.benchmark_data(config, workers, args.batches, args.train_steps)
    print(benchmark.format_data_results(result))
    if args.out:
        benchmark.write_result(args.out, result)
    return 0
