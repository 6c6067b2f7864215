"""Does InstructPix2Pix learn to edit? The shapes demo's measure: recolour the shape of the source as told.

Each edit pairs a source (one shape of the shapes dataset, in one of its colours) with the same shape, same place,
in another colour; its caption is the instruction ("make it blue"). An output is an edit when the one shape read
from its pixels (sdtrain.evaluate.adherence.detect_shapes) has the instructed colour and sits where the source's
does (its centre within a quarter of the shape's side). The base pipeline, which cannot see the source, draws from
the same instructions as the reference.

    python benchmarks/instruct_pix2pix_recolour.py data --out data/edits --num 4000
    sdtrain prepare folder data/edits --out data/edits-shards
    sdtrain train configs/instruct-pix2pix.yaml model.pretrained=runs/demo/pipeline data.shards=data/edits-shards ...
    sdtrain export runs/ip2p --out out/ip2p
    python benchmarks/instruct_pix2pix_recolour.py score --model out/ip2p --base runs/demo/pipeline --num 100
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from sdtrain.data.shapes import COLOURS, draw_shapes, render_shapes_sample
from sdtrain.evaluate.adherence import detect_shapes


def edits(num: int, size: int, seed: int) -> list[tuple[object, object, str, dict]]:
    """(source image, edited image, instruction, the edited shape) for `num` one-shape samples."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        _, _, meta = render_shapes_sample(rng, size, num_shapes=1)
        shape = meta["shapes"][0]
        target = str(rng.choice([c for c in COLOURS if c != shape["colour"]]))
        background = tuple(int(v) for v in rng.integers(225, 256, size=3))
        edited = {**shape, "colour": target}
        out.append((draw_shapes([shape], size, background), draw_shapes([edited], size, background),
                    f"make it {target}", edited))
    return out


def is_edit(image, shape: dict) -> bool:
    found = detect_shapes(image)
    if len(found) != 1 or found[0]["colour"] != shape["colour"]:
        return False
    x0, y0, x1, y1 = shape["box"]
    # detect_shapes' order is twice its box centre (x, y): against the source's, within a quarter of the side.
    (twice_x, twice_y), side = found[0]["order"], x1 - x0
    return abs(twice_x / 2 - (x0 + x1) / 2) <= side / 4 and abs(twice_y / 2 - (y0 + y1) / 2) <= side / 4


def write_data(out: Path, num: int, size: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for i, (source, edited, instruction, _) in enumerate(edits(num, size, seed=1)):
        source.save(out / f"{i:06d}.src.png")
        edited.save(out / f"{i:06d}.png")
        (out / f"{i:06d}.txt").write_text(instruction + "\n")


def score(model: str, base: str, num: int, size: int, steps: int) -> dict:
    from sdtrain.generate import load_pipeline

    cases = edits(num, size, seed=2)  # held out: another seed than the training data's
    pipe, plain = load_pipeline(model, device="cpu"), load_pipeline(base, device="cpu")
    for p in (pipe, plain):
        p.set_progress_bar_config(disable=True)
    start = time.perf_counter()
    hits = {"instruct_pix2pix": 0, "base": 0}
    for i, (source, _, instruction, shape) in enumerate(cases):
        image = pipe(instruction, image=source, num_inference_steps=steps,
                     generator=torch.Generator().manual_seed(i)).images[0]
        hits["instruct_pix2pix"] += is_edit(image, shape)
        image = plain(instruction, num_inference_steps=steps, height=size, width=size,
                      generator=torch.Generator().manual_seed(i)).images[0]
        hits["base"] += is_edit(image, shape)
    return {**{k: v / num for k, v in hits.items()}, "num": num, "steps": steps, "size": size,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="write a folder of edits for `sdtrain prepare folder`")
    data.add_argument("--out", type=Path, required=True)
    data.add_argument("--num", type=int, default=4000)
    data.add_argument("--size", type=int, default=64)
    measure = sub.add_parser("score", help="the share of held-out instructions each model carries out")
    measure.add_argument("--model", required=True, help="the exported InstructPix2Pix pipeline")
    measure.add_argument("--base", required=True, help="the base pipeline it was trained from")
    measure.add_argument("--num", type=int, default=100)
    measure.add_argument("--size", type=int, default=64)
    measure.add_argument("--steps", type=int, default=30)
    measure.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args()
    if args.command == "data":
        write_data(args.out, args.num, args.size)
        return
    result = score(args.model, args.base, args.num, args.size, args.steps)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
