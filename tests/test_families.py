"""Model family specs: every family lists the repeated blocks of its components, and activation
checkpointing, compilation and FSDP wrap exactly those, so a family added without them fails here instead of
silently training without any."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdtrain.config import ModelConfig, ParallelConfig
from sdtrain.distributed import Topology
from sdtrain.errors import UserError
from sdtrain.models import build, families
from sdtrain.models.families.sd import SD
from sdtrain.train.parallel import DataParallel, shard_units


class _Tokenizer:
    def __len__(self) -> int:
        return 100

    model_max_length, bos_token_id, eos_token_id, pad_token_id = 16, 98, 99, 99


def sd_components() -> dict[str, nn.Module]:
    config = ModelConfig(preset="tiny")
    return {"vae": build.build_vae(config), "text_encoder": build.build_text_encoder(config, _Tokenizer()),
            "unet": build.build_unet(config, latent_channels=4, latent_size=8, cross_attention_dim=64)}


def test_sd_lists_every_block_of_its_components():
    parts = sd_components()
    assert set(parts) == set(SD.components)
    assert all(isinstance(module, SD.components[name]) for name, module in parts.items())
    unet, vae, text = parts["unet"], parts["vae"], parts["text_encoder"]
    assert len(SD.blocks(unet)) == len(unet.down_blocks) + 1 + len(unet.up_blocks) == 7
    assert len(SD.blocks(vae)) == len(vae.encoder.down_blocks) + 2 + len(vae.decoder.up_blocks) == 8
    assert len(SD.blocks(text)) == text.config.num_hidden_layers == 2
    # Found inside whatever holds the components (the autoencoder task's wrapper, an adapter's container).
    holder = nn.ModuleDict(parts)
    assert len(families.blocks(holder)) == 7 + 8 + 2


@pytest.mark.parametrize("name", ["unet", "vae", "text_encoder"])
def test_checkpointing_and_compile_wrap_the_blocks_the_spec_lists(name, monkeypatch):
    module = sd_components()[name]
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda forward, **_: compiled.append(forward) or forward)

    class Task:
        def parallel_modules(self):
            return {name: module}

    DataParallel(ParallelConfig(), Topology(), torch.device("cpu")).apply(Task(), checkpointing=True, compile=True)
    listed = SD.blocks(module)
    wrapped = [m for m in module.modules() if "forward" in vars(m)]  # the instance's forward, not the class's
    assert wrapped == listed and len(compiled) == len(listed) > 0


def test_a_module_no_family_knows_is_an_error_not_a_silent_fallback():
    with pytest.raises(RuntimeError, match="no model family lists blocks"):
        shard_units(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))


def test_a_pretrained_model_is_recognised_from_its_files(pretrained, tmp_path):
    from safetensors.torch import save_file

    assert families.detect(pretrained) is SD
    sdxl = tmp_path / "sdxl"
    sdxl.mkdir()
    (sdxl / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    with pytest.raises(UserError, match="is SDXL, which this release does not train yet \\(StableDiffusionXLPipel"):
        families.detect(sdxl)
    flux = tmp_path / "flux.safetensors"
    save_file({"double_blocks.0.img_attn.norm.key_norm.scale": torch.ones(2)}, str(flux))
    with pytest.raises(UserError, match="is Flux.1, which"):
        families.detect(flux)
    unknown = tmp_path / "unknown.safetensors"
    save_file({"some.weight": torch.ones(2)}, str(unknown))
    with pytest.raises(UserError, match="of no model family this release knows \\(keys such as some.weight\\)"):
        families.detect(unknown)


def test_training_on_a_model_of_another_family_is_one_line(tmp_path, shapes_dir, capsys):
    from sdtrain.cli.main import main

    from .conftest import TINY, config_path

    sdxl = tmp_path / "sdxl"
    sdxl.mkdir()
    (sdxl / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    assert main(["train", str(config_path("diffusion.yaml").parents[1] / "finetune-full.yaml"), *TINY,
                 f"model.pretrained={sdxl}", f"data.shards={shapes_dir}", f"run_dir={tmp_path / 'run'}"]) == 2
    assert "is SDXL, which this release does not train yet" in capsys.readouterr().err
