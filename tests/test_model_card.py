"""Model cards: every export has a README.md the Hugging Face Hub reads (front-matter and body), offline, and a
card sdtrain did not write is never overwritten."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from sdtrain.checkpoint import latest_checkpoint, read_meta
from sdtrain.export import export_run, export_single_file
from sdtrain.loaders.pipelines import run_config
from sdtrain.model_card import hub_model_id

from .conftest import train

HUB_CARD = "---\nlicense: creativeml-openrail-m\ntags:\n- stable-diffusion\n---\n\n# A base model\n"


def _finetune(run: Path, pretrained: Path, shapes_dir: Path, mode: str, *overrides: str) -> Path:
    train("diffusion.yaml", run, f"data.shards={shapes_dir}", f"model.pretrained={pretrained}", "model.vae=null",
          f"mode={mode}", "train.max_steps=2", "optim.lr=0.01", "validation.steps=2", *overrides)
    return run


@pytest.fixture(scope="module")
def hub_base(tmp_path_factory, pretrained) -> Path:
    """The tiny pretrained pipeline where the Hub's cache would put acme/tiny-sd, with the Hub's card."""
    # A snapshot is named by its commit, as the Hub's cache names it.
    folder = tmp_path_factory.mktemp("hub") / "models--acme--tiny-sd" / "snapshots" / ("0123abc" * 6)[:40]
    shutil.copytree(pretrained, folder)
    (folder / "README.md").write_text(HUB_CARD)
    return folder


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, hub_base, shapes_dir) -> Path:
    return _finetune(tmp_path_factory.mktemp("runs") / "lora", hub_base, shapes_dir, "lora", "lora.rank=2",
                     "lora.alpha=4", "validation.prompts=[a red circle]")


def _card(path: Path) -> ModelCard:
    assert path.is_file(), path
    return ModelCard.load(path)


def _settings(card: ModelCard, run: Path) -> None:
    """The body's training table says what the run's config and checkpoint say."""
    config, meta = run_config(run), read_meta(latest_checkpoint(run))
    batch, accumulation = config.data.batch_size, config.train.grad_accum
    for row in (f"| Resolution | {config.data.resolution} |", f"| Steps | {meta['step']} |",
                f"| Batch size | {batch} per device, gradient accumulation {accumulation} |",
                f"| Samples seen | {meta['samples']} |", f"| Learning rate | {config.optim.lr:g}, ",
                f"| Optimizer | {config.optim.name} ", f"| Precision | {meta['tuning']['precision']} |",
                f"| Seed | {config.seed} |", f"| Checkpoint | {latest_checkpoint(run).name} |"):
        assert row in card.text, row


def test_a_full_run_exports_a_card_the_hub_reads_with_its_settings_and_validation_grid(tmp_path, diffusion_run):
    out = export_run(diffusion_run, tmp_path / "full")
    card = _card(out / "README.md")
    data = card.data
    assert data.base_model is None  # trained from scratch
    assert data.library_name == "diffusers" and data.pipeline_tag == "text-to-image" and data.license is None
    assert {"text-to-image", "diffusers", "stable-diffusion", "sdtrain"} <= set(data.tags)
    assert not {"lora", "textual-inversion", "dreambooth"} & set(data.tags)
    assert "instance_prompt" not in data.to_dict()
    assert (out / "validation.png").is_file() and "](validation.png)" in card.text
    assert data.widget == [{"text": "a red circle", "output": {"url": "validation.png"}}]
    assert "StableDiffusionPipeline.from_pretrained(\"full\")" in card.text
    assert "trained from scratch" in card.text and "| EMA | decay" in card.text and "EMA weights |" in card.text
    _settings(card, diffusion_run)
    assert str(diffusion_run) not in card.text and str(tmp_path) not in card.text

    # Exported again into the same folder: the card is replaced (it now describes the other checkpoint).
    first = (out / "README.md").read_text()
    export_run(diffusion_run, out, checkpoint=diffusion_run / "checkpoints" / "step_00000002", ema=False)
    again = (out / "README.md").read_text()
    assert again != first and "| Checkpoint | step_00000002 |" in again and "raw weights" in again
    assert "*Validation samples at step 2.*" in again and not (out / "README.sdtrain.md").exists()


def test_a_readme_sdtrain_did_not_write_or_one_edited_is_kept(tmp_path, diffusion_run, caplog):
    out = export_run(diffusion_run, tmp_path / "full")
    (out / "README.md").write_text("# My notes\n")
    with caplog.at_level("WARNING", logger="sdtrain.model_card"):
        export_run(diffusion_run, out)
    assert (out / "README.md").read_text() == "# My notes\n"
    assert "README.sdtrain.md" in caplog.text and len(caplog.records) == 1
    aside = _card(out / "README.sdtrain.md")
    assert "sdtrain" in aside.data.tags
    # An sdtrain card edited since is the user's too.
    (out / "README.md").unlink()
    export_run(diffusion_run, out)
    edited = (out / "README.md").read_text().replace("# full", "# My model")
    (out / "README.md").write_text(edited)
    export_run(diffusion_run, out)
    assert (out / "README.md").read_text() == edited and (out / "README.sdtrain.md").is_file()


def test_no_card_and_a_license_from_the_command_line(tmp_path, diffusion_run):
    from sdtrain.cli.main import main

    assert main(["export", str(diffusion_run), str(tmp_path / "bare"), "--no-card"]) == 0
    assert not (tmp_path / "bare" / "README.md").exists() and (tmp_path / "bare" / "model_index.json").is_file()
    assert main(["export", str(diffusion_run), str(tmp_path / "licensed"), "--license", "apache-2.0"]) == 0
    assert _card(tmp_path / "licensed" / "README.md").data.license == "apache-2.0"


def test_a_lora_card_names_its_hub_base_and_license_and_how_to_load_the_adapters(tmp_path, lora_run):
    out = export_run(lora_run, tmp_path / "adapter")
    card = _card(out / "README.md")
    data = card.data
    assert data.base_model == "acme/tiny-sd"  # from the Hub cache's folder name, never the local path
    assert data.license == "creativeml-openrail-m"  # the base model's card, read from disk
    assert {"lora", "stable-diffusion", "sdtrain", "text-to-image"} <= set(data.tags)
    assert "| LoRA (unet) | rank 2, alpha 4 on to_q, to_k, to_v, to_out.0 |" in card.text
    assert 'from_pretrained("acme/tiny-sd")' in card.text and 'pipe.load_lora_weights("adapter")' in card.text
    assert "lora_kohya.safetensors" in card.text and "ComfyUI/models/loras/" in card.text
    assert data.widget[0]["output"]["url"] == "validation.png" and (out / "validation.png").is_file()
    _settings(card, lora_run)
    assert "snapshots" not in card.text


def test_a_textual_inversion_card_gives_its_token_as_instance_prompt(tmp_path, pretrained, shapes_dir):
    run = _finetune(tmp_path / "ti", pretrained, shapes_dir, "textual_inversion",
                    "textual_inversion.placeholder_token=<shape>", "textual_inversion.initializer_token=red",
                    "textual_inversion.num_vectors=2", "validation.prompts=[a <shape> on white]")
    out = export_run(run, tmp_path / "embeds")
    card = _card(out / "README.md")
    data = card.data
    assert data.instance_prompt == "<shape>" and "textual-inversion" in data.tags
    assert data.widget == [{"text": "a <shape> on white", "output": {"url": "validation.png"}}]
    # A local base is named by its folder's name alone: the Hub takes no path as base_model.
    assert data.base_model is None and "`pipeline` (a local model)" in card.text and str(pretrained) not in card.text
    assert "pipe.load_textual_inversion(\"embeds\", weight_name=\"learned_embeds.safetensors\")" in card.text
    assert "| Placeholder token | `<shape>` (2 vectors, initialised from `red`) |" in card.text
    assert "embedding:embeds" in card.text
    _settings(card, run)


def test_a_dreambooth_card_gives_its_instance_prompt(tmp_path, pretrained, shapes_dir):
    run = _finetune(tmp_path / "db", pretrained, shapes_dir, "dreambooth",
                    "dreambooth.instance_prompt=a photo of sks shape", "validation.prompts=[a photo of sks shape]")
    out = export_run(run, tmp_path / "subject")
    card = _card(out / "README.md")
    assert card.data.instance_prompt == "a photo of sks shape"
    assert {"dreambooth", "stable-diffusion"} <= set(card.data.tags) and "lora" not in card.data.tags
    assert "| Instance prompt | `a photo of sks shape` |" in card.text and "| Mode | dreambooth |" in card.text
    assert 'image = pipe("a photo of sks shape")' in card.text
    _settings(card, run)


def test_a_single_file_card_is_readme_in_a_folder_of_its_own_else_named_after_it(tmp_path, diffusion_run):
    folder = tmp_path / "solo"
    first = export_single_file(diffusion_run, folder / "m.safetensors")
    card = _card(folder / "README.md")
    assert {"stable-diffusion", "sdtrain"} <= set(card.data.tags)
    assert (folder / "m.validation.png").is_file() and "](m.validation.png)" in card.text
    assert card.data.widget[0]["output"]["url"] == "m.validation.png"
    assert "from_single_file(\"m.safetensors\"" in card.text and "ComfyUI/models/checkpoints/" in card.text
    assert "`m.tokenizer/`" in card.text and "| Stored as | fp32 |" in card.text
    _settings(card, diffusion_run)
    # A second file in that folder: the README.md stays the first one's; the second's card is named after it.
    export_single_file(diffusion_run, folder / "n.safetensors", half=True)
    assert "# m\n" in (folder / "README.md").read_text()
    assert "| Stored as | fp16 |" in _card(folder / "n.md").text and (folder / "n.validation.png").is_file()
    export_single_file(diffusion_run, first, checkpoint=diffusion_run / "checkpoints" / "step_00000002")
    assert "| Checkpoint | step_00000002 |" in (folder / "README.md").read_text()  # its own card, replaced

    # Beside files of the user's: their README.md and m.md stay; the card goes to m.sdtrain.md.
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "README.md").write_text("mine\n")
    (shared / "m.md").write_text("mine too\n")
    export_single_file(diffusion_run, shared / "m.safetensors")
    assert (shared / "README.md").read_text() == "mine\n" and (shared / "m.md").read_text() == "mine too\n"
    assert "sdtrain" in _card(shared / "m.sdtrain.md").data.tags


def test_an_autoencoder_export_has_a_vae_card_and_is_still_replaceable(tmp_path, autoencoder_run):
    out = export_run(autoencoder_run, tmp_path / "vae")
    card = _card(out / "README.md")
    assert card.data.pipeline_tag is None and "vae" in card.data.tags and "widget" not in card.data.to_dict()
    assert "AutoencoderKL.from_pretrained(\"vae\")" in card.text and "](validation.png)" in card.text
    assert "| KL weight |" in card.text
    assert export_run(autoencoder_run, out) == out  # a VAE folder with its card is still an export


def test_hub_model_ids_and_local_paths(tmp_path):
    assert hub_model_id("stabilityai/stable-diffusion-2-1") == "stabilityai/stable-diffusion-2-1"
    assert hub_model_id("black-forest-labs/FLUX.1-dev@main") == "black-forest-labs/FLUX.1-dev"
    cached = tmp_path / "models--acme--tiny-sd" / "snapshots" / ("0123" * 10)
    cached.mkdir(parents=True)
    assert hub_model_id(cached) == "acme/tiny-sd" == hub_model_id(cached / "sd.safetensors")  # as a run records ids
    assert hub_model_id("acme/tiny-sd/sub/sd.safetensors") == "acme/tiny-sd"
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    for local in (tmp_path / "org" / "name", "./org/name", "/abs/path", "a/b/c", "model.safetensors", None, ""):
        assert hub_model_id(local) is None, local
