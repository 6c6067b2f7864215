"""`sdtrain train --check CONFIG`: what a model's family and a mode cannot take is known from the config and the
models' config files, so it is reported before any weight loads, every problem on a line of its own; every run
checks the same before it loads a weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdtrain.cli.main import main

FLUX_LORA = Path(__file__).resolve().parents[1] / "configs" / "flux-lora.yaml"
LORA = Path(__file__).resolve().parents[1] / "configs" / "lora.yaml"


@pytest.fixture
def weightless_flux(tmp_path) -> Path:
    """A Flux.1 pipeline folder as the Hub lays one out, with its config files and not one weight: what
    ``--check`` needs of a pretrained model (a Hub id fetches no more for it)."""
    folder = tmp_path / "FLUX.1-schnell"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (folder / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "FluxTransformer2DModel", "guidance_embeds": False}))
    return folder


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("sdtrain train: error: ")]


def test_a_config_its_model_takes_checks_ok_from_config_files_alone(weightless_flux, capsys):
    assert main(["train", str(FLUX_LORA), "--check", f"model.pretrained={weightless_flux}"]) == 0
    out = capsys.readouterr().out
    assert "ok: Flux.1, mode lora; no weight was loaded" in out, out


def test_a_key_the_pretrained_denoiser_cannot_read_is_one_line_from_its_config_json(weightless_flux, capsys):
    # schnell's transformer has no guidance embedding: a guidance range would train nothing.
    assert main(["train", str(FLUX_LORA), "--check", f"model.pretrained={weightless_flux}",
                 "diffusion.flow.guidance_range=[1.0,4.0]"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "diffusion.flow.guidance_range" in errors[0], errors


def test_every_key_the_family_and_the_mode_cannot_take_is_reported_each_on_its_own_line(capsys):
    assert main(["train", str(LORA), "--check", "model.pretrained=null", "model.family=z-image",
                 "model.preset=huge", "mode=instruct_pix2pix", "diffusion.flow.shift=3"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 2, errors
    assert errors[0].startswith("sdtrain train: error: model.preset: 'huge' is not a Z-Image preset"), errors
    assert "mode: Z-Image learns no InstructPix2Pix editing" in errors[1], errors


def test_flow_matching_options_on_a_noise_prediction_model_are_refused_before_training(capsys):
    assert main(["train", str(LORA), "--check", "model.pretrained=null", "model.family=sd", "model.preset=tiny",
                 "diffusion.timestep_sampling=cosmap", "diffusion.flow.shift=3"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "diffusion.timestep_sampling: cosmap, diffusion.flow.shift: 3.0" in errors[0]


def test_a_run_reports_what_its_model_cannot_take_before_it_loads_a_weight(weightless_flux, tmp_path, shapes_dir,
                                                                           capsys):
    """The same check at the start of a run: the weightless folder would fail to load, so the run's one line
    must be the capability's, found first."""
    assert main(["train", str(FLUX_LORA), f"model.pretrained={weightless_flux}", f"data.shards={shapes_dir}",
                 f"run_dir={tmp_path / 'run'}", "mode=instruct_pix2pix", "data.num_workers=0"]) == 2
    errors = _errors(capsys)
    assert errors == ["sdtrain train: error: mode: Flux.1 learns no InstructPix2Pix editing in this release; "
                      "Stable Diffusion 1.x/2.x, SDXL do"], errors


def test_image_sizes_the_pretrained_models_shapes_cannot_take_are_found_from_their_config_files(tmp_path, capsys):
    """SD3's transformer covers pos_embed_max_size patches a side; its VAE downsamples 8x; buckets must survive both
    with its 2x2 patches: all read from the folder's config.json files, every one reported."""
    folder = tmp_path / "stable-diffusion-3-medium-diffusers"
    for name, settings in {"vae": {"_class_name": "AutoencoderKL", "block_out_channels": [128, 256, 512, 512]},
                           "transformer": {"_class_name": "SD3Transformer2DModel", "patch_size": 2,
                                           "pos_embed_max_size": 8}}.items():
        (folder / name).mkdir(parents=True)
        (folder / name / "config.json").write_text(json.dumps(settings))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    sd3_lora = FLUX_LORA.with_name("sd3-lora.yaml")
    assert main(["train", str(sd3_lora), "--check", f"model.pretrained={folder}", "data.resolution=100"]) == 2
    assert _errors(capsys) == ["sdtrain train: error: data.resolution: 100 is not a multiple of the VAE's factor 8"]
    assert main(["train", str(sd3_lora), "--check", f"model.pretrained={folder}", "data.resolution=256",
                 "data.aspect_buckets=true", "data.bucket_step=24"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 2 and "data.bucket_step: 24 is not a multiple of 16" in errors[0]
    assert "takes images of at most 128 px a side" in errors[1], errors
    assert main(["train", str(sd3_lora), "--check", f"model.pretrained={folder}", "data.resolution=128"]) == 0


def test_a_component_the_family_does_not_declare_is_one_line_naming_those_it_does(capsys):
    # SDXL's second text encoder is no Stable Diffusion 1/2 component; a tokenizer is loaded, never built.
    assert main(["train", str(LORA), "--check", "model.pretrained=null", "model.family=sd", "model.preset=tiny",
                 "model.components.text_encoder_2.source=/models/clip-g",
                 "model.components.tokenizer.overrides.vocab_size=10"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 2, errors
    assert errors[0].endswith("model.components.text_encoder_2: Stable Diffusion 1.x/2.x has no component "
                              "text_encoder_2; its components are vae, text_encoder, unet, tokenizer"), errors
    assert "model.components.tokenizer.overrides: a tokenizer is loaded" in errors[1], errors


def test_a_family_names_its_own_components_open_slots_included(capsys):
    # Qwen-Image 2.1 reads captions through a processor: a component no other family has, taken by its name.
    assert main(["train", str(LORA), "--check", "model.pretrained=null", "model.family=qwen-image-2.1",
                 "model.preset=tiny", "lora.target_modules=[to_q]", "model.components.processor.source=/p"]) == 0, \
        capsys.readouterr().err


def test_a_misspelt_component_is_refused_and_another_familys_overrides_are_only_said_unread(capsys, caplog):
    base = ["train", str(LORA), "--check", "model.pretrained=null", "model.family=flux", "model.preset=tiny"]
    assert main([*base, "model.components.transfomer.overrides.num_layers=1"]) == 2
    assert "model.components.transfomer: Flux.1 has no component transfomer" in _errors(capsys)[0]
    # A Stable Diffusion config's UNet settings, run as Flux.1: nothing reads them, and the run says so.
    assert main([*base, "model.components.unet.overrides.layers_per_block=1"]) == 0
    assert "model.components.unet: Flux.1 has no component unet" in caplog.text and "not read" in caplog.text
