"""A run says which model it trains: the family (and, where the family stands for several released models, the
variant) recognised from the pretrained model's files is one log line at the start and is recorded in the run's
config.yaml, which the files, read again on resume and export, agree with; the user's config file is left as it
is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdtrain.cli.main import main
from sdtrain.config import ModelConfig, load_config, load_config_without, to_yaml
from sdtrain.errors import UserError
from sdtrain.models import families
from sdtrain.models.build import resolve_sources

from .conftest import TINY_CLI, config_path, tiny_components
from .test_qwenimage_edit import COMMON, PLUS, _release

CONFIGS = config_path("diffusion.yaml").parents[1]
T5_LENGTH = 12


@pytest.fixture(scope="module")
def plus_2511(tmp_path_factory) -> Path:
    return _release(tmp_path_factory.mktemp("qwen-image-edit-2511") / "pipeline", PLUS)


@pytest.fixture(scope="module")
def kontext(tmp_path_factory) -> Path:
    """A Flux.1 Kontext pipeline folder of the tiny preset's parts, as the release lays it out."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    flux = families.get("flux")
    folder = tmp_path_factory.mktemp("flux-kontext")
    tiny = tiny_components("flux", folder, ["make it red", "make it blue"], T5_LENGTH)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(flux.preset("tiny", "scheduler"))
    pipe = flux.editing_pipeline(flux.sampling.assemble(tiny["components"], tiny["tokenizers"], scheduler))
    pipe.save_pretrained(folder / "pipeline")
    assert json.loads((folder / "pipeline" / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    return folder / "pipeline"


def _trained(recipe: str, run: Path, pretrained: Path, *overrides: str) -> list[str]:
    """One step of `recipe` on `pretrained` into `run`; returns its overrides. The recipe file is left as it is."""
    given = (CONFIGS / recipe).read_bytes()
    overrides = [f"run_dir={run}", f"model.pretrained={pretrained}", *overrides, "train.max_steps=1",
                 "checkpoint.every=0"]
    assert main(["train", str(CONFIGS / recipe), *overrides]) == 0
    assert (CONFIGS / recipe).read_bytes() == given
    return overrides


def test_a_plus_run_logs_and_records_2511_and_its_resume_agrees(plus_2511, tmp_path, edits, caplog):
    caplog.set_level("INFO", logger="sdtrain")
    run = tmp_path / "run"
    overrides = _trained("qwen-image-edit-lora.yaml", run, plus_2511, *COMMON, f"data.shards={edits}",
                         "data.batch_size=1")
    line = (f"model: Qwen-Image-Edit-2511 (family qwen-image-edit-plus, variant 2511, recognised from "
            f"{plus_2511 / 'model_index.json'})")
    assert caplog.messages.count(line) == 1
    saved = load_config(run / "config.yaml")
    assert (saved.model.family, saved.model.variant) == ("qwen-image-edit-plus", "2511")
    # The same command again (a resume) resolves the same config: config.yaml stands, no later copy beside it.
    resumed = resolve_sources(load_config(CONFIGS / "qwen-image-edit-lora.yaml", overrides))
    assert to_yaml(resumed) == (run / "config.yaml").read_text()
    # What reads the saved config (a resume given it, export, generate) finds the same model in the files.
    again = families.recognise(saved.model)
    assert (again.family, again.variant.name) == (PLUS, "2511")
    with pytest.raises(UserError, match="model.variant: 2509, but .* is Qwen-Image-Edit-2511; set model.variant=2511"):
        families.recognise(ModelConfig(pretrained=str(plus_2511), variant="2509"))


def test_a_kontext_run_without_a_family_records_flux_kontext(kontext, tmp_path, edits, caplog):
    caplog.set_level("INFO", logger="sdtrain")
    run = tmp_path / "run"
    _trained("flux-kontext-lora.yaml", run, kontext, *TINY_CLI, "model.family=null", f"data.shards={edits}",
             f"model.t5_text_length={T5_LENGTH}", "data.aspect_buckets=false", "data.batch_size=1")
    assert (f"model: Flux.1 Kontext (family flux, variant kontext, recognised from {kontext / 'model_index.json'})"
            in caplog.messages)
    saved = load_config(run / "config.yaml")
    assert (saved.model.family, saved.model.variant) == ("flux", "kontext")
    # The recipe names the family itself: the variant is still the folder's.
    assert families.recognise(ModelConfig(family="flux", pretrained=str(kontext))).variant.name == "kontext"


def test_a_run_that_names_nothing_records_the_family_it_defaults_to(caplog):
    caplog.set_level("INFO", logger="sdtrain")
    recipe = config_path("diffusion.yaml")
    resolved = resolve_sources(load_config_without(recipe, []), fetch_weights=False)
    assert (resolved.model.family, resolved.model.variant) == ("sd", None)
    assert caplog.messages[-1].startswith("model: Stable Diffusion 1.x/2.x (family sd, the default: ")
    by_preset = resolve_sources(load_config_without(recipe, ["model.preset=flux-dev"]), fetch_weights=False)
    assert by_preset.model.family == "flux"
    assert caplog.messages[-1] == "model: Flux.1 (family flux, as model.preset=flux-dev names it)"
    with pytest.raises(UserError, match="model.variant: kontext, but no model.pretrained is set for it to name"):
        families.recognise(ModelConfig(variant="kontext"))
