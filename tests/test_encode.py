"""Pre-encoded shards: latents and text embeddings computed once, training skips the encoders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sdtrain.config import DataConfig
from sdtrain.data.decode import SampleDecoder
from sdtrain.data.encode import Encoder, encode_dataset
from sdtrain.data.encoded import load_npy
from sdtrain.data.shards import read_manifest

from .conftest import train


def _encoder(vae: Path, text: Path | None = None, dtype: str = "float32") -> Encoder:
    return Encoder(str(vae), str(text) if text else None, resolution=32, device=torch.device("cpu"), dtype=dtype)


@pytest.fixture(scope="module")
def encoded(tmp_path_factory, shapes_dir, autoencoder_run) -> Path:
    out = tmp_path_factory.mktemp("encoded")
    assert encode_dataset(str(shapes_dir), out, _encoder(autoencoder_run), batch_size=8) is not None
    return out


def test_encoded_shards_keep_the_samples_and_add_latents(encoded, shapes_dir):
    import webdataset as wds

    manifest = read_manifest(encoded)
    assert manifest["total"] == read_manifest(shapes_dir)["total"]
    assert manifest["encoding"]["resolution"] == 32 and manifest["encoding"]["text_encoder"] is None
    sample = next(iter(wds.WebDataset(str(encoded / manifest["shards"][0]["name"]), shardshuffle=False)))
    assert {"png", "txt", "json", "latent_mean.npy", "latent_std.npy"} <= set(sample)


def test_an_interrupted_encode_finishes_with_the_same_shards(tmp_path, encoded, shapes_dir, autoencoder_run):
    out = tmp_path / "enc"
    # The first of two processes finishes its share; the other was interrupted before writing anything.
    assert encode_dataset(str(shapes_dir), out, _encoder(autoencoder_run), batch_size=8, rank=0, world_size=2) is None
    assert read_manifest(out) is None
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    manifest = encode_dataset(str(shapes_dir), out, _encoder(autoencoder_run), batch_size=8)
    assert all(out.joinpath(name).stat().st_mtime_ns == t for name, t in finished.items())  # skipped, not redone
    assert manifest["shards"] == read_manifest(encoded)["shards"]  # same names, counts and sha256


def test_training_on_encoded_latents_skips_the_vae_and_matches_online_encoding(
        tmp_path, encoded, shapes_dir, autoencoder_run, monkeypatch, caplog):
    caplog.set_level("INFO")
    common = [f"model.vae={autoencoder_run}", "train.max_steps=1", "validation.prompts=[]", "logging.every=1"]
    train("diffusion.yaml", tmp_path / "online", f"data.shards={shapes_dir}", *common)
    from diffusers import AutoencoderKL

    def no_encoding(*_args, **_kwargs):
        raise AssertionError("the VAE encoder ran")

    monkeypatch.setattr(AutoencoderKL, "encode", no_encoding)
    train("diffusion.yaml", tmp_path / "encoded", f"data.shards={encoded}", *common)
    assert "VAE encoder skipped" in caplog.text
    losses = [json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
              for run in ("online", "encoded")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_text_embeddings_replace_a_frozen_text_encoder(tmp_path, shapes_dir, diffusion_run, monkeypatch, caplog):
    from transformers import CLIPTextModel

    from sdtrain.export import export_run

    caplog.set_level("INFO")
    pipeline = export_run(diffusion_run, tmp_path / "pipe")
    out = tmp_path / "enc"
    encode_dataset(str(shapes_dir), out, _encoder(pipeline, pipeline, dtype="float16"), batch_size=16)
    assert (out / "empty_caption.npy").is_file()
    import webdataset as wds

    # A pair keeps its three phrasings, each with its embedding, and training draws one per read as from images.
    originals = {s["__key__"]: s["txt"].decode().splitlines()
                 for s in wds.WebDataset(sorted(str(p) for p in shapes_dir.glob("*.tar")), shardshuffle=False)}
    samples = {s["__key__"]: s for s in wds.WebDataset(sorted(str(p) for p in out.glob("*.tar")), shardshuffle=False)}
    pairs = [key for key, lines in originals.items() if len(lines) == 3]
    assert pairs and set(samples) == set(originals)
    for key, sample in samples.items():
        assert sample["txt"].decode().splitlines() == originals[key]
        shape = load_npy(sample["text_emb.npy"]).shape
        assert shape[:-2] == ((3,) if key in pairs else ())
    decoder = SampleDecoder(DataConfig(shards=str(out), resolution=32, caption_dropout=0.0), None, seed=0,
                            encoded=True)
    drawn = {}
    for epoch in range(16):
        sample = decoder(samples[pairs[0]], (epoch, 0, 0))
        drawn[sample["caption"]] = sample["text_emb"]
    assert set(drawn) == set(originals[pairs[0]])
    encoder = _encoder(pipeline, pipeline)
    for caption, embedding in drawn.items():
        expected = torch.from_numpy(encoder.text([caption])["text_emb"][0]).half().float()
        torch.testing.assert_close(embedding, expected, atol=2e-3, rtol=2e-3)

    calls = []
    original = CLIPTextModel.forward
    monkeypatch.setattr(CLIPTextModel, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    tune = [f"data.shards={out}", f"model.pretrained={pipeline}", "model.vae=null",
            "diffusion.train_text_encoder=false", "train.max_steps=2", "validation.prompts=[]"]
    train("diffusion.yaml", tmp_path / "tune", *tune)
    assert "text encoder skipped" in caplog.text
    assert not calls
    # Shuffled tags are captions no shard holds an embedding of: the text encoder runs on them.
    caplog.clear()
    train("diffusion.yaml", tmp_path / "shuffled", *tune, "data.shuffle_tags=true")
    assert "text encoder skipped" not in caplog.text and calls


def test_latents_of_another_vae_or_resolution_are_one_clear_error(tmp_path, encoded, autoencoder_run, capsys):
    from sdtrain.cli.main import main

    from .conftest import TINY, config_path

    other = tmp_path / "other-vae"
    from sdtrain.loaders.components import load_run_modules

    load_run_modules(autoencoder_run)["vae"].save_pretrained(other)
    base = ["train", str(config_path("diffusion.yaml")), f"run_dir={tmp_path / 'run'}", f"data.shards={encoded}",
            *TINY, "train.max_steps=1"]
    assert main([*base, f"model.vae={other}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "encoded with the VAE" in err and "\n" not in err
    assert main([*base, f"model.vae={autoencoder_run}", "data.resolution=64", f"run_dir={tmp_path / 'run2'}"]) == 2
    assert "encoded at 32 px" in capsys.readouterr().err


def test_prepare_encode_from_the_cli(tmp_path, shapes_dir, autoencoder_run, encoded, capsys):
    from sdtrain.cli.main import main

    out = tmp_path / "enc"
    # No --resolution: the VAE's own sample_size (32 for this one).
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(autoencoder_run), "--out", str(out),
                 "--dtype", "float32", "--batch-size", "8"]) == 0
    assert "encoded 48 samples (latents) in 3 shards" in capsys.readouterr().out
    assert read_manifest(out)["shards"] == read_manifest(encoded)["shards"]
    assert main(["prepare", "verify", str(out)]) == 0
    assert main(["prepare", "encode", str(shapes_dir), "--out", str(out), "--resolution", "32"]) == 2
    assert "--model" in capsys.readouterr().err


def test_encoded_training_never_loads_the_unread_frozen_weights_and_still_validates(
        tmp_path, shapes_dir, diffusion_run):
    from sdtrain.config import load_config
    from sdtrain.export import export_run
    from sdtrain.train.trainer import Trainer

    from .conftest import TINY, config_path

    pipeline = export_run(diffusion_run, tmp_path / "pipe")
    out = tmp_path / "enc"
    encode_dataset(str(shapes_dir), out, _encoder(pipeline, pipeline), batch_size=16)
    config = load_config(config_path("diffusion.yaml"), [
        *TINY, f"run_dir={tmp_path / 'run'}", f"data.shards={out}", f"model.pretrained={pipeline}", "model.vae=null",
        "diffusion.train_text_encoder=false", "train.max_steps=2", "validation.prompts=[a red square]"])
    # Training never reads them, so it starts without their weights ever loaded (T5-XXL's are 19 GB in fp32):
    # here they are not even on disk until validation needs them.
    weights = [next((pipeline / name).glob("*.safetensors")) for name in ("vae", "text_encoder")]
    for file in weights:
        file.rename(file.with_suffix(".away"))
    trainer = Trainer(config)
    for file in weights:
        file.with_suffix(".away").rename(file)
    assert all(p.is_meta for p in trainer.task.vae.parameters())
    assert all(p.is_meta for p in trainer.task.text_encoder.parameters())
    trainer.train()
    assert (tmp_path / "run" / "samples" / "step_00000002.png").is_file()
