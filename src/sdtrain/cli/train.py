"""`sdtrain train CONFIG [key=value ...]`."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
import contextlib
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("train", help="train the stage a config describes (autoencoder or diffusion)")
    parser.add_argument("config", type=Path, help="YAML config")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.max_steps=100")
    parser.add_argument("--check", action="store_true",
                        help="check the config against its model's family and its mode without loading any weight "
                             "(Hub models: their config files only), print every key they cannot take, and exit")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sdtrain.config import load_config

    if args.check:
        return check(args.config, args.overrides)
    # Validate before the heavy imports, so a typo is reported at once.
    config = load_config(args.config, args.overrides)
    from sdtrain.models.build import resolve_sources

    # Hub ids (org/name) become their folders in the Hugging Face cache, fetched if not cached: the run's
    # config.yaml and checkpoints record those folders, the same commit on resume and export.
    config = resolve_sources(config)
    from sdtrain.distributed import RankFailure, destroy, detect_topology, exit_without_teardown, is_distributed
    from sdtrain.run import run_dir_lock
    from sdtrain.train.trainer import Preempted, Trainer

    # One job per run folder: its first rank holds it, the job's other ranks write through that rank.
    holding = run_dir_lock(config.run_dir) if detect_topology().rank == 0 else contextlib.nullcontext()
    try:
        with holding:
            trainer = Trainer(config)
            final = trainer.train()
        code, message = 0, f"finished: {config.run_dir} (checkpoint {final})" if trainer.is_main else None
    except Preempted as stop:
        code, message = Preempted.exit_code, f"sdtrain train: {stop}"
    except RankFailure as failure:
        # The process group is broken: tearing it down can hang on the dead peer, so leave at once and let
        # the launcher end the job (and restart it, where it restarts failed jobs).
        print(f"sdtrain train: error: {failure}", file=sys.stderr)
        exit_without_teardown(2)
    except BaseException:
        destroy()
        raise
    if message:
        print(message, file=sys.stderr if code else sys.stdout)
    if is_distributed():
        # Everything is saved and every rank has passed the final barrier.
        exit_without_teardown(code)
    return code


def check(path: Path, overrides: list[str]) -> int:
    """`sdtrain train --check`: every problem one line, from the config and the models' config files alone. The
    run folder and the data may still be open; the model's sources, which say its family, may not."""
    from sdtrain.config import FLAT_COMPONENTS, load_config_without
    from sdtrain.errors import UserError
    from sdtrain.models.build import resolve_sources

    sources = ("model.pretrained", "model.components", *(f"model.{name}" for name in FLAT_COMPONENTS))
    config = load_config_without(path, overrides, keep=sources)
    from sdtrain.train.modes import capability

    trains, problems = capability(resolve_sources(config, fetch_weights=False))
    if problems:
        raise UserError("\n".join(problems))
    print(f"{path}: ok: {trains}; no weight was loaded")
    return 0
