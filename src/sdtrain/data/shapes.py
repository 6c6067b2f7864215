"""The embedded demo dataset: coloured circles, squares and triangles with exact captions.

Small enough to generate in seconds and simple enough that a tiny model can learn it on a CPU, while the
captions still make text conditioning matter (colour, kind, and which side for two shapes).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from sdtrain.data.encoded import CONDITIONING_IMAGE
from sdtrain.data.shards import ShardWriter, read_manifest
from sdtrain.errors import UserError

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 210, 20),
    "purple": (140, 40, 190),
    "orange": (245, 130, 15),
}
KINDS: tuple[str, ...] = ("circle", "square", "triangle")

_SUPERSAMPLE = 4


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def shape_phrase(colour: str, kind: str) -> str:
    """``"a red circle"`` / ``"an orange square"``: the one place the article rule lives."""
    return f"{_article(colour)} {colour} {kind}"


SIDES: tuple[str, ...] = ("on the left", "on the right")
PHRASINGS: tuple[str, ...] = ("sides", "sides_reversed", "plain")
"""How a caption names two shapes: each with its side, left one first (``a blue square on the left and a yellow
triangle on the right``); each with its side, right one first (``a yellow triangle on the right and a blue square
on the left``); or without sides, left one first (``a blue square and a yellow triangle``)."""


def caption_for(shapes: list[dict], phrasing: str = "sides") -> str:
    """Caption for shapes already in left-to-right order: ``"a red circle"``, or for two the `phrasing` of
    ``PHRASINGS``. Naming the sides gives each one a word of its own to attend to; with the order alone, the
    model often learned the pair but not its order."""
    phrases = [shape_phrase(s["colour"], s["kind"]) for s in shapes]
    if len(shapes) == 1:
        return phrases[0]
    if phrasing == "plain":
        return " and ".join(phrases)
    sided = [f"{phrase} {side}" for phrase, side in zip(phrases, SIDES)]
    if phrasing == "sides_reversed":
        sided.reverse()
    elif phrasing != "sides":
        raise ValueError(f"phrasing must be one of {', '.join(PHRASINGS)}, got {phrasing!r}")
    return " and ".join(sided)


def captions_for(shapes: list[dict]) -> list[str]:
    """Every phrasing of the shapes' caption (one for a single shape): a sample's caption holds them one per line,
    and the loader draws one each time it reads the sample, so the model answers however a pair is asked for."""
    return list(dict.fromkeys(caption_for(shapes, phrasing) for phrasing in PHRASINGS))


def caption_prompts() -> list[str]:
    """Fixed demo prompts covering every colour and kind, phrased like the training captions: six single shapes,
    then two pairs in each of the ``PHRASINGS``."""
    singles = [("red", "circle"), ("blue", "square"), ("green", "triangle"), ("yellow", "circle"),
               ("purple", "square"), ("orange", "triangle")]
    pairs = [[("red", "square"), ("blue", "circle")], [("green", "circle"), ("yellow", "triangle")],
             [("orange", "circle"), ("purple", "triangle")], [("blue", "triangle"), ("red", "circle")],
             [("yellow", "square"), ("green", "triangle")], [("purple", "circle"), ("orange", "square")]]
    prompts = [caption_for([{"colour": c, "kind": k}]) for c, k in singles]
    for index, pair in enumerate(pairs):
        prompts.append(caption_for([{"colour": c, "kind": k} for c, k in pair], PHRASINGS[index // 2]))
    return prompts


def _random_box(rng: np.random.Generator, size: int, lo: float, hi: float,
                x_range: tuple[int, int] | None = None) -> list[int]:
    side = int(rng.integers(max(2, round(lo * size)), max(3, round(hi * size)) + 1))
    x_lo, x_hi = x_range or (0, size)
    x0, y0 = int(rng.integers(x_lo, x_hi - side + 1)), int(rng.integers(0, size - side + 1))
    return [x0, y0, x0 + side, y0 + side]


def _draw(draw: ImageDraw.ImageDraw, kind: str, box: list[int], fill: tuple[int, int, int]) -> None:
    s = _SUPERSAMPLE
    # Boxes are [x0, y0, x1, y1) in output pixels; PIL's ellipse/rectangle include their end coordinate.
    x0, y0, x1, y1 = box[0] * s, box[1] * s, box[2] * s - 1, box[3] * s - 1
    if kind == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif kind == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:
        # Upright isosceles triangle on the box bottom, so the box centre is always inside the shape.
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)


def render_shapes_sample(
    rng: np.random.Generator, size: int = 64, num_shapes: int | None = None
) -> tuple[Image.Image, str, dict]:
    """Draw one or two shapes on a light background; return (RGB image, captions one per line, json metadata).

    ``num_shapes`` None picks 1 or 2 with equal odds. Metadata lists shapes left to right by box centre,
    matching the caption order and the drawing order; boxes are ``[x0, y0, x1, y1]`` pixels, end exclusive.
    """
    if num_shapes is None:
        num_shapes = 1 + int(rng.integers(0, 2))
    if num_shapes not in (1, 2):
        raise ValueError(f"num_shapes must be 1 or 2, got {num_shapes}")
    names = list(COLOURS)
    shapes: list[dict] = []
    while len(shapes) < num_shapes:
        colour, kind = names[int(rng.integers(len(names)))], KINDS[int(rng.integers(len(KINDS)))]
        # "a red circle and a red circle" would be a poor caption; ask for distinct pairs instead.
        if any(s["colour"] == colour and s["kind"] == kind for s in shapes):
            continue
        shapes.append({"colour": colour, "kind": kind})

    if num_shapes == 1:
        shapes[0]["box"] = _random_box(rng, size, 0.35, 0.6)
    else:
        # One shape in each half: the caption's left-to-right order is never a judgement call, the shapes
        # never overlap, and a third shape would stand where the data never shows one.
        half = size // 2
        shapes[0]["box"] = _random_box(rng, size, 0.25, 0.42, (0, half))
        shapes[1]["box"] = _random_box(rng, size, 0.25, 0.42, (half, size))

    background = tuple(int(v) for v in rng.integers(225, 256, size=3))
    image = draw_shapes(shapes, size, background)
    meta = {"width": size, "height": size, "shapes": shapes}
    return image, "\n".join(captions_for(shapes)), meta


def draw_shapes(shapes: list[dict], size: int, background: tuple[int, int, int]) -> Image.Image:
    """`shapes` (render_shapes_sample's metadata) drawn on `background`, anti-aliased as the dataset draws them."""
    big = Image.new("RGB", (size * _SUPERSAMPLE, size * _SUPERSAMPLE), background)
    draw = ImageDraw.Draw(big)
    for s in shapes:
        _draw(draw, s["kind"], s["box"], COLOURS[s["colour"]])
    return big.resize((size, size), Image.Resampling.LANCZOS)


def layout_map(shapes: list[dict], size: int) -> Image.Image:
    """Where each of `shapes` is (render_shapes_sample's metadata): its silhouette in its colour on black, drawn as
    the image draws it: a ControlNet's conditioning image that says which shape goes where."""
    return draw_shapes(shapes, size, (0, 0, 0))


def _png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    # Explicit encoder settings so the bytes (and shard sha256s) don't drift with PIL defaults.
    image.save(buf, format="PNG", compress_level=6, optimize=False)
    return buf.getvalue()


def write_shapes_dataset(
    out_dir: str | Path,
    num: int,
    seed: int = 0,
    samples_per_shard: int = 1000,
    size: int = 64,
    two_shape_fraction: float = 0.5,
    layout: bool = False,
) -> dict:
    """Write ``num`` shapes samples as WebDataset shards plus manifest; return the manifest dict.

    Each sample gets its own generator seeded from ``(seed, index)``: output is byte-identical for a given
    seed, and sample ``i`` is the same whatever ``num`` is, so datasets can be extended or generated in
    parallel later. With `layout`, each sample also holds its layout map (`layout_map`) as its conditioning image.
    """
    if num < 0:
        raise UserError(f"shapes dataset: num must be >= 0, got {num}")
    if size < 16:
        raise UserError(f"shapes dataset: size must be >= 16 pixels, got {size}")
    if not 0.0 <= two_shape_fraction <= 1.0:
        raise UserError(f"shapes dataset: two_shape_fraction must be in [0, 1], got {two_shape_fraction}")
    if seed < 0:
        raise UserError(f"shapes dataset: seed must be >= 0, got {seed}")
    extra = {"source": "shapes", "seed": seed, "size": size, **({"conditioning": "layout"} if layout else {})}
    with ShardWriter(out_dir, samples_per_shard, extra=extra) as writer:
        for i in range(num):
            rng = np.random.Generator(np.random.PCG64([seed, i]))
            num_shapes = 2 if rng.random() < two_shape_fraction else 1
            image, caption, meta = render_shapes_sample(rng, size, num_shapes)
            sample = {"__key__": f"{i:08d}", "png": _png_bytes(image), "txt": caption, "json": meta}
            if layout:
                sample[CONDITIONING_IMAGE] = _png_bytes(layout_map(meta["shapes"], size))
            writer.write(sample)
    manifest = read_manifest(out_dir)
    assert manifest is not None
    return manifest
