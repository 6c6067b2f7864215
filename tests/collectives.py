"""Under torchrun: `sdtrain train ARGS` with every explicit collective of torch.distributed counted, step by step.

    torchrun --nproc_per_node 2 -m tests.collectives OUT_FOLDER train CONFIG key=value ...

writes OUT_FOLDER/rank<R>.json: for each training step but the last, the names of the collectives called from its
start to the next step's start (the loop's own work after a step included). DDP's gradient all-reduce runs in its
C++ reducer and is not counted: what is counted is what sdtrain itself asks of every rank each step."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from sdtrain.cli.main import main as sdtrain_main
from sdtrain.train.trainer import Trainer

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "reduce_scatter_tensor", "gather_object", "scatter")


def main(argv: list[str]) -> int:
    out, args = Path(argv[0]), argv[1:]
    out.mkdir(parents=True, exist_ok=True)
    # A distributed run ends without tearing down (os._exit): each step start writes what the steps before called.
    written = out / f"rank{os.environ.get('RANK', '0')}.json"
    steps: list[list[str]] = []

    def counted(name: str, call):
        def wrapper(*a, **k):
            if steps:
                steps[-1].append(name)
            return call(*a, **k)
        return wrapper

    for name in COLLECTIVES:
        setattr(dist, name, counted(name, getattr(dist, name)))
    step = Trainer.train_step

    def counting_step(self):
        written.write_text(json.dumps(steps))
        steps.append([])
        return step(self)

    Trainer.train_step = counting_step
    return sdtrain_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
