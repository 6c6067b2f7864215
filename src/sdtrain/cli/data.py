"""`sdtrain data preview CONFIG [key=value ...]`: the first samples as training receives them."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="look at a config's training data as the model receives it")
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    preview = kinds.add_parser(
        "preview", help="a grid of the first samples exactly as training receives them, with their captions",
        description="Reads data.shards as a run of this config would (decoding, orientation, background, crop, "
                    "flip, aspect buckets, the caption drawn for each sample, tag shuffling, caption dropout) and "
                    "tiles the first samples with their captions, a clip (video) as a strip of evenly spaced "
                    "frames; prints how many samples were skipped (undecodable) or filtered on the way. Nothing is "
                    "trained or loaded but the data.")
    preview.add_argument("config", type=Path, help="a training YAML config")
    preview.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    preview.add_argument("--num", type=int, default=16, metavar="N", help="samples to show (default 16)")
    preview.add_argument("--out", type=Path, default=Path("data-preview.png"), metavar="PNG",
                         help="where to write the grid (default data-preview.png)")
    preview.set_defaults(run=run_preview)


def run_preview(args: argparse.Namespace) -> int:
    from sdtrain.config import load_config_without
    from sdtrain.data.preview import preview_data
    from sdtrain.errors import UserError

    if args.num < 1:
        raise UserError("--num: must be at least 1")
    config = load_config_without(args.config, args.overrides, keep=("data.shards",))
    data = config.data
    if config.stage == "diffusion":
        from sdtrain.models import families
        from sdtrain.train.modes import make_part

        # What the mode makes of the data settings: its captions' dropout (a ControlNet's family's), its templates.
        data = make_part(config, families.for_model(config.model)).data_config(data)
    result = preview_data(data, config.seed, args.num, args.out)
    print(f"{result['grid']}: the first {result['samples']} samples as training receives them "
          f"({result['skipped']} skipped as undecodable, {result['filtered']} filtered by data.filters on the way)")
    return 0
