"""The published pretraining recipes (MLPerf's SD2 at 512 px, NeMo's SD 860M at 256 px): their figures are the
sources', and each trains at tiny size when only the model size and the data are overridden."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sdtrain.checkpoint import latest_checkpoint
from sdtrain.cli.main import main
from sdtrain.config import load_config
from sdtrain.models import build

from .conftest import TINY

RECIPES = Path(__file__).resolve().parents[1] / "configs"
MODEL_PATHS = [f"model.components.{name}.source=/models/{folder}"
               for name, folder in (("vae", "vae"), ("text_encoder", "text"), ("tokenizer", "text"))]
EVAL_PATHS = ["evaluation.prompts=/coco/val2014_30k.tsv", "evaluation.reference=/coco/val2014_512x512_30k_stats.npz",
              "evaluation.inception=/w/pt_inception-2015-12-05-6726825d.pth", "evaluation.clip=/w/clip"]


def recipe(name: str, *given: str):
    return load_config(RECIPES / f"{name}.yaml", [f"run_dir=/runs/{name}", "data.shards=/data", *given])


def unet_parameters(config, context_dim: int) -> int:
    with torch.device("meta"):
        unet = build.build_unet(config.model, 4, config.data.resolution // 8, context_dim)
    return build.count_parameters(unet)


def test_mlperf_recipe_has_the_reference_figures():
    config = recipe("mlperf-sd2-512", *MODEL_PATHS, *EVAL_PATHS)
    assert (config.data.resolution, config.diffusion.ddpm.prediction_type) == (512, "v_prediction")
    # The UNet is built from scratch (the checkpoint's UNet is discarded); VAE and text encoder are frozen.
    assert config.model.pretrained is None and build.component_source(config.model, "unet") is None
    assert not config.diffusion.train_text_encoder
    assert unet_parameters(config, 1024) == 865_910_724  # SD2's UNet, OpenCLIP ViT-H's 1024-wide context
    # Global batch 2 x 256 GPUs = 512 and lr 1.25e-7 x 512; warm-up 1000 steps; torch AdamW defaults; no EMA.
    assert config.data.batch_size * 32 * 8 * config.train.grad_accum == 512
    assert config.optim.lr == pytest.approx(1.25e-7 * 512)
    assert (config.optim.warmup_steps, config.optim.schedule) == (1000, "constant")
    assert (config.optim.betas, config.optim.weight_decay, config.optim.eps) == ([0.9, 0.999], 0.01, 1e-8)
    assert not config.ema.enabled and config.data.use_encoded
    ev = config.evaluation
    assert (ev.every_samples, ev.metrics, ev.scheduler, ev.steps, ev.guidance) == (512000, ["fid", "clip"], "ddim",
                                                                                  50, 8.0)
    assert ev.target == {"fid": 90, "clip": 0.15}


def test_nemo_recipe_has_the_published_figures():
    config = recipe("nemo-sd-res256", *MODEL_PATHS)
    assert (config.data.resolution, config.diffusion.ddpm.prediction_type) == (256, "epsilon")
    assert config.model.pretrained is None and build.component_source(config.model, "unet") is None
    # SD 1.x's UNet (8 heads, 1x1-conv projections, CLIP ViT-L/14's 768-wide context): NeMo's "860M".
    assert unet_parameters(config, 768) == 859_520_964
    # micro-batch 128, 8192 a step on 2 nodes x 8 GPUs.
    assert config.data.batch_size == 128 and 8192 % (config.data.batch_size * 16) == 0
    assert config.optim.lr == pytest.approx(8.192e-5)
    assert (config.optim.warmup_steps, config.optim.weight_decay, config.optim.grad_clip) == (10000, 0.0, 1.0)
    assert (config.ema.enabled, config.ema.decay, config.ema.warmup) == (True, 0.9999, False)
    assert config.train.max_steps == 82500 and not config.diffusion.train_text_encoder


REQUIRED = [
    *(("mlperf-sd2-512", key) for key in [*MODEL_PATHS, *EVAL_PATHS]),
    *(("nemo-sd-res256", key) for key in MODEL_PATHS),
]


@pytest.mark.parametrize(("name", "left_out"), REQUIRED)
def test_every_path_a_recipe_needs_is_asked_for_by_name(name, left_out):
    from sdtrain.errors import UserError

    given = [*MODEL_PATHS, *EVAL_PATHS] if name.startswith("mlperf") else MODEL_PATHS
    key = left_out.split("=")[0]
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        recipe(name, *(g for g in given if g != left_out))


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory, shapes_dir) -> Path:
    """A diffusers pipeline folder of randomly initialised tiny parts, standing in for the recipes' frozen VAE and
    text encoder (77 positions, as CLIP's): made in seconds, where conftest's trained `pretrained` takes a minute."""
    from sdtrain.config import DiffusionConfig, ModelConfig
    from sdtrain.data.pipeline import read_captions
    from sdtrain.models.pipeline import assemble_pipeline
    from sdtrain.models.tokenizer import train_clip_tokenizer

    tmp = tmp_path_factory.mktemp("tiny-pipeline")
    tokenizer = train_clip_tokenizer(read_captions(str(shapes_dir), "txt"), tmp / "tokenizer", 600, 77)
    model = ModelConfig(preset="tiny")
    torch.manual_seed(0)
    vae, text_encoder = build.build_vae(model), build.build_text_encoder(model, tokenizer)
    unet = build.build_unet(model, vae.config.latent_channels, 8, text_encoder.config.hidden_size)
    pipe = assemble_pipeline(vae, text_encoder, tokenizer, unet, build.build_noise_scheduler(DiffusionConfig()))
    pipe.save_pretrained(tmp / "pipeline")
    return tmp / "pipeline"


def _tiny(name: str, run: Path, *overrides: str) -> None:
    """Train `name` for 2 steps with only the model size and the data overridden (and TINY's test settings)."""
    assert main(["train", str(RECIPES / f"{name}.yaml"), f"run_dir={run}", *TINY, "model.preset=tiny",
                 "train.max_steps=2", *overrides]) == 0
    assert latest_checkpoint(run).name == "step_00000002"


def test_mlperf_recipe_trains_at_tiny_size_on_encoded_shards_and_evaluates_in_the_loop(tmp_path, tiny_pipeline,
                                                                                       shapes_dir):
    pretrained = tiny_pipeline
    encoded = tmp_path / "encoded"
    # The recipe's own data path: `sdtrain prepare encode` with the folder that gives model.vae/text_encoder.
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(pretrained), "--resolution", "32",
                 "--out", str(encoded)]) == 0
    run = tmp_path / "mlperf"
    _tiny("mlperf-sd2-512", run, f"data.shards={encoded}", *(f"model.{c}={pretrained}" for c in
                                                             ("vae", "text_encoder", "tokenizer")),
          # FID and CLIP need weights that cannot be downloaded here: the shapes adherence score instead.
          "evaluation.every_samples=8", "evaluation.metrics=[adherence]", "evaluation.prompts=null",
          "evaluation.reference=null", "evaluation.inception=null", "evaluation.clip=null", "evaluation.num=2",
          "evaluation.steps=2", "evaluation.batch=2")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "adherence_overall" in line] == [2]
    saved = load_config(run / "config.yaml")
    assert (saved.diffusion.ddpm.prediction_type, saved.optim.lr, saved.ema.enabled) == ("v_prediction", 6.4e-5, False)
    assert saved.evaluation.target == {"fid": 90, "clip": 0.15}  # not met by adherence alone: ran to the end
    assert not (run / "target.json").exists()


def test_nemo_recipe_trains_at_tiny_size(tmp_path, tiny_pipeline, shapes_dir):
    pretrained, run = tiny_pipeline, tmp_path / "nemo"
    _tiny("nemo-sd-res256", run, f"data.shards={shapes_dir}", f"model.vae={pretrained / 'vae'}",
          f"model.text_encoder={pretrained / 'text_encoder'}", f"model.tokenizer={pretrained / 'tokenizer'}")
    saved = load_config(run / "config.yaml")
    assert (saved.diffusion.ddpm.prediction_type, saved.ema.decay,
            saved.model.overrides("unet")["attention_head_dim"]) == ("epsilon", 0.9999, 8)
