"""Model presets and loading components from local folders."""

from __future__ import annotations

import pytest
import torch

from sdtrain.config import ComponentConfig, ModelConfig, load_config
from sdtrain.errors import UserError
from sdtrain.loaders.components import load_component
from sdtrain.models import build

from .conftest import config_path


def test_sd2_preset_is_the_real_sd2_base_unet():
    # On the meta device: the architecture without allocating 3.5 GB.
    with torch.device("meta"):
        unet = build.build_unet(ModelConfig(preset="sd2"), latent_channels=4, latent_size=32, cross_attention_dim=1024)
    assert build.count_parameters(unet) == 865_910_724


def test_sd2_256_config_loads():
    root = config_path("diffusion.yaml").parents[1]
    config = load_config(root / "sd2-256.yaml", ["run_dir=/tmp/x", "data.shards=/tmp/y"])
    assert config.model.preset == "sd2" and config.data.resolution == 256
    # Neither assumed: measured on the machine it runs on.
    assert config.train.mixed_precision == "auto" and config.train.gradient_checkpointing == "auto"


def test_unet_overrides_replace_preset_values():
    config = ModelConfig(preset="tiny", components={"unet": ComponentConfig(overrides={"layers_per_block": 2})})
    unet = build.build_unet(config, latent_channels=4, latent_size=8, cross_attention_dim=64)
    assert unet.config.layers_per_block == 2


def test_components_load_from_pipeline_component_and_run_folders(tmp_path, diffusion_run):
    from sdtrain.export import export_run

    pipeline = export_run(diffusion_run, tmp_path / "pipeline")
    from_pipeline = load_component("unet", pipeline)
    from_component = load_component("unet", pipeline / "unet")
    from_run = load_component("unet", diffusion_run)
    for a, b, c in zip(from_pipeline.parameters(), from_component.parameters(), from_run.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    tokenizer = build.load_tokenizer(pipeline)
    assert tokenizer("a red circle").input_ids == build.load_tokenizer(diffusion_run)("a red circle").input_ids


def test_unknown_source_folder_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="not a diffusers component folder"):
        load_component("vae", tmp_path)


def test_a_run_without_the_component_says_so(autoencoder_run):
    with pytest.raises(UserError, match="did not train a unet"):
        load_component("unet", autoencoder_run)
