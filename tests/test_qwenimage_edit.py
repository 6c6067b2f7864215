"""Qwen-Image-Edit through the CLI at tiny size: a pipeline folder built by plain diffusers and transformers as the
release is (the whole Qwen2.5-VL model as its text encoder, a processor folder beside the tokenizer), recognised and
fine-tuned by reference (LoRA and full); the conditioning (the vision-language model reading the source with the
instruction) and the denoiser's output with the source's tokens are the pipeline's own; the LoRA loads into
QwenImageEditPipeline and changes its edit, a full run exports a folder `generate --image` edits with; encoded
shards give the latents, the text encoder runs every step. (The spec-level guarantees are the conformance
suite's, tests/test_family_conformance.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from sdtrain.cli.main import main
from sdtrain.export import export_run
from sdtrain.models import build, families
from sdtrain.models.families import causal_lm
from sdtrain.models.families.patches import pack, unpack
from sdtrain.models.families.qwenimage import VISION_MARKERS, VisionTextProcessor, image_processor, vision_images
from sdtrain.models.tokenizer import CaptionTokenizer

from .conftest import TINY_CLI, config_path, run_card
from .test_qwenimage import released_parts

CONFIGS = config_path("diffusion.yaml").parents[1]
EDIT = families.get("qwen-image-edit")
PLUS = families.get("qwen-image-edit-plus")
TEXT_LENGTH = 40
COMMON = [*TINY_CLI, f"model.t5_text_length={TEXT_LENGTH}", "data.aspect_buckets=false", "train.max_steps=2",
          "optim.lr=0.01", "model.frozen_precision=fp32"]


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    return _release(tmp_path_factory.mktemp("qwen-image-edit") / "pipeline", EDIT)


@pytest.fixture(scope="module")
def released_plus(tmp_path_factory) -> Path:
    return _release(tmp_path_factory.mktemp("qwen-image-edit-plus") / "pipeline", PLUS)


def _release(folder: Path, family) -> Path:
    """A Qwen-Image-Edit pipeline folder (of `family`'s pipeline) as the release is: the whole vision-language model
    as the text encoder (its vision tokens' ids in its config), the 3D autoencoder with its latent statistics, the
    transformer (2511's modulating the source at timestep zero, for the Plus pipeline), a Qwen2 chat tokenizer with
    the vision markers, and the processor folder (the image processor's settings beside the tokenizer), saved by
    diffusers."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = causal_lm.train_chat_tokenizer(
        [f"make it {c}" for c in ("red", "green", "blue", "yellow")] * 4, folder.parent / "tokenizer", 600,
        TEXT_LENGTH, tuple(VISION_MARKERS.values()))
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=None, eos_token_id=None, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]})
    markers = {f"{role}_token_id": tokenizer.convert_tokens_to_ids(token) for role, token in VISION_MARKERS.items()}
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                                             out_hidden_size=32, fullatt_block_indexes=[1]), **markers))
    pipe = family.sampling.pipeline_class(text_encoder=encoder, tokenizer=tokenizer,
                                 processor=VisionTextProcessor(image_processor(14, 2, 2), tokenizer),
                                 **released_parts(zero_cond_t=family is PLUS))
    # The release's model_index names transformers' processor, whose folder holds the image processor's
    # preprocessor_config.json and the tokenizer (transformers needs torchvision to build one with its video half).
    pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
    pipe.save_pretrained(folder)
    assert json.loads((folder / "model_index.json").read_text())["processor"] == ["transformers", "Qwen2VLProcessor"]
    for name in ("preprocessor_config.json", "processor_config.json"):
        (folder / "processor" / name).unlink(missing_ok=True)
    image_processor(14, 2, 2).save_pretrained(folder / "processor")
    return folder


def _pipeline(folder: Path, family=EDIT):
    pipe = family.sampling.pipeline_from_folder(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _source(side: tuple[int, int] = (48, 32)) -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, (side[1], side[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _edit(pipe, source: Image.Image, family=EDIT) -> np.ndarray:
    with family.reference.at_own_size([source]) as own_size:
        return pipe(prompt="make it blue", image=[source], num_inference_steps=2, height=source.height,
                    width=source.width, true_cfg_scale=1.0, output_type="np",
                    generator=torch.Generator().manual_seed(0), **own_size).images[0]


def test_a_released_folder_is_recognised_and_what_it_cannot_do_is_one_line(released, tmp_path, shapes_dir,
                                                                               capsys):
    assert families.detect(released) is EDIT
    pipe = _pipeline(released)
    assert type(pipe).__name__ == "QwenImageEditPipeline" and pipe.prompt_template_encode_start_idx > 0
    assert main(["train", str(CONFIGS / "lora.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={shapes_dir}"]) == 2
    assert "edit.reference" in capsys.readouterr().err
    assert main(["train", str(CONFIGS / "qwen-image-edit-lora.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={shapes_dir}"]) == 2
    assert "KEY.src.png" in capsys.readouterr().err
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    assert main(["train", str(CONFIGS / "qwen-image-edit-lora.yaml"), f"run_dir={tmp_path / 'run'}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={shapes_dir}", "evaluation.every_samples=4",
                 f"evaluation.prompts={tmp_path / 'prompts.txt'}"]) == 2
    assert "evaluation.metrics" in capsys.readouterr().err
    assert main(["generate", "--model", str(released), "--prompt", "a red circle", "--steps", "2", "--size", "32",
                 "--out", str(tmp_path / "images")]) == 2  # nothing to edit
    assert "--image" in capsys.readouterr().err.splitlines()[-1]


def test_the_text_encoder_reads_the_released_names_whole_and_a_tensor_at_a_time(released):
    """The release's vision-language model keeps transformers' earlier names (model.layers, visual.blocks): read
    whole (fp32) and streamed into a low-precision base alike, vision tower and head included."""
    from sdtrain.loaders.components import load_component

    with safe_open(str(released / "text_encoder" / "model.safetensors"), framework="pt") as file:
        names = list(file.keys())  # noqa: SIM118 - safe_open is no dict
    assert any(n.startswith("visual.") for n in names) and any(n.startswith("model.layers.") for n in names)
    whole = load_component("text_encoder", released, family=EDIT)
    ids = torch.randint(0, 100, (1, 9))
    images = vision_images(whole.config, [_source((32, 32))])
    ids[0, 3] = whole.config.image_token_id
    ids = torch.cat([ids[:, :3], ids[:, 3:4].repeat(1, 4), ids[:, 4:]], dim=1)  # 32 px: 4 merged patches

    def states(model) -> torch.Tensor:
        with torch.no_grad():
            return model.model(input_ids=ids, pixel_values=images["pixel_values"],
                               image_grid_thw=images["image_grid_thw"]).last_hidden_state

    expected = states(whole)
    low = load_component("text_encoder", released, family=EDIT, frozen_precision="fp8")
    assert type(low) is type(whole)
    assert (states(low) - expected).abs().max() <= 0.2 * expected.abs().max()


@pytest.mark.parametrize("family", [EDIT, PLUS], ids=lambda family: family.name)
def test_the_conditioning_and_the_denoiser_with_the_source_are_the_pipelines_own(family, request):
    """Training's conditioning (the instruction's states with the source's vision tokens, the system turn dropped;
    for the Plus pipeline, the source named "Picture 1" and seen at its condition size) is what the pipeline gives
    its transformer for that source; the denoiser's output with the source's latent tokens, as training computes
    it, is the pipeline's at a sampling step (with a source at its own size)."""
    from sdtrain.utils import to_pil

    folder = request.getfixturevalue("released" if family is EDIT else "released_plus")
    pipe = _pipeline(folder, family)
    with torch.no_grad():  # a model trained longer: its output far from the initial one
        for parameter in pipe.transformer.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    tokenizer = build.load_tokenizer(str(folder), TEXT_LENGTH)
    captions = ["make it blue", ""]
    sources = torch.from_numpy(np.stack([np.asarray(_source()), np.asarray(_source())[::-1]]).copy())
    sources = sources.permute(0, 3, 1, 2).float() / 127.5 - 1
    ids, masks = family.token_inputs(CaptionTokenizer([tokenizer], family)(captions))
    with torch.no_grad():
        text = family.conditioner.encode_text([pipe.text_encoder], ids, captions, masks, sources=sources)
        reference = family.reference.latents(pipe.vae, sources)
    height, width = 32 // 4, 48 // 4  # the tiny autoencoder's latents
    tokens = height * width // 4
    seen: dict[int, tuple] = {}

    def keep(module, args, kwargs, output) -> None:
        seen.setdefault(len(seen), (kwargs, output[0]))

    for i, source in enumerate(to_pil(sources)):
        seen.clear()
        hook = pipe.transformer.register_forward_hook(keep, with_kwargs=True)
        try:
            with torch.no_grad(), family.reference.at_own_size([source]) as own_size:
                pipe(prompt=captions[i:i + 1], image=[source], num_inference_steps=2, height=32, width=48,
                     true_cfg_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0), **own_size)
        finally:
            hook.remove()
        kwargs, expected = seen[0]
        kept = text["text_mask"][i].bool()
        assert int(kept.sum()) == kwargs["encoder_hidden_states"].shape[1]
        torch.testing.assert_close(text["text_emb"][i][kept], kwargs["encoder_hidden_states"][0], rtol=1e-5,
                                   atol=1e-6)
        assert not text["text_emb"][i][~kept].any()
        # The source's latents, not resized, after the noisy ones.
        torch.testing.assert_close(pack(reference[i:i + 1]), kwargs["hidden_states"][:, tokens:])
        with torch.no_grad():
            condition = family.denoising.condition({key: value[i:i + 1] for key, value in text.items()}, {},
                                         torch.device("cpu"))
            output = family.denoising.denoise(pipe.transformer,
                                              unpack(kwargs["hidden_states"][:, :tokens], height, width),
                                    kwargs["timestep"] * 1000, {**condition, "reference_latents": reference[i:i + 1]})
        torch.testing.assert_close(pack(output), expected[:, :tokens], rtol=1e-4, atol=1e-5)


def _lora_edits(folder: Path, family, tmp_path: Path, edits: Path) -> None:
    """configs/qwen-image-edit-lora.yaml on `folder` (a `family` release): trained on edits, it validates by
    editing the last batch's sources, its LoRA loads into the family's pipeline and changes the edit, and `generate
    --lora --image` edits with it."""
    run = tmp_path / "lora"
    assert main(["train", str(CONFIGS / "qwen-image-edit-lora.yaml"), f"run_dir={run}", *COMMON,
                 f"model.pretrained={folder}", f"data.shards={edits}", "validation.prompts=[make it blue]",
                 "validation.steps=2"]) == 0
    assert (run / "samples" / "step_00000002.png").is_file()
    out = export_run(run, tmp_path / "out")
    source = _source((32, 32))
    pipe = _pipeline(folder, family)
    before = _edit(pipe, source, family)
    # The model card lists an editor, and its code loads the LoRA into the pipeline the base's model_index.json
    # names, then gives it the image to edit: it edits otherwise than the base. (Given the processor the family
    # builds from the folder: transformers' own needs torchvision, which a machine may lack.)
    data, made = run_card(out, folder, processor=pipe.processor)
    assert data.pipeline_tag == "image-to-image" and 'image=load_image("before.png")' in (out / "README.md").read_text()
    index = json.loads((folder / "model_index.json").read_text())
    assert type(made["pipe"]) is family.sampling.pipeline_class and type(made["pipe"]).__name__ == index["_class_name"]
    edited = _edit(family.sampling.prepare(made["pipe"]), source, family)  # what sampling needs that no folder says
    assert np.abs(edited - before).max() > 1e-4
    source.save(tmp_path / "before.png")
    assert main(["generate", "--model", str(folder), "--lora", str(out), "--image", str(tmp_path / "before.png"),
                 "--prompt", "make it blue", "--steps", "2", "--size", "32", "--out", str(tmp_path / "images")]) == 0
    assert len(list((tmp_path / "images").glob("*.png"))) == 2


def test_a_lora_learns_to_edit_and_loads_into_the_edit_pipeline(released, tmp_path, edits, caplog):
    """`_lora_edits` on Qwen-Image-Edit; on encoded shards the VAE encodes the sources and the text encoder stays,
    reading them."""
    _lora_edits(released, EDIT, tmp_path, edits)
    encoded = tmp_path / "encoded"
    caplog.set_level("INFO")
    assert main(["prepare", "encode", str(edits), "--model", str(released), "--out", str(encoded),
                 "--resolution", "32"]) == 0
    assert "latents alone are encoded" in caplog.text
    # Measuring the step's memory (gradient checkpointing auto) steps on a synthetic batch with sources too.
    assert main(["train", str(CONFIGS / "qwen-image-edit-lora.yaml"), f"run_dir={tmp_path / 'on-encoded'}",
                 *COMMON, f"model.pretrained={released}", f"data.shards={encoded}",
                 "train.gradient_checkpointing=auto"]) == 0
    assert "pre-encoded shards: latents read" in caplog.text


def test_a_full_run_exports_an_edit_pipeline_that_generate_edits_with(released, tmp_path, edits):
    full = tmp_path / "full"
    assert main(["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={full}", *COMMON,
                 f"model.pretrained={released}", f"data.shards={edits}", "edit.reference=true",
                 "optim.warmup_steps=0"]) == 0
    folder = export_run(full, tmp_path / "out")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline" and index["processor"] == ["transformers",
                                                                                       "Qwen2VLProcessor"]
    assert families.detect(folder) is EDIT
    # Where torchvision is installed, transformers builds the processor's video half from the image settings.
    from transformers.models.auto.video_processing_auto import get_video_processor_config

    assert get_video_processor_config(folder / "processor")["image_processor_type"] == "Qwen2VLImageProcessor"
    _source((64, 32)).save(tmp_path / "source.png")  # wider than tall, as a bucketed run's may be
    assert main(["generate", "--model", str(folder), "--image", str(tmp_path / "source.png"), "--prompt",
                 "make it blue", "--steps", "2", "--out", str(tmp_path / "images")]) == 0
    edited = sorted((tmp_path / "images").glob("0*.png"))
    assert len(edited) == 1 and Image.open(edited[0]).width > Image.open(edited[0]).height  # the source's aspect

    # Its transformer alone in one file, as ComfyUI loads it, and read back as an edit run's transformer.
    single = tmp_path / "qwen-image-edit.safetensors"
    assert main(["export", str(full), str(single), "--single-file"]) == 0
    trained = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))  # as exported
    assert main(["train", str(CONFIGS / "qwen-image-edit-lora.yaml"), f"run_dir={tmp_path / 'from-file'}", *COMMON,
                 f"model.pretrained={released}", f"model.transformer={single}", f"data.shards={edits}",
                 "train.max_steps=1"]) == 0
    from sdtrain.loaders.components import load_component

    transformer = load_component("transformer", single, family=EDIT)
    for key, value in transformer.state_dict().items():
        assert torch.equal(value, trained[key]), key


def test_the_benchmark_times_an_edit_run_on_encoded_shards(released, tmp_path):
    """`sdtrain benchmark train --encoded` of an edit run: its synthetic shards carry sources, the text encoder runs
    (it reads them), and the step is timed as training runs it."""
    out = tmp_path / "result.json"
    assert main(["benchmark", "train", str(CONFIGS / "qwen-image-edit-lora.yaml"), f"run_dir={tmp_path / 'run'}",
                 f"model.pretrained={released}", "data.resolution=32", "data.aspect_buckets=false",
                 f"model.t5_text_length={TEXT_LENGTH}", "train.mixed_precision=fp32", "model.frozen_precision=fp32",
                 "--encoded", "--steps", "1", "--warmup", "0", "--peak-seconds", "0.2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["encoded"] and result["step_ms"] > 0 and result["peak_memory_gib"] > 0


@pytest.mark.slow  # the default suite's time: the Plus path's parity and conformance cases stay in it
def test_a_plus_model_lora_learns_to_edit_and_loads_into_its_pipeline(released_plus, tmp_path, edits):
    """`_lora_edits` on a Qwen-Image-Edit-2511 folder (QwenImageEditPlusPipeline, its transformer modulating the
    source at timestep zero), recognised as the Plus family."""
    assert families.detect(released_plus) is PLUS
    _lora_edits(released_plus, PLUS, tmp_path, edits)
