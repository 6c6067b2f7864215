"""SD3 and Flux.1, the flow-matching transformer families, at tiny size through the CLI: from scratch and every
fine-tuning mode trains, resumes bitwise after kill -9 and exports what plain diffusers loads
(StableDiffusion3Pipeline / FluxPipeline.from_pretrained, load_lora_weights, Flux's kohya file), and what it loads
changes the image."""

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
from sdtrain.models.families.patches import pack, unpack

from .conftest import TINY_CLI, config_path, resumes_bitwise_after_kill_9, run_card, warns_nothing

CONFIGS = config_path("diffusion.yaml").parents[1]
FAMILIES = ["flux", "sd3"]
# From scratch (tiny_scratch_command): the CLIP and T5 encoders and the transformer train, the tokenizers are
# trained on the captions, latents from the 16-channel autoencoder with a latent shift both families build.
SCRATCH = ["checkpoint.every=1", "data.caption_dropout=0.25", "model.t5_text_length=12"]


def _pipeline(family: str, folder: Path):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    cls = FluxPipeline if family == "flux" else StableDiffusion3Pipeline
    return cls.from_pretrained(folder, local_files_only=True)


def _image(pipe, prompt: str = "a red circle") -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt, num_inference_steps=2, guidance_scale=3.0, height=32, width=32, output_type="np",
                max_sequence_length=_t5_length(pipe),
                generator=torch.Generator().manual_seed(0)).images[0]


def _t5_length(pipe) -> int:
    t5 = pipe.tokenizer_3 if type(pipe).__name__.startswith("StableDiffusion3") else pipe.tokenizer_2
    return t5.model_max_length


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, tiny_scratch_run) -> dict[str, Path]:
    runs = {}
    for family in FAMILIES:
        run = tiny_scratch_run(family, tmp_path_factory.mktemp(family) / "scratch", 3, *SCRATCH,
                               "validation.prompts=[a red circle]", "validation.steps=2")
        assert (run / "samples" / "step_00000003.png").is_file()  # validation renders through the family's pipeline
        runs[family] = run
    return runs


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, scratch) -> dict[str, Path]:
    return {family: export_run(run, tmp_path_factory.mktemp(f"{family}-pipeline") / "pipeline")
            for family, run in scratch.items()}


MODES = {
    "full": ("finetune-full.yaml", ["optim.lr=0.01", "optim.warmup_steps=0"]),
    # The family's own recipe (configs/flux-lora.yaml, sd3-lora.yaml) at tiny size.
    "lora": ("{family}-lora.yaml", ["lora.text_encoder=true", "optim.lr=0.01", "data.aspect_buckets=false"]),
    "dreambooth": ("dreambooth.yaml", ["dreambooth.instance_prompt=a sks shape", "dreambooth.class_prompt=a shape",
                                       "dreambooth.num_class_images=2", "dreambooth.generation_steps=2",
                                       "optim.lr=0.01", "optim.warmup_steps=0"]),
}


def _command(mode: str, run: Path, pretrained: Path, shapes_dir: Path, steps: int) -> list[str]:
    config, extra = MODES[mode]
    family = json.loads((pretrained / "model_index.json").read_text())["_class_name"]
    config = config.format(family="flux" if family == "FluxPipeline" else "sd3")
    return ["train", str(CONFIGS / config), f"run_dir={run}", *TINY_CLI, f"model.pretrained={pretrained}",
            f"data.shards={shapes_dir}", f"train.max_steps={steps}", "checkpoint.every=1",
            "data.caption_dropout=0.25", *extra]


# Each case trains three runs; the default suite takes Flux.1's LoRA (a transformer's adapters over a flow
# objective), the rest are slow, as the conformance suite's from-scratch resume of every family but the first.
RESUME_CASES = [("flux", "lora"),
                *[pytest.param(f, m, marks=pytest.mark.slow) for f, m in
                  (("flux", "scratch"), ("flux", "full"), ("flux", "dreambooth"), ("sd3", "full"), ("sd3", "lora"),
                   ("sd3", "scratch"), ("sd3", "dreambooth"))]]


@pytest.mark.parametrize(("family", "mode"), RESUME_CASES)
def test_every_mode_resumes_bitwise_after_kill_9(family, mode, tmp_path, pretrained, shapes_dir,
                                                 tiny_scratch_command):
    def command(run: Path) -> list[str]:
        if mode == "scratch":
            return tiny_scratch_command(family, run, 3, *SCRATCH)
        return _command(mode, run, pretrained[family], shapes_dir, 3)

    resumes_bitwise_after_kill_9(command, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_from_scratch_exports_a_pipeline_diffusers_loads_with_the_training_schedule(family, scratch, pretrained):
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = _pipeline(family, pretrained[family])
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    # The sampler shifts as training did: the tiny presets keep their release's schedule (Flux.1-dev's dynamic
    # shift, SD3's static 3.0).
    if family == "flux":
        assert pipe.scheduler.config.use_dynamic_shifting and pipe.transformer.config.guidance_embeds
        assert type(pipe.text_encoder_2).__name__ == "T5EncoderModel"
    else:
        assert pipe.scheduler.config.shift == 3.0 and not pipe.scheduler.config.use_dynamic_shifting
        assert type(pipe.text_encoder_3).__name__ == "T5EncoderModel"
    assert _t5_length(pipe) == 12
    vae = pipe.vae.config
    assert vae.latent_channels == 16 and vae.shift_factor is not None
    image = _image(pipe)
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_files_load_in_diffusers_and_change_the_image(family, tmp_path, pretrained, shapes_dir):
    run = tmp_path / "lora"
    assert main(_command("lora", run, pretrained[family], shapes_dir, 2)) == 0
    out = export_run(run, tmp_path / "out")
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    # T5 stays frozen, as diffusers' and kohya's scripts leave it: only the CLIPs and the transformer adapt.
    expected = {"flux": {"transformer", "text_encoder"}, "sd3": {"transformer", "text_encoder", "text_encoder_2"}}
    assert {k.split(".")[0] for k in keys} == expected[family]
    before = _image(_pipeline(family, pretrained[family]))
    with_lora = _pipeline(family, pretrained[family])
    with_lora.load_lora_weights(out)
    # Every adapter in the file is attached (diffusers drops those it cannot name, with only a warning).
    from peft.tuners.lora import LoraLayer

    in_file = {k.removeprefix("transformer.").rsplit(".lora", 1)[0] for k in keys if k.startswith("transformer.")}
    attached = {name for name, module in with_lora.transformer.named_modules() if isinstance(module, LoraLayer)}
    assert attached == in_file and any(name.endswith("attn.to_q") for name in attached)
    image = _image(with_lora)
    assert np.abs(image - before).max() > 1e-3
    if family == "flux":
        # kohya's layout: BFL's module names with q, k, v fused (their adapters stacked: rank 3 x 4), alpha
        # included. That diffusers and ComfyUI apply such a file as peft merged it is tests/test_flux_layout.py's.
        kohya = load_file(str(out / "lora_kohya.safetensors"))
        for name, rank in (("double_blocks_0_img_attn_qkv", 48), ("double_blocks_0_txt_attn_qkv", 48),
                           ("single_blocks_0_linear1", 64)):  # q, k, v (and the single block's MLP in) at 16
            assert kohya[f"lora_unet_{name}.lora_down.weight"].shape[0] == rank, name
            assert kohya[f"lora_unet_{name}.alpha"].ndim == 0
        for name in ("double_blocks_0_img_attn_proj", "double_blocks_0_img_mlp_0", "double_blocks_0_txt_mlp_2",
                     "single_blocks_1_linear2"):
            assert f"lora_unet_{name}.lora_up.weight" in kohya, name
        assert any(k.startswith("lora_te1_text_model_encoder_layers_0_") for k in kohya)
    else:
        assert not (out / "lora_kohya.safetensors").exists()  # ComfyUI reads SD3's diffusers file itself


@pytest.mark.parametrize("family", FAMILIES)
def test_a_controlnet_trains_beside_the_frozen_transformer_and_exports_what_diffusers_samples_with(
        family, tmp_path, pretrained, layouts, caplog):
    """SD3's and Flux.1's ControlNets: made from the transformer's first blocks, they read the maps' latents, train
    alone, draw the validation images with the last batch's maps, and export a folder diffusers' own ControlNet
    pipeline and `sdtrain generate --controlnet` sample with."""
    from diffusers import FluxControlNetPipeline, StableDiffusion3ControlNetPipeline
    from PIL import Image

    spec = families.get(family).controlnet
    run = tmp_path / "run"
    assert main(["train", str(CONFIGS / "controlnet.yaml"), f"run_dir={run}", *TINY_CLI,
                 f"model.pretrained={pretrained[family]}", f"data.shards={layouts}", "train.max_steps=2",
                 "optim.lr=0.01", "validation.prompts=[a red circle]", "validation.steps=1"]) == 0
    weights = load_file(str(run / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert weights and all(k.startswith("controlnet.") for k in weights)  # the base is not the run's to save
    assert (run / "samples" / "step_00000002.png").is_file()

    out = export_run(run, tmp_path / "out")
    with warns_nothing(caplog):  # its config is all the ControlNet class's own
        controlnet = spec.model_class.from_pretrained(out / "controlnet")
    for key, value in controlnet.state_dict().items():
        torch.testing.assert_close(value, weights[f"controlnet.{key}"], rtol=0, atol=0, msg=key)
    # The model card's code loads it into the family's ControlNet pipeline on the base: the pipeline sampled below.
    data, made = run_card(out, pretrained[family])
    pipe = made["pipe"]
    assert data.pipeline_tag == "text-to-image" and "controlnet" in data.tags
    assert type(pipe) is (FluxControlNetPipeline if family == "flux" else StableDiffusion3ControlNetPipeline)
    pipe.set_progress_bar_config(disable=True)
    layout = Image.new("RGB", (32, 32))
    layout.paste((230, 30, 30), (4, 8, 14, 18))
    images = [pipe("a red circle", control_image=layout, num_inference_steps=2, height=32, width=32,
                   controlnet_conditioning_scale=scale, max_sequence_length=_t5_length(pipe), output_type="np",
                   generator=torch.Generator().manual_seed(0)).images[0] for scale in (0.0, 1.0)]
    assert np.abs(images[0] - images[1]).max() > 0  # the ControlNet steers
    _steers_as_the_pipeline_does(family, pipe, layout)
    layout.save(tmp_path / "layout.png")
    assert main(["generate", "--model", str(pretrained[family]), "--controlnet", str(tmp_path / "out" / "controlnet"),
                 "--control-image", str(tmp_path / "layout.png"), "--prompt", "a red circle", "--steps", "2",
                 "--size", "32", "--out", str(tmp_path / "images")]) == 0
    assert len(list((tmp_path / "images").glob("*.png"))) == 2  # the image and its grid


def test_a_flux_controlnet_and_lora_adapters_on_its_transformer_train_together_and_load_in_diffusers(
        tmp_path, pretrained, layouts):
    """``mode: [controlnet, lora]`` on Flux.1: adapters on the transformer the ControlNet steers, trained with it;
    FluxControlNetPipeline on the base takes the exported ControlNet and loads the adapters' file whole."""
    from diffusers import FluxControlNetModel, FluxControlNetPipeline
    from PIL import Image

    run = tmp_path / "run"
    assert main(["train", str(CONFIGS / "controlnet.yaml"), f"run_dir={run}", *TINY_CLI, "mode=[controlnet,lora]",
                 f"model.pretrained={pretrained['flux']}", f"data.shards={layouts}", "train.max_steps=2",
                 "optim.lr=0.01", "validation.prompts=[]"]) == 0
    weights = load_file(str(run / "checkpoints" / "step_00000002" / "model.safetensors"))
    adapters = [k for k in weights if k.startswith("transformer.")]
    assert adapters and all(".lora_" in k for k in adapters) and any(k.startswith("controlnet.") for k in weights)
    out = export_run(run, tmp_path / "out")
    pipe = FluxControlNetPipeline.from_pretrained(
        pretrained["flux"], controlnet=FluxControlNetModel.from_pretrained(out / "controlnet"), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    layout = Image.new("RGB", (32, 32))
    layout.paste((230, 30, 30), (4, 8, 14, 18))

    def image() -> np.ndarray:
        return pipe("a red circle", control_image=layout, num_inference_steps=2, height=32, width=32,
                    max_sequence_length=_t5_length(pipe), output_type="np",
                    generator=torch.Generator().manual_seed(0)).images[0]

    without = image()
    pipe.load_lora_weights(out)
    assert len([k for k in pipe.transformer.state_dict() if ".lora_" in k]) == len(adapters)
    assert np.abs(image() - without).max() > 0


def test_flux_learns_to_edit_by_reference_as_kontext_and_its_files_load_in_kontexts_pipeline(tmp_path, pretrained,
                                                                                              edits, caplog):
    """edit.reference on Flux.1 (configs/flux-kontext-lora.yaml): the sources' latent tokens beside the noisy ones
    as FluxKontextPipeline gives them (the denoiser's output as training computes it is the pipeline's), validated
    by editing the last batch's sources; the LoRA loads into FluxKontextPipeline and changes its edit, a full run
    exports a Kontext pipeline folder that `generate --image` edits with; pre-encoded shards keep the sources."""
    from diffusers import FluxKontextPipeline
    from PIL import Image

    run = tmp_path / "lora"
    common = [*TINY_CLI, f"model.pretrained={pretrained['flux']}", "train.max_steps=2", "optim.lr=0.01",
              "data.aspect_buckets=false", "train.mixed_precision=no"]
    assert main(["train", str(CONFIGS / "flux-kontext-lora.yaml"), f"run_dir={run}", *common, f"data.shards={edits}",
                 "validation.prompts=[make it blue]", "validation.steps=1"]) == 0
    assert (run / "samples" / "step_00000002.png").is_file()  # an edit of the last batch's source
    out = export_run(run, tmp_path / "out")
    source = Image.open(edits.parent / "images" / "0.src.png").convert("RGB")

    def edit(pipe) -> np.ndarray:
        pipe.set_progress_bar_config(disable=True)
        return pipe(prompt="make it blue", image=source, num_inference_steps=2, height=32, width=32,
                    max_area=32 * 32, _auto_resize=False, max_sequence_length=_t5_length(pipe), output_type="np",
                    generator=torch.Generator().manual_seed(0)).images[0]

    # The model card lists an editor, and its code loads the LoRA into the pipeline a full run exports (below) on
    # the base, then gives it the image to edit: it edits otherwise than the base.
    data, made = run_card(out, pretrained["flux"])
    assert data.pipeline_tag == "image-to-image" and 'image=load_image("before.png")' in (out / "README.md").read_text()
    pipe = FluxKontextPipeline.from_pretrained(pretrained["flux"], local_files_only=True)
    before = edit(pipe)
    assert type(made["pipe"]) is FluxKontextPipeline and np.abs(edit(made["pipe"]) - before).max() > 1e-4
    _edits_as_the_pipeline_does(pipe, source)

    full = tmp_path / "full"
    assert main(["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={full}", *common, f"data.shards={edits}",
                 "edit.reference=true", "optim.warmup_steps=0"]) == 0
    folder = export_run(full, tmp_path / "full-out")
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == type(made["pipe"]).__name__
    source.resize((64, 16)).save(tmp_path / "source.png")  # wider than tall, as a bucketed run's may be
    assert main(["generate", "--model", str(folder), "--image", str(tmp_path / "source.png"), "--prompt",
                 "make it blue", "--steps", "2", "--out", str(tmp_path / "images")]) == 0
    edited = sorted((tmp_path / "images").glob("0*.png"))
    assert len(edited) == 1 and Image.open(edited[0]).width > Image.open(edited[0]).height  # the source's aspect
    assert main(["generate", "--model", str(pretrained["flux"]), "--image", str(tmp_path / "source.png"),
                 "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "no")]) == 2  # FluxPipeline edits nothing

    # Pre-encoded shards keep the sources: T5 and CLIP stay on disk, the VAE encodes the sources alone.
    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(edits), "--model", str(pretrained["flux"]), "--out", str(encoded),
                 "--t5-text-length", "12"]) == 0
    caplog.set_level("INFO")
    assert main(["train", str(CONFIGS / "flux-kontext-lora.yaml"), f"run_dir={tmp_path / 'on-encoded'}", *common,
                 f"data.shards={encoded}", "model.t5_text_length=12"]) == 0
    assert "pre-encoded shards: text encoder skipped" in caplog.text


def _edits_as_the_pipeline_does(pipe, source) -> None:
    """The denoiser's output with the reference, as training computes it (the family's reference latents and
    denoise), is FluxKontextPipeline's at its first step, given what the pipeline gave its transformer."""
    spec = families.get("flux").reference
    pipe.vae.register_to_config(shift_factor=0.1, scaling_factor=1.3)  # the released models' are not the identity
    with torch.no_grad():  # a model trained longer than three steps: its output far from the initial zero
        for parameter in pipe.transformer.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    seen = {}

    def keep(module, args, kwargs, output) -> None:
        seen.setdefault("call", (kwargs, output[0]))

    hook = pipe.transformer.register_forward_hook(keep, with_kwargs=True)
    try:
        pipe(prompt="make it blue", image=source, num_inference_steps=1, height=32, width=32, max_area=32 * 32,
             _auto_resize=False, max_sequence_length=_t5_length(pipe), output_type="latent",
             generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    kwargs, expected = seen["call"]
    pixels = torch.from_numpy(np.asarray(source, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)[None]
    with torch.no_grad():
        reference = spec.latents(pipe.vae, pixels)
        side = reference.shape[-1]
        tokens = side * side // 4
        noisy = unpack(kwargs["hidden_states"][:, :tokens], side, side)
        condition = {"encoder_hidden_states": kwargs["encoder_hidden_states"],
                     "pooled_projections": kwargs["pooled_projections"], "guidance": kwargs["guidance"],
                     "reference_latents": reference}
        output = families.get("flux").denoising.denoise(pipe.transformer, noisy, kwargs["timestep"] * 1000, condition)
    torch.testing.assert_close(pack(output), expected[:, :tokens], rtol=1e-4, atol=1e-5)


def _steers_as_the_pipeline_does(family: str, pipe, layout) -> None:
    """The denoiser's output with the ControlNet's residuals, as training computes it (the family's conditioner of
    the map, its residuals, its denoise), is the pipeline's at its first step, given what the pipeline gave its
    transformer: the map's latents, shift, pooled text and timestep scale as diffusers' pipeline has them."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    spec = families.get(family).controlnet
    pipe.vae.register_to_config(shift_factor=0.1, scaling_factor=1.3)  # the released models' are not the identity
    seen = {}

    def keep(module, args, kwargs, output):
        seen.setdefault("call", (kwargs, output[0]))

    hook = pipe.transformer.register_forward_hook(keep, with_kwargs=True)
    sample = DiagonalGaussianDistribution.sample
    DiagonalGaussianDistribution.sample = lambda self, generator=None: self.mode()  # SD3's pipeline draws the map's
    try:
        pipe("a red circle", control_image=layout, num_inference_steps=1, height=32, width=32,
             max_sequence_length=_t5_length(pipe), output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        DiagonalGaussianDistribution.sample = sample
        hook.remove()
    kwargs, expected = seen["call"]
    image = torch.from_numpy(np.asarray(layout, dtype=np.float32) / 255).permute(2, 0, 1)[None]
    with torch.no_grad():
        control = spec.control_input(pipe.vae, image)
        side = control.shape[-1]
        condition = {"encoder_hidden_states": kwargs["encoder_hidden_states"],
                     "pooled_projections": kwargs["pooled_projections"]}
        if family == "flux":  # packed tokens and sigma, as FluxPipeline passes them
            noisy, timesteps = unpack(kwargs["hidden_states"], side, side), kwargs["timestep"] * 1000
            condition["guidance"] = kwargs["guidance"]
        else:
            noisy, timesteps = kwargs["hidden_states"], kwargs["timestep"]
        residuals = spec.residuals(pipe.controlnet, noisy, timesteps, condition, control)
        output = families.get(family).denoising.denoise(pipe.transformer, noisy, timesteps, {**condition, **residuals})
    if family == "flux":
        output = pack(output)
    torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["flux", pytest.param("sd3", marks=pytest.mark.slow)])
def test_full_and_dreambooth_exports_change_the_image(family, tmp_path, pretrained, shapes_dir):
    before = _image(_pipeline(family, pretrained[family]))
    for mode in ("full", "dreambooth"):
        run = tmp_path / mode
        assert main(_command(mode, run, pretrained[family], shapes_dir, 2)) == 0
        after = _image(_pipeline(family, export_run(run, tmp_path / f"{mode}-out")))
        assert np.abs(after - before).max() > 1e-3, mode


@pytest.mark.parametrize("family", FAMILIES)
def test_textual_inversion_is_refused_in_one_line(family, tmp_path, pretrained, shapes_dir, capsys):
    assert main(["train", str(CONFIGS / "textual-inversion.yaml"), f"run_dir={tmp_path / 'ti'}", *TINY_CLI,
                 f"model.pretrained={pretrained[family]}", f"data.shards={shapes_dir}", "train.max_steps=1",
                 "textual_inversion.placeholder_token=<shp>", "textual_inversion.initializer_token=circle"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert "textual_inversion learns CLIP token vectors" in error[-1] and "mode: lora" in error[-1]


def test_flux_encoded_shards_hold_t5_states_and_clip_pooled_and_train_as_online(tmp_path, pretrained, shapes_dir,
                                                                                 caplog, capsys):
    from sdtrain.data.encode import Encoder, encode_dataset
    from sdtrain.data.encoded import load_npy
    from sdtrain.data.order import read_shard

    caplog.set_level("INFO")
    folder = pretrained["flux"]
    out = tmp_path / "encoded"
    manifest = encode_dataset(str(shapes_dir), out, Encoder(str(folder), str(folder), 32, torch.device("cpu"),
                                                            "float32"), batch_size=16)
    assert manifest["encoding"]["text_encoder_2"] == str(folder)
    pipe = _pipeline("flux", folder)
    sample = read_shard(str(sorted(out.glob("*.tar"))[0]))[0]
    assert load_npy(sample["text_emb.npy"]).shape == (12, pipe.text_encoder_2.config.d_model)
    assert load_npy(sample["text_pooled.npy"]).shape == (pipe.text_encoder.config.hidden_size,)
    # Caption dropout's stand-in: the empty caption encoded once, as FluxPipeline encodes it (not zeros).
    assert load_npy((out / "empty_caption.text_pooled.npy").read_bytes()).any()

    common = [*TINY_CLI, f"model.pretrained={folder}", "train.max_steps=1", "logging.every=1",
              "data.caption_dropout=0"]
    finetune = str(CONFIGS / "finetune-full.yaml")
    assert main(["train", finetune, f"run_dir={tmp_path / 'online'}", f"data.shards={shapes_dir}", *common]) == 0
    assert main(["train", finetune, f"run_dir={tmp_path / 'encoded'}", f"data.shards={out}", *common]) == 0
    assert "VAE encoder skipped, text encoder skipped" in caplog.text
    losses = [json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
              for run in ("online", "encoded")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)

    # T5's length is the run's: shards encoded at another are one line naming both fixes.
    assert manifest["encoding"]["t5_text_length"] == 12
    assert main(["train", finetune, f"run_dir={tmp_path / 'other'}", f"data.shards={out}", *common,
                 "model.t5_text_length=8"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "encoded at 12 tokens per caption but this run reads 8" in error and "--t5-text-length 8" in error
    shorter = tmp_path / "encoded-8"
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(folder), "--out", str(shorter),
                 "--resolution", "32", "--dtype", "float32", "--t5-text-length", "8"]) == 0
    sample = read_shard(str(sorted(shorter.glob("*.tar"))[0]))[0]
    assert load_npy(sample["text_emb.npy"]).shape[0] == 8


def test_t5_reads_what_the_model_samples_with_not_the_512_a_released_tokenizer_saves(tmp_path, pretrained):
    """Flux.1-schnell's and SD3's released T5 tokenizers save model_max_length 512 (T5's limit): training and
    encoding read 256, as their pipelines and kohya sample; dev (a guidance embedding) 512; model.t5_text_length
    wins, and a shorter saved length (a model sdtrain exported after training at it) is kept."""
    import shutil

    from sdtrain.config import ModelConfig
    from sdtrain.models import build

    def released(family: str, guidance: bool | None = None) -> Path:
        folder = tmp_path / f"{family}-{guidance}"
        shutil.copytree(pretrained[family], folder)
        spec = families.get(family)
        t5 = folder / spec.components.long_text_tokenizers[0] / "tokenizer_config.json"
        t5.write_text(json.dumps({**json.loads(t5.read_text()), "model_max_length": 512}))
        if guidance is not None:
            config = folder / "transformer" / "config.json"
            config.write_text(json.dumps({**json.loads(config.read_text()), "guidance_embeds": guidance}))
        return folder

    def t5_length(folder: Path, **model) -> int:
        family = families.detect(folder)
        tokenizers = build.load_text_tokenizers(ModelConfig(pretrained=str(folder), **model))
        folders = family.components
        return tokenizers[folders.tokenizers.index(folders.long_text_tokenizers[0])].model_max_length

    schnell = released("flux", guidance=False)
    assert t5_length(schnell) == 256
    assert t5_length(released("flux", guidance=True)) == 512
    assert t5_length(released("sd3")) == 256
    assert t5_length(schnell, t5_text_length=64) == 64
    assert t5_length(pretrained["flux"]) == 12  # exported after training at 12 tokens
    # prepare encode reads the same as training.
    from sdtrain.data.encode import Encoder

    encoder = Encoder(str(schnell), str(schnell), 32, torch.device("cpu"), served=ModelConfig(pretrained=str(schnell)))
    assert encoder.long_text_length == 256


def test_previews_and_generate_sample_as_the_model_does_schnell_without_guidance(pretrained, monkeypatch):
    """A Flux.1 transformer without a guidance embedding (schnell) samples by default in 4 steps with no
    classifier-free guidance (no negative pass); with one (dev), its embedding gets 3.5; a set value still wins."""
    from diffusers import FluxPipeline
    from PIL import Image

    from sdtrain.models.pipeline import sample_images

    calls = []

    def record(pipe, prompt, **kwargs):
        calls.append(kwargs)
        return type("Output", (), {"images": [Image.new("RGB", (8, 8))] * len(prompt)})()

    monkeypatch.setattr(FluxPipeline, "__call__", record)
    pipe = _pipeline("flux", pretrained["flux"])
    sample_images(pipe, ["a red circle"], default_steps=20)
    dev = calls.pop()
    assert (dev["num_inference_steps"], dev["guidance_scale"]) == (20, 3.5)
    pipe.transformer.register_to_config(guidance_embeds=False)
    sample_images(pipe, ["a red circle"], default_steps=20)
    schnell = calls.pop()
    assert schnell["num_inference_steps"] == 4
    assert "true_cfg_scale" not in schnell and "guidance_scale" not in schnell and schnell["negative_prompt"] is None
    sample_images(pipe, ["a red circle"], steps=8, guidance=5.0)
    assert calls.pop()["true_cfg_scale"] == 5.0


def test_a_resolution_past_sd3s_position_table_is_one_line_at_start(tmp_path, pretrained, shapes_dir, capsys):
    from diffusers import AutoencoderKL
    from diffusers.configuration_utils import FrozenDict

    folder = pretrained["sd3"]
    rows = json.loads((folder / "transformer" / "config.json").read_text())["pos_embed_max_size"] * 2  # patch 2
    largest = rows * families.get("sd3").codec.downsampling(FrozenDict(AutoencoderKL.load_config(folder / "vae")))
    command = _command("full", tmp_path / "run", folder, shapes_dir, 1)
    capsys.readouterr()
    assert main([*command, f"data.resolution={largest * 2}"]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # the progress bars of the weights loaded before it stand above
    assert f"at most {largest} px" in line and "error: data.resolution: " in line and "Traceback" not in err
    assert not list((tmp_path / "run").glob("checkpoints/*"))


def test_generate_samples_a_run_at_its_training_resolution(tmp_path, scratch):
    from PIL import Image

    out = tmp_path / "images"
    assert main(["generate", "--model", str(scratch["flux"]), "--prompt", "a red circle", "--steps", "2",
                 "--out", str(out)]) == 0
    # FluxPipeline's own default is 1024 px whatever the model trained on; a run samples at its resolution.
    assert Image.open(sorted(out.glob("000-*.png"))[0]).size == (32, 32)


def test_a_flux_single_file_trains_with_the_schedule_it_was_released_with(tmp_path):
    from safetensors.torch import save_file

    from sdtrain.config import DiffusionConfig, ModelConfig
    from sdtrain.models import build

    for name, keys, dynamic in (("dev", ["double_blocks.0.img_attn.qkv.weight", "guidance_in.in_layer.weight"], True),
                                ("schnell", ["model.diffusion_model.double_blocks.0.img_attn.qkv.weight"], False)):
        path = tmp_path / f"flux1-{name}.safetensors"
        save_file({key: torch.zeros(1) for key in keys}, str(path))
        scheduler = build.build_noise_scheduler(DiffusionConfig(), ModelConfig(pretrained=str(path)))
        assert scheduler.config.use_dynamic_shifting == dynamic, name
        assert scheduler.config.shift == (3.0 if dynamic else 1.0)


@pytest.fixture(scope="module")
def sd3_file(tmp_path_factory, scratch) -> Path:
    out = tmp_path_factory.mktemp("sd3-single") / "sd3.safetensors"
    assert main(["export", str(scratch["sd3"]), str(out), "--single-file"]) == 0
    return out


def test_an_sd3_single_file_holds_every_component_in_stabilitys_layout_which_diffusers_reads(sd3_file, pretrained):
    """What ComfyUI's Load Checkpoint and diffusers' from_single_file read (sd3_medium_incl_clips_t5xxlfp8's
    layout): loaded by diffusers' own converters, it draws the exported pipeline's image."""
    from diffusers import StableDiffusion3Pipeline
    from safetensors import safe_open

    assert sorted(p.name for p in sd3_file.parent.iterdir()) == [
        "README.md", "sd3.safetensors", "sd3.tokenizer", "sd3.tokenizer_2", "sd3.tokenizer_3", "sd3.validation.png"]
    with safe_open(str(sd3_file), framework="pt") as f:
        keys, metadata = set(f.keys()), f.metadata()  # noqa: SIM118 (not a dict)
    assert metadata["model_family"] == "sd3"
    assert {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight", "model.diffusion_model.pos_embed",
            "model.diffusion_model.joint_blocks.0.x_block.attn2.qkv.weight",
            "model.diffusion_model.final_layer.adaLN_modulation.1.weight", "first_stage_model.decoder.conv_in.weight",
            "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight",
            "text_encoders.clip_g.transformer.text_projection.weight",
            "text_encoders.t5xxl.transformer.shared.weight"} <= keys
    assert not any(k.startswith(("transformer_blocks.", "model.diffusion_model.transformer_blocks.")) for k in keys)

    loaded = StableDiffusion3Pipeline.from_single_file(str(sd3_file), config=str(pretrained["sd3"]),
                                                       local_files_only=True, torch_dtype=torch.float32)
    exported = _pipeline("sd3", pretrained["sd3"])
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        got, expected = getattr(loaded, name).state_dict(), getattr(exported, name).state_dict()
        assert got.keys() == expected.keys(), name
        differ = [k for k in expected if not torch.equal(got[k], expected[k])]
        # SD3 pools CLIP-L unprojected: diffusers reads its projection as the identity, whatever the file holds.
        assert differ == (["text_projection.weight"] if name == "text_encoder" else []), name
    loaded.text_encoder = exported.text_encoder
    np.testing.assert_allclose(_image(loaded), _image(exported), rtol=0, atol=1e-5)
    # sdtrain's own reader samples from the file too, its tokenizers beside it.
    out = sd3_file.parent.parent / "images"
    assert main(["generate", "--model", str(sd3_file), "--prompt", "a red circle", "--steps", "2", "--size", "32",
                 "--out", str(out)]) == 0
    assert (out / "000-a-red-circle.png").is_file()


def test_an_sd3_single_file_is_recognised_and_fine_tunes_as_its_pipeline_does(tmp_path, sd3_file, pretrained,
                                                                              shapes_dir):
    """Not told its family, the file (its tokenizers beside it) trains bit for bit as the pipeline folder."""
    from sdtrain.checkpoint import latest_checkpoint

    from .conftest import same_checkpoints

    assert families.detect(sd3_file) is families.get("sd3")
    checkpoints = []
    for name, source in (("file", sd3_file), ("folder", pretrained["sd3"])):
        run = tmp_path / name
        assert main(["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={run}", *TINY_CLI,
                     f"model.pretrained={source}", f"data.shards={shapes_dir}", "train.max_steps=1",
                     "optim.lr=0.01", "optim.warmup_steps=0"]) == 0
        checkpoints.append(latest_checkpoint(run))
    same_checkpoints(*checkpoints)


def test_an_sd3_file_without_some_component_or_settings(tmp_path, sd3_file, pretrained, shapes_dir, capsys):
    """As Stability ship them: sd3_medium.safetensors holds the MMDiT and VAE alone, and no file but ours says the
    settings tensors cannot tell (SD3's are assumed). A missing piece is one line naming what to set."""
    import shutil

    from safetensors.torch import save_file

    from sdtrain.errors import UserError
    from sdtrain.loaders.components import load_component

    sd3 = families.get("sd3")
    bare = tmp_path / "sd3_medium.safetensors"
    save_file({k: v for k, v in load_file(str(sd3_file)).items() if not k.startswith("text_encoders.")}, str(bare))
    for name in ("transformer", "vae"):
        expected = load_component(name, sd3_file, family=sd3).state_dict()
        got = load_component(name, bare, family=sd3).state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), name
    with pytest.raises(UserError, match=r"holds no CLIP-L .*set model.components.text_encoder.source ") as caught:
        load_component("text_encoder", bare, family=sd3)
    assert str(bare) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UserError, match="model.family=sd3"):
        load_component("transformer", bare, family=families.get("flux"))

    # Through the CLI: each missing piece one line naming the setting, until the file trains with the rest named.
    def train(*extra: str) -> int:
        return main(["train", str(CONFIGS / "finetune-full.yaml"), f"run_dir={tmp_path / 'run'}", *TINY_CLI,
                     f"model.pretrained={bare}", f"data.shards={shapes_dir}", "train.max_steps=1", *extra])

    shutil.copytree(sd3_file.with_suffix(".tokenizer"), bare.with_suffix(".tokenizer"))
    encoders = [f"model.{name}={pretrained['sd3']}" for name in ("text_encoder", "text_encoder_2", "text_encoder_3")]
    tokenizer_3 = f"model.components.tokenizer_3.source={pretrained['sd3'] / 'tokenizer_3'}"
    for extra, setting in (([], "model.components.tokenizer_3.source"),
                           ([tokenizer_3], "model.components.text_encoder.source")):
        assert train(*extra) == 2
        error = capsys.readouterr().err
        assert setting in error.strip().splitlines()[-1] and "Traceback" not in error
    assert train(*encoders) == 0


def test_flux_clip_pools_at_end_of_text_after_an_embedding_is_loaded(tmp_path):
    """A released Flux.1 CLIP-L config (``eos_token_id: 2``) pools at the highest id, which a loaded embedding's
    token becomes: after `load_embedding` FluxPipeline's pooled vector is the end-of-text state, as in training."""
    from diffusers import FluxPipeline
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig, CLIPTextModel

    from sdtrain.models.families.text_towers import TINY_CLIP
    from sdtrain.models.tokenizer import train_clip_tokenizer

    tokenizer = train_clip_tokenizer(["a red circle", "a blue square"] * 8, tmp_path / "tokenizer", 600)
    torch.manual_seed(0)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length,
                                        bos_token_id=0, eos_token_id=2, pad_token_id=1, **TINY_CLIP)).eval()
    pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=clip, tokenizer=tokenizer, text_encoder_2=None,
                        tokenizer_2=None, transformer=None)
    save_file({"<shp>": torch.randn(1, clip.config.hidden_size)}, str(tmp_path / "learned_embeds.safetensors"))
    families.get("flux").files.load_embedding(pipe, str(tmp_path / "learned_embeds.safetensors"))
    ids = tokenizer(["a <shp> circle"], padding="max_length", max_length=tokenizer.model_max_length,
                    return_tensors="pt").input_ids[0].tolist()
    placeholder, end = ids.index(len(tokenizer) - 1), ids.index(tokenizer.eos_token_id)
    with torch.no_grad():
        pooled = pipe._get_clip_prompt_embeds("a <shp> circle", device=torch.device("cpu"))[0]
        states = clip(torch.tensor([ids])).last_hidden_state[0]
    torch.testing.assert_close(pooled, states[end], rtol=0, atol=0)
    assert not torch.allclose(pooled, states[placeholder])


def test_a_guidance_range_for_a_model_without_guidance_embedding_is_one_line(tmp_path, pretrained, shapes_dir,
                                                                             capsys):
    """SD3 has no guidance embedding: a guidance range would be drawn and never read, so the key is named."""
    assert main([*_command("full", tmp_path / "run", pretrained["sd3"], shapes_dir, 1),
                 "diffusion.flow.guidance_range=[1.0,4.0]"]) == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if "error:" in line]  # beside transformers' loading bars
    assert "Traceback" not in err and len(error) == 1
    assert "diffusion.flow.guidance_range" in error[0] and "no guidance embedding" in error[0]
