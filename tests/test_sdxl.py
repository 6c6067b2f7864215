"""SDXL as the second model family, at tiny size: every mode trains, resumes bitwise after kill -9 and exports
files plain diffusers loads (StableDiffusionXLPipeline.from_pretrained and .from_single_file,
load_lora_weights, load_textual_inversion), and what it loads changes the image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from sdtrain.cli.main import main
from sdtrain.export import export_run, export_single_file

from .conftest import TINY, config_path, resumes_bitwise_after_kill_9

CONFIGS = config_path("diffusion.yaml").parents[1]
PROMPT = "a red circle"


def _image(pipe, prompt: str = PROMPT) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt, num_inference_steps=2, guidance_scale=3.0, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images[0]


def _pipeline(folder: Path):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def sdxl_scratch(tmp_path_factory, shapes_dir, autoencoder_run) -> Path:
    """A tiny SDXL trained from scratch (both text encoders and the UNet) for a few steps."""
    run = tmp_path_factory.mktemp("sdxl") / "scratch"
    assert main(["train", str(config_path("diffusion.yaml")), f"run_dir={run}", *TINY, "model.family=sdxl",
                 f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}", "train.max_steps=3",
                 "evaluation.every_samples=0", "validation.prompts=[a red circle]", "validation.steps=2"]) == 0
    assert (run / "samples" / "step_00000003.png").is_file()  # validation renders through the SDXL pipeline
    return run


@pytest.fixture(scope="module")
def sdxl_pretrained(tmp_path_factory, sdxl_scratch) -> Path:
    return export_run(sdxl_scratch, tmp_path_factory.mktemp("sdxl-pipeline") / "pipeline")


MODES = {
    "full": ("finetune-full.yaml", []),
    "lora": ("lora.yaml", ["lora.text_encoder=true", "optim.lr=0.01"]),
    "textual_inversion": ("textual-inversion.yaml", ["textual_inversion.placeholder_token=<shp>",
                                                     "textual_inversion.initializer_token=circle", "optim.lr=0.05"]),
    "dreambooth": ("dreambooth.yaml", ["dreambooth.instance_prompt=a sks shape", "dreambooth.class_prompt=a shape",
                                       "dreambooth.num_class_images=2", "dreambooth.generation_steps=2"]),
}


def _command(mode: str, run: Path, pretrained: Path, shapes_dir: Path, steps: int) -> list[str]:
    config, extra = MODES[mode]
    return ["train", str(CONFIGS / config), f"run_dir={run}", *TINY, f"model.pretrained={pretrained}",
            f"data.shards={shapes_dir}", "data.batch_size=2", f"train.max_steps={steps}", "checkpoint.every=1",
            "validation.prompts=[]", "data.caption_dropout=0.25", *extra]


def _scratch_command(run: Path, vae: Path, shapes_dir: Path, steps: int) -> list[str]:
    """SDXL from scratch: both text encoders and the UNet train, the tokenizer is trained on the captions."""
    return ["train", str(config_path("diffusion.yaml")), f"run_dir={run}", *TINY, "model.family=sdxl",
            f"model.vae={vae}", f"data.shards={shapes_dir}", "data.batch_size=2", f"train.max_steps={steps}",
            "checkpoint.every=1", "validation.prompts=[]", "evaluation.every_samples=0", "data.caption_dropout=0.25"]


# The default run resumes the cheapest mode; from scratch, full, DreamBooth (which trains the UNet whole as full
# does) and textual inversion (SD's runs by default) run with the slow tests.
@pytest.mark.parametrize("mode", [*(pytest.param(m, marks=pytest.mark.slow) for m in ("scratch", "full", "dreambooth",
                                                                                      "textual_inversion")),
                                  "lora"])
def test_every_mode_resumes_bitwise_after_kill_9(mode, tmp_path, sdxl_pretrained, shapes_dir, autoencoder_run):
    def command(run: Path) -> list[str]:
        if mode == "scratch":
            return _scratch_command(run, autoencoder_run, shapes_dir, 3)
        return _command(mode, run, sdxl_pretrained, shapes_dir, 3)

    resumes_bitwise_after_kill_9(command, tmp_path)


def test_from_scratch_exports_a_pipeline_and_a_single_file_diffusers_reads(sdxl_scratch, sdxl_pretrained, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    pipe = _pipeline(sdxl_pretrained)
    assert type(pipe.text_encoder_2).__name__ == "CLIPTextModelWithProjection"
    assert pipe.config.force_zeros_for_empty_prompt  # the unconditional half as training dropped captions
    reference = _image(pipe)
    single = export_single_file(sdxl_scratch, tmp_path / "model.safetensors")
    with safe_open(str(single), framework="pt") as file:
        keys = list(file.keys())
    assert any(k.startswith("conditioner.embedders.0.transformer.") for k in keys)
    assert any(k.startswith("conditioner.embedders.1.model.") for k in keys)
    loaded = StableDiffusionXLPipeline.from_single_file(str(single), config=str(sdxl_pretrained),
                                                        local_files_only=True)
    np.testing.assert_allclose(_image(loaded), reference, atol=1e-5)


def test_full_and_dreambooth_exports_change_the_image(tmp_path, sdxl_pretrained, shapes_dir):
    before = _image(_pipeline(sdxl_pretrained))
    for mode in ("full", "dreambooth"):
        run = tmp_path / mode
        assert main(_command(mode, run, sdxl_pretrained, shapes_dir, 2) + ["optim.lr=0.01"]) == 0
        after = _image(_pipeline(export_run(run, tmp_path / f"{mode}-out")))
        assert np.abs(after - before).max() > 1e-3, mode


def test_lora_files_load_in_diffusers_kohya_names_included_and_change_the_image(tmp_path, sdxl_pretrained,
                                                                               shapes_dir):
    run = tmp_path / "lora"
    assert main(_command("lora", run, sdxl_pretrained, shapes_dir, 2)) == 0
    out = export_run(run, tmp_path / "out")
    kohya = load_file(str(out / "lora_kohya.safetensors"))
    prefixes = {key.split("_", 2)[1] for key in kohya}
    assert prefixes == {"unet", "te1", "te2"}
    # kohya names SDXL's UNet modules in the original layout, as A1111 and ComfyUI expect.
    assert any(k.startswith("lora_unet_input_blocks_") for k in kohya)
    assert not any(k.startswith("lora_unet_down_blocks_") for k in kohya)
    # Text encoder keys keep CLIP's text_model level, without which ComfyUI places none of them.
    diffusers_keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert {k.split(".")[0] for k in diffusers_keys} == {"unet", "text_encoder", "text_encoder_2"}
    assert all(k.split(".")[1] == "text_model" for k in diffusers_keys if k.startswith("text_encoder"))
    before = _image(_pipeline(sdxl_pretrained))
    with_lora = _pipeline(sdxl_pretrained)
    with_lora.load_lora_weights(out)
    assert not torch.equal(with_lora.text_encoder(torch.tensor([[0, 5, 1]]))[0],
                           _pipeline(sdxl_pretrained).text_encoder(torch.tensor([[0, 5, 1]]))[0])
    image = _image(with_lora)
    assert np.abs(image - before).max() > 1e-3
    # The kohya file is the same adapters: every module found, the same image.
    with_kohya = _pipeline(sdxl_pretrained)
    with_kohya.load_lora_weights(str(out), weight_name="lora_kohya.safetensors")
    np.testing.assert_allclose(_image(with_kohya), image, atol=1e-4)


def test_textual_inversion_file_holds_clip_l_and_clip_g_and_diffusers_loads_it(tmp_path, sdxl_pretrained,
                                                                                shapes_dir):
    run = tmp_path / "ti"
    assert main(_command("textual_inversion", run, sdxl_pretrained, shapes_dir, 2)) == 0
    out = export_run(run, tmp_path / "out", full_pipeline=True)
    with safe_open(str(out / "learned_embeds.safetensors"), framework="pt") as file:
        assert set(file.keys()) == {"clip_l", "clip_g"}
        assert file.metadata()["placeholder_token"] == "<shp>"
        vectors = {key: file.get_tensor(key) for key in ("clip_l", "clip_g")}
    pipe = _pipeline(sdxl_pretrained)
    assert vectors["clip_l"].shape[-1] == pipe.text_encoder.config.hidden_size
    assert vectors["clip_g"].shape[-1] == pipe.text_encoder_2.config.hidden_size
    before = _image(pipe, "a <shp>")
    # As diffusers' docs load an SDXL embedding: each encoder's vectors into its own encoder and tokenizer.
    pipe.load_textual_inversion(vectors["clip_l"], token="<shp>", text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer)
    pipe.load_textual_inversion(vectors["clip_g"], token="<shp>", text_encoder=pipe.text_encoder_2,
                                tokenizer=pipe.tokenizer_2)
    image = _image(pipe, "a <shp>")
    assert np.abs(image - before).max() > 1e-3
    # The exported full pipeline (new token merged into both tokenizers and encoders) draws the same.
    np.testing.assert_allclose(_image(_pipeline(out / "pipeline"), "a <shp>"), image, atol=1e-4)


def test_encoded_shards_carry_both_encoders_states_and_the_pooled_embedding(tmp_path, sdxl_pretrained, shapes_dir,
                                                                             monkeypatch, caplog):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from sdtrain.data.encode import Encoder, encode_dataset
    from sdtrain.data.encoded import load_npy
    from sdtrain.data.order import read_shard

    caplog.set_level("INFO")
    out = tmp_path / "encoded"
    encoder = Encoder(str(sdxl_pretrained), str(sdxl_pretrained), 32, torch.device("cpu"), "float32")
    manifest = encode_dataset(str(shapes_dir), out, encoder, batch_size=16)
    assert manifest["encoding"]["text_encoder_2"] == manifest["encoding"]["text_encoder"] == str(sdxl_pretrained)
    sample = read_shard(str(sorted(out.glob("*.tar"))[0]))[0]
    pipe = _pipeline(sdxl_pretrained)
    width = pipe.text_encoder.config.hidden_size + pipe.text_encoder_2.config.hidden_size
    assert load_npy(sample["text_emb.npy"]).shape[-1] == width
    assert load_npy(sample["text_pooled.npy"]).shape == (pipe.text_encoder_2.config.projection_dim,)
    assert load_npy(sample["size_ids.npy"]).tolist() == [32, 32, 0, 0, 32, 32]
    # Caption dropout's stand-in: SDXL conditions an empty caption on zeros.
    assert not load_npy((out / "empty_caption.text_pooled.npy").read_bytes()).any()

    common = [*TINY, f"model.pretrained={sdxl_pretrained}", "train.max_steps=1", "logging.every=1",
              "validation.prompts=[]", "data.caption_dropout=0"]
    finetune = str(CONFIGS / "finetune-full.yaml")
    assert main(["train", finetune, f"run_dir={tmp_path / 'online'}", f"data.shards={shapes_dir}", *common]) == 0
    calls = []
    for cls in (CLIPTextModel, CLIPTextModelWithProjection):
        original = cls.forward
        monkeypatch.setattr(cls, "forward", lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    assert main(["train", finetune, f"run_dir={tmp_path / 'encoded'}", f"data.shards={out}", *common]) == 0
    assert "VAE encoder skipped, text encoder skipped" in caplog.text and not calls
    import json

    losses = [json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
              for run in ("online", "encoded")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_micro_conditioning_comes_from_the_image_and_the_crop_the_loader_made():
    import io

    from PIL import Image

    from sdtrain.config import DataConfig
    from sdtrain.data.decode import SampleDecoder

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    raw = {"__key__": "k", "png": buffer.getvalue(), "txt": b"a caption"}
    resized = image.resize((43, 32), Image.Resampling.BICUBIC)  # the shorter side to 32
    seen = set()
    for flip in (False, True):
        decoder = SampleDecoder(DataConfig(shards="x", resolution=32, center_crop=False, random_flip=flip), None, 0)
        for index in range(8):
            sample = decoder(raw, (0, 0, index))
            height, width, top, left, target_h, target_w = sample["size_ids"].tolist()
            assert (height, width, top, target_h, target_w) == (48, 64, 0, 32, 32)
            assert 0 <= left <= 43 - 32
            pixels = ((sample["pixel_values"].numpy().transpose(1, 2, 0) + 1) * 127.5).round()
            crop = np.asarray(resized, dtype=np.float32)[:, left:left + 32]
            mirrored = np.asarray(resized, dtype=np.float32)[:, ::-1][:, left:left + 32]
            # A flipped crop's corner is where it lies in the flipped image, so it still says what was cut off.
            matched = np.abs(pixels - crop).max() < 1.5 or (flip and np.abs(pixels - mirrored).max() < 1.5)
            assert matched, (flip, index, left)
            seen.add(left)
    assert len(seen) > 1


def _released_style_clip(cls, settings: dict, tokenizer):
    """A tiny CLIP text tower configured as the released ones are: ``eos_token_id: 2``, bos 0, pad 1 (which
    transformers reads as "pool at the highest id"), its vocabulary the tokenizer's, whose end-of-text is the
    highest id as in CLIP's own."""
    from transformers import CLIPTextConfig

    torch.manual_seed(0)
    return cls(CLIPTextConfig(vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
                              bos_token_id=0, eos_token_id=2, pad_token_id=1, **settings)).eval()


def test_textual_inversion_pools_clip_g_at_end_of_text_not_at_the_placeholder(tmp_path):
    """A released SDXL's text_encoder_2 config pools at the highest id, which textual inversion's new token
    becomes: the conditioner's text_embeds must stay the projected end-of-text state, where ComfyUI and SGM read
    the trained vectors; captions without the token condition bitwise as before, and a rebuilt run pools alike."""
    from types import SimpleNamespace

    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from sdtrain.config import TextualInversionConfig
    from sdtrain.loaders.components import rebuild_textual_inversion
    from sdtrain.models.families.sdxl import SDXL
    from sdtrain.models.families.text_towers import TINY_CLIP, TINY_CLIP_WIDER
    from sdtrain.models.tokenizer import load_clip_tokenizer, train_clip_tokenizer
    from sdtrain.train.modes.textual_inversion import NewTokens

    train_clip_tokenizer(["a red circle", "a blue square", "a green circle"] * 8, tmp_path / "tokenizer", 600)
    tokenizers = [load_clip_tokenizer(tmp_path / "tokenizer") for _ in range(2)]
    eos = tokenizers[0].eos_token_id
    assert eos == len(tokenizers[0]) - 1  # as in CLIP's vocabulary: argmax and end-of-text agree until a token is added
    encoders = {"text_encoder": _released_style_clip(CLIPTextModel, TINY_CLIP, tokenizers[0]),
                "text_encoder_2": _released_style_clip(CLIPTextModelWithProjection, TINY_CLIP_WIDER, tokenizers[1])}
    encoders["text_encoder_2"].save_pretrained(tmp_path / "text_encoder_2")

    def ids(caption: str) -> list[torch.Tensor]:
        return [t([caption], padding="max_length", max_length=t.model_max_length, truncation=True,
                  return_tensors="pt").input_ids for t in tokenizers]

    with torch.no_grad():
        plain_before = SDXL.conditioner.encode_text(list(encoders.values()), ids("a red circle"), None)["text_pooled"]
    config = SimpleNamespace(textual_inversion=TextualInversionConfig(placeholder_token="<shp>",
                                                                      initializer_token="circle"))
    NewTokens(config, SDXL).make_trainable(torch.nn.Linear(1, 1), encoders, tokenizers)
    second = encoders["text_encoder_2"]
    with torch.no_grad():
        torch.nn.init.normal_(second.get_input_embeddings().added)  # a trained vector, unlike the initializer's
        encode = SDXL.conditioner.encode_text
        assert torch.equal(encode(list(encoders.values()), ids("a red circle"), None)["text_pooled"],
                           plain_before)
        tokens = ids("a <shp> circle")
        placeholder = tokens[1][0].tolist().index(len(tokenizers[1]) - 1)
        end = tokens[1][0].tolist().index(eos)
        assert placeholder < end and int(tokens[1][0].argmax()) == placeholder
        pooled = SDXL.conditioner.encode_text(list(encoders.values()), tokens, None)["text_pooled"]
        states = second(tokens[1]).last_hidden_state[0]  # after the final layer norm
        torch.testing.assert_close(pooled[0], second.text_projection(states[end]), rtol=0, atol=0)
        assert not torch.allclose(pooled[0], second.text_projection(states[placeholder]))
    assert second.config.eos_token_id == eos  # a pipeline saved from it pools there too
    rebuilt = rebuild_textual_inversion("text_encoder_2", str(tmp_path / "text_encoder_2"),
                                        {"family": "sdxl", "tokens": ["<shp>"]})
    assert rebuilt.config.eos_token_id == eos
