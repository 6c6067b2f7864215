"""Prompt adherence for the shapes demo, read from the pixels with no learned model.

A shapes prompt such as ``"a red square on the left and a blue circle on the right"`` promises how many shapes
an image shows, their colours, their kinds and their left-to-right order. :func:`detect_shapes` reads those back:

- background: the median colour of the image border (the renderer paints one flat light colour, generated
  images may add noise, and shapes cover well under half of any border);
- colour: every pixel is explained as a mix of the background and one palette colour with a coverage in
  [0, 1] (exactly how anti-aliased edges are made), picking the palette colour whose mix line passes
  closest; pixels at least half covered are foreground. A shape is then named by the hue of its inside
  (``"other"`` if grey or far from every palette hue);
- shapes: 4-connected components of same-colour foreground; specks (tiny, or with no interior, like the
  thin blended seam where two shapes touch) are ignored;
- kind: from two features of the soft coverages. Lopsidedness, the larger skewness of the mass per row or
  per column, is ~0.57 for a triangle whichever way it points and 0 for squares and circles; blur keeps it
  (a symmetric blur adds nothing to the third moment), so it picks out triangles. The fill ratio
  ``area / (widest row * tallest column)`` then tells squares (1) from circles (pi/4);
- order: by box centre x, then y, as the renderer orders its captions.

:func:`score_image` compares one image with its prompt and :func:`score_images` aggregates;
:func:`adherence_prompts` is the fixed prompt set to generate from.
"""

from __future__ import annotations

import colorsys
from collections.abc import Sequence

import numpy as np
from PIL import Image

from sdtrain.data.shapes import COLOURS, KINDS, PHRASINGS, SIDES, caption_for, shape_phrase

_COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
_PALETTE = np.array([COLOURS[c] for c in _COLOUR_NAMES], dtype=np.float32)
# Shapes span a quarter of the image or more, so this keeps every detail while bounding the cost of big images.
_MAX_SIDE = 128
_BORDER = 2
_MIN_COVERAGE = 0.5
# The smallest rendered shape (a triangle in a box of a quarter of the side) covers ~3% of the image.
_MIN_AREA_FRACTION = 0.005
# A triangle's ideal lopsidedness is 0.57 (blur lowers it, to ~0.4 for small shapes); squares and circles
# stay under ~0.13.
_TRIANGLE_MIN_LOPSIDED = 0.25
# Between the ideal fills of a square (1) and a circle (pi/4), nearer the square's, as blurred circles read high.
_SQUARE_MIN_FILL = 0.89
_PALETTE_HUES = {name: colorsys.rgb_to_hsv(*(np.array(rgb) / 255.0))[0] for name, rgb in COLOURS.items()}
# The palette is vivid (saturation >= 0.8, value >= 0.6) and its hues at least 22 degrees apart; greys, black
# and hues far from all six (cyan, lime) name no palette colour.
_MIN_SATURATION = 0.4
_MIN_VALUE = 0.2
_MAX_HUE_GAP = 30 / 360
_BACKGROUND = -1
OTHER_COLOUR = "other"


def parse_prompt(prompt: str) -> list[tuple[str, str]]:
    """``"a red square on the left and a blue circle on the right"`` -> ``[("red", "square"), ("blue",
    "circle")]``, left to right.

    The language is the demo captions (:func:`~sdtrain.data.shapes.caption_for`): one phrase
    ``"a|an <colour> <kind>"``, or two joined by ``" and "``, each followed by its side (either side first) or
    neither (then read left to right). Case and runs of whitespace are forgiven; anything else raises
    ``ValueError``.
    """
    return _parse(prompt)[0]


def phrasing_of(prompt: str) -> str | None:
    """Which of :data:`~sdtrain.data.shapes.PHRASINGS` a two-shape prompt uses; None for one shape."""
    return _parse(prompt)[1]


def _parse(prompt: str) -> tuple[list[tuple[str, str]], str | None]:
    words = prompt.lower().split()
    left, right = (side.split() for side in SIDES)
    phrasing = None
    if len(words) == 3:
        phrases = [words]
    elif len(words) == 7 and words[3] == "and":
        phrases, phrasing = [words[:3], words[4:]], "plain"
    elif len(words) == 13 and words[3:6] == left and words[6] == "and" and words[10:] == right:
        phrases, phrasing = [words[:3], words[7:10]], "sides"
    elif len(words) == 13 and words[3:6] == right and words[6] == "and" and words[10:] == left:
        phrases, phrasing = [words[7:10], words[:3]], "sides_reversed"
    else:
        raise ValueError(f"not a shapes prompt (one shape, or two joined by 'and'): {prompt!r}")
    shapes = []
    for article, colour, kind in phrases:
        if colour not in COLOURS or kind not in KINDS or shape_phrase(colour, kind).split()[0] != article:
            raise ValueError(f"not a shapes prompt ({' '.join((article, colour, kind))!r} is no shape): {prompt!r}")
        shapes.append((colour, kind))
    return shapes, phrasing


def _as_pixels(image: Image.Image | np.ndarray) -> np.ndarray:
    """Float RGB array in 0..255, at most ``_MAX_SIDE`` pixels a side."""
    if isinstance(image, np.ndarray):
        array = image
        if array.ndim == 2:
            array = np.repeat(array[..., None], 3, axis=2)
        if array.ndim != 3 or array.shape[2] not in (3, 4):
            raise ValueError(f"expected an HxW, HxWx3 or HxWx4 image array, got shape {array.shape}")
        if np.issubdtype(array.dtype, np.floating):
            array = array * 255.0  # float images are in [0, 1], as diffusers pipelines return them
        image = Image.fromarray(np.clip(array[..., :3], 0, 255).astype(np.uint8))
    image = image.convert("RGB")
    if max(image.size) > _MAX_SIDE:
        scale = _MAX_SIDE / max(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.BOX)
    return np.asarray(image, dtype=np.float32)


def _background(pixels: np.ndarray) -> np.ndarray:
    b = _BORDER
    edges = (pixels[:b], pixels[-b:], pixels[:, :b], pixels[:, -b:])
    return np.median(np.concatenate([edge.reshape(-1, 3) for edge in edges]), axis=0)


def _unmix(pixels: np.ndarray, background: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel: the palette index it mixes best with (``_BACKGROUND`` if under half covered), and the
    coverage of every palette colour (H x W x colours, clipped to [0, 1])."""
    offsets = pixels - background  # H x W x 3
    directions = _PALETTE - background  # colours x 3
    lengths_sq = np.maximum((directions**2).sum(axis=1), 1e-6)
    coverage = np.clip(offsets @ directions.T / lengths_sq, 0.0, 1.0)
    # Distance from the pixel to each background-to-colour segment: how badly that mix explains it.
    residual = ((offsets[..., None, :] - coverage[..., None] * directions) ** 2).sum(axis=-1)
    best = residual.argmin(axis=-1)
    best_coverage = np.take_along_axis(coverage, best[..., None], axis=-1)[..., 0]
    classes = np.where(best_coverage >= _MIN_COVERAGE, best, _BACKGROUND)
    return classes, coverage


def _label_components(classes: np.ndarray) -> np.ndarray:
    """Ids of the 4-connected same-class components (a member's flat index); background gets ``h * w``."""
    h, w = classes.shape
    none = h * w
    ids = np.where(classes != _BACKGROUND, np.arange(none).reshape(h, w), none)
    same_right = (classes[:, :-1] == classes[:, 1:]) & (classes[:, 1:] != _BACKGROUND)
    same_below = (classes[:-1] == classes[1:]) & (classes[1:] != _BACKGROUND)
    while True:
        new = ids.copy()
        new[:, :-1] = np.where(same_right, np.minimum(new[:, :-1], ids[:, 1:]), new[:, :-1])
        new[:, 1:] = np.where(same_right, np.minimum(new[:, 1:], ids[:, :-1]), new[:, 1:])
        new[:-1] = np.where(same_below, np.minimum(new[:-1], ids[1:]), new[:-1])
        new[1:] = np.where(same_below, np.minimum(new[1:], ids[:-1]), new[1:])
        # Pointer jumping: an id names a pixel of the same component whose own id is no larger, so
        # following it shortcuts long chains and the loop ends after a few passes, not one per pixel.
        flat = new.ravel()
        labelled = flat < none
        flat[labelled] = flat[flat[labelled]]
        if np.array_equal(new, ids):
            return new
        ids = new


def _neighbourhood(mask: np.ndarray, erode: bool) -> np.ndarray:
    """3x3 erosion (the image edge counts as inside, so shapes touching it keep an interior) or dilation."""
    h, w = mask.shape
    padded = np.pad(mask, 1, mode="edge" if erode else "constant")
    out = mask.copy()
    for dy in range(3):
        for dx in range(3):
            window = padded[dy : dy + h, dx : dx + w]
            out = out & window if erode else out | window
    return out


def _colour_name(rgb: np.ndarray) -> str:
    """The palette colour of this hue, or ``OTHER_COLOUR``: hue, unlike RGB distance, calls a darker or paler
    red red and a grey no colour at all."""
    hue, saturation, value = colorsys.rgb_to_hsv(*(rgb / 255.0))
    if saturation < _MIN_SATURATION or value < _MIN_VALUE:
        return OTHER_COLOUR
    gaps = {name: abs((hue - palette_hue + 0.5) % 1.0 - 0.5) for name, palette_hue in _PALETTE_HUES.items()}
    nearest = min(gaps, key=gaps.__getitem__)
    return nearest if gaps[nearest] <= _MAX_HUE_GAP else OTHER_COLOUR


def _describe(mask: np.ndarray, core: np.ndarray, colour_index: int, classes: np.ndarray, coverage: np.ndarray) -> dict:
    """Kind, the features it was read from, and the renderer-style sort key of one component."""
    # The faint anti-aliased rim lies just outside the half-covered mask; count it, but not the pixels of a
    # neighbouring shape of another colour.
    rim = _neighbourhood(mask, erode=False) & ((classes == colour_index) | (classes == _BACKGROUND))
    # A shape drawn off-palette (a darker red) covers its own colour's line only partly even inside; rescale
    # so its inside counts as full, or the fill ratio would grow as its colour drifts.
    inside = max(float(np.median(coverage[..., colour_index][core])), _MIN_COVERAGE)
    soft = np.where(rim, np.clip(coverage[..., colour_index] / inside, 0.0, 1.0), 0.0)
    row_mass, column_mass = soft.sum(axis=1), soft.sum(axis=0)
    fill = float(soft.sum() / max(row_mass.max() * column_mass.max(), 1e-6))
    lopsided = max(abs(_skewness(row_mass)), abs(_skewness(column_mass)))
    rows, cols = np.nonzero(mask)
    order = (int(cols.min() + cols.max()), int(rows.min() + rows.max()))
    return {"kind": _kind(fill, lopsided), "fill": fill, "lopsided": lopsided, "order": order}


def _kind(fill: float, lopsided: float) -> str:
    if lopsided >= _TRIANGLE_MIN_LOPSIDED:
        return "triangle"
    return "square" if fill >= _SQUARE_MIN_FILL else "circle"


def _skewness(mass: np.ndarray) -> float:
    positions = np.arange(len(mass))
    total = max(float(mass.sum()), 1e-6)
    mean = float((mass * positions).sum()) / total
    variance = float((mass * (positions - mean) ** 2).sum()) / total
    return float((mass * (positions - mean) ** 3).sum()) / total / max(variance, 1e-6) ** 1.5


def detect_shapes(image: Image.Image | np.ndarray) -> list[dict]:
    """The shapes an image shows, left to right: dicts with ``colour`` (a palette name, or ``OTHER_COLOUR``
    for a colour far from all of them), ``kind``, the features the kind was read from (``fill``,
    ``lopsided``) and ``order``, the sort key (twice the box centre x, then y, in pixels).

    ``image`` is a PIL image or an HxW[x3|4] array (uint8, or float in [0, 1]). See the module docstring
    for the method.
    """
    pixels = _as_pixels(image)
    classes, coverage = _unmix(pixels, _background(pixels))
    ids = _label_components(classes)
    min_area = _MIN_AREA_FRACTION * ids.size
    labels, counts = np.unique(ids[classes != _BACKGROUND], return_counts=True)
    shapes = []
    for label, count in zip(labels, counts):
        if count < min_area:
            continue
        mask = ids == label
        core = _neighbourhood(mask, erode=True)
        if not core.any():
            continue
        features = _describe(mask, core, int(classes.flat[label]), classes, coverage)
        shapes.append({"colour": _colour_name(pixels[core].mean(axis=0)), **features})
    return sorted(shapes, key=lambda s: s["order"])


def score_image(image: Image.Image | np.ndarray, prompt: str) -> dict:
    """How well one image shows its shapes prompt.

    Returns ``expected`` and ``detected`` (lists of ``(colour, kind)`` left to right), ``phrasing`` (a pair's, see
    :func:`phrasing_of`) and booleans:
    ``count_ok`` (as many shapes as the prompt names), ``colour_ok`` / ``shape_ok`` (count right and every
    shape's colour / kind right, position by position), ``all_ok`` (both) and ``drawn_ok`` (count right and the
    same shapes, in any order: a pair drawn whole, whichever side each is on). ``ValueError`` if the prompt
    is not a shapes prompt (:func:`parse_prompt`).
    """
    expected, phrasing = _parse(prompt)
    detected = [(s["colour"], s["kind"]) for s in detect_shapes(image)]
    count_ok = len(detected) == len(expected)
    colour_ok = count_ok and all(d[0] == e[0] for d, e in zip(detected, expected))
    shape_ok = count_ok and all(d[1] == e[1] for d, e in zip(detected, expected))
    return {
        "prompt": prompt,
        "phrasing": phrasing,
        "expected": expected,
        "detected": detected,
        "count_ok": count_ok,
        "colour_ok": colour_ok,
        "shape_ok": shape_ok,
        "all_ok": colour_ok and shape_ok,
        "drawn_ok": count_ok and sorted(detected) == sorted(expected),
    }


def _mean(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def score_images(images: Sequence[Image.Image | np.ndarray], prompts: Sequence[str]) -> dict:
    """Aggregate :func:`score_image` over images paired with the prompts they were generated from.

    - ``colour_accuracy``: fraction of single-shape prompts whose image shows exactly one shape, of the
      prompt's colour;
    - ``shape_accuracy``: the same for the kind;
    - ``two_shape_accuracy``: fraction of two-shape prompts whose image shows exactly two shapes with both
      colours and kinds right, in the prompt's left-to-right order;
    - ``pairs_drawn_accuracy``: fraction of two-shape prompts whose image shows exactly their two shapes, in either
      order (which side each lands on left aside);
    - ``count_accuracy``: fraction of all prompts whose image shows as many shapes as named;
    - ``overall``: fraction of all prompts fully right (``all_ok``);
    - ``pairs_<phrasing>_accuracy``: ``two_shape_accuracy`` over the pairs of each of
      :data:`~sdtrain.data.shapes.PHRASINGS` (``pairs_sides``, ``pairs_sides_reversed``, ``pairs_plain``);
    - ``num_single``, ``num_double``: how many prompts of each; an accuracy over none is ``None``;
    - ``per_image``: the :func:`score_image` results, in order.
    """
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    results = [score_image(image, prompt) for image, prompt in zip(images, prompts)]
    singles = [r for r in results if len(r["expected"]) == 1]
    doubles = [r for r in results if len(r["expected"]) == 2]
    by_phrasing = {f"pairs_{phrasing}_accuracy": _mean([r["all_ok"] for r in doubles if r["phrasing"] == phrasing])
                   for phrasing in PHRASINGS}
    return {
        "colour_accuracy": _mean([r["colour_ok"] for r in singles]),
        "shape_accuracy": _mean([r["shape_ok"] for r in singles]),
        "two_shape_accuracy": _mean([r["all_ok"] for r in doubles]),
        **by_phrasing,
        "pairs_drawn_accuracy": _mean([r["drawn_ok"] for r in doubles]),
        "count_accuracy": _mean([r["count_ok"] for r in results]),
        "overall": _mean([r["all_ok"] for r in results]),
        "num_single": len(singles),
        "num_double": len(doubles),
        "per_image": results,
    }


def adherence_prompts(num_single: int = 54, num_double: int = 18, seed: int = 0) -> list[str]:
    """A fixed, seeded prompt set: ``num_single`` one-shape prompts, then ``num_double`` two-shape ones.

    Both come in blocks of 18, one per colour x kind, so any multiple of 18 is balanced: in a block of
    singles each colour x kind appears once; in a block of doubles each is the left shape once and the right
    shape once, never paired with itself. Phrased by :func:`~sdtrain.data.shapes.caption_for` like the training
    captions, the doubles in each of its ``PHRASINGS`` in turn (a third of any multiple of 3 each).
    """
    if num_single < 0 or num_double < 0:
        raise ValueError(f"prompt counts must be >= 0, got {num_single} single and {num_double} double")
    rng = np.random.default_rng(seed)
    combos = [{"colour": c, "kind": k} for c in _COLOUR_NAMES for k in KINDS]
    singles: list[str] = []
    while len(singles) < num_single:
        singles += [caption_for([combos[i]]) for i in rng.permutation(len(combos))]
    doubles: list[str] = []
    while len(doubles) < num_double:
        left, right = rng.permutation(len(combos)), rng.permutation(len(combos))
        while np.any(left == right):
            right = rng.permutation(len(combos))
        # Phrasings take turns within a block: any number of pairs asks each of them alike.
        doubles += [caption_for([combos[a], combos[b]], PHRASINGS[i % len(PHRASINGS)])
                    for i, (a, b) in enumerate(zip(left, right))]
    return singles[:num_single] + doubles[:num_double]


def adherence_prompt_set(num: int | None = None, pairs: int | None = None) -> list[str]:
    """The prompts an adherence evaluation of ``num`` images generates, ``pairs`` of them two-shape ones.

    By default 54 single-shape and 18 two-shape prompts; for another ``num`` a quarter pairs, at least 18
    where ``num`` allows (so a quick in-loop evaluation of 36 still scores pairs on a balanced block), at
    most half. ``pairs`` sets the two-shape count instead (at most ``num``): with 18 pairs one image moves
    the pair score by 5.6 points, so a score meant to be compared should ask for more."""
    if not num or num <= 0:
        num = 72 if pairs is None else max(72, pairs)
    if pairs is None:
        pairs = min(num // 2, max(18, num // 4))
    if not 0 <= pairs <= num:
        raise ValueError(f"pairs must be between 0 and the number of prompts ({num}), got {pairs}")
    return adherence_prompts(num - pairs, pairs)
