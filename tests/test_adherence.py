"""Prompt adherence for the shapes demo: the renderer's own images score near 100%, wrong prompts fail."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from sdtrain.data.shapes import COLOURS, KINDS, PHRASINGS, caption_for, caption_prompts, render_shapes_sample
from sdtrain.evaluate.adherence import (
    OTHER_COLOUR,
    adherence_prompts,
    detect_shapes,
    parse_prompt,
    phrasing_of,
    score_image,
    score_images,
)

SIZES = (32, 64)
SAMPLES_PER_SIZE = 160


def _caption(shapes: list[tuple[str, str]]) -> str:
    return caption_for([{"colour": c, "kind": k} for c, k in shapes])


def _render(size: int, seed: int, num_shapes: int | None = None) -> tuple[Image.Image, str, dict]:
    """A rendered sample with one of its captions, each phrasing of a pair in turn by seed."""
    image, captions, meta = render_shapes_sample(np.random.default_rng([size, seed]), size, num_shapes)
    lines = captions.splitlines()
    return image, lines[seed % len(lines)], meta


@pytest.fixture(scope="module")
def rendered() -> list[tuple[Image.Image, str, dict]]:
    return [_render(size, seed) for size in SIZES for seed in range(SAMPLES_PER_SIZE)]


@pytest.fixture(scope="module")
def rendered_scores(rendered) -> dict:
    return score_images([image for image, _, _ in rendered], [caption for _, caption, _ in rendered])


def test_rendered_images_score_near_perfect(rendered_scores: dict) -> None:
    scores = rendered_scores
    assert scores["num_single"] + scores["num_double"] == len(SIZES) * SAMPLES_PER_SIZE
    assert min(scores["num_single"], scores["num_double"]) > 100
    assert scores["colour_accuracy"] >= 0.98
    assert scores["shape_accuracy"] >= 0.95
    assert scores["two_shape_accuracy"] >= 0.9
    assert all(scores[f"pairs_{phrasing}_accuracy"] >= 0.85 for phrasing in PHRASINGS)
    assert scores["count_accuracy"] >= 0.97
    assert scores["overall"] >= 0.95


def test_detection_follows_the_renderer_metadata(rendered, rendered_scores: dict) -> None:
    for (_, _, meta), result in zip(rendered, rendered_scores["per_image"]):
        if result["all_ok"]:
            assert result["detected"] == [(s["colour"], s["kind"]) for s in meta["shapes"]]


def _wrong_captions(shapes: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(which check must fail, caption) pairs that differ from the truth in one respect."""
    colours, kinds = list(COLOURS), list(KINDS)
    (colour, kind), rest = shapes[0], shapes[1:]
    other_colour = colours[(colours.index(colour) + 1) % len(colours)]
    other_kind = kinds[(kinds.index(kind) + 1) % len(kinds)]
    wrong = [
        ("colour_ok", _caption([(other_colour, kind), *rest])),
        ("shape_ok", _caption([(colour, other_kind), *rest])),
    ]
    if rest:
        wrong.append(("all_ok", _caption(shapes[::-1])))
        wrong.append(("count_ok", _caption(shapes[:1])))
    else:
        wrong.append(("count_ok", _caption([(colour, kind), (other_colour, other_kind)])))
    return wrong


def test_wrong_prompts_fail(rendered, rendered_scores: dict) -> None:
    checked = Counter()
    for (image, caption, meta), right in list(zip(rendered, rendered_scores["per_image"]))[::3]:
        # Where even the true caption fails (two same-coloured shapes touching read as one), a wrong one
        # could match by accident; the claim is that the score tells right from wrong where it can see.
        if not right["all_ok"]:
            continue
        shapes = [(s["colour"], s["kind"]) for s in meta["shapes"]]
        for check, wrong in _wrong_captions(shapes):
            result = score_image(image, wrong)
            assert not result[check] and not result["all_ok"], (caption, wrong, result["detected"])
            checked[check] += 1
    assert min(checked.values()) >= 30


def test_mirrored_images_match_reversed_captions(rendered) -> None:
    doubles = [(image, meta) for image, _, meta in rendered if len(meta["shapes"]) == 2]
    mirrored = [image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for image, _ in doubles]
    reversed_captions = [_caption([(s["colour"], s["kind"]) for s in meta["shapes"][::-1]]) for _, meta in doubles]
    assert score_images(mirrored, reversed_captions)["two_shape_accuracy"] >= 0.9


def test_a_pair_on_swapped_sides_is_drawn_whole_but_not_in_order(rendered) -> None:
    """pairs_drawn_accuracy leaves the sides aside: a mirrored image still shows both shapes of its caption."""
    doubles = [(image, caption, meta) for image, caption, meta in rendered if len(meta["shapes"]) == 2
               and meta["shapes"][0] != meta["shapes"][1]]
    mirrored = [image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for image, _, _ in doubles]
    captions = [_caption([(s["colour"], s["kind"]) for s in meta["shapes"]]) for _, _, meta in doubles]
    scores = score_images(mirrored, captions)
    assert scores["pairs_drawn_accuracy"] >= 0.9 and scores["two_shape_accuracy"] <= 0.1


@pytest.mark.parametrize("noise", [0.0, 12.0])
def test_blank_image_fails_count(noise: float) -> None:
    pixels = np.full((64, 64, 3), 235.0) + np.random.default_rng(0).normal(0.0, noise, (64, 64, 3))
    result = score_image(np.clip(pixels, 0, 255).astype(np.uint8), "a red circle")
    assert result["detected"] == []
    assert not result["count_ok"] and not result["colour_ok"] and not result["all_ok"]


def test_robust_to_mild_noise_and_blur() -> None:
    noise = np.random.default_rng(0)
    images, captions = [], []
    for seed in range(60):
        image, caption, _ = _render(64, 1000 + seed)
        pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(0.7)), dtype=np.float64)
        images.append(np.clip(pixels + noise.normal(0.0, 10.0, pixels.shape), 0, 255).astype(np.uint8))
        captions.append(caption)
    assert score_images(images, captions)["overall"] >= 0.95


def test_image_forms_agree() -> None:
    image, caption, meta = _render(64, 7, num_shapes=2)
    expected = [(s["colour"], s["kind"]) for s in meta["shapes"]]
    as_uint8 = np.asarray(image)
    forms = [
        image,
        image.convert("RGBA"),
        as_uint8,
        as_uint8.astype(np.float32) / 255.0,
        image.resize((256, 256), Image.Resampling.NEAREST),
    ]
    for form in forms:
        assert score_image(form, caption)["detected"] == expected


def _drawn(kind: str, fill: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (64, 64), (240, 240, 240))
    draw = ImageDraw.Draw(image)
    box = (12, 12, 44, 44)
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(12, 44), (44, 44), (28, 12)], fill=fill)
    return image


@pytest.mark.parametrize(
    ("fill", "colour"),
    [((150, 20, 20), "red"), ((20, 30, 120), "blue"), ((128, 128, 128), OTHER_COLOUR), ((0, 0, 0), OTHER_COLOUR)],
)
@pytest.mark.parametrize("kind", KINDS)
def test_colours_are_named_by_hue(kind: str, fill: tuple[int, int, int], colour: str) -> None:
    assert [(s["colour"], s["kind"]) for s in detect_shapes(_drawn(kind, fill))] == [(colour, kind)]


def test_score_images_aggregates() -> None:
    red_circle = _drawn("circle", COLOURS["red"])
    double, double_caption, _ = _render(64, 3, num_shapes=2)
    scores = score_images(
        [red_circle, red_circle, red_circle, double],
        ["a red circle", "a blue circle", "a red square", double_caption],
    )
    assert scores["colour_accuracy"] == pytest.approx(2 / 3)
    assert scores["shape_accuracy"] == pytest.approx(2 / 3)
    assert scores["two_shape_accuracy"] == 1.0
    assert scores["count_accuracy"] == 1.0
    assert scores["overall"] == pytest.approx(2 / 4)
    assert (scores["num_single"], scores["num_double"]) == (3, 1)
    assert [r["all_ok"] for r in scores["per_image"]] == [True, False, False, True]
    assert score_images([red_circle], ["a red circle"])["two_shape_accuracy"] is None
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        score_images([red_circle, red_circle], ["a red circle"])


def test_parse_prompt_round_trips_captions() -> None:
    singles = [[(c, k)] for c in COLOURS for k in KINDS]
    for shapes in singles + [a + b for a, b in itertools.permutations(singles, 2)]:
        assert parse_prompt(_caption(shapes)) == shapes
    for prompt in caption_prompts():
        assert caption_for([{"colour": c, "kind": k} for c, k in parse_prompt(prompt)],
                           phrasing_of(prompt) or "sides") == prompt
    assert parse_prompt("  An Orange  TRIANGLE ") == [("orange", "triangle")]
    # Every phrasing of a pair reads back left to right: sides named in either order, or none.
    pair = [("red", "circle"), ("blue", "square")]
    for phrasing in PHRASINGS:
        prompt = caption_for([{"colour": c, "kind": k} for c, k in pair], phrasing)
        assert parse_prompt(prompt) == pair and phrasing_of(prompt) == phrasing
    assert parse_prompt("a blue square on the right and a red circle on the left") == pair
    assert parse_prompt("a red circle and a blue square") == pair
    assert phrasing_of("a red circle") is None


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        "a photo of a cat",
        "red circle",
        "an red circle",
        "a orange square",
        "a pink circle",
        "a red hexagon",
        "a red circle and",
        "a red circle or a blue square",
        "a red circle, a blue square",
        "a red circle and a blue square and a green triangle",
        "a red circle on the right and a blue square on the right",
        "a red circle on the left and a blue square",
    ],
)
def test_foreign_prompts_raise(prompt: str) -> None:
    with pytest.raises(ValueError, match="not a shapes prompt"):
        parse_prompt(prompt)
    with pytest.raises(ValueError):
        score_image(_drawn("circle", COLOURS["red"]), prompt)


def test_adherence_prompts_cover_every_shape() -> None:
    prompts = adherence_prompts()
    assert prompts == adherence_prompts(seed=0)
    assert prompts != adherence_prompts(seed=1)
    parsed = [parse_prompt(p) for p in prompts]
    singles, doubles = parsed[:54], parsed[54:]
    assert all(len(s) == 1 for s in singles) and all(len(d) == 2 for d in doubles)
    combos = {(c, k) for c in COLOURS for k in KINDS}
    assert Counter(s[0] for s in singles) == {combo: 3 for combo in combos}
    assert Counter(d[0] for d in doubles) == {combo: 1 for combo in combos}
    assert Counter(d[1] for d in doubles) == {combo: 1 for combo in combos}
    assert all(d[0] != d[1] for d in doubles)
    assert Counter(phrasing_of(p) for p in prompts[54:]) == {phrasing: 6 for phrasing in PHRASINGS}
    assert [caption_for([{"colour": c, "kind": k} for c, k in shapes], phrasing_of(p) or "sides")
            for shapes, p in zip(parsed, prompts)] == prompts
    assert len(adherence_prompts(num_single=5, num_double=40)) == 45
    with pytest.raises(ValueError):
        adherence_prompts(num_single=-1)


def test_an_adherence_set_of_any_size_scores_pairs():
    from sdtrain.evaluate.adherence import adherence_prompt_set, adherence_prompts

    assert adherence_prompt_set(None) == adherence_prompt_set(72) == adherence_prompts()
    # A quick in-loop evaluation still scores a balanced block of pairs.
    quick = adherence_prompt_set(36)
    assert len(quick) == 36 and sum(" and " in p for p in quick) == 18
    tiny = adherence_prompt_set(4)
    assert len(tiny) == 4 and sum(" and " in p for p in tiny) == 2
    # A score meant to be compared asks for more pairs than the default quarter.
    half = adherence_prompt_set(108, pairs=54)
    assert len(half) == 108 and sum(" and " in p for p in half) == 54
    assert half[:54] == adherence_prompts()[:54]  # the default set's singles, then more pairs
    with pytest.raises(ValueError):
        adherence_prompt_set(10, pairs=11)


def test_evaluate_pairs_out_of_range_or_with_other_prompts_is_one_clear_line(tmp_path, capsys):
    from sdtrain.cli.main import main

    assert main(["evaluate", str(tmp_path), "--metrics", "adherence", "--num", "10", "--pairs", "11"]) == 2
    assert "--pairs" in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    assert main(["evaluate", str(tmp_path), "--metrics", "adherence", "--prompts", str(prompts), "--pairs", "1"]) == 2
    assert "only the built-in adherence prompt set" in capsys.readouterr().err
