"""The same guarantees for every registered model family, at its tiny preset: a family added to the registry gets
these cases with no test edits. Each builds the family's components as training does (`sdtrain.models.build`
from a ModelConfig naming the family), then checks what the trainer, the encoded shards, the loaders and the
exports rely on the spec for."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sdtrain.config import ComponentConfig, DiffusionConfig, ModelConfig
from sdtrain.models import build, families
from sdtrain.models.families import spec
from sdtrain.models.pipeline import sampler_from
from sdtrain.models.tokenizer import CaptionTokenizer

from .conftest import resumes_bitwise_after_kill_9, warns_nothing

FAMILIES = list(families.FAMILIES)
TEXT_LENGTH = 12
LATENT_SIDE = 8


CAPTIONS = [f"a {c} {s} beside a {s2}" for c in ("red", "green", "blue") for s in ("circle", "square")
            for s2 in ("triangle", "star")]


class Tiny:
    """A family's tiny model, built as a from-scratch run builds it: its tokenizer learnt from captions by the
    family's own trainer, every text encoder reading its ids."""

    def __init__(self, name: str, folder: Path):
        torch.manual_seed(0)
        self.family = families.get(name)
        self.family.conditioner.train_tokenizer(CAPTIONS, folder / "tokenizer", 600, TEXT_LENGTH)
        self.config = ModelConfig(family=name, preset="tiny", t5_text_length=TEXT_LENGTH, components={
            "tokenizer": ComponentConfig(source=str(folder / "tokenizer"))})
        self.tokenizers = build.load_text_tokenizers(self.config)
        self.captions = CaptionTokenizer(self.tokenizers, self.family)
        self.vae = build.build_vae(self.config)
        self.text_encoders = {encoder: build.build_text_encoder(self.config, tokenizer, encoder)
                              for encoder, tokenizer in zip(self.family.components.text_encoders, self.tokenizers)}
        self.denoiser = build.build_denoiser(self.config, self.family.codec.channels(self.vae.config), LATENT_SIDE,
                                             self.text_encoders)

    @property
    def components(self) -> dict[str, torch.nn.Module]:
        return {"vae": self.vae, **self.text_encoders, self.family.components.denoiser: self.denoiser}

    def text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """As training conditions a batch: the loader's tokens, then the family's conditioner (given each caption's
        source image, for a family whose text encoder reads it)."""
        encoders = [self.text_encoders[name] for name in self.family.components.text_encoders]
        ids, masks = self.family.token_inputs(self.captions(captions))
        if not self.family.text_reads_source:
            return self.family.conditioner.encode_text(encoders, ids, captions, masks)
        sources = torch.rand(len(captions), 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
        return self.family.conditioner.encode_text(encoders, ids, captions, masks, sources=sources)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory) -> Tiny:
    return Tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_every_component_the_family_lists_is_built_of_its_class(tiny):
    assert set(tiny.family.components) == set(tiny.components)
    for name, module in tiny.components.items():
        assert isinstance(module, tiny.family.components.classes[name]), name


def test_the_denoiser_and_each_text_encoder_list_their_repeated_blocks(tiny):
    """The units of activation checkpointing, compilation and FSDP: in forward order, each a module of its
    component, and the registry-wide lookup finds the same."""
    for name in (tiny.family.components.denoiser, *tiny.family.components.text_encoders):
        module = tiny.components[name]
        blocks = tiny.family.blocks(module)
        assert blocks, f"{tiny.family.name}: no blocks listed for the {name}"
        inside = {id(m) for m in module.modules()}
        assert all(id(block) in inside for block in blocks)
        assert [id(b) for b in families.blocks(module)] == [id(b) for b in blocks]


def test_the_loader_tokens_are_picklable_and_the_conditioner_gives_the_shapes_it_declares(tiny):
    """Loader workers receive the tokenizers pickled; what encoded shards store is sized from `text_shapes` before
    any caption is encoded."""
    import pickle

    again = pickle.loads(pickle.dumps(tiny.captions))
    for key, value in tiny.captions(["a red circle"]).items():
        assert torch.equal(again(["a red circle"])[key], value), key
    captions = ["a red circle", ""]
    text = tiny.text(captions)
    configs = {name: encoder.config for name, encoder in tiny.text_encoders.items()}
    lengths = [tokenizer.model_max_length for tokenizer in tiny.tokenizers]
    declared = tiny.family.conditioner.text_shapes(configs, lengths)
    assert set(text) == set(declared) and "text_emb" in text
    for key, tensor in text.items():
        if tiny.family.text_reads_source:  # the sources' vision tokens lengthen the sequence by their count
            assert tensor.shape[0] == len(captions) and tensor.shape[2:] == declared[key][1:], key
        else:
            assert tuple(tensor.shape) == (len(captions), *declared[key]), key


def frames(tiny: Tiny) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The frame axis of the pixels and of the latents a family reads: none for still images; for clips, those of a
    clip of two latent frames (Wan's 5 frames)."""
    step = tiny.family.codec.clip_frames(tiny.vae.config)
    return ((), ()) if step is None else ((1 + step,), (2,))


def test_the_latent_codec_encodes_images_to_the_latents_the_denoiser_reads_and_back(tiny):
    """Images (or clips) in, a posterior over (B, C, h, w) latents (B, C, t, h, w for clips) out, decoded back; the
    normalisation an autoencoder run fits to its latents gives the denoiser latents of unit scale."""
    family, vae = tiny.family, tiny.vae
    channels, factor = family.codec.channels(vae.config), family.codec.downsampling(vae.config)
    pixel_frames, latent_frames = frames(tiny)
    pixels = torch.rand(2, 3, *pixel_frames, 32, 32) * 2 - 1
    with torch.no_grad():
        posterior = family.codec.encode(vae, pixels)
        assert posterior.mean.shape == (2, channels, *latent_frames, 32 // factor, 32 // factor)
        assert posterior.sample(torch.Generator().manual_seed(0)).shape == posterior.mean.shape
        assert family.codec.decode(vae, posterior.mode()).shape == pixels.shape
    centre, spread = torch.linspace(-2, 2, channels), torch.linspace(0.5, 3, channels)
    shape = (1, -1, *[1] * (len(latent_frames) + 2))
    latents = centre.view(shape) + spread.view(shape) * torch.randn(64, channels, *latent_frames, 8, 8)
    axes = (0, *range(2, latents.dim()))
    fitted = copy.deepcopy(vae)
    family.codec.fit_normalization(fitted, latents.mean(dim=axes), latents.square().mean(dim=axes))
    normalized = family.codec.normalize(latents, fitted)
    assert normalized.dtype == torch.float32
    assert abs(normalized.square().mean().sqrt().item() - 1) < 0.05


def test_a_denoiser_step_predicts_the_latents_shape_and_trains_every_weight(tiny):
    latents = torch.randn(2, tiny.family.codec.channels(tiny.vae.config), *frames(tiny)[1], LATENT_SIDE, LATENT_SIDE)
    with torch.no_grad():
        text = tiny.text(["a red circle", "a blue square"])
    batch = {"size_ids": torch.tensor([[64, 64, 0, 0, 64, 64]] * 2)}
    condition = tiny.family.denoising.condition(text, batch, torch.device("cpu"))
    if tiny.family.denoising.takes_guidance(tiny.denoiser.config):
        condition["guidance"] = torch.full((2,), 3.5)
    timesteps = torch.tensor([100.0, 900.0])
    output = tiny.family.denoising.denoise(tiny.denoiser, latents, timesteps, condition)
    assert output.shape == latents.shape and torch.isfinite(output).all()
    tiny.denoiser.zero_grad()
    output.square().mean().backward()
    # What a data-parallel step waits for: a gradient for every parameter the family does not declare unused.
    untouched = [n for n, p in tiny.denoiser.named_parameters()
                 if p.grad is None
                 and not _declared_unused(tiny.family, tiny.family.components.denoiser, tiny.denoiser, n)]
    assert not untouched, f"{tiny.family.name}: no gradient reaches {untouched[:3]}"


def test_its_controlnet_starts_at_the_base_model_and_then_steers_it(tiny):
    """A family hosting a ControlNet: made from its denoiser, it changes nothing until its zero convolutions train
    (the paper's starting point), then every weight gets a gradient through the frozen denoiser, and its blocks are
    listed (checkpointing, FSDP)."""
    spec = tiny.family.controlnet
    if spec is None:
        pytest.skip(f"{tiny.family.title} hosts no ControlNet in this release")
    factor = tiny.family.codec.downsampling(tiny.vae.config)
    # A trained base: a reference initialisation's zero output layer (Flux.1's) would hide what is added in.
    denoiser = copy.deepcopy(tiny.denoiser).requires_grad_(False)
    with torch.no_grad():
        for parameter in denoiser.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    controlnet = spec.from_denoiser(denoiser, factor)
    assert isinstance(controlnet, spec.model_class) and families.blocks(controlnet)
    latents = torch.randn(2, tiny.family.codec.channels(tiny.vae.config), LATENT_SIDE, LATENT_SIDE)
    # What the ControlNet reads: the conditioning images, or what the family makes of them (their latents).
    images = torch.rand(2, 3, LATENT_SIDE * factor, LATENT_SIDE * factor)
    if spec.control_input is not None:
        with torch.no_grad():
            images = spec.control_input(tiny.vae, images)
    with torch.no_grad():
        text = tiny.text(["a red circle", "a blue square"])
    condition = tiny.family.denoising.condition(text, {"size_ids": torch.tensor([[64, 64, 0, 0, 64, 64]] * 2)},
                                      torch.device("cpu"))
    if tiny.family.denoising.takes_guidance(tiny.denoiser.config):
        condition["guidance"] = torch.full((2,), 3.5)
    timesteps = torch.tensor([100.0, 900.0])
    with torch.no_grad():
        plain = tiny.family.denoising.denoise(denoiser, latents, timesteps, condition)
        controlled = tiny.family.denoising.denoise(denoiser, latents, timesteps,
                                         {**condition, **spec.residuals(controlnet, latents, timesteps, condition,
                                                                        images)})
    torch.testing.assert_close(controlled, plain, rtol=0, atol=0)
    with torch.no_grad():
        for parameter in controlnet.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    output = tiny.family.denoising.denoise(denoiser, latents, timesteps,
                                 {**condition, **spec.residuals(controlnet, latents, timesteps, condition, images)})
    assert not torch.equal(output, plain)
    output.square().mean().backward()
    # What a data-parallel step waits for: a gradient for every parameter the family does not declare unused.
    untouched = [n for n, p in controlnet.named_parameters()
                 if p.grad is None and not _declared_unused(tiny.family, "controlnet", controlnet, n)]
    assert not untouched, f"{tiny.family.name}: no gradient reaches the ControlNet's {untouched}"


def test_its_exported_controlnet_loads_in_diffusers_without_a_warning(tiny, tmp_path, caplog):
    """A ControlNet as `sdtrain export` writes it (the module rebuilt from its checkpoint's spec, saved), made from
    a denoiser read from a folder as a run's base is (its config then states every setting, unset ones too):
    diffusers' own class loads the folder without a warning, its config holding only what that class takes."""
    from sdtrain.checkpoint import module_spec
    from sdtrain.loaders.components import instantiate

    spec = tiny.family.controlnet
    if spec is None:
        pytest.skip(f"{tiny.family.title} hosts no ControlNet in this release")
    tiny.denoiser.save_pretrained(tmp_path / "denoiser")
    denoiser = type(tiny.denoiser).from_pretrained(tmp_path / "denoiser")
    controlnet = spec.from_denoiser(denoiser, tiny.family.codec.downsampling(tiny.vae.config))
    instantiate(module_spec(controlnet)).save_pretrained(tmp_path / "controlnet")
    with warns_nothing(caplog):
        spec.model_class.from_pretrained(tmp_path / "controlnet")


@pytest.mark.parametrize("kind", ["dora", "lokr"])
def test_its_lycoris_adapters_load_in_diffusers_as_they_trained(tiny, kind, tmp_path):
    """DoRA's and LoKr's adapters on the denoiser's attention, written as the trainer writes them (diffusers' file),
    and loaded as `generate --lora` loads them into the family's pipeline: its denoiser computes what the trained
    one did."""
    from sdtrain.config import LoraConfig
    from sdtrain.generate import load_adapters
    from sdtrain.loaders.adapters import add_lora
    from sdtrain.loaders.writers import save_lora
    from sdtrain.train.modes.lora import lora_settings

    family = tiny.family
    # A trained base: a reference initialisation's zero output layer (Flux.1's) would hide the adapters.
    base = copy.deepcopy(tiny.denoiser).requires_grad_(False)
    with torch.no_grad():
        for parameter in base.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    trained = copy.deepcopy(base)
    add_lora(trained, lora_settings(LoraConfig(type=kind, rank=2, alpha=3, target_modules=["to_q", "to_k", "to_v"])),
             "lora.target_modules")
    with torch.no_grad():  # trained: every factor and magnitude away from where it started
        for name, parameter in trained.named_parameters():
            if "lora_" in name or "lokr_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    denoiser = family.components.denoiser
    save_lora({denoiser: trained}, {denoiser: trained.state_dict()}, tmp_path, family)
    noise = build.build_noise_scheduler(DiffusionConfig(), tiny.config)
    pipe = family.sampling.assemble({**tiny.components, family.components.denoiser: copy.deepcopy(base)},
                                    tiny.tokenizers,
                           sampler_from(noise, "euler"))
    load_adapters(pipe, tmp_path, None, "trained")
    latents = torch.randn(1, family.codec.channels(tiny.vae.config), *frames(tiny)[1], LATENT_SIDE, LATENT_SIDE)
    with torch.no_grad():
        condition = family.denoising.condition(tiny.text(["a red circle"]),
                                               {"size_ids": torch.tensor([[64, 64, 0, 0, 64, 64]])},
                                     torch.device("cpu"))
        if family.denoising.takes_guidance(tiny.denoiser.config):
            condition["guidance"] = torch.full((1,), 3.5)
        timesteps = torch.tensor([500.0])
        expected = family.denoising.denoise(trained, latents, timesteps, condition)
        loaded = family.denoising.denoise(getattr(pipe, family.components.denoiser), latents, timesteps, condition)
        plain = family.denoising.denoise(base, latents, timesteps, condition)
    assert not torch.allclose(expected, plain)
    torch.testing.assert_close(loaded, expected, rtol=1e-4, atol=1e-5)


def test_its_instruct_pix2pix_denoiser_starts_at_the_base_model(tiny):
    """A family whose denoiser learns InstructPix2Pix's editing: widened, it ignores the source latents until they
    train, and its config says how many channels it reads (what its pipeline and a checkpoint rebuild it from)."""
    spec = tiny.family.instruct
    if spec is None:
        pytest.skip(f"{tiny.family.title} learns no InstructPix2Pix editing in this release")
    channels = tiny.family.codec.channels(tiny.vae.config)
    latents = torch.randn(2, channels, LATENT_SIDE, LATENT_SIDE)
    with torch.no_grad():
        text = tiny.text(["make it red", "make it blue"])
    condition = tiny.family.denoising.condition(text, {"size_ids": torch.tensor([[64, 64, 0, 0, 64, 64]] * 2)},
                                      torch.device("cpu"))
    timesteps = torch.tensor([100.0, 900.0])
    widened = copy.deepcopy(tiny.denoiser)
    spec.widen(widened)
    assert widened.config.in_channels == 2 * channels
    with torch.no_grad():
        plain = tiny.family.denoising.denoise(tiny.denoiser, latents, timesteps, condition)
        given = tiny.family.denoising.denoise(widened, torch.cat([latents, torch.randn_like(latents)], dim=1),
                                              timesteps,
                                    condition)
    torch.testing.assert_close(given, plain, rtol=0, atol=0)


def _declared_unused(family, name: str, module: torch.nn.Module, parameter: str) -> bool:
    return any(parameter.startswith(path + ".") for path in family.conditioner.unused_modules(name, module))


def test_each_text_encoder_that_trains_gives_every_weight_a_gradient(tiny):
    """``diffusion.train_text_encoder``: the conditioning depends on every weight left trainable."""
    text = tiny.text(["a red circle", "a blue square"])
    sum(value.float().square().mean() for value in text.values()).backward()
    untouched = [f"{name}.{n}" for name, encoder in tiny.text_encoders.items() for n, p in encoder.named_parameters()
                 if p.grad is None and not _declared_unused(tiny.family, name, encoder, n)]
    for encoder in tiny.text_encoders.values():
        encoder.zero_grad()
    assert not untouched, f"{tiny.family.name}: no gradient reaches {untouched[:3]}"


def test_the_latents_side_survives_the_denoiser(tiny):
    """Aspect buckets are multiples of what the denoiser downsamples by; the position table (if any) covers them."""
    step = tiny.family.denoising.downsampling(tiny.denoiser.config)
    assert step >= 1 and LATENT_SIDE % step == 0
    longest = tiny.family.denoising.max_latent_side(tiny.denoiser.config)
    assert longest is None or longest >= LATENT_SIDE


def test_the_pipeline_it_assembles_loads_in_diffusers_and_is_recognised(tiny, tmp_path):
    noise = build.build_noise_scheduler(DiffusionConfig(), tiny.config)
    pipe = tiny.family.sampling.assemble(tiny.components, tiny.tokenizers, sampler_from(noise, "euler"))
    assert isinstance(pipe, tiny.family.sampling.pipeline_class)
    pipe.save_pretrained(tmp_path)
    assert families.detect(tmp_path) is tiny.family
    loaded = tiny.family.sampling.pipeline_from_folder(tmp_path, local_files_only=True)
    assert type(loaded) is tiny.family.sampling.pipeline_class
    state = getattr(loaded, tiny.family.components.denoiser).state_dict()
    for key, value in tiny.denoiser.state_dict().items():
        assert torch.equal(state[key], value), key


def test_the_sampling_defaults_are_what_the_pipeline_takes(tiny):
    defaults = tiny.family.sampling.defaults(tiny.denoiser.config)
    assert defaults["guidance"] > 0 and set(defaults) <= {"guidance", "steps"}


@pytest.mark.parametrize("name", FAMILIES)
def test_every_preset_sets_every_component(name):
    family = families.get(name)
    assert "tiny" in family.presets
    for preset, settings in family.presets.items():
        missing = [c for c in family.components if c not in settings]
        assert not missing, f"{name} preset {preset} lacks {missing}"


def test_families_are_told_apart_by_their_files():
    """No two unmarked families claim the same pipeline class name, and each name is its own; a family that shares
    its pipeline's name (WanPipeline's: two experts, or timesteps per token) is told by the marks its folder sets."""
    def marks(family: spec.ModelFamily) -> tuple[str, ...]:
        return (*(family.experts.marks() if family.experts is not None else ()), *family.sampling.index_marks)

    names = [f.sampling.pipeline_names for f in families.FAMILIES.values() if not marks(f)]
    flat = [n for group in names for n in group]
    assert len(flat) == len(set(flat))
    for family in families.FAMILIES.values():
        if marks(family):
            name = family.sampling.pipeline_names[0]
            named = [f for f in families.FAMILIES.values() if name in f.sampling.pipeline_names]
            index = {"_class_name": name, **dict.fromkeys(marks(family), 1)}
            assert spec.of_index(named, index) is family
            assert spec.of_index(named, {"_class_name": index["_class_name"]}) is not family
    for name, family in families.FAMILIES.items():
        assert family.name == name and families.get(name) is family
        assert family.sampling.pipeline_class.__name__ in family.sampling.pipeline_names


def test_its_single_file_layout_reads_back_what_it_writes(tiny, tmp_path):
    """Every family with a single-file layout: what `export --single-file` writes of the components the layout
    holds is recognised as the family's and loads back weight for weight, through the path training and
    `generate` read files by (`loaders.components.load_component`)."""
    from sdtrain.loaders.components import load_component

    layout = tiny.family.files.single_file
    if layout is None:
        pytest.skip(f"{tiny.family.title} has no single-file layout")
    held = layout.holds or tuple(tiny.components)
    out = tmp_path / "model.safetensors"
    layout.write(out, {name: tiny.components[name] for name in held}, half=False,
                 scheduler=build.build_noise_scheduler(DiffusionConfig(), tiny.config), text_layout="auto",
                 text_source=None)
    assert families.detect(out).files.single_file is layout  # a layout two families share is told by the family set
    for name in held:
        loaded = load_component(name, out, family=tiny.family, served=tiny.config)
        assert isinstance(loaded, tiny.family.components.classes[name])
        expected = tiny.components[name].state_dict()
        got = loaded.state_dict()
        assert set(expected) <= set(got), name
        for key, tensor in expected.items():
            assert torch.equal(got[key].float(), tensor.float()), f"{name}: {key}"


def test_its_lora_file_loads_whole_through_the_pipelines_own_loader(tiny, tmp_path):
    """What a LoRA run exports of the denoiser's adapters, the family pipeline's own load_lora_weights attaches in
    full: fused, the pipeline's denoiser carries exactly the update sdtrain's adapters make."""
    from sdtrain.config import LoraConfig
    from sdtrain.loaders.adapters import add_lora, merge_lora
    from sdtrain.loaders.writers import save_lora

    noise = build.build_noise_scheduler(DiffusionConfig(), tiny.config)
    tiny.family.sampling.assemble(tiny.components, tiny.tokenizers, sampler_from(noise, "euler")).save_pretrained(
        tmp_path / "pipeline")
    adapted = copy.deepcopy(tiny.denoiser)
    torch.manual_seed(1)
    # Random ups as well as downs (peft starts the ups at zero), so every adapter changes its layer.
    add_lora(adapted, {"r": 2, "lora_alpha": 4, "target_modules": LoraConfig().target_modules,
                       "init_lora_weights": False}, "lora.target_modules")
    denoiser = tiny.family.components.denoiser
    save_lora({denoiser: adapted}, {denoiser: adapted.state_dict()}, tmp_path / "lora",
              tiny.family)
    pipe = tiny.family.sampling.pipeline_from_folder(tmp_path / "pipeline", local_files_only=True)
    pipe.load_lora_weights(tmp_path / "lora")
    pipe.fuse_lora()
    expected = merge_lora(adapted).state_dict()
    got = {key.replace(".base_layer.", "."): value
           for key, value in getattr(pipe, tiny.family.components.denoiser).state_dict().items() if "lora_" not in key}
    changed = [key for key, value in expected.items() if not torch.equal(value, tiny.denoiser.state_dict()[key])]
    assert changed  # the adapters do change the weights they sit on
    for key in changed:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def _reads_clips(name: str) -> bool:
    family = families.get(name)
    return family.codec.clip_frames(SimpleNamespace(**family.preset("tiny", "vae"))) is not None


# The kill -9 resume (12 to 35 s a family) runs by default for the first family of still images; every other
# family's with the slow tests, which keeps the default suite within 15 minutes. The first family of clips resumes by
# default on real clips (tests/test_clips.py), here on still images read as one-frame clips.
_RESUMES_BY_DEFAULT = {next(name for name in FAMILIES if not _reads_clips(name))}


@pytest.mark.parametrize("name", [name if name in _RESUMES_BY_DEFAULT else pytest.param(name, marks=pytest.mark.slow)
                                  for name in FAMILIES])
def test_a_run_from_scratch_resumes_bitwise_after_kill_9(name, tmp_path, tiny_scratch_command):
    """Every text encoder and the denoiser trained from the tiny preset, SIGKILLed after its second checkpoint,
    resumed: it ends on the checkpoint of a run that was never stopped, bit for bit (weights, EMA, optimizer)."""
    resumes_bitwise_after_kill_9(
        lambda run: tiny_scratch_command(name, run, 3, "checkpoint.every=1", "data.caption_dropout=0.25",
                                         f"model.t5_text_length={TEXT_LENGTH}"), tmp_path)
