"""Wan 2.1 text-to-video at tiny size: a pipeline folder built by plain diffusers and transformers as the release is
(umT5 with a SentencePiece tokenizer, the video autoencoder with latent statistics, UniPC at flow_shift 3) is
recognised; the conditioning, the codec's normalisation and the transformer's call are the pipeline's own; the codec
reads clips of 4n + 1 frames; a model built from the tiny preset assembles into a pipeline that saves, reloads, is
recognised and draws a few-frame video; a LoRA loads whole through WanPipeline.load_lora_weights in both files it
is written as; the released presets have the released sizes; a training step on clips reaches every weight. (The
spec-level guarantees are the conformance suite's, tests/test_family_conformance.py.)"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sdtrain.cli.main import main
from sdtrain.config import DiffusionConfig, ModelConfig, load_config
from sdtrain.errors import UserError
from sdtrain.models import build, families
from sdtrain.models.families import umt5, wan_vae
from sdtrain.models.pipeline import sampler_from
from sdtrain.models.tokenizer import CaptionTokenizer

from . import test_clips
from .conftest import FINE_TUNE_MODES, TINY, TINY_CLI, config_path, t5_tokenizer, tiny_components

WAN = families.get("wan")
clips = test_clips.clips  # two captioned videos and a still image, prepared into clips of 5 frames
TEXT_LENGTH = 16
CAPTIONS = [f"a {c} {s}" for c in ("red", "green", "blue", "yellow") for s in ("circle", "square", "triangle")]


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A WanPipeline folder as diffusers saves Wan-AI's release, at tiny size: umT5's encoder, the video autoencoder
    with latent statistics of its own, the transformer, and the released UniPC sampler at flow_shift 3."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    folder = tmp_path_factory.mktemp("wan") / "pipeline"
    torch.manual_seed(0)
    tokenizer = t5_tokenizer(folder.parent / "tokenizer", CAPTIONS, TEXT_LENGTH)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                          num_heads=4, relative_attention_num_buckets=8,
                                          relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
                                          dropout_rate=0.0))
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64,
                                        num_layers=2, rope_max_seq_len=64)
    generator = torch.Generator().manual_seed(1)
    vae = AutoencoderKLWan(**{**wan_vae.TINY_WAN_VIDEO_VAE,
                              "latents_mean": (torch.randn(16, generator=generator) * 0.1).tolist(),
                              "latents_std": (1 + torch.rand(16, generator=generator)).tolist()})
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=vae, scheduler=scheduler,
                transformer=transformer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The tiny preset's components as a run from scratch builds them, its tokenizer learnt from captions."""
    return tiny_components("wan", tmp_path_factory.mktemp("wan-tiny"), CAPTIONS, TEXT_LENGTH)


def _pipeline(folder: Path):
    pipe = WAN.sampling.pipeline_from_folder(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _text(pipe, captions: list[str], length: int = TEXT_LENGTH) -> dict[str, torch.Tensor]:
    """sdtrain's conditioning of `captions`, as training makes it: the loader's tokens (the pipeline's tokenizer at
    the run's length), then the conditioner."""
    tokenizer = copy.copy(pipe.tokenizer)
    tokenizer.model_max_length = length
    ids, masks = WAN.token_inputs(CaptionTokenizer([tokenizer], WAN)(captions))
    with torch.no_grad():
        return WAN.conditioner.encode_text([pipe.text_encoder], ids, captions, masks)


def test_a_released_folder_is_recognised_and_its_conditioning_is_the_pipelines(released):
    """umT5's last states under the attention mask, each caption cleaned as the pipeline cleans it (HTML entities,
    runs of spaces), the padding zeroed, a long caption cut: what WanPipeline.encode_prompt gives, bit for bit; the
    mask marks the caption's tokens and its end-of-text."""
    assert families.detect(released) is WAN
    pipe = _pipeline(released)
    captions = ["a red circle", "", "  a green &amp; blue   square ",
                "a red circle a blue square a green triangle a yellow circle a red square a blue triangle"]
    text = _text(pipe, captions)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=TEXT_LENGTH)
    assert text["text_emb"].shape == embeds.shape == (4, TEXT_LENGTH, 32)
    assert torch.equal(text["text_emb"], embeds)
    counts = text["text_mask"].sum(dim=1).tolist()
    assert counts[1] == 1 and counts[3] == TEXT_LENGTH  # "" is </s> alone; the long caption is cut
    assert torch.equal(_text(pipe, ["a green & blue square"])["text_emb"][0], text["text_emb"][2])  # as cleaned
    assert WAN.conditioner.text_shapes({"text_encoder": pipe.text_encoder.config}, [TEXT_LENGTH]) == {
        "text_emb": (TEXT_LENGTH, 32), "text_mask": (TEXT_LENGTH,)}


def test_the_transformers_call_is_the_pipelines_own(released):
    """Fed the conditioning and the latents and timestep the pipeline's transformer is called with in a sampling
    step, `denoise` computes exactly what that call did; its velocity keeps the latents' shape."""
    pipe = _pipeline(released)
    calls = []
    hook = pipe.transformer.register_forward_hook(
        lambda _module, _args, kwargs, output: calls.append((kwargs, output[0])), with_kwargs=True)
    pipe("a red circle", num_frames=5, height=32, width=32, num_inference_steps=2, guidance_scale=1.0,
         output_type="latent", max_sequence_length=TEXT_LENGTH, generator=torch.Generator().manual_seed(0))
    hook.remove()
    assert len(calls) == 2
    condition = WAN.denoising.condition(_text(pipe, ["a red circle"]), {}, torch.device("cpu"))
    for kwargs, output in calls:
        assert kwargs["hidden_states"].shape == (1, 16, 2, 8, 8)
        with torch.no_grad():
            ours = WAN.denoising.denoise(pipe.transformer, kwargs["hidden_states"], kwargs["timestep"], condition)
        assert torch.equal(ours, output)
    with pytest.raises(UserError, match=r"denoises clips' latents \(B, C, t, h, w\).*\(1, 16, 8, 8\)"):
        WAN.denoising.denoise(pipe.transformer, torch.zeros(1, 16, 8, 8), torch.tensor([500.0]), condition)


@pytest.mark.parametrize("frames", [1, 5, 9])
def test_the_codec_reads_clips_of_4n_plus_1_frames(released, frames):
    """(B, 3, T, H, W) in, a posterior over (B, 16, 1 + (T - 1) / 4, H / 4, W / 4) out (the tiny autoencoder's
    4x), decoded back to the clip's shape; each channel normalised as the pipelines normalise it."""
    vae = _pipeline(released).vae
    clip = torch.rand(2, 3, frames, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        posterior = WAN.codec.encode(vae, clip)
        assert posterior.mean.shape == (2, 16, 1 + (frames - 1) // 4, 8, 8)
        assert WAN.codec.decode(vae, posterior.mode()).shape == clip.shape
    # WanVideoToVideoPipeline's normalisation of the posterior's mode; WanPipeline's undoing of it before decoding.
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    normalized = WAN.codec.normalize(posterior.mode(), vae)
    torch.testing.assert_close(normalized, (posterior.mode() - mean) * (1.0 / std))
    torch.testing.assert_close(normalized / (1.0 / std) + mean, posterior.mode())


def test_the_clip_rule_is_the_autoencoders():
    """A clip family's codec says its frame rule (4: the released and tiny autoencoders' two temporal halvings) and
    WanPipeline sizes its latents by the same; a clip of another length, or no clip, is one line; image families'
    codecs read no clips."""
    from diffusers import AutoencoderKLWan, WanPipeline

    for preset in WAN.presets:
        config = WAN.presets[preset]["vae"]
        with torch.device("meta"):
            vae = AutoencoderKLWan(**config)
        assert WAN.codec.clip_frames(vae.config) == vae.config.scale_factor_temporal == 4
        assert WAN.codec.downsampling(vae.config) == vae.config.scale_factor_spatial == (4 if preset == "tiny" else 8)
    vae = AutoencoderKLWan(**wan_vae.TINY_WAN_VIDEO_VAE)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=None)
    assert pipe.vae_scale_factor_temporal == WAN.codec.clip_frames(vae.config)
    with pytest.raises(UserError, match=r"^a clip of 6 frames: .*reads 4n \+ 1 \(1, 5, 9, \.\.\.\).*trim it to 5$"):
        WAN.codec.encode(vae, torch.zeros(1, 3, 6, 16, 16))
    with pytest.raises(UserError, match=r"reads clips \(B, 3, T, H, W\), a still image as T = 1"):
        WAN.codec.encode(vae, torch.zeros(1, 3, 16, 16))
    assert all(family.codec.clip_frames(None) is None for family in families.FAMILIES.values()
               if not isinstance(family.codec, wan_vae.WanVideoCodec))


def test_a_model_from_the_tiny_preset_saves_reloads_is_recognised_and_draws_a_video(tiny, tmp_path):
    """The family's assembled pipeline, saved, is recognised from its folder alone and loads in plain diffusers, which
    draws a five-frame video with the run's sampler (the training schedule's Euler at shift 3) and arguments."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    noise = build.build_noise_scheduler(DiffusionConfig(), tiny["config"])
    assert (noise.config.shift, noise.config.use_dynamic_shifting) == (3.0, False)
    pipe = WAN.sampling.assemble(tiny["components"], tiny["tokenizers"], sampler_from(noise, "euler"))
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    assert families.detect(tmp_path) is WAN
    loaded = WanPipeline.from_pretrained(tmp_path, local_files_only=True)
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded.scheduler, FlowMatchEulerDiscreteScheduler) and loaded.scheduler.config.shift == 3.0
    defaults = WAN.sampling.defaults(loaded.transformer.config)
    assert defaults == {"guidance": 5.0, "steps": 50}
    arguments = WAN.sampling.arguments(loaded, defaults["guidance"], None)
    assert arguments == {"guidance_scale": 5.0, "negative_prompt": None, "max_sequence_length": TEXT_LENGTH}
    frames = loaded("a red circle", num_frames=5, height=32, width=32, num_inference_steps=2, output_type="pil",
                    generator=torch.Generator().manual_seed(0), **arguments).frames
    assert len(frames) == 1 and len(frames[0]) == 5 and all(frame.size == (32, 32) for frame in frames[0])


def test_a_wan_2_2_folder_and_mismatched_scale_factors_are_one_line(tiny):
    from diffusers import AutoencoderKLWan

    noise = sampler_from(build.build_noise_scheduler(DiffusionConfig(), tiny["config"]), "euler")
    pipe = WAN.sampling.assemble(tiny["components"], tiny["tokenizers"], noise)
    pipe.register_to_config(boundary_ratio=0.875)
    with pytest.raises(UserError, match="Wan 2.2's"):
        WAN.sampling.prepare(pipe)
    vae = AutoencoderKLWan(**{**wan_vae.TINY_WAN_VIDEO_VAE, "scale_factor_spatial": 8})
    with pytest.raises(UserError, match="downsamples 4x a side and 4x in time, but .* say 8 and 4"):
        WAN.sampling.assemble({**tiny["components"], "vae": vae}, tiny["tokenizers"], noise)


def test_a_lora_loads_whole_through_the_pipelines_loader_in_both_files(released, tmp_path):
    """Adapters on every attention and feed-forward layer of the blocks and on layers outside them (the text
    embedding, the time projection, the head), written as a run writes them: diffusers' file (peft's names) and
    the one in the names ComfyUI's Wan loader applies (diffusion_model.blocks.0.self_attn.q ...). WanPipeline's
    load_lora_weights reads each whole: every adapter attached, and fused, the pipeline's transformer carries
    exactly the update the trained adapters make."""
    from safetensors import safe_open

    from sdtrain.loaders.adapters import add_lora, merge_lora
    from sdtrain.loaders.writers import KOHYA_WEIGHTS, LORA_WEIGHTS, save_lora

    base = _pipeline(released).transformer
    adapted = copy.deepcopy(base)
    torch.manual_seed(1)
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "text_embedder.linear_1",
               "time_proj", "proj_out"]
    add_lora(adapted, {"r": 2, "lora_alpha": 3, "target_modules": targets, "init_lora_weights": False},
             "lora.target_modules")
    adapters = {name for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert len(adapters) == 2 * (4 * 2 + 2) + 3
    save_lora({"transformer": adapted}, {"transformer": adapted.state_dict()}, tmp_path, WAN)
    with safe_open(str(tmp_path / KOHYA_WEIGHTS), framework="pt") as file:
        assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in set(file.keys())
    expected = merge_lora(copy.deepcopy(adapted)).state_dict()
    changed = [key for key, value in expected.items() if not torch.equal(value, base.state_dict()[key])]
    assert len(changed) == len(adapters)  # each adapter changes its layer's weight
    for weights in (LORA_WEIGHTS, KOHYA_WEIGHTS):
        pipe = _pipeline(released)
        pipe.load_lora_weights(tmp_path, weight_name=weights)
        attached = {name for name, module in pipe.transformer.named_modules() if hasattr(module, "lora_A")}
        assert attached == adapters, weights
        pipe.fuse_lora()
        got = {key.replace(".base_layer.", "."): value for key, value in pipe.transformer.state_dict().items()
               if "lora_" not in key}
        for key in changed:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=f"{weights}: {key}")


@pytest.mark.parametrize("preset, transformer", [("wan2.1-t2v-1.3b", 1_418_996_800),
                                                  ("wan2.1-t2v-14b", 14_288_491_584)])
def test_the_released_presets_have_the_released_sizes(preset, transformer, capsys):
    """`sdtrain params` of each released preset: the transformer's count (1.3B: 30 blocks 1536 wide; 14B: 40 blocks
    5120 wide), umT5-XXL's encoder (its 256,384-row vocabulary) and the video autoencoder."""
    assert main(["params", str(config_path("diffusion.yaml")), "run_dir=x", "data.shards=x", "model.vae=null",
                 "model.family=wan", f"model.preset={preset}", "model.unet_overrides={}", "data.resolution=480",
                 "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert (rows["transformer"]["cls"], rows["transformer"]["parameters"]) == ("WanTransformer3DModel", transformer)
    assert (rows["text_encoder"]["cls"], rows["text_encoder"]["parameters"]) == ("UMT5EncoderModel", 5_680_910_336)
    assert (rows["vae"]["cls"], rows["vae"]["parameters"]) == ("AutoencoderKLWan", 126_892_531)
    with torch.device("meta"):
        vae = build.build_vae(ModelConfig(family="wan", preset=preset))
    assert (vae.config.latents_mean, vae.config.latents_std) == (wan_vae.WAN_LATENTS_MEAN, wan_vae.WAN_LATENTS_STD)
    shift = build.build_noise_scheduler(DiffusionConfig(), ModelConfig(family="wan", preset=preset)).config.shift
    assert shift == (3.0 if preset == "wan2.1-t2v-1.3b" else 5.0)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_training_step_on_clips_reaches_every_trained_weight(released, shapes_dir, tmp_path, mode):
    """What the trainer gives a clip family: ``pixel_values`` (B, 3, T, H, W) in [-1, 1] (a still image T = 1) and
    the loader's tokens; the loss of a batch of 5-frame clips (and of images as one-frame clips) is finite, and
    every weight that trains gets a gradient. The LoRA recipe trains at the released shift whatever the folder's
    sampler says (UniPC's flow_shift, which the flow schedule does not read)."""
    from sdtrain.train.modes import make_task

    recipe = Path(__file__).resolve().parents[1] / "configs" / "wan-lora.yaml"
    overrides = [*TINY, f"run_dir={tmp_path}", f"data.shards={shapes_dir}", f"model.pretrained={released}",
                 f"model.t5_text_length={TEXT_LENGTH}", "lora.rank=2"]
    config = (load_config(recipe, overrides) if mode == "lora"
              else load_config(config_path("diffusion.yaml"), [*overrides, "model.vae=null", "model.family=null",
                                                               "model.max_text_length=null"]))
    torch.manual_seed(0)
    task = make_task(config, torch.device("cpu"), tmp_path)
    if mode == "lora":
        assert task.noise_scheduler.config.shift == 3.0
    tokens = task.caption_tokenizer(["a red circle", "a blue square"])
    for frames in (5, 1):
        pixels = torch.rand(2, 3, frames, 32, 32, generator=torch.Generator().manual_seed(frames)) * 2 - 1
        loss = task.denoising_loss({"pixel_values": pixels, "captions": ["a red circle", "a blue square"], **tokens},
                                   torch.Generator().manual_seed(0))
        assert loss.shape == (2,) and torch.isfinite(loss).all()
        task.denoiser.zero_grad()
        loss.mean().backward()
        trained = [(name, p) for name, p in task.denoiser.named_parameters() if p.requires_grad]
        assert trained and all(p.grad is not None for _, p in trained), [n for n, p in trained if p.grad is None][:3]


def test_the_lora_recipe_loads_once_its_paths_are_given(tmp_path):
    recipe = Path(__file__).resolve().parents[1] / "configs" / "wan-lora.yaml"
    config = load_config(recipe, [f"run_dir={tmp_path}", "data.shards=data", "model.pretrained=wan"])
    # The shift is the folder's own (3.0 for 1.3B, 5.0 for 14B): see the next test.
    assert config.mode == "lora" and config.model.family == "wan" and config.diffusion.flow.shift is None
    assert {"to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"} <= set(config.lora.target_modules)
    assert umt5.TEXT_LENGTH == 512 and WAN.conditioner.long_text_length("wan2.1-t2v-14b") == 512


def test_a_released_folder_trains_at_the_shift_its_unipc_sampler_keeps_as_flow_shift(released):
    schedule = build.build_noise_scheduler(DiffusionConfig(), ModelConfig(pretrained=str(released)))
    assert schedule.config.shift == 3.0 and not schedule.config.use_dynamic_shifting
    assert build.build_noise_scheduler(dataclasses.replace(DiffusionConfig(), flow=dataclasses.replace(
        DiffusionConfig().flow, shift=5.0)), ModelConfig(pretrained=str(released))).config.shift == 5.0


def test_a_transformer_from_scratch_starts_as_wans_training_code_starts_it(tiny):
    """``model.denoiser_init`` reference (auto's choice for Wan): WanModel.init_weights on diffusers' modules, the
    output projection zero (the model starts predicting zero velocity), every linear bias zero, the embedders'
    weights N(0, 0.02) and the rest Xavier-uniform; library keeps diffusers' own."""
    config = tiny["config"]
    encoders = {"text_encoder": tiny["components"]["text_encoder"]}
    transformer = build.build_denoiser(config, 16, 8, encoders)
    assert not transformer.proj_out.weight.any()
    linears = [m for m in transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert all(not m.bias.any() for m in linears if m.bias is not None)
    bound = (6 / sum(transformer.blocks[0].ffn.net[2].weight.shape)) ** 0.5
    assert transformer.blocks[0].ffn.net[2].weight.abs().max() <= bound
    library = build.build_denoiser(dataclasses.replace(config, denoiser_init="library"), 16, 8, encoders)
    assert library.proj_out.weight.any()


@pytest.mark.parametrize("kind", ["dora", "lokr"])
def test_its_dora_and_lokr_adapters_load_as_they_trained_on_clips(tiny, kind, tmp_path):
    """DoRA's and LoKr's adapters on the attention, written as the trainer writes them and loaded as `generate
    --lora` loads them: on a clip's latents the pipeline's transformer computes what the trained one did."""
    from sdtrain.config import LoraConfig
    from sdtrain.generate import load_adapters
    from sdtrain.loaders.adapters import add_lora
    from sdtrain.loaders.writers import save_lora
    from sdtrain.train.modes.lora import lora_settings

    torch.manual_seed(2)
    base = copy.deepcopy(tiny["components"]["transformer"]).requires_grad_(False)
    with torch.no_grad():  # a trained base: the reference initialisation's zero output would hide the adapters
        for parameter in base.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    trained = copy.deepcopy(base)
    add_lora(trained, lora_settings(LoraConfig(type=kind, rank=2, alpha=3, target_modules=["to_q", "to_k", "to_v"])),
             "lora.target_modules")
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if "lora_" in name or "lokr_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    save_lora({"transformer": trained}, {"transformer": trained.state_dict()}, tmp_path, WAN)
    noise = sampler_from(build.build_noise_scheduler(DiffusionConfig(), tiny["config"]), "euler")
    pipe = WAN.sampling.assemble({**tiny["components"], "transformer": copy.deepcopy(base)}, tiny["tokenizers"], noise)
    load_adapters(pipe, tmp_path, None, "trained")
    latents = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    condition = WAN.denoising.condition(_text(pipe, ["a red circle"]), {}, torch.device("cpu"))
    with torch.no_grad():
        expected, loaded, plain = (WAN.denoising.denoise(model, latents, torch.tensor([500.0]), condition)
                                   for model in (trained, pipe.transformer, base))
    assert not torch.allclose(expected, plain)
    torch.testing.assert_close(loaded, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_folder_plain_diffusers_saved_fine_tunes_on_clips_without_being_told_its_family(released, clips, tmp_path,
                                                                                         mode):
    """The shared fine-tuning configs on a WanPipeline folder as released (no model.family): recognised from its
    model_index.json, trained on clips, exported as a folder WanPipeline loads with the trained weights."""
    from diffusers import WanPipeline

    config, extra = FINE_TUNE_MODES[mode]
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["train", str(config_path("diffusion.yaml").parents[1] / config), f"run_dir={run}", *TINY_CLI,
                 f"model.pretrained={released}", f"data.shards={clips}", "train.max_steps=2",
                 f"model.t5_text_length={TEXT_LENGTH}", *extra]) == 0
    assert main(["export", str(run), "--out", str(out)]) == 0
    if mode == "lora":
        pipe = WanPipeline.from_pretrained(released)
        pipe.load_lora_weights(out)
        assert pipe.get_active_adapters()
    else:
        trained = WanPipeline.from_pretrained(out).transformer.state_dict()
        base = WanPipeline.from_pretrained(released).transformer.state_dict()
        assert any(not torch.equal(trained[key], base[key]) for key in base)
