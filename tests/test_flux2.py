"""Flux.2 (dev and klein) through the CLI at tiny size: pipeline folders built by plain diffusers and transformers as
the releases are (dev's text encoder the whole Mistral3 vision-language model, its tokenizer folder naming a
PixtralProcessor that needs torchvision; klein's Qwen3ForCausalLM), recognised and fine-tuned; the conditioning is
the pipelines' own; the autoencoder's BatchNorm statistics normalise the patchified latents; a LoRA on the double and
single blocks loads whole through diffusers' Flux.2 loader from either file; encoded shards train; from scratch it
trains, exports and generates. (The spec-level guarantees are the conformance suite's.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdtrain.cli.main import main
from sdtrain.export import export_run
from sdtrain.models import families
from sdtrain.models.families import causal_lm, flux2

from .conftest import TINY_CLI, config_path

CONFIGS = config_path("diffusion.yaml").parents[1]
DEV, KLEIN = families.get("flux2"), families.get("flux2-klein")
TEXT_LENGTH = 64  # dev's system turn counts toward it, as in the pipeline
COMMON = [*TINY_CLI, f"model.t5_text_length={TEXT_LENGTH}"]
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16)
LAYERS = (1, 2, 3)


def _parts(tokenizer, guidance: bool):
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=128, num_layers=1, num_single_layers=2,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=96,
                                          timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
                                          guidance_embeds=guidance)
    vae = AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                             block_out_channels=(32, 32, 64), layers_per_block=1, latent_channels=32,
                             norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
                             mid_block_add_attention=False)
    generator = torch.Generator().manual_seed(1)
    vae.bn.running_mean.copy_(torch.randn(128, generator=generator) * 0.1)
    vae.bn.running_var.copy_(1 + torch.rand(128, generator=generator))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return dict(scheduler=scheduler, vae=vae, transformer=transformer)


def _tokenizer(folder: Path):
    captions = [f"a {c} {s}" for c in ("red", "green", "blue", "yellow") for s in ("circle", "square", "triangle")]
    return causal_lm.train_chat_tokenizer([*captions * 4, flux2.SYSTEM_MESSAGE], folder, 600, TEXT_LENGTH)


@pytest.fixture(scope="module")
def released_dev(tmp_path_factory) -> Path:
    """Flux.2-dev's folder as the release has it: the whole Mistral3 model as the text encoder, and a tokenizer folder
    that diffusers reads as a PixtralProcessor (which transformers builds only with torchvision)."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    folder = tmp_path_factory.mktemp("flux2") / "pipeline"
    torch.manual_seed(0)
    tokenizer = _tokenizer(folder.parent / "tokenizer")
    encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         sliding_window=None, **TEXT),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=16)))
    Flux2Pipeline(text_encoder=encoder, tokenizer=tokenizer, **_parts(tokenizer, True)).save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "tokenizer" / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor",
                                                                            "patch_size": 16}))
    return folder


@pytest.fixture(scope="module")
def released_klein(tmp_path_factory) -> Path:
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("flux2-klein") / "pipeline"
    torch.manual_seed(0)
    tokenizer = _tokenizer(folder.parent / "tokenizer")
    encoder = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **TEXT))
    Flux2KleinPipeline(text_encoder=encoder, tokenizer=tokenizer, **_parts(tokenizer, False)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def distilled_klein(tmp_path_factory, released_klein) -> Path:
    """FLUX.2-klein-4B's and 9B's folder: klein's, its model_index.json saying is_distilled (the -base models' says
    false), the transformer's config the same."""
    import shutil

    folder = shutil.copytree(released_klein, tmp_path_factory.mktemp("flux2-klein-distilled") / "pipeline")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["is_distilled"] is False
    (folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    return folder


def _pipeline(family, folder: Path):
    pipe = family.sampling.pipeline_from_folder(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe) -> np.ndarray:
    return pipe(prompt="a red circle", num_inference_steps=2, guidance_scale=2.0, height=32, width=32, output_type="np",
                max_sequence_length=TEXT_LENGTH, text_encoder_out_layers=LAYERS,
                generator=torch.Generator().manual_seed(0)).images[0]


def _lora(run: Path, pretrained: Path, shards: Path, steps: int, *extra: str) -> list[str]:
    return ["train", str(CONFIGS / "flux2-lora.yaml"), f"run_dir={run}", *COMMON, f"model.pretrained={pretrained}",
            f"data.shards={shards}", "data.resolution=32", "data.aspect_buckets=false", f"train.max_steps={steps}",
            "lora.rank=3", "optim.lr=0.01", "train.mixed_precision=fp32", *extra]


def test_released_folders_are_recognised_and_dev_loads_without_torchvision(released_dev, released_klein):
    from diffusers import Flux2Pipeline

    assert families.detect(released_dev) is DEV and families.detect(released_klein) is KLEIN
    # diffusers alone asks the folder for its PixtralProcessor; sdtrain reads the tokenizer.
    with pytest.raises((ImportError, ValueError), match="[Pp]ixtral|[Tt]orchvision"):
        Flux2Pipeline.from_pretrained(released_dev, local_files_only=True)
    assert type(_pipeline(DEV, released_dev).tokenizer).__name__ != "PixtralProcessor"


@pytest.mark.parametrize("which", ["dev", "klein"])
def test_the_conditioning_is_the_pipelines_own_and_the_language_tower_loads_alone(which, released_dev,
                                                                                  released_klein):
    """Three hidden layers side by side per token, padding included, as each pipeline encodes a prompt; the text
    encoder read from the released folder (whole, or a tensor at a time for a low-precision base) is the tower."""
    from sdtrain.loaders.components import load_component
    from sdtrain.models import build
    from sdtrain.models.tokenizer import CaptionTokenizer

    family, folder = (DEV, released_dev) if which == "dev" else (KLEIN, released_klein)
    pipe = _pipeline(family, folder)
    tokenizer = build.load_tokenizer(str(folder), TEXT_LENGTH)
    captions = ["a red circle", "", "a green square beside a yellow triangle"]
    ids, masks = family.token_inputs(CaptionTokenizer([tokenizer], family)(captions))
    with torch.no_grad():
        expected = pipe.encode_prompt(captions, max_sequence_length=TEXT_LENGTH, text_encoder_out_layers=LAYERS)[0]
        for precision, tolerance in (("fp32", 1e-5), ("fp8", 0.2)):
            tower = load_component("text_encoder", folder, family=family, frozen_precision=precision)
            assert type(tower) is family.components.classes["text_encoder"]
            got = family.conditioner.encode_text([tower], ids, captions, masks)["text_emb"]
            assert got.shape == expected.shape == (3, TEXT_LENGTH, 96)
            assert (got - expected).abs().max() <= tolerance * expected.abs().max(), precision


def test_a_lora_on_every_block_loads_whole_through_diffusers_from_either_file(tmp_path, released_dev, shapes_dir):
    run = tmp_path / "lora"
    assert main(_lora(run, released_dev, shapes_dir, 2, "model.frozen_precision=fp8")) == 0
    out = export_run(run, tmp_path / "out")
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    adapted = {k.removeprefix("transformer.").rsplit(".lora", 1)[0] for k in keys}
    assert "single_transformer_blocks.1.attn.to_out" in adapted and "transformer_blocks.0.attn.to_out.0" in adapted
    assert {"single_transformer_blocks.0.attn.to_qkv_mlp_proj", "transformer_blocks.0.ff.linear_in"} <= adapted
    kohya = load_file(str(out / "lora_kohya.safetensors"))
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in kohya
    assert "lora_unet_single_blocks_1_linear2.lora_up.weight" in kohya
    base = _pipeline(DEV, released_dev).transformer.state_dict()
    fused = []
    for name in ("pytorch_lora_weights.safetensors", "lora_kohya.safetensors"):
        pipe = _pipeline(DEV, released_dev)
        pipe.load_lora_weights(out, weight_name=name)
        pipe.fuse_lora()
        fused.append({k.replace(".base_layer.", "."): v for k, v in pipe.transformer.state_dict().items()
                      if "lora_" not in k})
    changed = [key for key, value in fused[0].items() if not torch.equal(value, base[key])]
    assert len(changed) == len(adapted)  # every adapter, and nothing else, reached the transformer
    for key in changed:
        torch.testing.assert_close(fused[1][key], fused[0][key], rtol=1e-5, atol=1e-6, msg=key)
    assert main(["generate", "--model", str(released_dev), "--lora", str(out), "--prompt", "a red circle",
                 "--steps", "2", "--size", "32", "--out", str(tmp_path / "images")]) == 0


def test_a_distilled_klein_samples_in_4_steps_without_guidance_and_its_merged_export_says_so(
        tmp_path, distilled_klein, released_klein, shapes_dir, monkeypatch):
    """Validation, generate on the run and on its merged export sample a distilled klein as it was distilled to: 4
    transformer calls, none for classifier-free guidance; the export's model_index.json keeps is_distilled. The -base
    models are not distilled."""
    from diffusers import Flux2Transformer2DModel

    from sdtrain.generate import run_sampling_of

    calls = []
    forward = Flux2Transformer2DModel.forward

    def counted(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # sampling, not a training step
            calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Flux2Transformer2DModel, "forward", counted)
    run = tmp_path / "lora"
    assert main(_lora(run, distilled_klein, shapes_dir, 1, "validation.prompts=[a red circle]",
                      "lora.save_merged=true")) == 0
    assert len(calls) == 4 * len(list((run / "samples").glob("step_*.png"))) > 0
    assert run_sampling_of(run)["distilled"] is True  # generate on the run samples as validation did
    out = export_run(run, tmp_path / "out")
    assert json.loads((out / "pipeline" / "model_index.json").read_text())["is_distilled"] is True
    calls.clear()
    assert main(["generate", "--model", str(out / "pipeline"), "--prompt", "a red circle", "--out",
                 str(tmp_path / "images")]) == 0
    assert len(calls) == 4
    assert not KLEIN.sampling.distilled(released_klein)  # the base models sample with guidance, as before


@pytest.mark.parametrize("which", ["dev", "distilled klein"])
def test_the_recipe_trains_at_the_shift_its_pipeline_samples_with(which, released_dev, distilled_klein):
    """configs/flux2-lora.yaml's claim: at its resolution and its step count (the previews', 20; a distilled klein's
    4), training shifts the sigmas as the pipeline shifts its sampling sigmas, not by the scheduler's linear mu."""
    from sdtrain.config import load_config
    from sdtrain.models import build
    from sdtrain.models.pipeline import is_distilled, run_sampling, sampling_steps
    from sdtrain.train.tasks import make_objective

    family, folder = (DEV, released_dev) if which == "dev" else (KLEIN, distilled_klein)
    config = load_config(CONFIGS / "flux2-lora.yaml", ["run_dir=unused", "data.shards=unused",
                                                      f"model.pretrained={folder}"])
    pipe = _pipeline(family, folder)
    steps = sampling_steps(family, pipe.transformer.config, run_sampling(config, is_distilled(family, folder)))
    assert steps == (20 if which == "dev" else 4)
    objective = make_objective(family, config.diffusion, build.build_noise_scheduler(config.diffusion, config.model),
                               torch.device("cpu"), pipe.transformer.config, steps)
    # The release's autoencoder and patches make a token of 16 px a side; the tiny one here of 8.
    tokens = (config.data.resolution // 16) ** 2
    sampled = []

    def first_step(pipe, step, timestep, tensors):  # the schedule is set: the other steps are skipped
        sampled.append(pipe.scheduler.sigmas)
        pipe._interrupt = True
        return {}

    pipe(prompt="a red circle", num_inference_steps=steps, guidance_scale=1.0, height=config.data.resolution // 2,
         width=config.data.resolution // 2, output_type="latent", max_sequence_length=TEXT_LENGTH,
         text_encoder_out_layers=LAYERS, callback_on_step_end=first_step, generator=torch.Generator().manual_seed(0))
    grid = torch.linspace(1.0, 1 / steps, steps)
    torch.testing.assert_close(objective.shift(grid, tokens), sampled[0][:-1].float(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(objective.shift(grid, tokens), pipe.scheduler.time_shift(objective.mu(tokens), 1.0, grid))


def test_klein_full_fine_tuning_exports_what_diffusers_loads_and_changes_the_image(tmp_path, released_klein,
                                                                                    shapes_dir):
    run = tmp_path / "full"
    assert main(["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={run}", *COMMON,
                 f"model.pretrained={released_klein}", f"data.shards={shapes_dir}", "train.max_steps=2",
                 "optim.lr=0.01", "optim.warmup_steps=0"]) == 0
    out = export_run(run, tmp_path / "out")
    assert families.detect(out) is KLEIN
    assert np.abs(_image(_pipeline(KLEIN, out)) - _image(_pipeline(KLEIN, released_klein))).max() > 1e-4

    # The transformer alone in Black Forest Labs' layout, as flux-2-klein-*.safetensors and ComfyUI hold it: diffusers'
    # own single-file loader reads it into the trained weights, sdtrain tells klein from dev by it and trains on it.
    from diffusers import Flux2Transformer2DModel

    single = tmp_path / "klein.safetensors"
    assert main(["export", str(run), str(single), "--single-file"]) == 0
    keys = list(load_file(str(single)))
    assert {"double_blocks.0.img_attn.qkv.weight", "double_blocks.0.txt_attn.norm.query_norm.scale",
            "single_blocks.1.linear1.weight", "final_layer.adaLN_modulation.1.weight"} <= set(keys)
    assert not any(k.startswith(("guidance_in.", "transformer_blocks.")) for k in keys)
    assert families.detect(single) is KLEIN
    trained = Flux2Transformer2DModel.from_pretrained(out, subfolder="transformer").state_dict()
    read = Flux2Transformer2DModel.from_single_file(str(single), config=str(out), subfolder="transformer",
                                                    local_files_only=True).state_dict()
    assert read.keys() == trained.keys() and all(torch.equal(read[k], trained[k]) for k in trained)
    assert main(_lora(tmp_path / "lora", released_klein, shapes_dir, 1, f"model.transformer={single}",
                      "model.frozen_precision=fp8")) == 0


@pytest.mark.parametrize("family", [DEV, KLEIN])
def test_bfl_files_read_through_diffusers_conversion_into_the_model_and_tell_dev_from_klein(family):
    from diffusers import Flux2Transformer2DModel

    from sdtrain.models.families.flux2 import bfl_config, from_bfl, to_bfl

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(**family.presets["tiny"]["transformer"], in_channels=128, joint_attention_dim=96)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    original = to_bfl(state)
    back = {key: value for k, v in original.items() for key, value in from_bfl(k, v).items()}
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    shapes = {k: tuple(v.shape) for k, v in original.items()}
    config = bfl_config(shapes, {"transformer_config": json.dumps({"axes_dims_rope": [4, 4, 4, 4]})})
    rebuilt = Flux2Transformer2DModel(**config).config
    assert {k: v for k, v in rebuilt.items() if not k.startswith("_")} == {
        k: v for k, v in model.config.items() if not k.startswith("_") and k != "rope_theta"} | {"rope_theta": 2000}
    for prefix in ("", "model.diffusion_model."):
        assert families.family_of_keys([prefix + k for k in original]) is family
    with pytest.raises(ValueError, match="RoPE axes"):  # the released axes do not fit a tiny model's heads
        bfl_config({k: tuple(v.shape) for k, v in original.items()}, {})


def test_encoded_shards_keep_the_autoencoder_for_its_statistics_and_train(tmp_path, released_dev, shapes_dir):
    """The latents are stored patchified (128 channels at 1/16 the side); training on them keeps the small
    autoencoder loaded, whose BatchNorm statistics normalise them, and leaves the language model on disk."""
    from sdtrain.data.encoded import load_npy
    from sdtrain.data.order import read_shard, resolve_shards

    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(released_dev), "--out", str(encoded),
                 "--resolution", "32", "--dtype", "float32", "--t5-text-length", str(TEXT_LENGTH)]) == 0
    sample = next(iter(read_shard(resolve_shards(str(encoded))[0].url)))
    assert load_npy(sample["latent_mean.npy"]).shape == (128, 4, 4)
    assert load_npy(sample["text_emb.npy"]).shape[-2:] == (TEXT_LENGTH, 96)
    assert main(_lora(tmp_path / "run", released_dev, encoded, 2)) == 0


def test_from_scratch_the_autoencoder_records_its_statistics_and_the_model_trains_exports_and_generates(
        tmp_path, tiny_autoencoder, tiny_scratch_run):
    from sdtrain.loaders.components import load_component

    vae = load_component("vae", tiny_autoencoder("flux2"), family=DEV)
    assert not torch.equal(vae.bn.running_var, torch.ones(128))  # measured, per patch channel
    run = tiny_scratch_run("flux2", tmp_path / "scratch", 2, f"model.t5_text_length={TEXT_LENGTH}",
                           "data.caption_dropout=0.25", "validation.prompts=[a red circle]", "validation.steps=2")
    assert (run / "samples" / "step_00000002.png").is_file()
    out = tmp_path / "pipeline"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "Flux2Pipeline"
    assert main(["generate", "--model", str(out), "--prompt", "a red circle", "--steps", "2",
                 "--out", str(tmp_path / "images")]) == 0


@pytest.mark.parametrize(("family", "preset", "counts"), [
    ("flux2", "flux2-dev", ("32,223,281,152", "84,046,115", "22,901,314,560")),
    ("flux2-klein", "flux2-klein-4b", ("3,875,544,576", "84,046,115", "4,022,468,096")),
    ("flux2-klein", "flux2-klein-9b", ("9,078,581,248", "84,046,115", "7,568,405,504")),
])
def test_params_counts_the_released_architectures(family, preset, counts, capsys):
    assert main(["params", str(CONFIGS / "flux2-lora.yaml"), f"model.family={family}", f"model.preset={preset}",
                 "model.pretrained=null"]) == 0
    report = capsys.readouterr().out
    assert all(count in report for count in counts)
