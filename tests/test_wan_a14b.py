"""Wan 2.2 A14B: two experts over shares of the timesteps, a run training one. Tiny, on the CPU: each expert's
sigmas drawn inside its share (and again on resume), the family told apart from Wan 2.1's folders, `model.expert`
refused in one line where it names nothing, and from the CLI a run of the low-noise expert alone whose export
WanPipeline samples with both experts and whose LoRA loads into the low-noise one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sdtrain.config import DiffusionConfig, ModelConfig, load_config
from sdtrain.models import build, families
from sdtrain.models.families.wan_a14b import BOUNDARY, WAN22_A14B
from sdtrain.train.objectives import FlowMatching
from sdtrain.train.tasks import capability_problems, expert_problems

FINETUNE = ["optim.lr=0.01", "optim.warmup_steps=0", "model.t5_text_length=16", "data.resolution=32",
            "data.aspect_buckets=false", "data.num_workers=0", "train.mixed_precision=fp32", "ema.enabled=false",
            "logging.tensorboard=false", "logging.progress=false", "validation.prompts=[]",
            "evaluation.every_samples=0", "data.batch_size=2"]


def _objective(share: tuple[float, float], shift: float = 3.0) -> FlowMatching:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatching(DiffusionConfig(timestep_sampling="logit_normal"),
                        FlowMatchEulerDiscreteScheduler(shift=shift), torch.device("cpu"), share=share)


@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_each_expert_draws_its_sigmas_inside_its_share_and_a_resume_draws_the_same(expert):
    share = WAN22_A14B.experts.share(expert, BOUNDARY)
    assert share == ((BOUNDARY, 1.0) if expert == "high_noise" else (0.0, BOUNDARY))
    objective = _objective(share)
    generator = torch.Generator().manual_seed(0)
    sigmas = torch.cat([objective.sample_sigmas(8, generator) for _ in range(20)])
    low, high = share
    assert sigmas.numel() == 160 and bool(((sigmas >= low) & (sigmas <= high)).all())
    assert high == 1.0 or bool((sigmas < high).all())  # the boundary itself is the high-noise expert's
    state = generator.get_state()
    again = torch.Generator()
    again.set_state(state)
    torch.testing.assert_close(objective.sample_sigmas(8, generator), objective.sample_sigmas(8, again),
                               rtol=0, atol=0)
    # Every draw of the whole schedule that falls inside the share is kept, in its order: the shape is kept.
    drawn = _objective((0.0, 1.0)).sample_sigmas(64, torch.Generator().manual_seed(1))
    inside = drawn[(drawn >= low) & ((drawn < high) if high < 1 else (drawn <= 1))]
    kept = objective.sample_sigmas(64, torch.Generator().manual_seed(1))
    torch.testing.assert_close(kept[:inside.numel()], inside, rtol=0, atol=0)
    # The held-out loss at fixed fractions k/N scores the expert inside its share too.
    latents = torch.zeros(4, 16, 1, 2, 2)
    noise = torch.ones_like(latents)
    noisy, timesteps, _ = objective.draw_at(latents, noise, torch.tensor([0.0, 0.25, 0.5, 0.75]))
    fixed = noisy.flatten(1)[:, 0]  # sigma x noise, noise being ones
    torch.testing.assert_close(fixed, low + torch.tensor([0.0, 0.25, 0.5, 0.75]) * (high - low))
    assert bool(((fixed >= low) & (fixed < high)).all()) and timesteps.shape == (4,)


def test_a_bad_expert_and_an_expert_of_a_model_without_experts_are_one_line_each():
    bad = expert_problems(ModelConfig(family="wan2.2-a14b", expert="medium_noise"), WAN22_A14B)
    assert bad == ["model.expert: 'medium_noise' is none of this model's experts; choose high_noise or low_noise"]
    none = expert_problems(ModelConfig(family="wan", expert="low_noise"), families.get("wan"))
    assert len(none) == 1 and "\n" not in none[0] and none[0].startswith("model.expert: Wan 2.1 has one denoiser")
    config = load_config(Path("src/sdtrain/configs/wan22-a14b-lora.yaml"),
                         ["run_dir=x", "data.shards=x", "model.pretrained=null", "model.expert=middle"])
    assert capability_problems(config, WAN22_A14B, []) == [bad[0].replace("medium_noise", "middle")]
    assert expert_problems(ModelConfig(family="wan2.2-a14b"), WAN22_A14B) == []


def _pipeline(folder: Path, experts: bool, **config: object) -> Path:
    """A model_index.json as diffusers' WanPipeline writes it, of one transformer or two experts."""
    folder.mkdir(parents=True)
    index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"] if experts else [None, None],
             "boundary_ratio": BOUNDARY if experts else None, "expand_timesteps": False, **config}
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_a_folder_of_two_experts_is_told_from_wan_2_1_and_from_a_model_of_one_transformer(tmp_path):
    assert families.detect(_pipeline(tmp_path / "a14b", True)) is WAN22_A14B
    assert families.detect(_pipeline(tmp_path / "wan21", False)) is families.get("wan")
    # Wan 2.2 TI2V-5B's: one transformer, a timestep per token.
    assert families.detect(_pipeline(tmp_path / "ti2v", False, expand_timesteps=True)) is not WAN22_A14B
    # The trained expert loads from its own folder of such a pipeline folder; its boundary is the folder's.
    folder = _pipeline(tmp_path / "boundary", True, boundary_ratio=0.9)
    model = ModelConfig(pretrained=str(folder))
    assert build.component_source(model, "transformer") == str(folder / "transformer_2")
    model.expert = "high_noise"
    assert build.component_source(model, "transformer") == str(folder / "transformer")
    (folder / "transformer_2").mkdir()
    assert WAN22_A14B.experts.boundary(folder / "transformer_2") == 0.9


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_scratch_command) -> Path:
    """A tiny Wan 2.2 A14B pipeline folder whose two experts differ: one step from scratch, exported (one denoiser
    standing for both experts), its low-noise expert then moved off the high-noise one."""
    from diffusers import WanPipeline

    from sdtrain.cli.main import main

    root = tmp_path_factory.mktemp("a14b")
    assert main(tiny_scratch_command("wan2.2-a14b", root / "run", 1, "model.t5_text_length=16")) == 0
    assert main(["export", str(root / "run"), "--out", str(root / "export")]) == 0
    pipe = WanPipeline.from_pretrained(root / "export")
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in pipe.transformer_2.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    pipe.register_to_config(boundary_ratio=0.9)  # not the release's: what the base says is what is kept
    pipe.save_pretrained(root / "base")
    return root / "base"


def _same(module: torch.nn.Module, other: torch.nn.Module) -> bool:
    theirs = other.state_dict()
    return all(torch.equal(value, theirs[key]) for key, value in module.state_dict().items())


def test_the_low_noise_expert_trains_alone_and_exports_beside_the_base_high_noise_one(base, shapes_dir, tmp_path):
    from diffusers import WanPipeline

    from sdtrain.checkpoint import latest_checkpoint, pinned_sources, read_meta
    from sdtrain.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "src/sdtrain/configs/finetune-full.yaml", f"run_dir={run}", f"model.pretrained={base}",
                 "model.family=wan2.2-a14b", f"data.shards={shapes_dir}", "train.max_steps=2", *FINETUNE]) == 0
    checkpoint = latest_checkpoint(run)
    assert list(read_meta(checkpoint)["modules"]) == ["transformer"]  # the expert alone trained, in its place
    assert Path(pinned_sources(checkpoint)["transformer"]).name == "transformer_2"  # from the low-noise weights
    released = WanPipeline.from_pretrained(base)
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    pipe = WanPipeline.from_pretrained(out)
    assert pipe.config.boundary_ratio == 0.9
    assert _same(pipe.transformer, released.transformer)  # the high-noise expert, as the base has it
    assert not _same(pipe.transformer_2, released.transformer_2)  # the trained one, in the low-noise place
    frames = pipe("a red circle", num_frames=5, height=32, width=32, num_inference_steps=2, guidance_scale=4.0,
                  guidance_scale_2=3.0, max_sequence_length=16, output_type="np",
                  generator=torch.Generator().manual_seed(0)).frames[0]
    assert frames.shape == (5, 32, 32, 3) and bool(torch.isfinite(torch.as_tensor(frames)).all())
    # `generate` samples it as the release does: each expert at its own guidance.
    assert families.of_pipeline(pipe) is WAN22_A14B
    assert WAN22_A14B.sampling.arguments(pipe, 4.0, None)["guidance_scale_2"] == 3.0
    assert main(["generate", "--model", str(out), "--prompt", "a red circle", "--frames", "5", "--steps", "2",
                 "--out", str(tmp_path / "drawn")]) == 0
    assert list((tmp_path / "drawn").glob("*.mp4"))


def test_a_lora_of_the_low_noise_expert_loads_into_it(base, shapes_dir, tmp_path, capsys):
    from diffusers import WanPipeline
    from safetensors import safe_open

    from sdtrain.checkpoint import latest_checkpoint
    from sdtrain.cli.main import main
    from sdtrain.generate import apply_additions

    run = tmp_path / "lora"
    assert main(["train", "src/sdtrain/configs/wan22-a14b-lora.yaml", f"run_dir={run}", f"model.pretrained={base}",
                 f"data.shards={shapes_dir}", "train.max_steps=2", "lora.rank=2", *FINETUNE]) == 0
    out = tmp_path / "adapters"
    assert main(["export", str(run), "--out", str(out)]) == 0
    with safe_open(str(out / "lora_kohya.safetensors"), framework="pt") as file:
        assert all(name.startswith("diffusion_model.") for name in file.keys())  # noqa: SIM118 - no dict
    pipe = WanPipeline.from_pretrained(base)
    pipe.load_lora_weights(out, load_into_transformer_2=True)
    assert getattr(pipe.transformer_2, "peft_config", None) and not getattr(pipe.transformer, "peft_config", None)
    # Its model card loads it as it was loaded here, into the low-noise expert.
    assert "load_into_transformer_2=True)" in (out / "README.md").read_text()
    # So does `generate --lora`, told by the file, as is `generate --lora` of the run's own checkpoint folder.
    for adapters in (out, latest_checkpoint(run)):
        pipe = WanPipeline.from_pretrained(base)
        apply_additions(pipe, [adapters])
        assert getattr(pipe.transformer_2, "peft_config", None) and not getattr(pipe.transformer, "peft_config", None)
    # The run's checkpoints hold the low-noise expert's adapters: resumed as the high-noise one's, refused.
    assert main(["train", "src/sdtrain/configs/wan22-a14b-lora.yaml", f"run_dir={run}", f"model.pretrained={base}",
                 f"data.shards={shapes_dir}", "train.max_steps=3", "lora.rank=2", *FINETUNE,
                 "model.expert=high_noise"]) == 2
    assert "this run trains the low_noise expert" in capsys.readouterr().err
