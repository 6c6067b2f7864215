"""Krea 2 through the CLI at tiny size: a pipeline folder built by plain diffusers and transformers as the release is
(the whole Qwen3-VL model as its text encoder), recognised and fine-tuned in each mode, its text encoder's language
tower read alone (also a tensor at a time, for a low-precision base); the conditioning, the transformer's call and
the sampling shift are the pipeline's own; a step-distilled folder samples as distilled; Krea's module names are
diffusers' converters' (LoRA and single file); encoded shards train without the text encoder; a LoRA loads whole
through diffusers' Krea 2 loader; from scratch it trains, exports and generates. (The spec-level guarantees are the
conformance suite's, tests/test_family_conformance.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdtrain.cli.main import main
from sdtrain.errors import UserError
from sdtrain.export import export_run
from sdtrain.models import families
from sdtrain.models.families import krea2

from .conftest import FINE_TUNE_MODES, TINY_CLI, config_path

CONFIGS = config_path("diffusion.yaml").parents[1]
KREA = families.get("krea2")
TEXT_LENGTH = 16
LAYERS = (2, 5)  # every third hidden state from the second, of a 6-layer language model
COMMON = [*TINY_CLI, f"model.t5_text_length={TEXT_LENGTH}"]
CAPTIONS = [f"a {c} {s}" for c in ("red", "green", "blue", "yellow") for s in ("circle", "square", "triangle")]


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A Krea 2 pipeline folder as diffusers saves the release: the whole Qwen3-VL model (vision tower beside the
    language one) as the text encoder, the taps the pipeline reads in model_index.json, the 3D autoencoder with
    latent statistics, the transformer, a Qwen2 chat tokenizer, and the scheduler the pipeline expects."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        Krea2Pipeline,
        Krea2Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLModel

    folder = tmp_path_factory.mktemp("krea2") / "pipeline"
    torch.manual_seed(0)
    tokenizer = KREA.conditioner.train_tokenizer(CAPTIONS * 4, folder.parent / "tokenizer", 600, TEXT_LENGTH)
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    encoder = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, deepstack_visual_indexes=[0])))
    transformer = Krea2Transformer2DModel(
        in_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=32, num_text_layers=len(LAYERS),
        text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=64,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6))
    generator = torch.Generator().manual_seed(1)
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True],
                                 latents_mean=(torch.randn(16, generator=generator) * 0.1).tolist(),
                                 latents_std=(1 + torch.rand(16, generator=generator)).tolist())
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=6400)
    Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=encoder, tokenizer=tokenizer, transformer=transformer,
                  text_encoder_select_layers=LAYERS).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, released) -> Path:
    """The step-distilled checkpoint's folder: the same components, its model_index.json saying is_distilled."""
    folder = shutil.copytree(released, tmp_path_factory.mktemp("krea2-distilled") / "pipeline")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    return folder


def _pipeline(folder: Path):
    pipe = KREA.sampling.pipeline_from_folder(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe) -> np.ndarray:
    return pipe("a red circle", num_inference_steps=2, guidance_scale=1.0, negative_prompt="", height=32, width=32,
                output_type="np", max_sequence_length=TEXT_LENGTH, generator=torch.Generator().manual_seed(0)).images[0]


def _command(mode: str, run: Path, pretrained: Path, shapes_dir: Path, steps: int, *extra: str) -> list[str]:
    config, settings = FINE_TUNE_MODES[mode]
    return ["train", str(CONFIGS / config), f"run_dir={run}", *COMMON, f"model.pretrained={pretrained}",
            f"data.shards={shapes_dir}", f"train.max_steps={steps}", "checkpoint.every=1",
            "data.caption_dropout=0.25", *settings, *extra]


def _text(pipe, captions: list[str]) -> dict[str, torch.Tensor]:
    """sdtrain's conditioning of `captions` with the pipeline's tokenizer and text encoder, as training makes it."""
    from sdtrain.models.tokenizer import CaptionTokenizer

    ids, masks = KREA.token_inputs(CaptionTokenizer([pipe.tokenizer], KREA)(captions))
    with torch.no_grad():
        return KREA.conditioner.encode_text([pipe.text_encoder], ids, captions, masks)


def test_the_released_taps_and_template_are_the_pipelines():
    """The rule sdtrain reads taps by gives the pipeline's default for Qwen3-VL-4B's 36 layers (the released
    preset's depth), and a tiny model's; the template is the pipeline's own."""
    from diffusers import Krea2Pipeline

    pipe = Krea2Pipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    assert krea2.text_layers(36) == pipe.text_encoder_select_layers
    assert (pipe.prompt_template_encode_prefix, pipe.prompt_template_encode_suffix) == (krea2.PREFIX, krea2.SUFFIX)
    assert KREA.presets["krea2"]["text_encoder"]["num_hidden_layers"] == 36
    assert krea2.text_layers(6) == LAYERS


def test_a_released_folder_is_recognised_and_its_language_tower_read_alone(released, tmp_path):
    """The whole Qwen3-VL's hidden states at the taps, with padding in the middle and the positions the pipeline
    gives, are its language tower's alone, loaded as transformers loads it and a tensor at a time in fp8, from the
    pipeline's Qwen3VLModel folder or from a Qwen3VLForConditionalGeneration one (Qwen's own release, its tower
    under model.language_model.)."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLTextModel

    from sdtrain.loaders.components import load_component

    assert families.detect(released) is KREA
    whole = _pipeline(released).text_encoder
    generation = Qwen3VLForConditionalGeneration(whole.config)
    generation.model.load_state_dict(whole.state_dict())
    generation.save_pretrained(tmp_path / "text_encoder")
    ids = torch.randint(0, 100, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, 3:6] = 0
    position = (mask.cumsum(-1) - 1).clamp(min=0).expand(3, -1, -1)
    expected = whole(input_ids=ids, attention_mask=mask, position_ids=position, output_hidden_states=True)
    for source, precision in [(released, "fp32"), (released, "fp8"), (tmp_path / "text_encoder", "fp32"),
                              (tmp_path / "text_encoder", "fp8")]:
        tower = load_component("text_encoder", source, family=KREA, frozen_precision=precision)
        assert type(tower) is Qwen3VLTextModel  # no vision tower
        got = tower(input_ids=ids, attention_mask=mask, position_ids=position, output_hidden_states=True)
        tolerance = 0 if precision == "fp32" else 0.2
        for layer in LAYERS:
            want = expected.hidden_states[layer]
            assert (got.hidden_states[layer] - want).abs().max() <= tolerance * want.abs().max(), precision


def test_the_conditioning_and_the_transformers_call_are_the_pipelines_own(released):
    """Each caption's tapped states from the caption on, the system turn dropped, the padding (between the caption
    and the suffix) masked and zeroed, a long caption cut as the pipeline cuts it: what Krea2Pipeline.encode_prompt
    gives. Fed to the transformer as `denoise` feeds it, they give what the pipeline's own call does. A caption
    length that leaves no room before the closing tokens is one line."""
    from sdtrain.models import build

    pipe = _pipeline(released)
    captions = ["a red circle", "", "a green square beside a yellow triangle and a blue circle, both small and red"]
    text = _text(pipe, captions)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(captions, max_sequence_length=TEXT_LENGTH)
    assert text["text_emb"].shape == (3, TEXT_LENGTH, len(LAYERS) * 32) and embeds.shape == (3, TEXT_LENGTH, 2, 32)
    assert torch.equal(text["text_mask"].bool(), mask)
    assert mask[1].sum() == 5 and mask[2].all()  # the empty caption keeps the suffix alone; the long one fills all
    stacked = text["text_emb"].unflatten(-1, (len(LAYERS), 32))
    torch.testing.assert_close(stacked, embeds * mask[..., None, None], rtol=1e-5, atol=1e-6)
    with pytest.raises(UserError, match="model.t5_text_length: 5 tokens leave no room"):
        KREA.conditioner.tokenize(build.load_tokenizer(str(released / "tokenizer"), 5), 0, captions)

    latents = torch.randn(3, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.2, 0.5, 0.9])
    condition = KREA.denoising.condition(text, {}, torch.device("cpu"))
    with torch.no_grad():
        ours = KREA.denoising.denoise(pipe.transformer, latents, sigma * 1000, condition)
        theirs = pipe.transformer(
            hidden_states=pipe._pack_latents(latents, 3, 16, 8, 8), encoder_hidden_states=embeds, timestep=sigma,
            position_ids=pipe.prepare_position_ids(TEXT_LENGTH, 4, 4, torch.device("cpu")),
            encoder_attention_mask=mask, return_dict=False)[0]
    torch.testing.assert_close(ours, pipe._unpack_latents(theirs, 32, 32).squeeze(2), rtol=1e-5, atol=1e-5)


def test_the_kept_length_changes_nothing_but_truncation(released):
    """Padding takes no position in the language model and is masked everywhere after it (the transformer's text
    tokens all sit at RoPE's origin), so a caption that fits conditions the transformer the same at any
    ``model.t5_text_length``: a shorter one only makes encoded shards smaller."""
    from sdtrain.models import build
    from sdtrain.models.tokenizer import CaptionTokenizer

    pipe = _pipeline(released)
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    outputs = []
    for length in (TEXT_LENGTH, 3 * TEXT_LENGTH):
        tokenizer = build.load_tokenizer(str(released / "tokenizer"), length)
        ids, masks = KREA.token_inputs(CaptionTokenizer([tokenizer], KREA)(["a red circle", ""]))
        with torch.no_grad():
            text = KREA.conditioner.encode_text([pipe.text_encoder], ids, None, masks)
            condition = KREA.denoising.condition(text, {}, torch.device("cpu"))
            outputs.append(KREA.denoising.denoise(pipe.transformer, latents, torch.tensor([300.0, 700.0]), condition))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_training_shifts_the_sigmas_as_the_base_pipeline_samples(released):
    """The base model's pipeline shifts its sampling sigmas by mu linear in the image tokens (0.5 at 256, 1.15 at
    6,400, from the scheduler's config): the training objective on the preset's scheduler shifts by the same."""
    from sdtrain.config import DiffusionConfig, ModelConfig
    from sdtrain.models import build
    from sdtrain.train.tasks import make_objective

    pipe = _pipeline(released)
    model = ModelConfig(family="krea2", preset="krea2")
    objective = make_objective(KREA, DiffusionConfig(), build.build_noise_scheduler(DiffusionConfig(), model),
                               torch.device("cpu"), pipe.transformer.config)
    sampled = []

    def first_step(pipe, step, timestep, tensors):  # the schedule is set: the other steps are skipped
        sampled.append(pipe.scheduler.sigmas)
        pipe._interrupt = True
        return {}

    pipe(prompt="a red circle", num_inference_steps=4, guidance_scale=0.0, height=64, width=48, output_type="latent",
         max_sequence_length=TEXT_LENGTH, callback_on_step_end=first_step, generator=torch.Generator().manual_seed(0))
    tokens = (64 // 8) * (48 // 8)
    torch.testing.assert_close(objective.shift(torch.linspace(1.0, 1 / 4, 4), tokens), sampled[0][:-1].float(),
                               rtol=1e-5, atol=1e-6)


def test_a_distilled_folder_samples_in_8_steps_without_guidance(distilled, released, tmp_path, monkeypatch):
    """model_index.json's is_distilled: `generate` samples as the pipeline's own example does, 8 transformer calls,
    none for classifier-free guidance, at the fixed shift mu = 1.15; the base model samples in 28 at Krea's 4.5,
    sdtrain's 5.5."""
    from diffusers import Krea2Transformer2DModel

    assert KREA.sampling.distilled(distilled) and KREA.sampling.distilled(distilled / "transformer")
    assert not KREA.sampling.distilled(released)
    assert KREA.sampling.defaults(None, distilled=False) == {"guidance": 5.5, "steps": 28}
    pipe = _pipeline(released)
    assert KREA.sampling.arguments(pipe, 5.5, None)["guidance_scale"] == 4.5
    assert KREA.sampling.arguments(pipe, 1.0, None)["guidance_scale"] == 0.0
    calls = []
    forward = Krea2Transformer2DModel.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Krea2Transformer2DModel, "forward", counted)
    assert main(["generate", "--model", str(distilled), "--prompt", "a red circle", "--size", "32",
                 "--out", str(tmp_path / "images")]) == 0
    assert len(calls) == 8
    # Whatever the image's size, at the distilled shift.
    sampled = []

    def first_step(pipe, step, timestep, tensors):
        sampled.append(pipe.scheduler.sigmas)
        pipe._interrupt = True
        return {}

    _pipeline(distilled)(prompt="a red circle", num_inference_steps=8, guidance_scale=0.0, height=64, width=48,
                         output_type="latent", max_sequence_length=TEXT_LENGTH, callback_on_step_end=first_step)
    grid = torch.linspace(1.0, 1 / 8, 8)
    torch.testing.assert_close(sampled[0][:-1].float(), pipe.scheduler.time_shift(krea2.DISTILLED_MU, 1.0, grid),
                               rtol=1e-5, atol=1e-6)
    # What an export of a run on it writes: its model_index.json keeps is_distilled, and the taps.
    assembled = KREA.sampling.assemble(
        {"vae": pipe.vae, "text_encoder": pipe.text_encoder, "transformer": pipe.transformer},
        [pipe.tokenizer], pipe.scheduler, distilled=True)
    assert assembled.config.is_distilled is True and tuple(assembled.config.text_encoder_select_layers) == LAYERS


def test_krea_module_names_are_diffusers_converters_own(released, tmp_path):
    """kohya's names (ComfyUI's lora_unet_ + Krea's module path) of every linear layer are those diffusers' Krea 2
    LoRA converter reads back to it, and the single file's keys those its checkpoint converter reads back to the
    model's: a file written and read through diffusers' from_single_file is the model weight for weight."""
    from diffusers import Krea2Transformer2DModel
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_krea2_lora_to_diffusers

    transformer = _pipeline(released).transformer
    linears = [name for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)]
    original = {name: KREA.files.original_module_path("transformer", name, transformer.config) for name in linears}
    state = {f"diffusion_model.{path}.lora_A.weight": torch.zeros(1) for path in original.values()}
    assert set(_convert_non_diffusers_krea2_lora_to_diffusers(state)) == {f"transformer.{n}.lora_A.weight"
                                                                          for n in linears}
    held = set(krea2.to_original(transformer.state_dict()))
    assert all(f"{path}.weight" in held for path in original.values())
    assert KREA.files.kohya_lora_name("transformer", "transformer_blocks.1.attn.to_out.0", transformer.config) == \
        "lora_unet_blocks_1_attn_wo"

    single = tmp_path / "krea2.safetensors"
    KREA.files.single_file.write(single, {"transformer": transformer}, half=False, scheduler=None, text_layout="auto",
                           text_source=None)
    assert families.detect(single) is KREA
    loaded = Krea2Transformer2DModel.from_single_file(str(single), config=str(released / "transformer"),
                                                      local_files_only=True, torch_dtype=torch.float32)
    assert loaded.state_dict().keys() == transformer.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in transformer.state_dict().items())


def test_a_lora_over_a_low_precision_base_loads_whole_through_diffusers(tmp_path, released, shapes_dir):
    run = tmp_path / "lora"
    assert main(_command("lora", run, released, shapes_dir, 1, "model.frozen_precision=fp8")) == 0
    out = export_run(run, tmp_path / "out")
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.") for k in keys)  # diffusers' loader adapts the transformer alone
    kohya = load_file(str(out / "lora_kohya.safetensors"))
    in_file = {k.removeprefix("transformer.").rsplit(".lora", 1)[0] for k in keys}
    config = _pipeline(released).transformer.config
    named = {KREA.files.kohya_lora_name("transformer", path, config) for path in in_file}
    assert {k.split(".")[0] for k in kohya} == named
    assert any(k.startswith("lora_unet_txtfusion_") for k in kohya) and any("_attn_wq." in k for k in kohya)
    before = _image(_pipeline(released))
    pipe = _pipeline(released)
    pipe.load_lora_weights(out, weight_name="pytorch_lora_weights.safetensors")
    from peft.tuners.lora import LoraLayer

    attached = {n for n, module in pipe.transformer.named_modules() if isinstance(module, LoraLayer)}
    assert attached == in_file and any(n.endswith("attn.to_q") for n in attached)
    assert not np.array_equal(_image(pipe), before)
    assert "- krea2" in (out / "README.md").read_text()  # the model card names the family


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "dreambooth"])
def test_full_and_dreambooth_exports_load_in_diffusers_and_change_the_image(mode, tmp_path, released, shapes_dir):
    run = tmp_path / mode
    assert main(_command(mode, run, released, shapes_dir, 2)) == 0
    out = export_run(run, tmp_path / "out")
    assert families.detect(out) is KREA
    assert json.loads((out / "model_index.json").read_text())["text_encoder_select_layers"] == list(LAYERS)
    assert np.abs(_image(_pipeline(out)) - _image(_pipeline(released))).max() > 1e-3
    if mode == "full":
        _single_file_export_loads_in_diffusers_and_trains(run, out, tmp_path, released, shapes_dir)


def _single_file_export_loads_in_diffusers_and_trains(run: Path, out: Path, tmp_path: Path, released: Path,
                                                      shapes_dir: Path) -> None:
    """`export --single-file` writes the transformer alone in Krea's layout (ComfyUI's diffusion_models/ file):
    diffusers' own from_single_file reads the run's weights from it, and sdtrain trains from it as
    model.transformer."""
    from diffusers import Krea2Transformer2DModel

    single = tmp_path / "krea2.safetensors"
    assert main(["export", str(run), str(single), "--single-file"]) == 0
    assert families.detect(single) is KREA
    loaded = Krea2Transformer2DModel.from_single_file(str(single), config=str(released / "transformer"),
                                                      local_files_only=True, torch_dtype=torch.float32)
    trained = _pipeline(out).transformer.state_dict()
    assert all(torch.equal(loaded.state_dict()[key], tensor) for key, tensor in trained.items())
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'again'}", *COMMON,
                 f"model.pretrained={released}", f"model.transformer={single}", f"data.shards={shapes_dir}",
                 "train.max_steps=1", "lora.rank=4"]) == 0


@pytest.mark.slow
def test_from_scratch_the_model_trains_exports_and_generates(tmp_path, tiny_scratch_run):
    """The text encoder and transformer train from the tiny preset on Wan's autoencoder (an autoencoder run's,
    shared with Qwen-Image's), validation renders through Krea2Pipeline, the export loads in diffusers with the taps
    its text encoder's depth gives and `generate` draws from it."""
    run = tiny_scratch_run("krea2", tmp_path / "scratch", 2, f"model.t5_text_length={TEXT_LENGTH}",
                           "data.caption_dropout=0.25", "validation.prompts=[a red circle]", "validation.steps=2")
    assert (run / "samples" / "step_00000002.png").is_file()
    out = tmp_path / "pipeline"
    assert main(["export", str(run), "--out", str(out)]) == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "Krea2Pipeline" and index["text_encoder_select_layers"] == list(LAYERS)
    _image(_pipeline(out))
    assert main(["generate", "--model", str(out), "--prompt", "a red circle", "--steps", "2",
                 "--out", str(tmp_path / "images")]) == 0
    assert (tmp_path / "images" / "grid.png").is_file()


@pytest.mark.slow
def test_encoded_shards_train_without_the_text_encoder(tmp_path, released, shapes_dir):
    """`prepare encode` stores each sample's latent posterior (4D: the frame axis gone) and the caption's tapped
    states side by side with their mask; a LoRA then trains on them."""
    from sdtrain.data.encoded import load_npy
    from sdtrain.data.order import read_shard, resolve_shards

    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(released), "--out", str(encoded),
                 "--resolution", "32", "--dtype", "float32", "--t5-text-length", str(TEXT_LENGTH)]) == 0
    sample = next(iter(read_shard(resolve_shards(str(encoded))[0].url)))
    assert load_npy(sample["latent_mean.npy"]).shape == (16, 8, 8)
    states, mask = load_npy(sample["text_emb.npy"]), load_npy(sample["text_mask.npy"])
    assert states.shape[-2:] == (TEXT_LENGTH, len(LAYERS) * 32) and mask.shape[-1] == TEXT_LENGTH
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={encoded}", "train.max_steps=2",
                 "data.caption_dropout=0.25", "lora.rank=4"]) == 0


def test_params_counts_the_released_architecture(capsys):
    assert main(["params", str(CONFIGS / "lora.yaml"), "model.family=krea2", "model.preset=krea2"]) == 0
    report = capsys.readouterr().out
    # The released transformer, Wan's autoencoder and Qwen3-VL-4B's language tower.
    assert "12,820,073,036" in report and "126,892,531" in report and "4,022,468,096" in report


def test_a_text_mask_with_no_padding_is_passed_as_none():
    """An explicit attention mask is what cuDNN's SDPA backward on Hopper answers with NaN gradients at some lengths
    (pytorch/pytorch#196678): a caption with no padding is attended without one."""
    call = families.get("krea2").denoising
    states = torch.zeros(2, 5, 8)
    full = call.condition({"text_emb": states, "text_mask": torch.ones(2, 5, dtype=torch.long)}, {}, "cpu")
    assert full["encoder_attention_mask"] is None
    padded = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    mask = call.condition({"text_emb": states, "text_mask": padded}, {}, "cpu")["encoder_attention_mask"]
    assert torch.equal(mask, padded.bool())
