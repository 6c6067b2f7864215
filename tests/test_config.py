"""Loading configs: every mistake is one line naming the key, overrides win, the run folder keeps the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdtrain.cli.main import main
from sdtrain.config import RunConfig, load_config, to_yaml
from sdtrain.errors import UserError
from sdtrain.run import prepare_run_dir

GOOD = """\
stage: diffusion
run_dir: {run_dir}
data:
  shards: /data/shards
  batch_size: 8
model:
  components: {{unet: {{overrides: {{block_out_channels: [32, 64]}}}}}}
"""


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write(tmp_path, GOOD.format(run_dir=tmp_path / "run"))


def error_of(path: Path | None, overrides: list[str] = ()) -> str:
    with pytest.raises(UserError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# (YAML text or None for the good config, overrides, what the one-line message must name; "{path}" = the file)
BAD = {
    "unknown key in yaml": ("optim: {lrr: 1}\n", [], ["{path}", "optim.lrr"]),
    "unknown key as override": (None, ["optim.lrr=1"], ["optim.lrr"]),
    "unknown section as override": (None, ["optimizer.lr=1"], ["optimizer"]),
    "wrong type as override": (None, ["data.batch_size=abc"], ["data.batch_size", "abc"]),
    "wrong type in yaml": ("data: {batch_size: abc}\n", [], ["{path}", "data.batch_size"]),
    "bad bool": (None, ["ema.enabled=maybe"], ["ema.enabled"]),
    "missing shards": ("stage: diffusion\nrun_dir: r\n", [], ["data.shards", "???"]),
    "missing stage": ("run_dir: r\ndata: {shards: s}\n", [], ["stage"]),
    "bad stage": (None, ["stage=foo"], ["stage", "foo"]),
    "component named twice": (None, ["model.vae=a", "model.components.vae.source=b"],
                              ["model.vae", "model.components.vae.source"]),
    "component not a name": (None, ["model.components.9vae.source=a"], ["model.components.9vae"]),
    "fp16 not offered": (None, ["train.mixed_precision=fp16"], ["train.mixed_precision"]),
    "out of range": (None, ["data.caption_dropout=1.0"], ["data.caption_dropout"]),
    "one beta": (None, ["optim.betas=[0.9]"], ["optim.betas"]),
    "invalid yaml": ("stage: [diffusion\n  run_dir: : x\n", [], ["{path}", "YAML"]),
    "not utf-8": ("\udcff\udcfe", [], ["{path}", "YAML"]),
    "override without =": (None, ["train.max_steps"], ["train.max_steps", "key=value"]),
    "a moved key under both names": ("diffusion: {snr_gamma: 5, ddpm: {snr_gamma: 1}}\n", [],
                                     ["{path}", "diffusion.snr_gamma", "diffusion.ddpm.snr_gamma"]),
    "an objective's option outside its section": (None, ["diffusion.shift=3"], ["diffusion.shift"]),
    "a moved key beside its section given a scalar": ("diffusion: {flow: 5, flow_shift: 3}\n", [],
                                                      ["{path}", "diffusion.flow", "mapping"]),
    "section is a scalar": pytest.param(
        "data: 5\n", [], ["{path}", "data"]
    ),
    "top level is a list": pytest.param(
        "- stage\n- diffusion\n", [], ["{path}"]
    ),
}


@pytest.mark.parametrize(("text", "overrides", "names"), list(BAD.values()), ids=list(BAD))
def test_bad_config_is_one_line_naming_the_key(
    tmp_path: Path, good: Path, text: str | None, overrides: list[str], names: list[str]
) -> None:
    path = good if text is None else tmp_path / "bad.yaml"
    if text is not None:
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
    message = error_of(path, overrides)
    for name in names:
        assert name.format(path=path) in message, message


def test_missing_config_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert str(missing) in error_of(missing)
    assert str(tmp_path) in error_of(tmp_path)  # a folder is not a config file either


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["optim.lrr=1"], "optim.lrr"),
        (["data.batch_size=abc"], "data.batch_size"),
        (["train.max_steps"], "train.max_steps"),
    ],
)
def test_cli_prints_one_error_line(good: Path, capsys: pytest.CaptureFixture[str], args: list[str], names: str) -> None:
    assert main(["train", str(good), *args]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("sdtrain train: error: ")
    assert names in lines[0]
    assert "Traceback" not in out + err


def test_cli_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sdtrain train: error: ") and "nope.yaml" in err


def test_good_config_and_overrides(good: Path, tmp_path: Path) -> None:
    config = load_config(good)
    assert isinstance(config, RunConfig)
    assert (config.stage, config.run_dir, config.data.shards) == ("diffusion", str(tmp_path / "run"), "/data/shards")
    assert config.data.batch_size == 8  # YAML over the default
    assert config.data.resolution == 64  # default kept
    assert config.model.overrides("unet") == {"block_out_channels": [32, 64]}

    config = load_config(
        good,
        [
            "data.batch_size=2",
            "optim.lr=3e-4",
            "optim.betas=[0.8,0.95]",
            "model.components.unet.overrides.layers_per_block=2",
            "model.pretrained=/models/sd2",
            "stage=autoencoder",
        ],
    )
    assert config.data.batch_size == 2  # override over YAML
    assert config.optim.lr == pytest.approx(3e-4)
    assert config.optim.betas == [0.8, 0.95]
    assert config.model.overrides("unet") == {"block_out_channels": [32, 64], "layers_per_block": 2}
    assert config.model.pretrained == "/models/sd2"
    assert config.stage == "autoencoder"


def test_config_from_overrides_only(tmp_path: Path) -> None:
    config = load_config(None, ["stage=autoencoder", f"run_dir={tmp_path}", "data.shards=x/{0..3}.tar"])
    assert (config.stage, config.data.shards) == ("autoencoder", "x/{0..3}.tar")


def test_run_folder_keeps_the_first_config(good: Path, tmp_path: Path) -> None:
    config = load_config(good)
    run_dir = prepare_run_dir(config)
    assert run_dir == tmp_path / "run"
    saved = run_dir / "config.yaml"
    first_text = saved.read_text()
    assert load_config(saved) == config  # round-trips to an equal RunConfig

    prepare_run_dir(config)  # a plain restart records nothing new
    assert sorted(p.name for p in run_dir.glob("config*.yaml")) == ["config.yaml"]

    longer = load_config(good, ["train.max_steps=5000"])
    prepare_run_dir(longer)
    assert saved.read_text() == first_text
    assert load_config(saved).train.max_steps == config.train.max_steps == 1000
    changed = list(run_dir.glob("config.*.yaml"))
    assert len(changed) == 1
    assert load_config(changed[0]) == longer


def test_two_changed_restarts_in_one_second_keep_both(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sdtrain.run.time.strftime", lambda *args: "20250101-000000")
    for steps in (1000, 2000, 3000):
        prepare_run_dir(load_config(good, [f"train.max_steps={steps}"]))
    recorded = sorted(load_config(p).train.max_steps for p in (tmp_path / "run").glob("config.*.yaml"))
    assert recorded == [2000, 3000]


@pytest.mark.parametrize("name", ["finetune-full", "lora", "textual-inversion", "textual-inversion-cpu", "dreambooth",
                                  "sd2-256"])
def test_every_shipped_recipe_loads_once_its_paths_are_given(name, tmp_path):
    path = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    given = [f"run_dir={tmp_path}", "data.shards=data", "model.pretrained=sd",
             "textual_inversion.initializer_token=toy"]
    config = load_config(path, given)
    assert config.mode in ("full", "lora", "textual_inversion", "dreambooth")
    if name == "textual-inversion":  # the one value a user must choose is asked for by name
        with pytest.raises(UserError, match="textual_inversion.initializer_token"):
            load_config(path, given[:3])


def test_a_config_with_the_flat_objective_keys_of_earlier_releases_loads_into_their_sections(tmp_path, caplog):
    """Configs and run folders written before the objectives' options moved to diffusion.ddpm and diffusion.flow
    keep loading (the previous release's runs resume from their config.yaml): each key is read where it lives
    now, in one warning line naming both names."""
    old = write(tmp_path, GOOD.format(run_dir=tmp_path / "run") + "diffusion:\n  snr_gamma: 5.0\n  flow_shift: 3.0\n"
                "  prediction_type: v_prediction\n  train_text_encoder: true\n")
    caplog.set_level("WARNING")
    config = load_config(old, ["diffusion.guidance_range=[1.0,4.0]"])
    assert (config.diffusion.ddpm.snr_gamma, config.diffusion.ddpm.prediction_type) == (5.0, "v_prediction")
    assert (config.diffusion.flow.shift, config.diffusion.flow.guidance_range) == (3.0, [1.0, 4.0])
    assert config.diffusion.train_text_encoder
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    assert str(old) in warnings[0]
    assert "diffusion.snr_gamma" in warnings[0] and "diffusion.ddpm.snr_gamma" in warnings[0]
    assert "diffusion.flow_shift" in warnings[0] and "diffusion.flow.shift" in warnings[0]
    assert warnings[1].startswith("command line: diffusion.guidance_range: moved to diffusion.flow.guidance_range")
    new = write(tmp_path, GOOD.format(run_dir=tmp_path / "run") + "diffusion:\n  train_text_encoder: true\n"
                "  ddpm: {snr_gamma: 5.0, prediction_type: v_prediction}\n"
                "  flow: {shift: 3.0, guidance_range: [1, 4]}\n", "new.yaml")
    assert load_config(new) == config


def test_the_flat_component_keys_of_earlier_configs_still_load_with_one_note(tmp_path: Path, caplog) -> None:
    old = write(tmp_path, "stage: diffusion\nrun_dir: r\ndata: {shards: s}\nmodel: {vae: runs/ae, tokenizer_2: tok, "
                          "unet_overrides: {sample_size: 8}, text_encoder: null}\n")
    with caplog.at_level("WARNING", logger="sdtrain.config"):
        config = load_config(old, ["model.text_encoder_2=enc"])
    assert (config.model.source("vae"), config.model.source("tokenizer_2"), config.model.source("text_encoder_2")) \
        == ("runs/ae", "tok", "enc")
    assert config.model.overrides("unet") == {"sample_size": 8}
    # An unset slot, as every saved run's resolved config holds them, is no component and no note.
    assert "text_encoder" not in config.model.components
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 2 and "model.components.vae.source" in notes[0] and "rename them" in notes[0], notes
    assert "model.text_encoder_2: moved to model.components.text_encoder_2.source" in notes[1]
    # Saved resolved, the config names the components the new way.
    assert "components:\n    vae:\n      source: runs/ae" in to_yaml(config)
    # On the command line an old key's null still clears what a file asks for (???).
    asks = write(tmp_path, "stage: diffusion\nrun_dir: r\ndata: {shards: s}\nmodel:\n  pretrained: p\n  vae: ???\n")
    assert load_config(asks, ["model.vae=null"]).model.source("vae") is None


def test_every_section_with_a_bad_value_is_reported_a_line_each(good: Path) -> None:
    with pytest.raises(UserError) as info:
        load_config(good, ["data.caption_dropout=1.0", "optim.betas=[0.9]", "model.t5_text_length=2"])
    lines = str(info.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["data.caption_dropout", "model.t5_text_length", "optim.betas"], \
        lines
