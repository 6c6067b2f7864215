"""Does a ControlNet put each shape where its map does? The shapes demo's measure (issue: control and edit).

Each prompt names two shapes, one on the left and one on the right; its layout map (each shape's silhouette in its
colour, as `prepare shapes --conditioning layout` draws them) places them on the SWAPPED sides. An image follows the
map when the shapes read from its pixels (sdtrain.evaluate.adherence.detect_shapes) are the map's two colours in
the map's left-to-right order. The same prompts and seeds run through the base pipeline with the ControlNet's scale
at 0 as the reference: the demo's model alone leaves the side to its starting noise (or follows the caption).

    python benchmarks/controlnet_layout.py --model runs/demo/pipeline --controlnet out/cn/controlnet --num 50
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from sdtrain.data.shapes import COLOURS, KINDS, layout_map, shape_phrase
from sdtrain.evaluate.adherence import detect_shapes


def layout_prompts(num: int, size: int, seed: int = 0) -> list[tuple[str, object, list[str]]]:
    """(prompt, swapped layout map, the map's colours left to right) for `num` pairs of distinct colours."""
    rng = np.random.default_rng(seed)
    colours = list(COLOURS)
    out = []
    for _ in range(num):
        first, second = rng.choice(len(colours), size=2, replace=False)
        kinds = [KINDS[int(k)] for k in rng.integers(len(KINDS), size=2)]
        named = [(colours[first], kinds[0]), (colours[second], kinds[1])]
        prompt = f"{shape_phrase(*named[0])} on the left and {shape_phrase(*named[1])} on the right"
        side = int(rng.integers(int(size * 0.25), int(size * 0.42) + 1))
        half = size // 2
        boxes = []
        for lo in (half, 0):  # the first named shape on the right, the second on the left: swapped
            x0, y0 = int(rng.integers(lo, lo + half - side + 1)), int(rng.integers(0, size - side + 1))
            boxes.append([x0, y0, x0 + side, y0 + side])
        shapes = [{"colour": c, "kind": k, "box": b} for (c, k), b in zip(named, boxes)]
        out.append((prompt, layout_map(shapes, size), [named[1][0], named[0][0]]))
    return out


def follows(image, expected: list[str]) -> bool:
    found = [s["colour"] for s in detect_shapes(image)]
    return found == expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the base pipeline folder (the demo's runs/demo/pipeline)")
    parser.add_argument("--controlnet", required=True, help="the exported ControlNet folder (OUT/controlnet)")
    parser.add_argument("--num", type=int, default=50)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args()
    from diffusers import ControlNetModel

    from sdtrain.generate import load_pipeline
    from sdtrain.models import families

    base = load_pipeline(args.model, device="cpu")
    controlnet = ControlNetModel.from_pretrained(args.controlnet)
    pipe = families.of_pipeline(base).controlnet.pipeline_class.from_pipe(base, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    cases = layout_prompts(args.num, args.size)
    start = time.perf_counter()
    result = {}
    for scale in (1.0, 0.0):
        hits = 0
        for i, (prompt, layout, expected) in enumerate(cases):
            image = pipe(prompt, image=layout, num_inference_steps=args.steps, height=args.size, width=args.size,
                         controlnet_conditioning_scale=scale, generator=torch.Generator().manual_seed(i)).images[0]
            hits += follows(image, expected)
        result["controlnet" if scale else "base"] = hits / len(cases)
    result.update(num=len(cases), steps=args.steps, size=args.size, seconds=round(time.perf_counter() - start, 1))
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
