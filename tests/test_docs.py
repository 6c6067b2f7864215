"""The configuration reference (docs/configuration.md) is generated from the config's field docstrings."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sdtrain.cli.config_reference import MissingDocstring, field_docstrings, readable_type, render, section_keys
from sdtrain.cli.main import main
from sdtrain.config import RunConfig

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _config_classes(cls: type = RunConfig) -> list[type]:
    found = [cls]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        entries = typing.get_args(hints[f.name])[-1:] if typing.get_origin(hints[f.name]) is dict else ()
        if dataclasses.is_dataclass(default):
            found += _config_classes(type(default))
        elif entries and dataclasses.is_dataclass(entries[0]):  # model.components.NAME's keys
            found += _config_classes(entries[0])
    return found


def test_committed_page_is_current():
    committed = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    assert committed == render(), (
        "docs/configuration.md differs from what `sdtrain docs config` generates from src/sdtrain/config.py: "
        "run `make docs` and commit the page")


def test_every_config_field_has_a_docstring():
    missing = []
    for cls in _config_classes():
        docs = field_docstrings(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if not dataclasses.is_dataclass(default) and not docs.get(f.name, "").strip():
                missing.append(f"{cls.__name__}.{f.name}")
    assert not missing, f"config fields without a docstring (a string literal right after the field): {missing}"


def test_page_lists_every_key_in_order_with_type_and_default():
    text = render()
    sections = [line.removeprefix("## ") for line in text.splitlines() if line.startswith("## ")]
    assert sections == ["Top-level keys", "data", "model", "diffusion", "autoencoder", "lora", "textual_inversion",
                        "dreambooth", "instruct_pix2pix", "edit", "optim", "ema", "train", "parallel", "checkpoint",
                        "logging", "validation", "evaluation"]
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in text.splitlines() if line.startswith("| `")}
    assert rows["`stage`"].startswith("| `stage` | `str` | `???` | What to train")
    assert rows["`data.resolution`"].startswith("| `data.resolution` | `int` | `64` | ")
    assert rows["`data.class_key`"].startswith("| `data.class_key` | `str \\| None` | `null` | ")
    assert rows["`data.filters`"].startswith("| `data.filters` | `dict` | `{}` | ")
    assert rows["`model.offload_frozen`"].startswith("| `model.offload_frozen` | `bool \\| auto` | `auto` | ")
    assert rows["`model.components.NAME.source`"].startswith("| `model.components.NAME.source` | `str \\| None` | ")
    assert rows["`lora.target_modules`"].startswith("| `lora.target_modules` | `list[str]` | `[to_q, to_k, to_v, "
                                                    "to_out.0]` | ")
    assert rows["`textual_inversion.initializer_token`"].split(" | ")[2] == "`''`"
    assert rows["`optim.lr`"].split(" | ")[2] == "`0.0001`"
    assert len(rows) == sum(len(section_keys(cls, nested=False)) for cls in _config_classes())
    # Docstrings become one line each, with every pipe in them escaped: four cells a row.
    assert all(len(re.findall(r"(?<!\\)\|", line)) == 5 for line in rows.values())
    # Nothing depends on the machine.
    assert str(Path.cwd()) not in text and str(Path.home()) not in text


def test_types_read_as_written():
    assert readable_type("str | None", None) == "str | None"
    assert readable_type("Optional[int]", None) == "int | None"
    assert readable_type("Union[bool, str]", "auto") == "bool | auto"
    assert readable_type("dict[str, Any]", {}) == "dict"
    assert readable_type("list[float]", []) == "list[float]"


@dataclass
class _Undocumented:
    documented: int = 1
    """Has one."""
    bare: str = "x"
    items: list[str] = field(default_factory=list)
    """Has one too."""


def test_a_field_without_a_docstring_is_named():
    with pytest.raises(MissingDocstring, match=r"config field sec\.bare \(\S*_Undocumented\.bare\) has no docstring"):
        section_keys(_Undocumented, "sec.")


def test_command_prints_and_writes_the_page(tmp_path, capsys):
    assert main(["docs", "config"]) == 0
    assert capsys.readouterr().out == render()
    out = tmp_path / "configuration.md"
    out.write_text("old\n")
    assert main(["docs", "config", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render()
    assert [p.name for p in tmp_path.iterdir()] == ["configuration.md"]
    assert main(["docs", "config", "--out", str(tmp_path / "absent" / "x.md")]) == 2
