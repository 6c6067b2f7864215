"""Wan 2.2 TI2V-5B at tiny size: the conditioning is umT5's as the pipeline reads it; the transformer's call is
WanPipeline's with ``expand_timesteps`` (a timestep per token) and WanImageToVideoPipeline's in that mode (the first
latent frame clean, its tokens at timestep 0); training conditions clips on their own first frame (kept clean, at
timestep 0, out of the loss); a model from the tiny preset saves as a WanPipeline folder plain diffusers loads and
draws from text and from an image; a LoRA loads whole through load_lora_weights; the released preset has the
released sizes; videos train it end to end from the CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import av
import pytest
import torch
from PIL import Image

from sdtrain.cli.main import main
from sdtrain.config import DiffusionConfig, ModelConfig
from sdtrain.errors import UserError
from sdtrain.models import build, families
from sdtrain.models.families import spec, wan22, wan_vae
from sdtrain.models.pipeline import sampler_from
from sdtrain.models.tokenizer import CaptionTokenizer

from . import test_clips
from .conftest import config_path, tiny_components

TI2V = families.get("wan2.2-ti2v")
TEXT_LENGTH = 16
clips = test_clips.clips  # two captioned videos and a still image, prepared into clips of 5 frames
CAPTIONS = [f"a {c} {s}" for c in ("red", "green", "blue", "yellow") for s in ("circle", "square", "triangle")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The tiny preset's components as a run from scratch builds them, its tokenizer learnt from captions."""
    return tiny_components("wan2.2-ti2v", tmp_path_factory.mktemp("wan22-tiny"), CAPTIONS, TEXT_LENGTH)


@pytest.fixture(scope="module")
def folder(tiny, tmp_path_factory) -> Path:
    """The tiny model assembled with the training schedule's Euler sampler and saved as a pipeline folder."""
    noise = build.build_noise_scheduler(DiffusionConfig(), tiny["config"])
    pipe = TI2V.sampling.assemble(tiny["components"], tiny["tokenizers"], sampler_from(noise, "euler"))
    out = tmp_path_factory.mktemp("wan22-folder")
    pipe.save_pretrained(out)
    return out


def _pipeline(folder: Path):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _text(pipe, captions: list[str]) -> dict[str, torch.Tensor]:
    ids, masks = TI2V.token_inputs(CaptionTokenizer([pipe.tokenizer], TI2V)(captions))
    with torch.no_grad():
        return TI2V.conditioner.encode_text([pipe.text_encoder], ids, captions, masks)


def test_the_conditioning_is_the_pipelines(folder):
    """umT5's masked last states of the cleaned captions: what WanPipeline.encode_prompt gives, bit for bit."""
    pipe = _pipeline(folder)
    captions = ["a red circle", "", "  a green &amp; blue   square "]
    text = _text(pipe, captions)
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=TEXT_LENGTH)
    assert torch.equal(text["text_emb"], expected)


def test_the_transformers_call_is_the_pipelines_with_a_timestep_per_token(folder):
    """From text, every token at the step's timestep (WanPipeline's ``mask[0][0][:, ::2, ::2] * t``); from an image,
    the first latent frame's tokens at 0 (WanImageToVideoPipeline's ``first_frame_mask``): the denoiser call gives
    the transformer exactly those timesteps, and so its output."""
    pipe = _pipeline(folder)
    torch.manual_seed(0)
    latents = torch.randn(2, 16, 3, 4, 6)
    text = _text(pipe, ["a red circle", "a blue square"])
    t = torch.tensor(700.0)
    condition = TI2V.denoising.condition(text, {}, torch.device("cpu"))
    for first_frame in (None, torch.tensor([True, True])):
        mask = torch.ones(1, 1, *latents.shape[2:])
        if first_frame is not None:
            mask[:, :, 0] = 0
        timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(2, -1)
        assert torch.equal(wan22.token_timesteps(t.expand(2), latents, first_frame), timestep)
        with torch.no_grad():
            expected = pipe.transformer(hidden_states=latents, timestep=timestep,
                                        encoder_hidden_states=text["text_emb"], return_dict=False)[0]
            got = TI2V.denoising.denoise(pipe.transformer, latents, t.expand(2),
                                         {**condition, wan22.FIRST_FRAME: first_frame})
        assert torch.equal(got, expected)


def test_a_clip_conditioned_on_its_first_frame_keeps_it_clean_at_timestep_0_and_out_of_the_loss():
    """Half the clips, by the run's generator: their first latent frame is the clean latents', their tokens there at
    timestep 0, their loss weight there 0; the other clips, and a still image (one latent frame), as drawn."""
    latents, noisy = torch.randn(64, 4, 3, 4, 4), torch.randn(64, 4, 3, 4, 4)
    given, condition, weights = TI2V.denoising.conditioned(latents, noisy, torch.Generator().manual_seed(0))
    flags = condition[wan22.FIRST_FRAME]
    assert 16 < int(flags.sum()) < 48  # about half
    assert torch.equal(given[flags, :, 0], latents[flags, :, 0])
    assert torch.equal(given[~flags, :, 0], noisy[~flags, :, 0]) and torch.equal(given[:, :, 1:], noisy[:, :, 1:])
    assert torch.equal(weights[:, 0, 0, 0, 0], (~flags).float()) and bool((weights[:, :, 1:] == 1).all())
    timesteps = wan22.token_timesteps(torch.full((64,), 500.0), latents, flags).view(64, 3, -1)
    assert bool((timesteps[flags, 0] == 0).all()) and bool((timesteps[~flags, 0] == 500).all())
    assert bool((timesteps[:, 1:] == 500).all())
    still = torch.randn(8, 4, 1, 4, 4)
    _, condition, weights = TI2V.denoising.conditioned(still, still, torch.Generator().manual_seed(0))
    assert not condition[wan22.FIRST_FRAME].any() and bool((weights == 1).all())


def test_training_calls_the_familys_first_frame_conditioning():
    """The loss reads the family's `conditioned` between the objective's draw and the denoiser's call: every family
    has it (by default the noisy latents, nothing, no weights), and the task multiplies its weights into the loss
    mask."""
    import inspect

    from sdtrain.train import tasks

    noisy = torch.randn(1, 4, 2, 4, 4)
    assert spec.DenoiserCall().conditioned(noisy, noisy, None) == (noisy, {}, None)
    assert "denoising.conditioned(" in inspect.getsource(tasks.DiffusionTask.denoising_loss)


def test_a_model_from_the_tiny_preset_saves_and_draws_from_text_and_from_an_image(folder, tiny, monkeypatch):
    """Plain diffusers loads the folder (``expand_timesteps`` set) and draws a five-frame video from a prompt; the
    same components as WanImageToVideoPipeline draw one from a first frame."""
    from diffusers import WanImageToVideoPipeline

    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True
    pipe = TI2V.sampling.pipeline_from_folder(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    defaults = TI2V.sampling.defaults(pipe.transformer.config)
    assert defaults == {"guidance": 5.0, "steps": 50}
    arguments = TI2V.sampling.arguments(pipe, defaults["guidance"], None)
    drawn = pipe("a red circle", num_frames=5, height=32, width=32, num_inference_steps=2, output_type="pil",
                 generator=torch.Generator().manual_seed(0), **arguments).frames
    assert len(drawn[0]) == 5 and drawn[0][0].size == (32, 32)
    image = TI2V.sampling.image_pipeline_class.from_pipe(pipe)
    assert isinstance(image, WanImageToVideoPipeline) and image.config.expand_timesteps
    assert families.of_pipeline(image) is TI2V
    drawn = image(image=Image.new("RGB", (32, 32), "red"), prompt="a red circle", num_frames=5, height=32, width=32,
                  num_inference_steps=2, output_type="pil", generator=torch.Generator().manual_seed(0),
                  **arguments).frames
    assert len(drawn[0]) == 5


def test_a_folder_is_recognised_by_its_per_token_timesteps(folder):
    assert families.detect(folder) is TI2V
    assert families.of_pipeline(_pipeline(folder)) is TI2V


def test_wan_2_1_folders_and_mismatched_scale_factors_are_one_line(tiny, folder):
    """Wan 2.1 refuses a TI2V folder and this family one without per-token timesteps (2.1's, A14B's)."""
    from diffusers import AutoencoderKLWan

    pipe = _pipeline(folder)
    with pytest.raises(UserError, match="Wan 2.2's"):
        families.get("wan").sampling.prepare(pipe)
    pipe.register_to_config(expand_timesteps=False)
    with pytest.raises(UserError, match="not Wan 2.2 TI2V's"):
        TI2V.sampling.prepare(pipe)
    vae = AutoencoderKLWan(**{**wan_vae.TINY_WAN22_VIDEO_VAE, "scale_factor_spatial": 16})
    noise = sampler_from(build.build_noise_scheduler(DiffusionConfig(), tiny["config"]), "euler")
    with pytest.raises(UserError, match="downsamples 8x a side and 4x in time, but .* say 16 and 4"):
        TI2V.sampling.assemble({**tiny["components"], "vae": vae}, tiny["tokenizers"], noise)


def test_a_lora_loads_whole_through_the_pipelines_loader_in_both_files(folder, tmp_path):
    """Adapters on the blocks' attention and feed-forward layers, in diffusers' file and in ComfyUI's names
    (diffusion_model.blocks.0.self_attn.q ...): load_lora_weights attaches every one from each."""
    from safetensors import safe_open

    from sdtrain.loaders.adapters import add_lora
    from sdtrain.loaders.writers import KOHYA_WEIGHTS, LORA_WEIGHTS, save_lora

    adapted = copy.deepcopy(_pipeline(folder).transformer)
    add_lora(adapted, {"r": 2, "lora_alpha": 2, "target_modules": ["to_q", "to_k", "to_v", "to_out.0",
                                                                   "ffn.net.0.proj", "ffn.net.2"],
                       "init_lora_weights": False}, "lora.target_modules")
    adapters = {name for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    save_lora({"transformer": adapted}, {"transformer": adapted.state_dict()}, tmp_path, TI2V)
    with safe_open(str(tmp_path / KOHYA_WEIGHTS), framework="pt") as file:
        assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in set(file.keys())
    for weights in (LORA_WEIGHTS, KOHYA_WEIGHTS):
        pipe = _pipeline(folder)
        pipe.load_lora_weights(tmp_path, weight_name=weights)
        assert {name for name, module in pipe.transformer.named_modules() if hasattr(module, "lora_A")} == adapters


def test_the_released_preset_has_the_released_sizes(capsys):
    """`sdtrain params` of the 5B: its transformer (30 blocks 3072 wide, 48 channels), umT5-XXL's encoder and Wan
    2.2's autoencoder; its latent statistics and its schedule's shift 5."""
    assert main(["params", str(config_path("diffusion.yaml")), "run_dir=x", "data.shards=x", "model.vae=null",
                 "model.family=wan2.2-ti2v", "model.preset=wan2.2-ti2v-5b", "model.unet_overrides={}",
                 "data.resolution=704", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert (rows["transformer"]["cls"], rows["transformer"]["parameters"]) == ("WanTransformer3DModel", 4_999_787_712)
    assert (rows["text_encoder"]["cls"], rows["text_encoder"]["parameters"]) == ("UMT5EncoderModel", 5_680_910_336)
    assert (rows["vae"]["cls"], rows["vae"]["parameters"]) == ("AutoencoderKLWan", 704_688_668)
    config = ModelConfig(family="wan2.2-ti2v", preset="wan2.2-ti2v-5b")
    with torch.device("meta"):
        vae = build.build_vae(config)
    assert (TI2V.codec.channels(vae.config), TI2V.codec.downsampling(vae.config), TI2V.codec.clip_frames(vae.config)) \
        == (48, 16, 4)
    assert vae.config.latents_std == wan_vae.WAN22_LATENTS_STD
    assert build.build_noise_scheduler(DiffusionConfig(), config).config.shift == 5.0


def test_videos_train_it_from_scratch_and_it_exports_a_folder_diffusers_loads(clips, tmp_path, tiny_scratch_command):
    from diffusers import WanPipeline

    run = tmp_path / "run"
    assert main(tiny_scratch_command("wan2.2-ti2v", run, 2, f"data.shards={clips}", "model.t5_text_length=16",
                                     "validation.prompts=[]")) == 0
    export = tmp_path / "export"
    assert main(["export", str(run), "--out", str(export)]) == 0
    pipe = WanPipeline.from_pretrained(export)
    assert pipe.config.expand_timesteps and pipe.transformer.config.in_channels == 16
    # Image-to-video from the same model: its first frame given, a clip drawn after it.
    Image.new("RGB", (32, 32), "red").save(tmp_path / "first.png")
    drawn = tmp_path / "drawn"
    assert main(["generate", "--model", str(export), "--image", str(tmp_path / "first.png"), "--prompt",
                 "a red square moves", "--frames", "5", "--steps", "2", "--out", str(drawn)]) == 0
    with av.open(str(next(drawn.glob("*.mp4")))) as container:
        assert sum(1 for _ in container.decode(video=0)) == 5
