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
    from sdtrain.config import load_config_without
    from sdtrain.models.build import resolve_sources
    from sdtrain.params import count, format_counts

    # Counting needs neither data nor a run folder, and a component the config asks for but the command line
    # does not name is counted from its preset.
    config = load_config_without(args.config, args.overrides)
    config = resolve_sources(config)
    rows = count(config)
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else format_counts(rows))
    return 0
