"""Whatever a config file or an override says, loading it runs or gives one UserError; nothing else escapes."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdtrain.cli.main import main
from sdtrain.config import RunConfig, load_config
from sdtrain.errors import UserError

from .conftest import config_path


def _field_names(cls: type) -> list[str]:
    names = []
    for f in dataclasses.fields(cls):
        names.append(f.name)
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            names += [f"{f.name}.{sub}" for sub in _field_names(f.default_factory)]
    return names


KEYS = _field_names(RunConfig)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["???", "${oops}", "auto", "fp32", "1e-3", "[1,", "{a: 1}"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)


def _nest(pairs: dict[str, object]) -> dict[str, object]:
    tree: dict[str, object] = {}
    for key, value in pairs.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.get(part)
            node = node.setdefault(part, {}) if not isinstance(child, dict) or child is None else child
            if not isinstance(node, dict):
                break
        else:
            node[leaf] = value
    return tree


def _loads_or_user_error(path, overrides=()) -> None:
    try:
        load_config(path, list(overrides))
    except UserError as exc:
        message = str(exc)
        assert message and "\n" not in message.strip(), message


FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=10)), values, max_size=6))
def test_a_config_with_random_keys_and_values_loads_or_says_what_is_wrong(tmp_path, pairs):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(_nest(pairs)))
    _loads_or_user_error(path)


@FUZZ
@given(st.text(max_size=200))
def test_random_text_as_a_config_file_is_one_error(tmp_path, text):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    _loads_or_user_error(path)


@FUZZ
@given(st.lists(st.tuples(st.one_of(st.sampled_from(KEYS), st.text(max_size=10)), st.text(max_size=12)),
                max_size=4))
def test_random_overrides_on_a_real_config_load_or_say_what_is_wrong(pairs):
    _loads_or_user_error(config_path("diffusion.yaml"), [f"{k}={v}" for k, v in pairs])


@pytest.mark.parametrize("override", ["train.max_steps=[1,", "data={a: 1}", "=1", "optim.lr=abc", "stage=x",
                                      "model.vae_overrides.block_out_channels=7"])
def test_the_cli_turns_a_bad_override_into_one_line(override, capsys):
    assert main(["params", str(config_path("diffusion.yaml")), override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sdtrain params: error:"), err
