"""Single-file checkpoints in the original Stable Diffusion layout: export, load, train from one; offline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sdtrain.config import ComponentConfig, DdpmConfig, DiffusionConfig, ModelConfig
from sdtrain.errors import UserError
from sdtrain.loaders.components import load_component
from sdtrain.loaders.pipelines import pipeline_from_file
from sdtrain.models import build
from sdtrain.models import single_file as sf
from sdtrain.models.families import ldm_checkpoint as ldm
from sdtrain.models.families.sd import PRESETS

from .conftest import train


def _tiny_components(vocab: int = 600, **text):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    vae = AutoencoderKL(**PRESETS["tiny"]["vae"])
    unet = UNet2DConditionModel(**PRESETS["tiny"]["unet"], in_channels=4, out_channels=4, sample_size=8,
                                cross_attention_dim=64)
    config = {**PRESETS["tiny"]["text_encoder"], "vocab_size": vocab, "max_position_embeddings": 16,
              "bos_token_id": vocab - 2, "eos_token_id": vocab - 1, "pad_token_id": vocab - 1, **text}
    return unet, vae, CLIPTextModel(CLIPTextConfig(**config))


def _assert_same_weights(loaded, reference, what: str) -> None:
    a, b = loaded.state_dict(), reference.state_dict()
    assert a.keys() == b.keys(), f"{what}: {sorted(set(a) ^ set(b))[:3]}"
    for key in a:
        assert a[key].dtype == torch.float32 and torch.equal(a[key], b[key].float()), f"{what}: {key}"


@pytest.fixture(scope="module")
def exported(tmp_path_factory, diffusion_run):
    """The diffusion run as one file and as a diffusers folder."""
    from sdtrain.export import export_run, export_single_file

    out = tmp_path_factory.mktemp("single") / "model.safetensors"
    return export_single_file(diffusion_run, out), export_run(diffusion_run, out.parent / "pipeline")


def test_round_trip_loads_in_diffusers_and_sdtrain_with_the_runs_weights(exported, diffusion_run, monkeypatch):
    from diffusers import StableDiffusionPipeline

    from sdtrain.export import pipeline_from_run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path, folder = exported
    with safe_open(str(path), framework="pt") as f:
        keys, metadata = set(f.keys()), f.metadata()  # noqa: SIM118
    assert {k.split(".")[0] for k in keys} == {"model", "first_stage_model", "cond_stage_model"}
    assert any(k.startswith("cond_stage_model.transformer.text_model.encoder.layers.0.") for k in keys)
    assert metadata["prediction_type"] == "epsilon" and metadata["text_encoder_layout"] == "clip"
    assert json.loads(metadata["vae_config"])["norm_num_groups"] == 8
    assert {"scaling_factor", "sample_size"} <= set(json.loads(metadata["vae_config"]))
    assert json.loads(metadata["scheduler_config"])["beta_schedule"] == "scaled_linear"
    assert all(t.dtype == torch.float32 for t in load_file(str(path)).values())
    assert (sf.tokenizer_folder(path) / "tokenizer_config.json").is_file()

    reference = pipeline_from_run(diffusion_run)  # EMA weights, as the export
    for name in ("unet", "vae", "text_encoder"):
        loaded = load_component(name, path)
        _assert_same_weights(loaded, getattr(reference, name), f"sdtrain {name}")
    assert load_component("vae", path).config.scaling_factor == reference.vae.config.scaling_factor

    single = StableDiffusionPipeline.from_single_file(str(path), config=str(folder), local_files_only=True)
    for name in ("unet", "vae", "text_encoder"):
        _assert_same_weights(getattr(single, name), getattr(reference, name), f"diffusers {name}")
    plain = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
    ours = pipeline_from_file(path)  # sdtrain's loader, the OUT.tokenizer/ beside the file
    images = []
    for pipe in (single, plain, ours):
        pipe.set_progress_bar_config(disable=True)
        generator = torch.Generator().manual_seed(7)
        images.append(pipe("a red circle", num_inference_steps=2, generator=generator, output_type="np").images[0])
    assert np.isfinite(images[0]).all() and np.array_equal(images[0], images[1])
    assert np.array_equal(images[0], images[2])


def test_cli_exports_half_precision_and_refuses_a_foreign_file(exported, diffusion_run, tmp_path):
    from sdtrain.cli.main import main

    path, _ = exported
    half = tmp_path / "half.safetensors"
    assert main(["export", str(diffusion_run), str(half), "--single-file", "--half"]) == 0
    assert {t.dtype for t in load_file(str(half)).values()} == {torch.float16}
    unet = load_component("unet", half)
    reference = load_component("unet", path)
    assert all(torch.equal(a, b.half().float()) for a, b in zip(unet.parameters(), reference.parameters()))
    assert main(["export", str(diffusion_run), str(half), "--single-file"]) == 0  # an earlier export is replaced
    foreign = tmp_path / "downloaded.safetensors"
    save_file({"x": torch.zeros(1)}, str(foreign))
    with pytest.raises(UserError, match="not an earlier sdtrain single-file export"):
        from sdtrain.export import export_single_file

        export_single_file(diffusion_run, foreign)
    assert main(["export", str(diffusion_run), str(tmp_path / "x.safetensors")]) == 2  # needs --single-file
    with pytest.raises(UserError, match="checkpoints"):
        export_single_file(diffusion_run, diffusion_run / "checkpoints" / "x.safetensors")
    assert main(["export", str(diffusion_run), "--out", str(tmp_path / "folder")]) == 0  # the folder export stays
    assert (tmp_path / "folder" / "model_index.json").is_file()


def test_sd2_layout_reads_as_v_prediction_with_the_same_text_encoder(tmp_path):
    from transformers import CLIPTextConfig, CLIPTextModel


    unet, vae, text = _tiny_components()
    path = ldm.save(tmp_path / "sd2.safetensors", unet=unet, vae=vae, text_encoder=text,
                               text_layout="openclip")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        fused = f.get_slice("cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight").get_shape()
    assert "prediction_type" not in metadata and fused == [3 * 64, 64]
    assert ldm.prediction_type(path) == "v_prediction"
    noise = build.build_noise_scheduler(DiffusionConfig(), ModelConfig(pretrained=str(path)))
    assert noise.config.prediction_type == "v_prediction"
    assert (noise.config.beta_schedule, noise.config.beta_start, noise.config.beta_end,
            noise.config.num_train_timesteps) == ("scaled_linear", 0.00085, 0.012, 1000)
    epsilon = build.build_noise_scheduler(DiffusionConfig(ddpm=DdpmConfig(prediction_type="epsilon")),
                                          ModelConfig(pretrained=str(path)))
    assert epsilon.config.prediction_type == "epsilon"

    loaded = load_component("text_encoder", path)
    assert isinstance(loaded, CLIPTextModel)
    ids = torch.tensor([[598, 5, 17, 200, 599, 599], [598, 42, 599, 599, 599, 599]])
    with torch.no_grad():
        want, got = text.eval()(ids), loaded(ids)
    assert torch.equal(want.last_hidden_state, got.last_hidden_state)
    assert torch.equal(want.pooler_output, got.pooler_output)
    _assert_same_weights(load_component("unet", path), unet, "unet")
    # Exported again from an SD 2.x-layout source, the text encoder keeps that layout.
    assert ldm.choose_text_layout(loaded, source=path) == "openclip"

    # Stability's SD 2.x files have 24 text blocks, the last a trained one SD 2 does not use (it conditions on the
    # penultimate): a 24-layer encoder's first 24 blocks, with or without text_projection and logit_scale.
    deep_config = CLIPTextConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=24, num_attention_heads=2,
                                 vocab_size=40, max_position_embeddings=8, hidden_act="gelu")
    deep = CLIPTextModel(deep_config).eval()
    with pytest.raises(UserError, match="openclip"):
        ldm.save(tmp_path / "deep.safetensors", text_encoder=deep, text_layout="openclip")
    state = ldm.to_original_state_dict(text_encoder=deep, text_layout="openclip")
    stability = {k: v.contiguous() for k, v in state.items() if ".resblocks.24." not in k}
    stripped = {k: v for k, v in stability.items() if not k.endswith(("text_projection", "logit_scale"))}
    # Their metadata, as ComfyUI or kohya may write it, says the settings but is not sdtrain's format.
    metadata = {k: v for k, v in ldm.single_file_metadata(text_encoder=deep).items() if k != sf.FORMAT_KEY}
    deep.encoder.layers = deep.encoder.layers[:23]
    ids = torch.tensor([[0, 5, 9, 2]])
    with torch.no_grad():
        want = deep(ids).last_hidden_state
    for name, tensors in (("sd2-24", stability), ("sd2-24-stripped", stripped)):
        save_file(tensors, str(tmp_path / f"{name}.safetensors"), metadata=metadata)
        read = load_component("text_encoder", tmp_path / f"{name}.safetensors")
        assert read.config.num_hidden_layers == 23 and read.config.hidden_act == "gelu", name
        with torch.no_grad():
            assert torch.equal(want, read(ids).last_hidden_state), name


def _openclip_forward(state: dict[str, torch.Tensor], ids: torch.Tensor, blocks: int, heads: int, act: str):
    """The original OpenCLIP text forward (fused-projection attention, causal mask) through the first `blocks`
    blocks, then ln_final: what a reader of the original layout computes."""
    import torch.nn.functional as F
    from transformers.activations import ACT2FN

    p = {k.removeprefix(ldm.OPENCLIP_PREFIX): v.float() for k, v in state.items()}
    x = p["token_embedding.weight"][ids] + p["positional_embedding"][: ids.shape[1]]
    width, length = x.shape[-1], ids.shape[1]
    mask = torch.full((length, length), float("-inf")).triu(1)
    for b in range(blocks):
        r = f"transformer.resblocks.{b}."
        attention = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        attention.load_state_dict({k: p[r + "attn." + k] for k in attention.state_dict()})
        h = F.layer_norm(x, (width,), p[r + "ln_1.weight"], p[r + "ln_1.bias"])
        x = x + attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = F.layer_norm(x, (width,), p[r + "ln_2.weight"], p[r + "ln_2.bias"])
        h = ACT2FN[act](F.linear(h, p[r + "mlp.c_fc.weight"], p[r + "mlp.c_fc.bias"]))
        x = x + F.linear(h, p[r + "mlp.c_proj.weight"], p[r + "mlp.c_proj.bias"])
    return F.layer_norm(x, (width,), p["ln_final.weight"], p["ln_final.bias"])


def test_sd2_file_holds_the_whole_openclip_tower_and_reads_back_the_same(tmp_path, caplog):
    """ComfyUI builds SD 2's whole tower (24 blocks, text_projection, logit_scale): the file has one block past the
    encoder's N layers, which changes nothing, and reads back as the N-layer encoder it was."""
    import math

    from transformers import CLIPTextModel

    unet, vae, text = _tiny_components()
    text.eval()
    layers, width = text.config.num_hidden_layers, text.config.hidden_size
    path = ldm.save(tmp_path / "sd2.safetensors", unet=unet, vae=vae, text_encoder=text,
                               text_layout="openclip")
    state = {k: v for k, v in load_file(str(path)).items() if k.startswith("cond_stage_model.")}
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()[sf.FORMAT_KEY] == sf.FORMAT_VERSION == "2"
    blocks = {int(k.split(".")[4]) for k in state if ".resblocks." in k}
    assert blocks == set(range(layers + 1))
    prefix = ldm.OPENCLIP_PREFIX
    assert torch.equal(state[prefix + "text_projection"], torch.eye(width))
    scale = state[prefix + "logit_scale"]
    assert scale.shape == () and scale.item() == pytest.approx(math.log(1 / 0.07))
    assert {t.dtype for t in state.values()} == {torch.float32}
    # The extra block: the last layer's weights with its attention and MLP output projections zeroed.
    extra, last = f"{prefix}transformer.resblocks.{layers}.", f"{prefix}transformer.resblocks.{layers - 1}."
    for key in [k for k in state if k.startswith(last)]:
        rest = key[len(last):]
        if rest.startswith(("attn.out_proj.", "mlp.c_proj.")):
            assert not state[extra + rest].any(), rest
        else:
            assert torch.equal(state[extra + rest], state[key]), rest

    # Through all N+1 blocks, as a reader conditioning on the last layer would, or through N: the same output,
    # which is the diffusers encoder's.
    ids = torch.tensor([[598, 5, 17, 200, 599, 599], [598, 42, 599, 599, 599, 599]])
    heads, act = text.config.num_attention_heads, text.config.hidden_act
    with torch.no_grad():
        whole, conditioned = (_openclip_forward(state, ids, n, heads, act) for n in (layers + 1, layers))
        want = text(ids)
    assert torch.equal(whole, conditioned)
    torch.testing.assert_close(conditioned, want.last_hidden_state, rtol=1e-5, atol=1e-5)

    # Read back by sdtrain (diffusers' converter, as sdtrain drives it): the same N layers, weights and outputs.
    with caplog.at_level("WARNING"):
        loaded = load_component("text_encoder", path)
    assert "not used" not in caplog.text
    assert isinstance(loaded, CLIPTextModel) and loaded.config.num_hidden_layers == layers
    _assert_same_weights(loaded, text, "text encoder")
    with torch.no_grad():
        got = loaded(ids)
    assert torch.equal(want.last_hidden_state, got.last_hidden_state)
    assert torch.equal(want.pooler_output, got.pooler_output)

    # In half precision the tower's end is fp16 like the rest.
    half = ldm.save(tmp_path / "half.safetensors", text_encoder=text, text_layout="openclip", half=True)
    assert {t.dtype for t in load_file(str(half)).values()} == {torch.float16}

    # A file of the previous format (1): N blocks for N layers, no text_projection nor logit_scale.
    old = {k: v for k, v in load_file(str(path)).items()
           if not k.startswith(extra) and not k.endswith(("text_projection", "logit_scale"))}
    with safe_open(str(path), framework="pt") as f:
        metadata = {**f.metadata(), sf.FORMAT_KEY: "1"}
    save_file(old, str(tmp_path / "old.safetensors"), metadata=metadata)
    assert sf.written_by_sdtrain(tmp_path / "old.safetensors")  # an export may replace it
    read = load_component("text_encoder", tmp_path / "old.safetensors")
    assert read.config.num_hidden_layers == layers
    _assert_same_weights(read, text, "format 1 text encoder")


def test_vae_alone_with_attention_as_convolutions_or_linear(tmp_path):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(**{**PRESETS["tiny"]["vae"], "mid_block_add_attention": True}, scaling_factor=0.3)
    path = ldm.save(tmp_path / "vae.safetensors", vae=vae)
    state = load_file(str(path))
    assert "encoder.conv_in.weight" in state and state["encoder.mid.attn_1.q.weight"].shape == (64, 64, 1, 1)
    loaded = load_component("vae", path)
    _assert_same_weights(loaded, vae, "vae")
    assert loaded.config.scaling_factor == 0.3
    # Some files store the attention projections as linear weights.
    linear = {k: v[:, :, 0, 0] if ".attn_1." in k and v.ndim == 4 else v for k, v in state.items()}
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    save_file(linear, str(tmp_path / "linear.safetensors"), metadata=metadata)
    _assert_same_weights(load_component("vae", tmp_path / "linear.safetensors"), vae, "linear vae")
    with pytest.raises(UserError, match="holds no UNet"):
        load_component("unet", path)


def test_any_levels_and_layers_per_block_round_trip(tmp_path):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=[16, 32], layers_per_block=2, down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], attention_head_dim=[2, 4], norm_num_groups=8,
        use_linear_projection=True, transformer_layers_per_block=2, cross_attention_dim=24, in_channels=3,
        out_channels=5, sample_size=8, upcast_attention=True)
    path = ldm.save(tmp_path / "unet.safetensors", unet=unet)
    loaded = load_component("unet", path)
    _assert_same_weights(loaded, unet, "unet")
    for key in ("attention_head_dim", "block_out_channels", "down_block_types", "up_block_types",
                "use_linear_projection", "transformer_layers_per_block", "upcast_attention", "out_channels"):
        assert ldm._normalize(loaded.config[key]) == ldm._normalize(unet.config[key]), key
    with pytest.raises(UserError, match="single file"):  # weights the original layout has no place for
        ldm.save(tmp_path / "x.safetensors", unet=UNet2DConditionModel(
            **PRESETS["tiny"]["unet"], cross_attention_dim=64, class_embed_type="timestep"))


def test_stable_diffusion_sized_layouts_match_diffusers_converters():
    """Shapes only (meta tensors): our key mapping for SD 1.x/2.x sizes is what diffusers' converters read, and
    the configs inferred from a metadata-free file are SD's own."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    sd1 = dict(block_out_channels=[320, 640, 1280, 1280], layers_per_block=2, attention_head_dim=8,
               cross_attention_dim=768, down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
               up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, sample_size=64)
    sd2 = {**sd1, **PRESETS["sd2"]["unet"], "cross_attention_dim": 1024, "sample_size": 96}
    clip_l = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
    for unet_config, text_config, layout in ((sd1, clip_l, "clip"), (sd2, PRESETS["sd2"]["text_encoder"],
                                                                     "openclip")):
        with torch.device("meta"):
            unet = UNet2DConditionModel(**unet_config)
            vae = AutoencoderKL(**PRESETS["sd2"]["vae"], sample_size=512 if layout == "clip" else 768)
            # SD's own text encoder configs: pooling at the highest token id (eos 2), as a file without metadata reads.
            text = CLIPTextModel(CLIPTextConfig(**{**text_config, "projection_dim": text_config["hidden_size"]},
                                                vocab_size=49408, max_position_embeddings=77, bos_token_id=0,
                                                eos_token_id=2, pad_token_id=1))
            state = ldm.to_original_state_dict(unet, vae, text, layout)
        assert set(convert_ldm_unet_checkpoint(state, dict(unet.config))) == set(unet.state_dict())
        assert set(convert_ldm_vae_checkpoint(state, dict(vae.config))) == set(vae.state_dict())
        converted = (convert_ldm_clip_checkpoint(state) if layout == "clip" else
                     convert_open_clip_checkpoint(text, state))
        assert {k.removeprefix("text_model.") for k in converted} == set(text.state_dict())
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        if layout == "openclip":  # the whole tower, as a real SD 2.x file has it
            assert shapes[ldm.OPENCLIP_PREFIX + "text_projection"] == (1024, 1024)
            assert shapes[ldm.OPENCLIP_PREFIX + "logit_scale"] == ()
            assert max(int(k.split(".")[4]) for k in shapes if ".resblocks." in k) == 23
        configs, _, found, prediction, _, errors = ldm._infer(shapes, {})
        assert not errors
        assert (found, prediction) == (layout, "epsilon" if layout == "clip" else "v_prediction")
        for name, module in (("unet", unet), ("vae", vae), ("text_encoder", text)):
            inferred = configs[name]
            expected = ldm._module_config(name, module)
            assert not [k for k in inferred if k in expected and ldm._normalize(inferred[k]) !=
                        ldm._normalize(expected[k])], name


def test_a_planted_pickle_payload_never_runs(tmp_path, monkeypatch):

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"first_stage_model.encoder.conv_in.weight": torch.zeros(1), "x": Payload()}}, evil)
    monkeypatch.delenv(sf.TRUST_PICKLE_ENV, raising=False)
    with pytest.raises(UserError, match="SDTRAIN_TRUST_PICKLE") as refused:
        load_component("vae", evil)
    assert str(evil) in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(UserError, match="more than tensors"):
        load_component("vae", evil, trust_pickle=True)
    monkeypatch.setenv(sf.TRUST_PICKLE_ENV, "1")
    with pytest.raises(UserError, match="more than tensors"):
        load_component("vae", evil)
    with pytest.raises(UserError, match="more than tensors"):
        build.build_noise_scheduler(DiffusionConfig(), ModelConfig(pretrained=str(evil)))
    assert not marker.exists()

    # A plain trusted checkpoint loads through the same conversion (a bare VAE, for the model family it serves).
    _, vae, _ = _tiny_components()
    plain = tmp_path / "vae.ckpt"
    torch.save({"state_dict": ldm.to_original_state_dict(vae=vae), "global_step": 3}, plain)
    _assert_same_weights(load_component("vae", plain, served=ModelConfig(family="sd")), vae, "pickled vae")
    assert build.source_kind(plain) == "single_file" and build.pin_source(plain) == str(plain.resolve())


def test_bad_files_are_one_clear_error(tmp_path):
    unet, vae, text = _tiny_components()
    good = ldm.save(tmp_path / "good.safetensors", unet=unet, vae=vae, text_encoder=text)
    data = good.read_bytes()
    for name, content in (("truncated", data[: len(data) // 2]), ("stub", data[:5])):
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(UserError, match="truncated") as caught:
            load_component("unet", bad)
        assert str(bad) in str(caught.value) and "\n" not in str(caught.value)
    unknown = tmp_path / "lora.safetensors"
    save_file({"lora_unet_down.alpha": torch.ones(1)}, str(unknown))
    with pytest.raises(UserError, match="unrecognized checkpoint layout") as caught:
        load_component("unet", unknown)
    assert str(unknown) in str(caught.value) and "\n" not in str(caught.value)
    # Keys of the right kind in a structure the converters do not handle: one line too.
    broken = {k: v for k, v in load_file(str(good)).items() if ".middle_block.1." not in k}
    save_file(broken, str(tmp_path / "broken.safetensors"))
    with pytest.raises(UserError, match="unrecognized unet layout.*middle block") as caught:
        load_component("unet", tmp_path / "broken.safetensors")
    assert "\n" not in str(caught.value)
    _assert_same_weights(load_component("vae", tmp_path / "broken.safetensors"), vae, "vae beside a bad unet")
    with pytest.raises(UserError, match="no such file"):
        build.source_kind(tmp_path / "missing.safetensors")

    from sdtrain.config import ModelConfig

    with pytest.raises(UserError, match="set model.components.tokenizer.source") as caught:
        build.tokenizer_source(ModelConfig(pretrained=str(good)))
    assert "\n" not in str(caught.value)
    named = ModelConfig(pretrained=str(good), components={"tokenizer": ComponentConfig(source="/tok")})
    assert build.tokenizer_source(named) == "/tok"


def test_training_starts_from_a_single_file(tmp_path, exported, shapes_dir):
    from sdtrain.checkpoint import latest_checkpoint, read_meta
    from sdtrain.export import export_single_file

    path, _ = exported
    run = tmp_path / "from-file"
    train("diffusion.yaml", run, f"data.shards={shapes_dir}", f"model.pretrained={path}", "model.vae=null",
          "train.max_steps=2", "validation.prompts=[]")
    meta = read_meta(latest_checkpoint(run))
    assert meta["sources"]["vae"] == str(path.resolve())
    assert meta["sources"]["unet"] == str(path.resolve())
    # The frozen VAE is the file's; the run exports back to one file in the same layout.
    again = export_single_file(run, tmp_path / "again.safetensors")
    assert ldm.text_encoder_layout(again) == "clip"
    _assert_same_weights(load_component("vae", again), load_component("vae", path), "vae")
