"""val_loss, MLPerf's Flux.1 quality metric (the loss on held-out shards at 8 fixed timesteps and fixed noise), and
the MLPerf Flux.1-schnell recipe that evaluates it in the loop."""

from __future__ import annotations

import copy
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrain.checkpoint import latest_checkpoint
from sdtrain.cli.main import main
from sdtrain.config import DiffusionConfig, FlowConfig, ModelConfig, load_config
from sdtrain.data.encoded import dataset_encoding
from sdtrain.errors import UserError
from sdtrain.evaluate.run import EvalSettings, Evaluator, target_met
from sdtrain.evaluate.val_loss import ValLoss, my_blocks, sample_noise, timestep_of
from sdtrain.models import build, families
from sdtrain.train.modes import make_task

from .conftest import TINY

RECIPES = Path(__file__).resolve().parents[1] / "configs"
FLUX_RECIPE = RECIPES / "mlperf-flux1-schnell-256.yaml"
CPU = torch.device("cpu")
# The recipe at test size: tiny parts (schnell's structure: no guidance embedding), 32 T5 tokens, 32 px, the shapes
# data.
TINY_FLUX = [*TINY, "model.preset=tiny", "model.transformer_overrides.guidance_embeds=false", "model.t5_text_length=32"]


def _tiny_pipeline(folder: Path, shapes_dir: Path, family: str) -> Path:
    """A pipeline folder of randomly initialised tiny parts, standing in for the frozen VAE and text encoders
    (Flux.1-schnell's for flux, SD2's for sd); made in seconds."""
    from sdtrain.data.pipeline import read_captions
    from sdtrain.models.tokenizer import train_clip_tokenizer

    tokenizer = train_clip_tokenizer(read_captions(str(shapes_dir), "txt"), folder / "tokenizer", 600, 77)
    model = ModelConfig(family=family, preset="tiny")
    spec = families.get(family)
    torch.manual_seed(0)
    vae = build.build_vae(model)
    # Flux's T5 tokenizer reads as many tokens as TINY_FLUX's (and `prepare encode` then writes as many).
    t5 = copy.deepcopy(tokenizer)
    t5.model_max_length = 32
    tokenizers = [tokenizer, t5][: len(spec.components.text_encoders)]
    text_encoders = {name: build.build_text_encoder(model, tok, name)
                     for name, tok in zip(spec.components.text_encoders, tokenizers)}
    denoiser = build.build_denoiser(model, vae.config.latent_channels, 8, text_encoders=text_encoders)
    diffusion = DiffusionConfig(flow=FlowConfig(shift=1.0)) if family == "flux" else DiffusionConfig()
    scheduler = build.build_noise_scheduler(diffusion, model)
    pipe = spec.sampling.assemble({"vae": vae, **text_encoders, spec.components.denoiser: denoiser}, tokenizers,
                                  scheduler)
    pipe.save_pretrained(folder / "pipeline")
    return folder / "pipeline"


@pytest.fixture(scope="module")
def flux_pipeline(tmp_path_factory, shapes_dir) -> Path:
    return _tiny_pipeline(tmp_path_factory.mktemp("flux-pipeline"), shapes_dir, "flux")


@pytest.fixture(scope="module")
def sd_pipeline(tmp_path_factory, shapes_dir) -> Path:
    return _tiny_pipeline(tmp_path_factory.mktemp("sd-pipeline"), shapes_dir, "sd")


@pytest.fixture(scope="module")
def flux_encoded(tmp_path_factory, shapes_dir, flux_pipeline) -> Path:
    """The shapes shards encoded as the recipe's header says, with the pipeline that gives model.vae and the text
    encoders."""
    out = tmp_path_factory.mktemp("flux-encoded") / "encoded"
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(flux_pipeline), "--resolution", "32",
                 "--out", str(out)]) == 0
    return out


def flux_config(run: Path, pipeline: Path, shards: Path, *overrides: str):
    """The recipe at test size, its transformer from scratch with diffusers' initialisation: the recipe's own
    (the reference's) outputs zero until trained, a loss that no input, timestep or text embedding would change."""
    return load_config(FLUX_RECIPE, [f"run_dir={run}", f"data.shards={shards}", f"evaluation.val_shards={shards}",
                                     *(f"model.{c}={pipeline}" for c in ("vae", "text_encoder", "text_encoder_2")),
                                     *TINY_FLUX, "model.denoiser_init=library", *overrides])


def sd_config(run: Path, pipeline: Path, shards: Path, *overrides: str):
    """MLPerf's SD2 recipe (v-prediction on a DDPM schedule) at test size, scored by val_loss instead of FID."""
    return load_config(RECIPES / "mlperf-sd2-512.yaml", [
        f"run_dir={run}", f"data.shards={shards}", *(f"model.{c}={pipeline}" for c in ("vae", "text_encoder",
                                                                                      "tokenizer")),
        *TINY, "model.preset=tiny", "evaluation.metrics=[val_loss]", f"evaluation.val_shards={shards}",
        "evaluation.prompts=null", "evaluation.reference=null", "evaluation.inception=null", "evaluation.clip=null",
        "data.caption_dropout=0.1", *overrides])


def task_and_loss(config, run: Path, rank: int = 0, world: int = 1):
    torch.manual_seed(0)  # the denoiser built from scratch: the same weights in every call
    task = make_task(config, CPU, run)
    return task, ValLoss(task, config.evaluation, CPU, rank, world)


def held_out(shards: Path, count: int) -> list[tuple[np.ndarray, str]]:
    """The first `count` samples of image shards (tars in name order, samples in tar order), read with tarfile."""
    samples: list[tuple[np.ndarray, str]] = []
    for path in sorted(shards.glob("*.tar")):
        with tarfile.open(path) as tar:
            files: dict[str, dict[str, bytes]] = {}
            for member in tar.getmembers():
                key, ext = member.name.rsplit(".", 1)
                files.setdefault(key, {})[ext] = tar.extractfile(member).read()
        for fields in files.values():
            with Image.open(io.BytesIO(fields["png"])) as image:
                pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 127.5 - 1  # already 32 px
            samples.append((pixels, fields["txt"].decode().strip().splitlines()[0]))  # a pair's first phrasing
    return samples[:count]


@torch.no_grad()
def loss_by_hand(task, shards: Path, count: int, seed: int = 0, timesteps: int = 8, posterior: bool = False
                 ) -> float:
    """Sample i at t = (i mod 8) / 8 with its fixed noise: mixed, predicted and compared one sample at a time, the
    per-timestep means averaged. `posterior`: each latent a draw of the VAE posterior from its own fixed noise."""
    family, vae = task.family, task.vae
    per_timestep: dict[int, list[float]] = {}
    for index, (pixels, caption) in enumerate(held_out(shards, count)):
        dist = vae.encode(torch.from_numpy(pixels.transpose(2, 0, 1))[None]).latent_dist
        latent = dist.mode()
        if posterior:
            latent = dist.mean + dist.std * sample_noise(seed, index, tuple(latent.shape[1:]), "posterior")[None]
        x0 = (latent - (vae.config.get("shift_factor") or 0.0)) * vae.config.scaling_factor
        noise = sample_noise(seed, index, tuple(x0.shape[1:]))[None]
        k = index % timesteps
        ids = task.caption_tokenizer([caption])
        text = family.conditioner.encode_text(list(task.text_encoders.values()), list(ids.values()), [caption])
        condition = family.denoising.condition(text, {"size_ids": torch.tensor([[32, 32, 0, 0, 32, 32]])}, CPU)
        if family.denoising.objective == "flow_matching":
            sigma = k / timesteps
            noisy, t, target = (1 - sigma) * x0 + sigma * noise, torch.tensor([sigma * 1000]), noise - x0
        else:  # v-prediction on the DDPM schedule, at timestep k/8 of its 1000
            t = torch.tensor([k * 1000 // timesteps])
            alpha = task.noise_scheduler.alphas_cumprod[t].float()
            noisy = alpha.sqrt() * x0 + (1 - alpha).sqrt() * noise
            target = alpha.sqrt() * noise - (1 - alpha).sqrt() * x0
        output = family.denoising.denoise(task.denoiser, noisy, t, condition).float()
        per_timestep.setdefault(k, []).append(float(((output - target) ** 2).mean()))
    return float(np.mean([np.mean(losses) for losses in per_timestep.values()]))


@pytest.mark.parametrize("family", ["flux", "sd"])
def test_val_loss_is_the_mean_of_eight_fixed_timestep_losses_computed_by_hand(tmp_path, shapes_dir, flux_pipeline,
                                                                              sd_pipeline, family):
    make = flux_config if family == "flux" else sd_config
    pipeline = flux_pipeline if family == "flux" else sd_pipeline
    # Flux, 20 samples: timesteps 0-3 get three, 4-7 two, and batches of 3 mix timesteps and cross a shard boundary
    # (16 samples a shard). SD's UNet is slower: one sample per timestep.
    num = 20 if family == "flux" else 8
    config = make(tmp_path, pipeline, shapes_dir, f"evaluation.num={num}", "evaluation.batch=3")
    assert config.data.caption_dropout > 0  # ...which held-out samples must not see: the by-hand loss has none
    task, val_loss = task_and_loss(config, tmp_path)
    result = val_loss(task.trainable)
    assert result["val_samples"] == num and list(result["val_loss_by_timestep"]) == [f"{k}/8" for k in range(8)]
    assert result["val_loss"] == pytest.approx(loss_by_hand(task, shapes_dir, num), rel=1e-5)
    # The same weights score the same number again: noise, latents and captions are all fixed.
    assert val_loss(task.trainable)["val_loss"] == result["val_loss"]


def test_val_loss_may_sample_the_posterior_as_the_reference_does_and_says_so(tmp_path, shapes_dir, flux_pipeline):
    from sdtrain.evaluate.run import flat_metrics

    mean = flux_config(tmp_path, flux_pipeline, shapes_dir, "evaluation.num=8")
    sample = flux_config(tmp_path, flux_pipeline, shapes_dir, "evaluation.num=8", "evaluation.val_posterior=sample")
    task, by_mean = task_and_loss(mean, tmp_path)
    _, by_sample = task_and_loss(sample, tmp_path)
    drawn = by_sample(task.trainable)
    assert drawn["val_loss"] == pytest.approx(loss_by_hand(task, shapes_dir, 8, posterior=True), rel=1e-5)
    assert drawn["val_loss"] != by_mean(task.trainable)["val_loss"]
    assert by_sample(task.trainable)["val_loss"] == drawn["val_loss"]  # the draws are fixed: repeatable
    assert flat_metrics(drawn)["val_posterior_sampled"] == 1.0
    assert flat_metrics(by_mean(task.trainable))["val_posterior_sampled"] == 0.0


def test_val_loss_depends_on_neither_batch_size_nor_rank_count(tmp_path, shapes_dir, flux_pipeline):
    def value(batch: int, world: int = 1) -> float:
        config = flux_config(tmp_path, flux_pipeline, shapes_dir, "evaluation.num=10", f"evaluation.batch={batch}")
        parts = []
        for rank in range(world):
            task, val_loss = task_and_loss(config, tmp_path, rank, world)
            parts.append(val_loss.score(task.trainable))
        assert sorted(i for part in parts for i, _, _ in part[0]) == list(range(10))  # each sample once
        return val_loss.summarise(parts)["val_loss"]

    one = value(3)
    # Ranks take whole blocks of the same 3, so each sample is computed exactly as in one process.
    assert value(3, world=2) == value(3, world=3) == one
    # Other batch sizes change only the rounding of batched kernels.
    assert value(1) == pytest.approx(one, rel=1e-5) and value(10) == pytest.approx(one, rel=1e-5)


def test_blocks_split_the_samples_into_contiguous_runs_per_rank():
    assert my_blocks(10, 3, 0, 1) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert my_blocks(10, 3, 0, 2) == [[0, 1, 2], [3, 4, 5]] and my_blocks(10, 3, 1, 2) == [[6, 7, 8], [9]]
    assert [my_blocks(2, 4, rank, 3) for rank in range(3)] == [[], [], [[0, 1]]]  # more ranks than blocks


def test_a_samples_json_may_fix_its_timestep():
    # MLPerf's COCO shards name each sample's timestep k (of 8) in its json; without one, k = i mod 8.
    assert timestep_of({"json": b'{"id": "1", "timestep": 5}'}, 0, 8) == 5
    assert timestep_of({"json": b'{"id": "1"}'}, 11, 8) == 3 and timestep_of({}, 2, 8) == 2
    assert timestep_of({"json": b'{"timestep": 8}'}, 11, 8) == 3 and timestep_of({"json": b"[1]"}, 9, 8) == 1


def test_encoded_held_out_shards_give_the_loss_of_their_images(tmp_path, shapes_dir, flux_pipeline, flux_encoded):
    plain = flux_config(tmp_path, flux_pipeline, shapes_dir, "evaluation.num=16")
    encoded = flux_config(tmp_path, flux_pipeline, flux_encoded, "evaluation.num=16")
    task, from_images = task_and_loss(plain, tmp_path / "plain")
    other, from_latents = task_and_loss(encoded, tmp_path / "encoded")
    assert from_latents.encoded and from_latents.text_embeddings and not from_images.encoded
    # The shards store latents and embeddings in float16.
    assert from_latents(other.trainable)["val_loss"] == pytest.approx(from_images(task.trainable)["val_loss"],
                                                                      rel=1e-2)


def test_held_out_shards_of_another_vae_are_one_clear_line(tmp_path, shapes_dir, flux_pipeline, flux_encoded):
    other = tmp_path / "other-pipeline"
    shutil.copytree(flux_pipeline, other)
    config = flux_config(tmp_path, other, shapes_dir, f"evaluation.val_shards={flux_encoded}")
    with pytest.raises(UserError, match=r"^evaluation\.val_shards: the latents in .* were encoded with the VAE"):
        task_and_loss(config, tmp_path)


def test_val_loss_settings_are_checked_at_load(tmp_path):
    base = ["stage=diffusion", f"run_dir={tmp_path}", "data.shards=/data", "evaluation.every_samples=8",
            "evaluation.metrics=[val_loss]"]
    with pytest.raises(UserError, match=r"^evaluation\.val_shards: required for val_loss"):
        load_config(None, base)
    with pytest.raises(UserError, match=r"^evaluation\.val_timesteps: must be at least 1"):
        load_config(None, [*base, "evaluation.val_shards=/held-out", "evaluation.val_timesteps=0"])
    # No prompts needed without fid or clip; val_loss is a target key, met at or below it like FID.
    config = load_config(None, [*base, "evaluation.val_shards=/held-out", "evaluation.target.val_loss=0.586"])
    assert config.evaluation.target == {"val_loss": 0.586}
    assert target_met({"val_loss": 0.586}, {"val_loss": 0.586}) and not target_met({"val_loss": 0.6},
                                                                                    {"val_loss": 0.586})
    with pytest.raises(UserError, match=r"^evaluation\.metrics: choose from fid, clip, adherence, val_loss"):
        load_config(None, [*base, "evaluation.metrics=[loss]"])
    # `sdtrain evaluate` scores saved pipelines by their images: it says where val_loss is measured instead.
    with pytest.raises(UserError, match=r"^metrics: val_loss is the training loss on held-out shards, measured in"):
        Evaluator(["a red circle"], EvalSettings(["val_loss"]), CPU)


REQUIRED = ["data.shards", "evaluation.val_shards",
            *(f"model.components.{name}.source" for name in ("vae", "text_encoder", "text_encoder_2"))]


def test_flux_recipe_has_the_reference_figures():
    config = load_config(FLUX_RECIPE, ["run_dir=/runs/flux", *(f"{key}=/given" for key in REQUIRED)])
    model, diffusion, optim = config.model, config.diffusion, config.optim
    assert (model.family, model.preset, model.t5_text_length, config.data.resolution) == ("flux", "flux-schnell",
                                                                                          256, 256)
    # The transformer is built from scratch; VAE, CLIP and T5 come from the given folder and stay frozen.
    assert model.pretrained is None and build.component_source(model, "transformer") is None
    assert not diffusion.train_text_encoder and config.data.use_encoded
    assert (diffusion.timestep_sampling, diffusion.flow.shift, diffusion.flow.loss_weighting) == ("uniform", 1.0,
                                                                                                   "none")
    assert config.data.caption_dropout == 0.1 and config.train.mixed_precision == "bf16"
    assert (optim.lr, optim.warmup_steps, optim.schedule, optim.grad_clip) == (1e-4, 0, "constant", 1.0)
    assert (optim.betas, optim.eps, optim.weight_decay) == ([0.9, 0.95], 1e-8, 0.1)
    assert not config.ema.enabled and config.train.max_steps == 30000
    ev = config.evaluation
    assert (ev.metrics, ev.every_samples, ev.val_timesteps, ev.num) == (["val_loss"], 262144, 8, 0)
    assert ev.target == {"val_loss": 0.586}
    with torch.device("meta"):
        transformer = build.build_denoiser(model, 16, 32, derived={"joint_attention_dim": 4096,
                                                                   "pooled_projection_dim": 768})
    assert build.count_parameters(transformer) == 11_891_178_560  # Flux.1-schnell's


@pytest.mark.parametrize("left_out", REQUIRED)
def test_every_path_the_flux_recipe_needs_is_asked_for_by_name(left_out):
    given = [f"{key}=/given" for key in REQUIRED if key != left_out]
    with pytest.raises(UserError, match=left_out.replace(".", r"\.")):
        load_config(FLUX_RECIPE, ["run_dir=/runs/flux", *given])


def test_flux_recipe_trains_at_tiny_size_on_encoded_shards_until_the_val_loss_target(tmp_path, flux_pipeline,
                                                                                     flux_encoded):
    run = tmp_path / "flux"
    # Only the model size and the data shrink; a target any loss meets ends the run at the first evaluation.
    assert main(["train", str(FLUX_RECIPE), f"run_dir={run}", f"data.shards={flux_encoded}",
                 f"evaluation.val_shards={flux_encoded}",
                 *(f"model.{c}={flux_pipeline}" for c in ("vae", "text_encoder", "text_encoder_2")), *TINY_FLUX,
                 "train.max_steps=6", "evaluation.every_samples=8", "evaluation.num=16", "evaluation.batch=8",
                 "evaluation.target.val_loss=1e9"]) == 0
    reached = json.loads((run / "target.json").read_text())
    assert (reached["step"], reached["samples"], reached["target"]) == (2, 8, {"val_loss": 1e9})
    assert 0 < reached["metrics"]["val_loss"] < 1e9
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "val_loss" in line] == [2]
    assert latest_checkpoint(run).name == "step_00000002"  # stopped there, saved
    saved = load_config(run / "config.yaml")
    assert (saved.model.family, saved.evaluation.metrics, saved.optim.lr) == ("flux", ["val_loss"], 1e-4)


def test_in_loop_val_loss_scores_the_ema_weights(tmp_path, flux_pipeline, flux_encoded):
    run = tmp_path / "flux-ema"
    common = [f"data.shards={flux_encoded}", f"evaluation.val_shards={flux_encoded}",
              *(f"model.{c}={flux_pipeline}" for c in ("vae", "text_encoder", "text_encoder_2")), *TINY_FLUX,
              "evaluation.num=8", "evaluation.batch=8"]
    assert main(["train", str(FLUX_RECIPE), f"run_dir={run}", *common, "ema.enabled=true", "train.max_steps=2",
                 "evaluation.every_samples=8"]) == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    in_loop = next(line["val_loss"] for line in logged if "val_loss" in line)
    # The run's transformer as a source is its EMA weights (the raw ones differ after 2 steps): scored offline,
    # the same number.
    config = load_config(FLUX_RECIPE, [f"run_dir={tmp_path / 'offline'}", *common, f"model.transformer={run}"])
    task, val_loss = task_and_loss(config, tmp_path / "offline")
    task.use_encoded(dataset_encoding(str(flux_encoded))[0])  # as the trainer does: the shards' text embeddings
    assert val_loss(task.trainable)["val_loss"] == pytest.approx(in_loop, rel=1e-6)


@pytest.mark.dist
@pytest.mark.slow  # two ranks of the Flux recipe: the default run keeps under CI's 15 minutes
def test_val_loss_under_two_gloo_ranks_is_the_number_of_one_process(tmp_path, flux_pipeline, flux_encoded):
    import os
    import signal
    import subprocess
    import sys

    run = tmp_path / "two"
    common = [f"data.shards={flux_encoded}", f"evaluation.val_shards={flux_encoded}",
              *(f"model.{c}={flux_pipeline}" for c in ("vae", "text_encoder", "text_encoder_2")), *TINY_FLUX,
              "evaluation.num=7", "evaluation.batch=3"]
    # The recipe's FSDP on 2 ranks, each scoring its blocks of 3: [0-2] and [3-5, 6]. Sharded forward passes are
    # collectives, so rank 0 makes a second one it discards (were it missing, the ranks would wait: hence the short
    # timeout).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "sdtrain", "train", str(FLUX_RECIPE), f"run_dir={run}", *common, "train.max_steps=1",
               "evaluation.every_samples=8", "parallel.backend=gloo", "parallel.timeout_minutes=2"]
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, err = process.communicate()
    assert process.returncode == 0, err[-3000:]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged if "val_loss" in line] == [1]  # 2 ranks x 4 = 8 samples a step
    in_loop = next(line["val_loss"] for line in logged if "val_loss" in line)
    # The run's final weights (no EMA in the recipe), scored by one process.
    config = load_config(FLUX_RECIPE, [f"run_dir={tmp_path / 'one'}", *common, f"model.transformer={run}"])
    task, val_loss = task_and_loss(config, tmp_path / "one")
    assert val_loss(task.trainable)["val_loss"] == pytest.approx(in_loop, rel=1e-5)
