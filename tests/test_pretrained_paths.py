"""Every fine-tuning mode's README command on a pretrained pipeline like the demo's (a text encoder of 16
positions, not CLIP's 77): it trains, exports and generates with no model.max_text_length given, since the
text length comes from the pretrained tokenizer and text encoder; a length they contradict is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sdtrain.cli.main import main
from sdtrain.config import ComponentConfig, ModelConfig, load_config
from sdtrain.models import build

from .conftest import TINY

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEMO_LENGTH = 16

# What each mode's README command adds to the config, at the tiny size; the commands' own configs otherwise.
MODES = {
    "finetune-full": [],
    "lora": [],
    "textual-inversion": ["textual_inversion.placeholder_token=<my-shape>", "textual_inversion.initializer_token=red"],
    "dreambooth": ["dreambooth.instance_prompt=a photo of sks shape", "dreambooth.class_prompt=a photo of a shape",
                   "dreambooth.num_class_images=2", "dreambooth.generation_steps=2", "validation.steps=2"],
}


def train(config: str, run: Path, pretrained: Path, shapes_dir: Path, *overrides: str) -> int:
    return main(["train", str(CONFIGS / config), f"model.pretrained={pretrained}", f"data.shards={shapes_dir}",
                 f"run_dir={run}", *TINY, "train.max_steps=2", *overrides])


def generate(out: Path, model: Path, prompt: str, *extra: str) -> list[str]:
    assert main(["generate", "--model", str(model), "--prompt", prompt, "--steps", "2", "--out", str(out),
                 *extra]) == 0
    return sorted(p.name for p in out.iterdir())


def test_the_pretrained_pipeline_is_shorter_than_clip(pretrained):
    """What the tests below rely on: the demo's lengths, not the old default of 77."""
    tokenizer = json.loads((pretrained / "tokenizer" / "tokenizer_config.json").read_text())
    encoder = json.loads((pretrained / "text_encoder" / "config.json").read_text())
    assert tokenizer["model_max_length"] == encoder["max_position_embeddings"] == DEMO_LENGTH


@pytest.mark.parametrize("config", list(MODES))
def test_each_mode_trains_exports_and_generates_on_a_demo_like_pipeline(tmp_path, pretrained, shapes_dir, config):
    run, out = tmp_path / "run", tmp_path / "out"
    assert train(f"{config}.yaml", run, pretrained, shapes_dir, *MODES[config]) == 0
    assert main(["export", str(run), "--out", str(out)]) == 0
    if config == "lora":
        model, prompt, extra = pretrained, "a red circle", ["--lora", str(out)]
    elif config == "textual-inversion":
        model, prompt, extra = pretrained, "a photo of <my-shape>", ["--embedding", str(out)]
    else:  # a whole pipeline
        model, prompt, extra = out, "a photo of sks shape", []
        tokenizer = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
        assert tokenizer["model_max_length"] == DEMO_LENGTH
    assert len(generate(tmp_path / "images", model, prompt, *extra)) == 2  # the image and its grid


def test_a_text_length_the_pretrained_encoder_cannot_read_is_one_line(tmp_path, pretrained, shapes_dir, capsys):
    assert train("lora.yaml", tmp_path / "run", pretrained, shapes_dir, "model.max_text_length=77") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "model.max_text_length: 77" in err and f"reads at most {DEMO_LENGTH}" in err
    assert str(pretrained / "text_encoder" / "config.json") in err
    assert str(pretrained / "tokenizer" / "tokenizer_config.json") in err
    assert f"model.max_text_length={DEMO_LENGTH}" in err


def test_a_shorter_text_length_than_the_pretrained_one_is_kept(pretrained):
    """Fewer positions than the encoder has is a choice, not a contradiction: the tokenizer pads to it."""
    config = load_config(CONFIGS / "lora.yaml", [f"model.pretrained={pretrained}", "data.shards=x", "run_dir=x",
                                                 "model.max_text_length=8"])
    assert build.load_text_tokenizer(config.model).model_max_length == 8


def test_a_tokenizer_longer_than_its_text_encoder_is_cut_to_the_encoder(tmp_path, pretrained):
    """A CLIP-length tokenizer beside a 16-position encoder: the encoder reads no more than 16."""
    tokenizer = shutil.copytree(pretrained / "tokenizer", tmp_path / "tokenizer")
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 77}))
    model = ModelConfig(pretrained=str(pretrained), components={"tokenizer": ComponentConfig(source=str(tokenizer))})
    assert build.load_text_tokenizer(model).model_max_length == DEMO_LENGTH


@pytest.fixture(scope="module")
def single_file(tmp_path_factory, diffusion_run) -> Path:
    """The same model as one original-layout file, its tokenizer in model.tokenizer/ beside it."""
    out = tmp_path_factory.mktemp("single") / "model.safetensors"
    assert main(["export", str(diffusion_run), str(out), "--single-file"]) == 0
    return out


def test_a_single_file_fine_tunes_at_its_own_length(tmp_path, single_file, shapes_dir):
    assert train("lora.yaml", tmp_path / "run", single_file, shapes_dir) == 0
    # The run folder generates too, its adapters merged on the fly.
    assert len(generate(tmp_path / "images", tmp_path / "run", "a red circle")) == 2


def test_text_length_is_read_from_every_kind_of_source(pretrained, diffusion_run, single_file):
    """Pipeline and component folders, a run, and a single file (its header): each says 16 without its
    weights; nothing pretrained is CLIP's 77."""
    for source in (pretrained, pretrained / "text_encoder", diffusion_run, single_file):
        assert build.text_encoder_positions(source)[0] == DEMO_LENGTH, source
    assert build.text_length(ModelConfig(pretrained=str(single_file))) == DEMO_LENGTH
    assert build.text_length(ModelConfig()) == build.DEFAULT_TEXT_LENGTH
    assert build.text_length(ModelConfig(max_text_length=20)) == 20
    # A run trained from scratch keeps its own tokenizer's length, whatever the config's default.
    assert build.text_length(ModelConfig(), fallback=diffusion_run) == DEMO_LENGTH
