"""`sdtrain report RUN [--out PATH]`: one self-contained HTML page about a run, to open in any browser."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("report", help="write one self-contained HTML page of a run's metrics, samples and setup",
                            description="Writes RUN/report.html (or --out): a verdict on the loss trend, a summary, "
                                        "plots of every logged metric, the validation grids, the resolved config "
                                        "and the environment. Images and plots are inside the page; it needs no "
                                        "network or server, and can be written while the run trains.")
    parser.add_argument("run_dir", type=Path, metavar="RUN", help="a training run folder")
    parser.add_argument("--out", type=Path, help="the HTML file to write (default RUN/report.html)")
    parser.add_argument("--images", type=int, default=None, metavar="N",
                        help="validation grids to include: the N newest and the first (default 12)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sdtrain.errors import UserError
    from sdtrain.report import MAX_IMAGES, write_report

    if args.images is not None and args.images < 1:
        raise UserError(f"--images {args.images}: pass 1 or more")
    out = write_report(args.run_dir, args.out, images=args.images or MAX_IMAGES)
    print(f"report: {out}")
    return 0
