"""`sdtrain` entry point: parse, dispatch to a subcommand module, print user errors as one line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from sdtrain.runtime import tune_host_allocator

# Before anything imports torch: its allocator reads the setting once, at its first allocation.
tune_host_allocator()

from sdtrain import __version__  # noqa: E402
from sdtrain.cli import (  # noqa: E402
    benchmark,
    data,
    demo,
    docs,
    evaluate,
    export,
    generate,
    launch,
    params,
    prepare,
    report,
    train,
    ui,
)
from sdtrain.errors import UserError  # noqa: E402

COMMANDS = (prepare, data, train, generate, evaluate, export, launch, benchmark, params, report, demo, docs, ui)


def _quiet_libraries() -> None:
    # HF_HUB_OFFLINE is the user's to set, not ours: every load passes local_files_only, and the Hub is reached
    # only to fetch a Hub id (org/name) that is not cached yet (sdtrain.models.hub); HF_HUB_OFFLINE=1 keeps even
    # that to the cache.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # The libraries set their own loggers' levels as they import, from these: a level set before would be undone.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", message=".*torchvision.*")
    # bitsandbytes' logger is quieted where sdtrain is first imported (sdtrain/__init__.py), loader workers included.
    for name in ("diffusers", "transformers", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdtrain", description="Train latent text-to-image diffusion models.")
    parser.add_argument("--version", action="version", version=f"sdtrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    # The demo is a script of the whole CLI, which lists the demo among its commands: it is handed the entry
    # point rather than importing it.
    parser.set_defaults(cli=main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # argparse stops filling a positional list at the first option, so `CONFIG --steps 5 key=value` would
    # leave key=value over; overrides may stand anywhere after the config.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or not all("=" in item and not item.startswith("-") for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    _quiet_libraries()
    try:
        return int(args.run(args) or 0)
    except UserError as exc:
        # A check that found several problems (`sdtrain train --check`) says each on a line of its own.
        for line in str(exc).splitlines() or [""]:
            print(f"sdtrain {args.command}: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sdtrain {args.command}: interrupted", file=sys.stderr)
        return 130
