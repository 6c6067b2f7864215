"""`sdtrain params CONFIG [key=value ...]`: parameter counts per component."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
import json
from dataclasses import asdict
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("params", help="total and trainable parameters of a config's model, per component",
                            description="Counts the parameters of the model a training config describes, "
                                        "building preset components on the meta device (no memory, no weights).")
    parser.add_argument("config", type=Path, help="a training YAML config")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from sdtrain.config import load_config, parse_overrides, read_layer
    from sdtrain.params import count, format_counts

    # Counting needs neither data nor a run folder, and a component the config asks for but the command line
    # does not name is counted from its preset: fill what the config leaves open.
    given = OmegaConf.merge(read_layer(args.config)[0], parse_overrides(args.overrides))
    open_keys = {"run_dir", "data.shards"} | set(OmegaConf.missing_keys(given))
    filled = [f"{key}={'null' if key.startswith('model.') else 'unused'}" for key in sorted(open_keys)
              if OmegaConf.select(given, key, default=None) is None or OmegaConf.is_missing(given, key)]
    rows = count(load_config(args.config, [*filled, *args.overrides]))
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else format_counts(rows))
    return 0
