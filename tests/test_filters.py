"""Sample filters: the spec forms, what a rejection reports, and one-line errors for bad specs."""

from __future__ import annotations

import pickle

import pytest

from sdtrain.data.filters import Filters, parse_filters
from sdtrain.errors import UserError


def check(spec: dict, meta: dict, caption: str = "a caption") -> str | None:
    return parse_filters(spec).check(meta, caption)


@pytest.mark.parametrize(
    ("cond", "passes", "fails"),
    [
        (">=0.5", [0.5, 0.9, "0.5"], [0.49, 0]),
        ("<=0.5", [0.5, 0.1, "0.2"], [0.51, "1"]),
        ("<0.1", [0.05, -1], [0.1, 0.2]),
        (">2", [3, 2.5], [2, 1]),
        ("==1", [1, 1.0, "1", True], [0, 2, "1.5"]),
        ("=1", [1], [2]),
        (1, [1, "1.0"], [2]),
        (0.5, [0.5], [0.25]),
        ("512", [512, "512"], [511]),
        ("!=3", [2, 4], [3, "3"]),
        ("!=x", ["y", 3], ["x"]),
        ("success", ["success"], ["failed", "Success"]),
        ("==en", ["en"], ["de"]),
        (" <= 0.5 ", [0.5], [0.6]),
    ],
)
def test_field_conditions(cond, passes: list, fails: list) -> None:
    filters = parse_filters({"f": cond})
    for value in passes:
        assert filters.check({"f": value}, "c") is None, (cond, value)
    for value in fails:
        assert filters.check({"f": value}, "c") == "f", (cond, value)


def test_missing_and_non_numeric_fields_are_rejected_with_their_own_reason() -> None:
    spec = {"pwatermark": "<=0.5"}
    assert check(spec, {}) == "pwatermark: missing"
    assert check(spec, {"pwatermark": None}) == "pwatermark: missing"
    assert check(spec, {"pwatermark": ""}) == "pwatermark: missing"  # an empty metadata.csv cell
    assert check(spec, {"pwatermark": "high"}) == "pwatermark: not a number"
    assert check(spec, {"pwatermark": [0.1]}) == "pwatermark: not a number"
    assert check({"status": "success"}, {}) == "status: missing"


def test_size_shortcuts_use_width_else_img2dataset_original_width() -> None:
    spec = {"min_width": 256, "min_height": "128"}
    assert check(spec, {"width": 256, "height": 128}) is None
    assert check(spec, {"width": 255, "height": 128}) == "min_width"
    assert check(spec, {"width": 300, "height": 100}) == "min_height"
    assert check(spec, {"original_width": 512, "original_height": 512}) is None
    assert check(spec, {"original_width": 100, "original_height": 512}) == "min_width"
    assert check(spec, {"width": "300", "height": "200"}) is None  # metadata.csv values are strings
    assert check(spec, {"height": 512}) == "min_width: missing"
    assert check(spec, {"width": "wide", "height": 512}) == "min_width: not a number"


def test_aspect_shortcuts() -> None:
    spec = {"min_aspect": 0.5, "max_aspect": "2"}
    assert check(spec, {"width": 200, "height": 100}) is None
    assert check(spec, {"width": 100, "height": 200}) is None
    assert check(spec, {"width": 201, "height": 100}) == "max_aspect"
    assert check(spec, {"width": 99, "height": 200}) == "min_aspect"
    assert check(spec, {"original_width": 300, "original_height": 100}) == "max_aspect"
    assert check(spec, {"width": 100}) == "min_aspect: missing"
    assert check(spec, {"width": 100, "height": 0}) == "min_aspect: not a number"


def test_caption_length_shortcuts() -> None:
    spec = {"min_caption_length": 3, "max_caption_length": 5}
    assert check(spec, {}, "abc") is None
    assert check(spec, {}, "abcde") is None
    assert check(spec, {}, "ab") == "min_caption_length"
    assert check(spec, {}, "abcdef") == "max_caption_length"
    assert check(spec, {}, "") == "min_caption_length"


def test_first_rejecting_filter_in_spec_order_is_reported() -> None:
    meta = {"width": 10, "height": 10, "pwatermark": 0.9}
    assert check({"pwatermark": "<=0.5", "min_width": 64}, meta) == "pwatermark"
    assert check({"min_width": 64, "pwatermark": "<=0.5"}, meta) == "min_width"
    assert check({"min_width": 8, "pwatermark": "<=0.95"}, meta) is None


def test_empty_filters_accept_everything_and_filters_pickle() -> None:
    for empty in (parse_filters({}), parse_filters(None), Filters()):
        assert not empty and len(empty) == 0
        assert empty.check({}, "") is None
    filters = parse_filters({"pwatermark": "<=0.5", "min_width": 64, "status": "!=failed"})
    assert len(filters) == 3 and filters.names == ["pwatermark", "min_width", "status"]
    clone = pickle.loads(pickle.dumps(filters))  # loader workers get a copy
    assert clone == filters
    assert clone.check({"pwatermark": 0.7, "width": 100}, "c") == "pwatermark"


def test_describe() -> None:
    filters = parse_filters({"pwatermark": "<=0.5", "min_width": 256, "score": "=7", "lang": "en", "n": "!=0"})
    assert [f.describe() for f in filters.filters] == [
        "pwatermark<=0.5", "min_width=256", "score==7", "lang==en", "n!=0",
    ]
    assert filters.describe("pwatermark") == "pwatermark<=0.5"
    assert filters.describe("pwatermark: missing") == "pwatermark: missing"


@pytest.mark.parametrize(
    ("key", "cond"),
    [
        ("pwatermark", ">=high"),
        ("pwatermark", "=>0.5"),
        ("pwatermark", "<"),
        ("pwatermark", ""),
        ("pwatermark", None),
        ("pwatermark", "<>3"),
        ("pwatermark", "!3"),
        ("pwatermark", [0.5]),
        ("min_width", "-1"),
        ("min_width", ">=256"),
        ("min_width", 2.5),
        ("min_height", True),
        ("max_aspect", 0),
        ("min_aspect", "wide"),
        ("max_caption_length", -3),
        (" ", "1"),
    ],
)
def test_bad_spec_is_one_line_naming_the_key_and_the_forms(key: str, cond) -> None:
    with pytest.raises(UserError) as info:
        parse_filters({key: cond})
    message = str(info.value)
    assert "\n" not in message
    assert f"filter {key!r}" in message
    assert "accepted forms" in message and "'>=N'" in message and "min_width" in message


def test_spec_must_be_a_mapping() -> None:
    with pytest.raises(UserError, match="expected a mapping"):
        parse_filters(["min_width=5"])  # type: ignore[arg-type]
