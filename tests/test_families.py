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
from sdtrain.models.families.flux import FLUX
from sdtrain.models.families.flux2 import FLUX2, FLUX2_KLEIN
from sdtrain.models.families.sd import SD
from sdtrain.models.families.sd3 import SD3
from sdtrain.models.families.sdxl import SDXL
from sdtrain.train.parallel import DataParallel, shard_units


class _Tokenizer:
    def __len__(self) -> int:
        return 100

    model_max_length, bos_token_id, eos_token_id, pad_token_id = 16, 98, 99, 99


def sd_components() -> dict[str, nn.Module]:
    config = ModelConfig(preset="tiny")
    return {"vae": build.build_vae(config), "text_encoder": build.build_text_encoder(config, _Tokenizer()),
            "unet": build.build_unet(config, latent_channels=4, latent_size=8, cross_attention_dim=64)}


def sdxl_components() -> dict[str, nn.Module]:
    config = ModelConfig(family="sdxl", preset="tiny")
    text = {name: build.build_text_encoder(config, _Tokenizer(), name) for name in SDXL.components.text_encoders}
    return {"vae": build.build_vae(config), **text,
            "unet": build.build_denoiser(config, latent_channels=4, latent_size=8, text_encoders=text)}


def test_sd_lists_every_block_of_its_components():
    parts = sd_components()
    assert set(parts) == set(SD.components)
    assert all(isinstance(module, SD.components.classes[name]) for name, module in parts.items())
    unet, vae, text = parts["unet"], parts["vae"], parts["text_encoder"]
    assert len(SD.blocks(unet)) == len(unet.down_blocks) + 1 + len(unet.up_blocks) == 7
    assert len(SD.blocks(vae)) == len(vae.encoder.down_blocks) + 2 + len(vae.decoder.up_blocks) == 8
    assert len(SD.blocks(text)) == text.config.num_hidden_layers == 2
    # Found inside whatever holds the components (the autoencoder task's wrapper, an adapter's container).
    holder = nn.ModuleDict(parts)
    assert len(families.blocks(holder)) == 7 + 8 + 2


def test_sdxl_lists_every_block_of_its_components_and_conditions_as_sdxl_does():
    parts = sdxl_components()
    assert set(parts) == set(SDXL.components)
    assert all(isinstance(module, SDXL.components.classes[name]) for name, module in parts.items())
    unet = parts["unet"]
    assert len(SDXL.blocks(unet)) == len(unet.down_blocks) + 1 + len(unet.up_blocks) == 7
    for name in SDXL.components.text_encoders:
        assert len(SDXL.blocks(parts[name])) == parts[name].config.num_hidden_layers == 2
    # Cross-attention reads both encoders' states side by side; the added embedding the second's pooled
    # projection and six size ids.
    first, second = parts["text_encoder"].config, parts["text_encoder_2"].config
    assert unet.config.cross_attention_dim == first.hidden_size + second.hidden_size
    assert unet.config.addition_embed_type == "text_time"
    assert unet.add_embedding.linear_1.in_features == 6 * unet.config.addition_time_embed_dim + second.projection_dim
    ids = [torch.tensor([[98, 5, 6, 99] + [99] * 12])] * 2
    text = SDXL.conditioner.encode_text([parts["text_encoder"], parts["text_encoder_2"]], ids, ["a circle"])
    assert text["text_emb"].shape == (1, 16, first.hidden_size + second.hidden_size)
    assert text["text_pooled"].shape == (1, second.projection_dim)
    # The penultimate layer's states, as SDXL and its pipeline read them.
    hidden = parts["text_encoder"](ids[0], output_hidden_states=True).hidden_states[-2]
    torch.testing.assert_close(text["text_emb"][..., :first.hidden_size], hidden)
    # An empty caption (caption dropout) conditions on zeros, as the pipeline's unconditional half does.
    empty = SDXL.conditioner.encode_text([parts["text_encoder"], parts["text_encoder_2"]], ids, [""])
    assert not empty["text_emb"].any() and not empty["text_pooled"].any()


class _T5Tokenizer(_Tokenizer):
    pad_token_id, eos_token_id = 0, 1


def flow_components(family: str) -> dict[str, nn.Module]:
    """A tiny SD3 or Flux.1: its VAE, its CLIP and T5 encoders, and the transformer they shape."""
    config = ModelConfig(family=family, preset="tiny")
    spec = families.get(family)
    names = spec.components.text_encoders
    text = {name: build.build_text_encoder(config, _Tokenizer() if i < len(names) - 1 else _T5Tokenizer(), name)
            for i, name in enumerate(names)}
    return {"vae": build.build_vae(config), **text,
            "transformer": build.build_denoiser(config, latent_channels=16, latent_size=8, text_encoders=text)}


COMPONENTS = {"sd": sd_components, "sdxl": sdxl_components, "sd3": lambda: flow_components("sd3"),
              "flux": lambda: flow_components("flux")}


def test_flow_families_list_every_block_of_their_components():
    for family, transformer_blocks in (("sd3", 2), ("flux", 1 + 2)):
        parts, spec = flow_components(family), families.get(family)
        assert set(parts) == set(spec.components)
        assert all(isinstance(module, spec.components.classes[name]) for name, module in parts.items())
        # SD3's joint blocks; Flux's double-stream blocks, then its single-stream ones.
        assert len(spec.blocks(parts["transformer"])) == transformer_blocks
        t5 = parts[spec.components.text_encoders[-1]]
        assert len(spec.blocks(t5)) == t5.config.num_layers == 2
        assert len(families.blocks(nn.ModuleDict(parts))) == sum(len(spec.blocks(m)) for m in parts.values())


@pytest.mark.parametrize("family,name", [("sd", "unet"), ("sd", "vae"), ("sd", "text_encoder"),
                                         ("sdxl", "unet"), ("sdxl", "text_encoder"), ("sdxl", "text_encoder_2"),
                                         ("sd3", "transformer"), ("sd3", "text_encoder_3"), ("flux", "transformer"),
                                         ("flux", "text_encoder_2")])
def test_checkpointing_and_compile_wrap_the_blocks_the_spec_lists(family, name, monkeypatch):
    module = COMPONENTS[family]()[name]
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda forward, **_: compiled.append(forward) or forward)

    class Task:
        def parallel_modules(self):
            return {name: module}

    DataParallel(ParallelConfig(), Topology(), torch.device("cpu")).apply(Task(), checkpointing=True, compile=True)
    listed = families.get(family).blocks(module)
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
    assert families.detect(sdxl) is SDXL
    # An SDXL single file holds SD's UNet and VAE prefixes too; its conditioner decides.
    single = tmp_path / "sdxl.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.ones(2),
               "conditioner.embedders.1.model.text_projection": torch.ones(2)}, str(single))
    assert families.detect(single) is SDXL
    sd3 = tmp_path / "sd3.safetensors"
    save_file({"first_stage_model.decoder.conv_in.weight": torch.ones(2),
               "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": torch.ones(2)}, str(sd3))
    assert families.detect(sd3) is SD3
    # Black Forest Labs' files hold the transformer alone; ComfyUI's all-in-one files put it under a prefix.
    for name, prefix in (("flux", ""), ("flux-comfy", "model.diffusion_model.")):
        flux = tmp_path / f"{name}.safetensors"
        save_file({f"{prefix}double_blocks.0.img_attn.norm.key_norm.scale": torch.ones(2),
                   f"{prefix}vector_in.in_layer.weight": torch.ones(2)}, str(flux))
        assert families.detect(flux) is FLUX
        # Flux.2's blocks have the same names; its shared modulations and no pooled vector tell it (and klein, which
        # has no guidance embedding, from dev).
        for guidance, family in ((True, FLUX2), (False, FLUX2_KLEIN)):
            flux2 = tmp_path / f"{name}-2-{guidance}.safetensors"
            save_file({f"{prefix}double_blocks.0.img_attn.norm.key_norm.scale": torch.ones(2),
                       f"{prefix}double_stream_modulation_img.lin.weight": torch.ones(2),
                       **({f"{prefix}guidance_in.in_layer.weight": torch.ones(2)} if guidance else {})}, str(flux2))
            assert families.detect(flux2) is family
    for cls, family in (("FluxPipeline", FLUX), ("StableDiffusion3Pipeline", SD3)):
        folder = tmp_path / cls
        folder.mkdir()
        (folder / "model_index.json").write_text(f'{{"_class_name": "{cls}"}}')
        assert families.detect(folder) is family
    unknown = tmp_path / "unknown.safetensors"
    save_file({"some.weight": torch.ones(2)}, str(unknown))
    with pytest.raises(UserError, match="of no model family this release knows \\(keys such as some.weight\\)"):
        families.detect(unknown)


def test_the_family_comes_from_the_config_the_pretrained_files_or_the_preset(pretrained):
    assert families.for_model(ModelConfig()) is SD
    assert families.for_model(ModelConfig(preset="sdxl")) is SDXL
    assert families.for_model(ModelConfig(family="sdxl")) is SDXL
    assert families.for_model(ModelConfig(preset="flux-schnell")) is FLUX
    assert families.for_model(ModelConfig(preset="sd3-medium")) is SD3
    assert families.for_model(ModelConfig(pretrained=str(pretrained))) is SD
    with pytest.raises(UserError, match="model.family: sdxl, but model.pretrained .* is Stable Diffusion"):
        families.for_model(ModelConfig(family="sdxl", pretrained=str(pretrained)))
    with pytest.raises(UserError, match="model.family: 'kandinsky' is not one of sd, sdxl, sd3, flux"):
        families.for_model(ModelConfig(family="kandinsky"))
    with pytest.raises(UserError, match="model.preset: 'sd2' is not a SDXL preset; choose one of tiny, sdxl"):
        build.build_vae(ModelConfig(family="sdxl", preset="sd2"))


def test_params_reports_the_real_sdxl_unet(capsys):
    from sdtrain.cli.main import main

    from .conftest import config_path

    assert main(["params", str(config_path("diffusion.yaml")), "run_dir=x", "data.shards=x", "model.vae=null",
                 "model.preset=sdxl", "model.unet_overrides={}", "data.resolution=1024", "--json"]) == 0
    import json

    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["unet"]["parameters"] == 2_567_463_684
    assert rows["text_encoder_2"]["cls"] == "CLIPTextModelWithProjection"


@pytest.mark.parametrize(("preset", "transformer"), [("sd3-medium", 2_028_328_000), ("flux-dev", 11_901_408_320),
                                                     ("flux-schnell", 11_891_178_560)])
def test_params_reports_the_released_transformers(preset, transformer, capsys):
    from sdtrain.cli.main import main

    from .conftest import config_path

    assert main(["params", str(config_path("diffusion.yaml")), "run_dir=x", "data.shards=x", "model.vae=null",
                 f"model.preset={preset}", "model.unet_overrides={}", "data.resolution=1024", "--json"]) == 0
    import json

    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["transformer"]["parameters"] == transformer
    assert rows["vae"]["cls"] == "AutoencoderKL" and rows[list(rows)[-1]]["cls"] == "T5EncoderModel"


def test_training_on_a_model_of_another_family_is_one_line(tmp_path, shapes_dir, capsys):
    from sdtrain.cli.main import main

    from .conftest import TINY, config_path

    other = tmp_path / "kandinsky"
    other.mkdir()
    (other / "model_index.json").write_text('{"_class_name": "KandinskyV22Pipeline"}')
    assert main(["train", str(config_path("diffusion.yaml").parents[1] / "finetune-full.yaml"), *TINY,
                 f"model.pretrained={other}", f"data.shards={shapes_dir}", f"run_dir={tmp_path / 'run'}"]) == 2
    error = capsys.readouterr().err
    assert "is of no model family this release knows (KandinskyV22Pipeline)" in error
    assert "sdtrain trains Stable Diffusion 1.x/2.x, SDXL, SD3, Flux.1" in error


def test_a_part_a_family_leaves_undeclared_is_one_line_naming_the_family_never_another_familys_value():
    """A family is composed of parts with no defaults from another family: what it leaves out is a line naming it."""
    from sdtrain.models.families import spec

    sd = families.get("sd")

    class Call(spec.DenoiserCall):
        objective = "flow_matching"

    class Sampling(spec.Sampling):
        pipeline_class = sd.sampling.pipeline_class

    made = spec.ModelFamily(name="made", title="Made", components=sd.components, presets=sd.presets, codec=sd.codec,
                            conditioner=spec.Conditioner(), denoising=Call(), files=spec.FileInterchange(),
                            sampling=Sampling())
    with pytest.raises(UserError, match="model family Made: its conditioner trains no tokenizer"):
        made.conditioner.train_tokenizer(["a"], None, 10, 4)
    with pytest.raises(UserError, match="model family Made: its denoiser call says not how much"):
        made.denoising.downsampling(None)
    with pytest.raises(UserError, match="model family Made: its sampling says not what its models sample with"):
        made.sampling.defaults(None)
    with pytest.raises(TypeError, match="model family made: declares no conditioner"):
        spec.ModelFamily(name="made", title="Made", components=sd.components, presets=sd.presets, codec=sd.codec,
                         conditioner=None, denoising=Call(), files=spec.FileInterchange(), sampling=Sampling())
    with pytest.raises(TypeError, match="one denoiser"):
        spec.Components(vae=sd.components["vae"])
