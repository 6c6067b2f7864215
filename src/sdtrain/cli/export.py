"""`sdtrain export RUN --out DIR`."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("export", help="write a run's model as a diffusers folder")
    parser.add_argument("run_dir", type=Path, help="a training run folder")
    parser.add_argument("--out", type=Path, required=True, help="output folder (replaced when complete)")
    parser.add_argument("--no-ema", dest="ema", action="store_false", help="export the raw weights, not the EMA")
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint folder other than the newest")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sdtrain.export import export_run

    out = export_run(args.run_dir, args.out, ema=args.ema, checkpoint=args.checkpoint)
    print(f"exported to {out}")
    return 0
