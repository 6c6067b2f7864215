"""SDXL single files (Stability's SGM layout): written by sdtrain, read back by diffusers and by sdtrain; offline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sdtrain.errors import UserError
from sdtrain.loaders.pipelines import pipeline_from_file
from sdtrain.models import single_file as sf
from sdtrain.models.families import ldm_checkpoint as ldm

NAMES = ("unet", "vae", "text_encoder", "text_encoder_2")
# SDXL's own schedule (its EulerDiscreteScheduler config), as the training noise scheduler.
SCHEDULE = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                steps_offset=1, timestep_spacing="leading")


def _tiny_sdxl(tokenizer) -> dict:
    """SDXL's structure at toy sizes: a first level without attention, a deeper transformer below it, the added
    embedding of pooled text (48) and six size embeddings (8 each), two text encoders of different widths."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=[32, 64], layers_per_block=1,
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"], up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"],
        transformer_layers_per_block=[1, 2], attention_head_dim=[2, 4], cross_attention_dim=32 + 48,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 48)
    # Norm groups at their default (32), as a file without metadata is read.
    vae = AutoencoderKL(block_out_channels=[32, 32], layers_per_block=1, latent_channels=4,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        sample_size=64, scaling_factor=0.13025)
    ids = dict(vocab_size=1000, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    text = CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, hidden_act="quick_gelu", projection_dim=32, **ids))
    text_2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                                        num_attention_heads=4, hidden_act="gelu", projection_dim=48,
                                                        **ids))
    return dict(unet=unet, vae=vae, text_encoder=text.eval(), text_encoder_2=text_2.eval(),
                scheduler=DDPMScheduler(**SCHEDULE))


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """A tiny SDXL written as one file (tokenizers beside it) and as a diffusers folder, and its components."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    from sdtrain.models.tokenizer import train_clip_tokenizer

    root = tmp_path_factory.mktemp("sdxl")
    tokenizer = train_clip_tokenizer(["a red circle", "a blue square", "a green triangle"], root / "tok")
    parts = _tiny_sdxl(tokenizer)
    path = ldm.save(root / "model.safetensors", **parts)
    for index in (1, 2):
        tokenizer.save_pretrained(sf.tokenizer_folder(path, index))
    pipe = StableDiffusionXLPipeline(
        vae=parts["vae"], text_encoder=parts["text_encoder"], text_encoder_2=parts["text_encoder_2"],
        tokenizer=tokenizer, tokenizer_2=tokenizer, unet=parts["unet"],
        scheduler=EulerDiscreteScheduler(**SCHEDULE), add_watermarker=False)
    pipe.save_pretrained(root / "pipeline")
    return path, root / "pipeline", parts, pipe


def _assert_same_weights(loaded, reference, what: str) -> None:
    a, b = loaded.state_dict(), reference.state_dict()
    assert a.keys() == b.keys(), f"{what}: {sorted(set(a) ^ set(b))[:3]}"
    for key in a:
        assert a[key].dtype == torch.float32 and torch.equal(a[key], b[key].float()), f"{what}: {key}"


def _image(pipe) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(3)
    return pipe("a red circle", height=64, width=64, num_inference_steps=2, generator=generator,
                output_type="np").images[0]


def test_file_is_in_sgm_layout_and_diffusers_reads_every_weight(sdxl):
    from diffusers import StableDiffusionXLPipeline
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
    )

    path, folder, parts, _ = sdxl
    state = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    assert {".".join(k.split(".")[:3]) if k.startswith("conditioner") else k.split(".")[0] for k in state} == {
        "model", "first_stage_model", "conditioner.embedders.0", "conditioner.embedders.1"}
    assert metadata["model_family"] == "sdxl" and metadata[sf.FORMAT_KEY] == sf.FORMAT_VERSION
    assert json.loads(metadata["text_encoder_2_config"])["hidden_act"] == "gelu"
    assert json.loads(metadata["unet_config"])["addition_time_embed_dim"] == 8
    assert sf.written_by_sdtrain(path)
    unet_keys = {k.removeprefix(ldm.UNET_PREFIX) for k in state if k.startswith(ldm.UNET_PREFIX)}
    assert {"label_emb.0.0.weight", "label_emb.0.2.bias"} <= unet_keys
    # Level 1 (input blocks 3 and 4 after a downsample at 2) has 2 transformer blocks; level 0 none.
    assert "input_blocks.3.1.transformer_blocks.1.attn2.to_k.weight" in unet_keys
    assert not any(k.startswith("input_blocks.1.1.") for k in unet_keys)
    bigg = ldm.SDXL_OPENCLIP_PREFIX
    assert torch.equal(state[bigg + "text_projection"], parts["text_encoder_2"].text_projection.weight.T)
    assert {int(k.split(".")[6]) for k in state if ".resblocks." in k} == {0, 1}  # whole tower, nothing added
    assert state[bigg + "logit_scale"].shape == ()

    # diffusers' own converters turn the file into exactly each module's keys: none missing, none unexpected.
    assert set(convert_ldm_unet_checkpoint(state, dict(parts["unet"].config))) == set(parts["unet"].state_dict())
    assert set(convert_ldm_vae_checkpoint(state, dict(parts["vae"].config))) == set(parts["vae"].state_dict())
    clip = {k.removeprefix("text_model.") for k in convert_ldm_clip_checkpoint(state)}
    assert clip == set(parts["text_encoder"].state_dict()) - {"embeddings.position_ids"}
    openclip = set(convert_open_clip_checkpoint(parts["text_encoder_2"], state, prefix=bigg))
    assert openclip == set(parts["text_encoder_2"].state_dict()) - {"text_model.embeddings.position_ids"}

    single = StableDiffusionXLPipeline.from_single_file(str(path), config=str(folder), local_files_only=True)
    for name in NAMES:
        _assert_same_weights(getattr(single, name), parts[name], f"diffusers {name}")


def test_sdtrain_reads_each_component_and_the_pipeline_without_a_config_folder(sdxl, caplog):
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextModelWithProjection

    path, _, parts, pipe = sdxl
    info = ldm.inspect(path)
    assert info.family == "sdxl" and ldm.model_family(path) == "sdxl" and info.text_layout == "clip"
    assert info.prefixes["text_encoder_2"] == ldm.SDXL_OPENCLIP_PREFIX
    assert info.scheduler_config["timestep_spacing"] == "leading" and info.prediction_type == "epsilon"
    with caplog.at_level("WARNING"):
        loaded = {name: ldm.load_component(name, path) for name in NAMES}
    assert "not used" not in caplog.text
    for name in NAMES:
        _assert_same_weights(loaded[name], parts[name], f"sdtrain {name}")
    assert isinstance(loaded["text_encoder_2"], CLIPTextModelWithProjection)
    for key in ("transformer_layers_per_block", "attention_head_dim", "down_block_types", "addition_embed_type",
                "addition_time_embed_dim", "projection_class_embeddings_input_dim", "cross_attention_dim"):
        assert ldm._normalize(loaded["unet"].config[key]) == ldm._normalize(parts["unet"].config[key]), key
    assert loaded["vae"].config.scaling_factor == 0.13025
    for name in ("text_encoder", "text_encoder_2"):
        for key in ("hidden_act", "num_attention_heads", "projection_dim", "eos_token_id"):
            assert getattr(loaded[name].config, key) == getattr(parts[name].config, key), (name, key)

    ours = pipeline_from_file(path)  # tokenizers from OUT.tokenizer/ and OUT.tokenizer_2/
    assert isinstance(ours, StableDiffusionXLPipeline) and ours.watermark is None
    assert ours.config.force_zeros_for_empty_prompt is True
    assert (ours.scheduler.config.timestep_spacing, ours.scheduler.config.steps_offset) == ("leading", 1)
    for name in NAMES:
        _assert_same_weights(getattr(ours, name), parts[name], f"sdtrain pipeline {name}")
    want, got = _image(pipe), _image(ours)
    assert np.isfinite(want).all() and want.shape == (64, 64, 3)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_a_file_without_metadata_reads_with_sdxl_defaults(sdxl, tmp_path):
    """Stability's files say nothing of their settings: the family, schedule and sizes come from the keys."""
    path, _, parts, _ = sdxl
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(str(path)), str(bare))
    info = ldm.inspect(bare)
    assert info.family == "sdxl" and info.prediction_type == "epsilon"
    assert {k: info.scheduler_config[k] for k in SCHEDULE} == SCHEDULE
    unet = info.configs["unet"]
    assert unet["addition_time_embed_dim"] == 8  # what the projection's input leaves beside the pooled 48
    assert unet["transformer_layers_per_block"] == [1, 2] and unet["sample_size"] == 128
    assert info.configs["vae"]["scaling_factor"] == 0.13025
    assert info.configs["text_encoder_2"]["projection_dim"] == 48
    assert info.configs["text_encoder_2"]["hidden_act"] == "gelu"
    assert info.configs["text_encoder"]["hidden_act"] == "quick_gelu"
    for name in NAMES:
        _assert_same_weights(ldm.load_component(name, bare), parts[name], f"bare {name}")

    # A second text encoder without its projection cannot condition SDXL's UNet: one clear line.
    broken = tmp_path / "broken.safetensors"
    save_file({k: v for k, v in load_file(str(path)).items() if not k.endswith("text_projection")}, str(broken))
    with pytest.raises(UserError, match="unrecognized text_encoder_2 layout.*text_projection") as caught:
        ldm.load_component("text_encoder_2", broken)
    assert str(broken) in str(caught.value) and "\n" not in str(caught.value)
    _assert_same_weights(ldm.load_component("unet", broken), parts["unet"], "unet beside it")
    with pytest.raises(UserError, match="no tokenizer") as caught:
        pipeline_from_file(bare)
    assert "\n" not in str(caught.value)
    # One tokenizer named for a bare file serves both encoders, as training reads such a file: SDXL's two share
    # their vocabulary.
    pipe = pipeline_from_file(bare, tokenizer=sf.tokenizer_folder(path))
    assert pipe.tokenizer_2.get_vocab() == pipe.tokenizer.get_vocab()


def test_writer_refuses_what_sdxl_files_cannot_hold(sdxl, tmp_path):
    from transformers import CLIPTextModel

    _, _, parts, _ = sdxl
    with pytest.raises(UserError, match="CLIP layout"):
        ldm.save(tmp_path / "x.safetensors", **parts, text_layout="openclip")
    plain = CLIPTextModel(parts["text_encoder_2"].config)  # no projection
    with pytest.raises(UserError, match="CLIPTextModelWithProjection"):
        ldm.save(tmp_path / "x.safetensors", text_encoder_2=plain)
    assert not list(tmp_path.iterdir())
    # The UNet alone is still SDXL's (its added embedding says so), and reads back.
    alone = ldm.save(tmp_path / "unet.safetensors", unet=parts["unet"])
    assert ldm.model_family(alone) == "sdxl"
    _assert_same_weights(ldm.load_component("unet", alone), parts["unet"], "unet alone")
    assert sf.tokenizer_folder(alone, 2).name == "unet.tokenizer_2"


def test_sdxl_sized_layout_is_what_diffusers_detects_and_converts():
    """Shapes only (meta tensors): SDXL base's real sizes map to keys diffusers detects as xl_base and converts to
    exactly the modules' keys, and a metadata-free file infers SDXL base's own configs."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_open_clip_checkpoint,
        infer_diffusers_model_type,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    unet_config = dict(
        sample_size=128, block_out_channels=[320, 640, 1280], layers_per_block=2, attention_head_dim=[5, 10, 20],
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        transformer_layers_per_block=[1, 2, 10],
        cross_attention_dim=2048, use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816)
    vae_config = dict(block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=4,
                      down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                      sample_size=1024, scaling_factor=0.13025)
    ids = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    with torch.device("meta"):
        unet, vae = UNet2DConditionModel(**unet_config), AutoencoderKL(**vae_config)
        clip_l = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                              num_attention_heads=12, projection_dim=768, **ids))
        bigg = CLIPTextModelWithProjection(CLIPTextConfig(
            hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
            projection_dim=1280, hidden_act="gelu", **ids))
        state = ldm.to_original_state_dict(unet, vae, clip_l, "clip", text_encoder_2=bigg)
    assert infer_diffusers_model_type(state) == "xl_base"
    assert set(convert_ldm_unet_checkpoint(state, dict(unet.config))) == set(unet.state_dict())
    assert {k.removeprefix("text_model.") for k in convert_ldm_clip_checkpoint(state)} == set(clip_l.state_dict())
    converted = set(convert_open_clip_checkpoint(bigg, state, prefix=ldm.SDXL_OPENCLIP_PREFIX))
    assert converted == set(bigg.state_dict())
    assert tuple(state[ldm.SDXL_OPENCLIP_PREFIX + "text_projection"].shape) == (1280, 1280)

    configs, _, layout, prediction, scheduler, errors = ldm._infer({k: tuple(v.shape) for k, v in state.items()}, {})
    assert not errors and (layout, prediction, scheduler["timestep_spacing"]) == ("clip", "epsilon", "leading")
    for name, module in (("unet", unet), ("vae", vae), ("text_encoder", clip_l), ("text_encoder_2", bigg)):
        expected = ldm._module_config(name, module)
        differ = [k for k in configs[name] if k in expected and ldm._normalize(configs[name][k]) !=
                  ldm._normalize(expected[k])]
        assert not differ, (name, differ)
