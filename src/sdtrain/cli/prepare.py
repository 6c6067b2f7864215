"""`sdtrain prepare`: turn data into WebDataset shards with a manifest."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("prepare", help="write training shards")
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="SOURCE")
    shapes = kinds.add_parser("shapes", help="the embedded demo dataset: coloured shapes with exact captions")
    shapes.add_argument("--out", type=Path, required=True, help="output folder for shards and manifest.json")
    shapes.add_argument("--num", type=int, default=2000, help="number of samples")
    shapes.add_argument("--seed", type=int, default=0, help="seed; the same seed gives identical shards")
    shapes.add_argument("--size", type=int, default=64, help="image side in pixels")
    shapes.add_argument("--samples-per-shard", type=int, default=1000)
    shapes.set_defaults(run=run_shapes)


def run_shapes(args: argparse.Namespace) -> int:
    from sdtrain.data.shapes import write_shapes_dataset
    from sdtrain.errors import UserError

    if args.samples_per_shard < 1:
        raise UserError("--samples-per-shard: must be at least 1")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out: {args.out} is a file; choose a folder")

    manifest = write_shapes_dataset(args.out, num=args.num, seed=args.seed, size=args.size,
                                    samples_per_shard=args.samples_per_shard)
    print(f"wrote {manifest['total']} samples in {len(manifest['shards'])} shards to {args.out}")
    return 0
