"""`sdtrain docs config [--out PATH]`: the configuration reference, generated from the config's field docstrings."""

from __future__ import annotations

# Commands import what they run inside their functions: `sdtrain --help` and a mistyped argument answer
# without loading torch, diffusers or the data stack.
import argparse
import os
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("docs", help="generate reference pages from the code (the configuration keys)",
                            description="Generates documentation from the code itself, so it cannot drift from it.")
    pages = parser.add_subparsers(dest="page", required=True, metavar="PAGE")
    config = pages.add_parser("config", help="the configuration reference, as Markdown",
                              description="Prints (or writes) the Markdown reference of every configuration key: "
                                          "its type, default and the docstring written after it in "
                                          "src/sdtrain/config.py. `make docs` writes docs/configuration.md.")
    config.add_argument("--out", type=Path, help="write the page to this file (atomically) instead of printing it")
    config.set_defaults(run=run_config)


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary name beside the file and rename it into place: readers (and an interrupted
    run) never leave half a page. Not sdtrain.utils' helper, which would load torch for a text file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run_config(args: argparse.Namespace) -> int:
    from sdtrain.cli.config_reference import render

    text = render()
    if args.out is None:
        sys.stdout.write(text)
        return 0
    if not args.out.parent.is_dir():
        from sdtrain.errors import UserError

        raise UserError(f"--out {args.out}: the folder {args.out.parent} does not exist")
    write_atomic(args.out, text)
    print(f"docs: {args.out} ({len(text.encode('utf-8'))} bytes)", file=sys.stderr)
    return 0
