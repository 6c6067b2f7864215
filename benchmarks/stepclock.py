"""Run a training script or module and record the wall time at which each optimizer step ends.

    STEPCLOCK_FILE=clock.txt STEPCLOCK_TOTAL=20 STEPCLOCK_DESC=Steps,train \
        python stepclock.py train_text_to_image.py ARGS...      # or: python stepclock.py -m sdtrain train ...

Both tools advance a tqdm progress bar once per optimizer step, after the optimizer and EMA updates and
before anything else (diffusers' example: ``progress_bar.update(1)`` under ``sync_gradients``; sdtrain:
``RunLogger.advance`` right after ``train_step``). This wraps ``tqdm.std.tqdm.update`` (every tqdm
flavour inherits it) and appends ``<unix time> <bar position> <process CPU seconds>`` to STEPCLOCK_FILE
for the bar whose total is STEPCLOCK_TOTAL and whose description is one of STEPCLOCK_DESC, so both tools
are timed by the same clock at the same point of their loop. The CPU seconds (all threads of the
training process, not its loader workers) give a figure that other load on the machine disturbs less
than wall time. Nothing else of either tool changes. The peer runs this file under ``accelerate launch``
as its training script, which passes the environment on.
"""

from __future__ import annotations

import os
import runpy
import sys
import time


def install() -> None:
    path = os.environ.get("STEPCLOCK_FILE")
    if not path:
        return
    total = int(os.environ.get("STEPCLOCK_TOTAL", "0"))
    descs = set(os.environ.get("STEPCLOCK_DESC", "Steps,train").split(","))
    import tqdm.std

    original = tqdm.std.tqdm.update
    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole process

    def update(self, n=1):
        result = original(self, n)
        if self.total == total and str(getattr(self, "desc", "")).rstrip(": ") in descs:
            out.write(f"{time.time():.6f} {self.n} {time.process_time():.6f}\n")
        return result

    tqdm.std.tqdm.update = update


def main() -> None:
    args = sys.argv[1:]
    if not args:
        sys.exit("usage: stepclock.py SCRIPT ARGS... | stepclock.py -m MODULE ARGS...")
    install()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        # The script's own folder first on sys.path, as `python SCRIPT` would have it.
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
