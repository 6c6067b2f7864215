"""Fine-tuning modes on a tiny pretrained pipeline: what trains, what stays frozen, what they save, and
that plain diffusers loads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from .conftest import TINY, config_path, train


def finetune(run: Path, pretrained: Path, shapes_dir: Path, mode: str, *overrides: str) -> None:
    train("diffusion.yaml", run, f"data.shards={shapes_dir}", f"model.pretrained={pretrained}", "model.vae=null",
          f"mode={mode}", "validation.prompts=[]", "logging.every=1", *overrides)


def _pipe(pretrained: Path):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(pretrained, local_files_only=True, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe, prompt: str) -> np.ndarray:
    return pipe(prompt, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images[0]


TI = ["textual_inversion.placeholder_token=<shape>", "textual_inversion.initializer_token=red",
      "textual_inversion.num_vectors=2", "optim.lr=0.05"]


def test_lora_trains_only_adapters_and_diffusers_loads_them(tmp_path, pretrained, shapes_dir):
    from sdtrain.checkpoint import latest_checkpoint, read_meta
    from sdtrain.export import export_run

    run = tmp_path / "lora"
    finetune(run, pretrained, shapes_dir, "lora", "train.max_steps=3", "optim.lr=0.01", "lora.rank=2", "lora.alpha=4")
    checkpoint = latest_checkpoint(run)
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert saved and all("lora_" in key for key in saved)  # adapters only, not the base model
    assert read_meta(checkpoint)["modules"]["unet"]["partial"]
    out = export_run(run, tmp_path / "adapter")
    pipe = _pipe(pretrained)
    before = _image(pipe, "a red circle")
    pipe.load_lora_weights(out)
    adapted = _image(pipe, "a red circle")
    assert not np.allclose(adapted, before)
    # The kohya-layout copy (what A1111 and ComfyUI read) is the same adapter to diffusers too.
    kohya = load_file(str(out / "lora_kohya.safetensors"))
    assert all(k.startswith("lora_unet_") for k in kohya) and kohya[next(k for k in kohya if k.endswith("alpha"))] == 4
    pipe = _pipe(pretrained)
    pipe.load_lora_weights(out, weight_name="lora_kohya.safetensors")
    np.testing.assert_allclose(_image(pipe, "a red circle"), adapted, atol=1e-5)


def test_lora_leaves_the_base_weights_bitwise_unchanged(tmp_path, pretrained, shapes_dir):
    from diffusers import UNet2DConditionModel

    from sdtrain.config import load_config
    from sdtrain.train.trainer import Trainer

    config = load_config(config_path("diffusion.yaml"), [
        *TINY, f"run_dir={tmp_path / 'run'}", f"data.shards={shapes_dir}", f"model.pretrained={pretrained}",
        "model.vae=null", "mode=lora", "train.max_steps=2", "optim.lr=0.01", "validation.prompts=[a red circle]",
        "validation.steps=2"])
    trainer = Trainer(config)
    trainer.train()
    base = UNet2DConditionModel.from_pretrained(pretrained / "unet").state_dict()
    live = trainer.task.unet.state_dict()
    for key, value in base.items():
        parts = key.rsplit(".", 1)
        adapted = f"{parts[0]}.base_layer.{parts[1]}"
        assert torch.equal(live.get(key, live.get(adapted)), value), key
    assert (tmp_path / "run" / "samples" / "step_00000002.png").is_file()


def test_textual_inversion_learns_only_the_new_vectors_and_diffusers_loads_them(tmp_path, pretrained, shapes_dir):
    from sdtrain.export import export_run

    run = tmp_path / "ti"
    finetune(run, pretrained, shapes_dir, "textual_inversion", "train.max_steps=3", *TI)
    from sdtrain.checkpoint import latest_checkpoint

    saved = load_file(str(latest_checkpoint(run) / "model.safetensors"))
    assert len(saved) == 1 and next(iter(saved)).endswith("token_embedding.added")
    out = export_run(run, tmp_path / "embeds")
    learned = load_file(str(out / "learned_embeds.safetensors"))
    assert list(learned) == ["<shape>"] and learned["<shape>"].shape[0] == 2
    pipe = _pipe(pretrained)
    base_table = pipe.text_encoder.get_input_embeddings().weight.detach().clone()
    pipe.load_textual_inversion(str(out / "learned_embeds.safetensors"))
    assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[: len(base_table)], base_table)
    with_token = _image(pipe, "a <shape>")
    assert not np.allclose(with_token, _image(pipe, "a red"))


@pytest.mark.parametrize("mode,extra", [("lora", ["lora.rank=2", "optim.lr=0.01"]), ("textual_inversion", TI)])
def test_fine_tuning_resumes_bitwise(tmp_path, pretrained, shapes_dir, mode, extra):
    from sdtrain.checkpoint import latest_checkpoint

    finetune(tmp_path / "straight", pretrained, shapes_dir, mode, "train.max_steps=4", *extra)
    finetune(tmp_path / "split", pretrained, shapes_dir, mode, "train.max_steps=2", *extra)
    finetune(tmp_path / "split", pretrained, shapes_dir, mode, "train.max_steps=4", *extra)
    for name in ("model.safetensors", "ema.safetensors"):
        a = load_file(str(latest_checkpoint(tmp_path / "straight") / name))
        b = load_file(str(latest_checkpoint(tmp_path / "split") / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def _same(a: Path, b: Path) -> bool:
    """Whether two .safetensors files hold the same tensors."""
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("mode,extra,files", [
    ("lora", ["lora.rank=2", "lora.alpha=4", "optim.lr=0.01"],
     ["pytorch_lora_weights.safetensors", "lora_kohya.safetensors"]),
    # Sharded checkpoints written in the background: the files go in before the folder is committed.
    ("lora", ["lora.rank=2", "optim.lr=0.01", "checkpoint.format=sharded", "checkpoint.async_save=true"],
     ["pytorch_lora_weights.safetensors", "lora_kohya.safetensors"]),
    ("textual_inversion", TI, ["learned_embeds.safetensors"])], ids=["lora", "lora-async-sharded", "ti"])
def test_every_checkpoint_holds_the_files_export_writes_and_still_resumes(tmp_path, pretrained, shapes_dir, mode,
                                                                          extra, files):
    from sdtrain.checkpoint import list_checkpoints, read_meta, require_intact
    from sdtrain.export import export_run

    run = tmp_path / "run"
    finetune(run, pretrained, shapes_dir, mode, "train.max_steps=2", "checkpoint.every=1", *extra)
    first, second = list_checkpoints(run)
    for checkpoint in (first, second):
        # Inside the folder, so its checksums cover them (resume and export still find it intact) and pruning
        # removes them with it; nothing left over from writing them.
        require_intact(checkpoint)
        assert set(files) <= set(read_meta(checkpoint)["files"])
        assert not [p.name for p in checkpoint.iterdir() if p.name.startswith(".")]
        out = export_run(run, tmp_path / f"export-{checkpoint.name}", checkpoint=checkpoint)
        for name in files:
            assert _same(checkpoint / name, out / name), (checkpoint.name, name)
    assert not _same(first / files[0], second / files[0])  # each checkpoint's own weights
    # The EMA weights, as export's default: not the raw ones.
    raw = export_run(run, tmp_path / "raw", checkpoint=second, ema=False)
    assert not _same(second / files[0], raw / files[0])

    pipe = _pipe(pretrained)
    if mode == "lora":
        pipe.load_lora_weights(second)
        pipe.load_lora_weights(second, weight_name="lora_kohya.safetensors", adapter_name="kohya")
    else:
        pipe.load_textual_inversion(str(second / "learned_embeds.safetensors"))
        assert "<shape>" in pipe.tokenizer.get_vocab()

    # Resume from such a checkpoint; keep_last (2) prunes the first together with its files.
    finetune(run, pretrained, shapes_dir, mode, "train.max_steps=3", "checkpoint.every=1", *extra)
    assert [c.name for c in list_checkpoints(run)] == ["step_00000002", "step_00000003"]
    assert not first.exists()
    third = list_checkpoints(run)[-1]
    require_intact(third)
    assert read_meta(third)["step"] == 3 and all((third / name).is_file() for name in files)


def test_generate_applies_a_lora_and_an_embedding_from_the_cli(tmp_path, pretrained, shapes_dir):
    from PIL import Image

    from sdtrain.cli.main import main
    from sdtrain.export import export_run

    finetune(tmp_path / "lora", pretrained, shapes_dir, "lora", "train.max_steps=2", "optim.lr=0.01")
    finetune(tmp_path / "ti", pretrained, shapes_dir, "textual_inversion", "train.max_steps=2", *TI)
    adapter, embeds = export_run(tmp_path / "lora", tmp_path / "a"), export_run(tmp_path / "ti", tmp_path / "e")
    base = ["generate", "--model", str(pretrained), "--prompt", "a <shape>", "--steps", "2"]
    assert main([*base, "--out", str(tmp_path / "plain"), "--embedding", str(embeds)]) == 0
    assert main([*base, "--out", str(tmp_path / "both"), "--embedding", str(embeds), "--lora", str(adapter)]) == 0
    plain, both = (np.asarray(Image.open(tmp_path / d / "000-a-shape.png")) for d in ("plain", "both"))
    assert not np.array_equal(plain, both)
    assert main([*base, "--out", str(tmp_path / "x"), "--lora", str(tmp_path / "missing")]) == 2


def test_a_lora_run_generates_and_exports_a_merged_pipeline(tmp_path, pretrained, shapes_dir):
    from diffusers import StableDiffusionPipeline

    from sdtrain.export import export_run

    run = tmp_path / "lora"
    finetune(run, pretrained, shapes_dir, "lora", "train.max_steps=2", "optim.lr=0.01", "lora.save_merged=true")
    out = export_run(run, tmp_path / "out")
    merged = StableDiffusionPipeline.from_pretrained(out / "pipeline", local_files_only=True, safety_checker=None)
    merged.set_progress_bar_config(disable=True)
    with_adapter = _pipe(pretrained)
    with_adapter.load_lora_weights(out)
    np.testing.assert_allclose(_image(merged, "a red circle"), _image(with_adapter, "a red circle"), atol=1e-4)


def _task(tmp_path, pretrained, shapes_dir, *overrides):
    from sdtrain.config import load_config
    from sdtrain.train.modes import make_task

    config = load_config(config_path("diffusion.yaml"), [
        *TINY, f"run_dir={tmp_path}", f"data.shards={shapes_dir}", f"model.pretrained={pretrained}",
        "model.vae=null", *overrides])
    return make_task(config, torch.device("cpu"), tmp_path)


def test_objectives_change_the_loss_and_min_snr_stays_finite_at_zero_snr(tmp_path, pretrained, shapes_dir):
    batch = {"pixel_values": torch.rand(4, 3, 32, 32) * 2 - 1, "input_ids": torch.randint(0, 50, (4, 16))}

    def loss(*overrides):
        torch.manual_seed(0)
        task = _task(tmp_path, pretrained, shapes_dir, *overrides)
        return task, task.denoising_loss(batch, torch.Generator().manual_seed(1)).detach()

    _, plain = loss()
    for option in ("diffusion.ddpm.noise_offset=0.1", "diffusion.ddpm.input_perturbation=0.1",
                   "diffusion.ddpm.multires_noise_iterations=6"):
        _, changed = loss(option)
        assert torch.isfinite(changed).all() and not torch.allclose(changed, plain), option
    task, _ = loss("diffusion.ddpm.zero_terminal_snr=true", "diffusion.ddpm.snr_gamma=5",
                   "diffusion.ddpm.prediction_type=epsilon")
    last = task.noise_scheduler.config.num_train_timesteps - 1
    assert task.objective.alphas_cumprod[last] < 1e-4  # the last step is (nearly) pure noise
    steps = torch.tensor([0, 500, last])
    weight = task.objective.snr_weight(steps)
    snr = task.objective.alphas_cumprod[steps] / (1 - task.objective.alphas_cumprod[steps])
    assert torch.isfinite(weight).all()
    # min(snr, gamma) / snr, which is 1 wherever snr <= gamma, the zero-SNR step included.
    assert torch.allclose(weight, torch.where(snr <= 5, 1.0, 5 / snr))
    task, _ = loss("diffusion.ddpm.prediction_type=v_prediction", "diffusion.ddpm.snr_gamma=5")
    snr = task.objective.alphas_cumprod[steps] / (1 - task.objective.alphas_cumprod[steps])
    assert torch.allclose(task.objective.snr_weight(steps), torch.minimum(snr, torch.tensor(5.0)) / (snr + 1))


def test_logit_normal_timesteps_favour_the_middle_and_a_positive_mean_the_noisy_end(tmp_path, pretrained,
                                                                                     shapes_dir):
    def draws(*overrides):
        task = _task(tmp_path, pretrained, shapes_dir, *overrides)
        steps = task.objective.sample_timesteps(20000, torch.Generator().manual_seed(0))
        assert steps.min() >= 0 and steps.max() < task.noise_scheduler.config.num_train_timesteps
        return steps.float()

    uniform = draws()
    middle = draws("diffusion.timestep_sampling=logit_normal")
    noisy = draws("diffusion.timestep_sampling=logit_normal", "diffusion.timestep_mean=1.0")
    assert abs(uniform.mean() - 500) < 15 and abs(middle.mean() - 500) < 15
    assert middle.std() < uniform.std() * 0.8  # fewer of the nearly clean and nearly pure-noise steps
    assert noisy.mean() > 650


def test_a_zero_terminal_snr_schedule_is_sampled_from_pure_noise_after_export():
    """Export and generate build the sampler from the run's config: it must keep the rescaled schedule and
    start at its last (zero-SNR) step, or sampling begins where the model never trained."""
    from sdtrain.config import DdpmConfig, DiffusionConfig
    from sdtrain.models import build
    from sdtrain.models.pipeline import sampler_from

    ddpm = DdpmConfig(zero_terminal_snr=True, prediction_type="v_prediction")
    schedule = build.build_noise_scheduler(DiffusionConfig(ddpm=ddpm))
    assert schedule.alphas_cumprod[-1] < 1e-6
    for name in ("euler", "ddim", "dpmpp"):
        sampler = sampler_from(schedule, name)
        sampler.set_timesteps(10)
        assert int(sampler.timesteps[0]) == 999, name
    plain = sampler_from(build.build_noise_scheduler(DiffusionConfig()), "euler")
    assert not plain.config.rescale_betas_zero_snr


@pytest.mark.parametrize("lora", [False, True])
def test_dreambooth_generates_class_images_and_trains_with_prior_preservation(tmp_path, pretrained, shapes_dir,
                                                                               lora):
    import json

    from sdtrain.export import export_run

    run = tmp_path / "db"
    common = ["dreambooth.instance_prompt=a photo of sks shape", "dreambooth.class_prompt=a photo of a shape",
              "dreambooth.num_class_images=3", "dreambooth.generation_steps=2", "dreambooth.class_batch_size=2",
              f"dreambooth.lora={str(lora).lower()}", "optim.lr=0.01"]
    finetune(run, pretrained, shapes_dir, "dreambooth", "train.max_steps=2", *common)
    assert len(list((run / "class_images").glob("*.png"))) == 3
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("prior_loss" in m and "instance_loss" in m for m in metrics if "loss" in m)
    # Resumes exactly like any run, both data streams included.
    finetune(tmp_path / "straight", pretrained, shapes_dir, "dreambooth", "train.max_steps=3", *common,
             f"dreambooth.class_data={run / 'class_images'}")
    finetune(run, pretrained, shapes_dir, "dreambooth", "train.max_steps=3", *common)
    from sdtrain.checkpoint import latest_checkpoint

    a = load_file(str(latest_checkpoint(run) / "model.safetensors"))
    b = load_file(str(latest_checkpoint(tmp_path / "straight") / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    out = export_run(run, tmp_path / "out")
    assert (out / ("pytorch_lora_weights.safetensors" if lora else "model_index.json")).is_file()
    # With LoRA, each checkpoint holds the adapter files export writes; a full run's holds no pipeline.
    lora_file = latest_checkpoint(run) / "pytorch_lora_weights.safetensors"
    assert _same(lora_file, out / lora_file.name) if lora else not lora_file.exists()


def test_textual_inversion_on_a_prepared_folder_without_captions_freezes_all_else_and_saves_a_full_pipeline(
        tmp_path, pretrained):
    """The seed's shape of run: a handful of a user's own images, no captions, `prepare folder`, then TI."""
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    from sdtrain.cli.main import main
    from sdtrain.config import load_config
    from sdtrain.export import export_run
    from sdtrain.train.trainer import Trainer

    images = tmp_path / "my_toy"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(images / f"toy{i}.png")
    assert main(["prepare", "folder", str(images), "--out", str(tmp_path / "shards"),
                 "--missing-caption", "empty"]) == 0
    config = load_config(config_path("diffusion.yaml"), [
        *TINY, f"run_dir={tmp_path / 'run'}", f"data.shards={tmp_path / 'shards'}", f"model.pretrained={pretrained}",
        "model.vae=null", "mode=textual_inversion", *TI, "train.max_steps=2", "data.batch_size=2",
        "textual_inversion.save_as_full_pipeline=true", "validation.prompts=[a <shape>]", "validation.steps=2"])
    trainer = Trainer(config)
    unet_before = {k: v.clone() for k, v in trainer.task.unet.state_dict().items()}
    table_before = trainer.task.text_encoder.get_input_embeddings().base.weight.clone()
    trainer.train()
    assert all(torch.equal(v, unet_before[k]) for k, v in trainer.task.unet.state_dict().items())
    assert torch.equal(trainer.task.text_encoder.get_input_embeddings().base.weight, table_before)
    assert (tmp_path / "run" / "samples" / "step_00000002.png").is_file()  # validation with the new token
    out = export_run(tmp_path / "run", tmp_path / "out")
    full = StableDiffusionPipeline.from_pretrained(out / "pipeline", local_files_only=True, safety_checker=None)
    assert "<shape>_1" in full.tokenizer.get_vocab()
    full.set_progress_bar_config(disable=True)
    loaded = _pipe(pretrained)
    loaded.load_textual_inversion(str(out / "learned_embeds.safetensors"))
    # Either way diffusers expands "<shape>" in a prompt to both vectors' tokens.
    np.testing.assert_allclose(_image(full, "a <shape>"), _image(loaded, "a <shape>"), atol=1e-5)


def test_lora_on_the_text_encoder_too(tmp_path, pretrained, shapes_dir):
    from sdtrain.checkpoint import latest_checkpoint
    from sdtrain.export import export_run

    run = tmp_path / "lora"
    finetune(run, pretrained, shapes_dir, "lora", "train.max_steps=2", "optim.lr=0.01", "lora.text_encoder=true")
    saved = load_file(str(latest_checkpoint(run) / "model.safetensors"))
    assert any(k.startswith("text_encoder.") for k in saved) and all("lora_" in k for k in saved)
    out = export_run(run, tmp_path / "out")
    kohya = load_file(str(out / "lora_kohya.safetensors"))
    assert any(k.startswith("lora_te_text_model_encoder_layers_0_self_attn_q_proj") for k in kohya)
    pipe = _pipe(pretrained)
    text_before = pipe.text_encoder(torch.tensor([[0, 5, 1]]))[0]
    pipe.load_lora_weights(out)
    assert not torch.allclose(pipe.text_encoder(torch.tensor([[0, 5, 1]]))[0], text_before)


def test_dreambooth_encodes_its_prompts_once_and_releases_the_text_encoder(tmp_path, pretrained, shapes_dir):
    """The instance and class prompts are the only captions DreamBooth trains on: encoded once at start (as the
    scripts users compare with do), the frozen text encoder unloaded, each step's conditioning the same as
    encoding the batch's captions, and validation loading the encoder back."""
    from sdtrain.config import load_config
    from sdtrain.train.trainer import Trainer

    prompts = ["a photo of sks shape", "a photo of a shape"]
    config = load_config(config_path("diffusion.yaml"), [
        *TINY, f"run_dir={tmp_path / 'run'}", f"data.shards={shapes_dir}", f"model.pretrained={pretrained}",
        "model.vae=null", "mode=dreambooth", "dreambooth.lora=true", f"dreambooth.instance_prompt={prompts[0]}",
        f"dreambooth.class_prompt={prompts[1]}", "dreambooth.num_class_images=2", "dreambooth.generation_steps=1",
        "dreambooth.class_batch_size=2", "train.max_steps=1", f"validation.prompts=[{prompts[0]}]",
        "validation.steps=2"])
    trainer = Trainer(config)
    task = trainer.task
    assert next(task.text_encoder.parameters()).is_meta
    assert sorted(task.prompt_embeddings) == sorted(prompts)
    batch = trainer.data.next()
    assert sorted(set(batch["captions"])) == sorted(prompts)
    encoder = task.frozen("text_encoder")
    expected = task.family.conditioner.encode_text([encoder], [batch["input_ids"]], batch["captions"])["text_emb"]
    torch.testing.assert_close(task.conditioning(batch)["encoder_hidden_states"], expected, atol=1e-5, rtol=1e-5)
    trainer.train()
    assert (tmp_path / "run" / "samples" / "step_00000001.png").is_file()
    assert next(task.text_encoder.parameters()).is_meta  # validation's copy was not kept


def test_dreambooth_cache_latents_encodes_once_and_trains_as_the_vae_would(tmp_path, pretrained, shapes_dir, caplog,
                                                                         capsys):
    import json

    from sdtrain.cli.main import main

    caplog.set_level("INFO")
    common = ["dreambooth.instance_prompt=a photo of sks shape", "dreambooth.class_prompt=a photo of a shape",
              "dreambooth.num_class_images=2", "dreambooth.generation_steps=1", "dreambooth.class_batch_size=2",
              "dreambooth.lora=true", "train.max_steps=1"]
    finetune(tmp_path / "online", pretrained, shapes_dir, "dreambooth", *common)
    caplog.clear()
    cached = [*common, "dreambooth.cache_latents=true", f"dreambooth.class_data={tmp_path / 'online' / 'class_images'}"]
    finetune(tmp_path / "cached", pretrained, shapes_dir, "dreambooth", *cached)
    assert "VAE encoder skipped" in caplog.text
    folders = list((tmp_path / "cached" / "cached_latents").iterdir())
    assert len(folders) == 2 and all((f / "manifest.json").is_file() for f in folders)  # instance and class images
    losses = [json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
              for run in ("online", "cached")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    # Started again, it reads the same latents without encoding anything.
    caplog.clear()
    finetune(tmp_path / "cached", pretrained, shapes_dir, "dreambooth", *cached, "train.max_steps=2")
    assert "cache_latents:" not in caplog.text and list((tmp_path / "cached" / "cached_latents").iterdir()) == folders
    # A flip would need another latent each time: refused in one line before anything loads.
    capsys.readouterr()
    assert main(["train", str(config_path("diffusion.yaml")), *TINY, f"run_dir={tmp_path / 'flip'}", "mode=dreambooth",
                 f"data.shards={shapes_dir}", f"model.pretrained={pretrained}", "model.vae=null", *cached,
                 "data.random_flip=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert "data.random_flip" in err and "cache_latents" in err and "\n" not in err
