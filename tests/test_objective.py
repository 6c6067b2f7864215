"""Golden values of the diffusion objective: for a fixed latent, noise and timestep, the noisy input the
denoiser sees, the target it is trained towards and the weight of its loss equal what the formulas give,
computed here by hand from the schedule's betas. These pin the objective before it moves into a
component of its own (issue 20), so the move cannot change what any run computes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.configuration_utils import FrozenDict
from torch import nn

from sdtrain.config import DdpmConfig, DiffusionConfig, FlowConfig, load_config
from sdtrain.models import build, families
from sdtrain.train.objectives import FlowMatching, NoisePrediction, multires_noise
from sdtrain.train.parts import TrainedPart
from sdtrain.train.tasks import DiffusionTask

from .conftest import config_path

SHAPE = (2, 4, 3, 3)
SCALING = 0.5


class RecordingDenoiser(nn.Module):
    """Predicts zeros and keeps what it was called with: the loss is then the target's mean square."""

    config = FrozenDict()  # the task asks a denoiser's config whether it takes guidance (Flux.1-dev's does)

    def forward(self, noisy: torch.Tensor, timesteps: torch.Tensor, encoder_hidden_states: torch.Tensor
                ) -> SimpleNamespace:
        self.seen = (noisy.clone(), timesteps.clone())
        return SimpleNamespace(sample=torch.zeros_like(noisy))


def objective(*overrides: str) -> DiffusionTask:
    """The diffusion task's loss with its objective, around a recording denoiser."""
    config = load_config(config_path("diffusion.yaml"), ["run_dir=unused", "data.shards=unused", "model.vae=unused",
                                                         "diffusion.sample_latents=false", *overrides])
    task = DiffusionTask.__new__(DiffusionTask)
    task.config, task.device, task.family = config, torch.device("cpu"), families.SD
    task.objective = NoisePrediction(config.diffusion, build.build_noise_scheduler(config.diffusion), task.device)
    # A FrozenDict as a diffusers model's config is: read by attribute and by .get (shift_factor, unset here).
    task.vae = SimpleNamespace(config=FrozenDict(scaling_factor=SCALING))
    task.unet = RecordingDenoiser()
    task.text_embeddings = True
    task.part, task.trainable = TrainedPart(config, families.SD), {"unet": task.unet}
    return task


def hand_alphas_cumprod(steps: int = 1000, start: float = 0.00085, end: float = 0.012) -> list[float]:
    """Stable Diffusion's scaled-linear schedule: betas linear in sqrt space, then the running product."""
    betas = [(math.sqrt(start) + (math.sqrt(end) - math.sqrt(start)) * i / (steps - 1)) ** 2 for i in range(steps)]
    products, running = [], 1.0
    for beta in betas:
        running *= 1 - beta
        products.append(running)
    return products


def draws(seed: int, *extra: str) -> dict[str, torch.Tensor]:
    """The random draws of one loss call, in the order the objective makes them."""
    generator = torch.Generator().manual_seed(seed)
    out = {"noise": torch.randn(SHAPE, generator=generator)}
    if "offset" in extra:
        out["offset"] = torch.randn(SHAPE[:2] + (1, 1), generator=generator)
    out["timesteps"] = torch.randint(0, 1000, (SHAPE[0],), generator=generator)
    if "perturbation" in extra:
        out["perturbation"] = torch.randn(SHAPE, generator=generator)
    return out


def run(task: DiffusionTask, latent_mean: torch.Tensor, seed: int) -> torch.Tensor:
    batch = {"latent_mean": latent_mean, "latent_std": torch.zeros_like(latent_mean), "text_emb": torch.zeros(2, 4, 8)}
    return task.denoising_loss(batch, torch.Generator().manual_seed(seed))


def per_sample(values: torch.Tensor) -> torch.Tensor:
    return values.double().pow(2).mean(dim=(1, 2, 3))


@pytest.fixture
def latent_mean() -> torch.Tensor:
    return torch.linspace(-1.5, 2.0, math.prod(SHAPE)).reshape(SHAPE)


def test_epsilon_noisy_input_target_and_loss(latent_mean):
    task = objective("diffusion.ddpm.prediction_type=epsilon", "diffusion.ddpm.snr_gamma=0")
    loss = run(task, latent_mean, seed=3)
    drawn, abar = draws(3), hand_alphas_cumprod()
    x0 = latent_mean.double() * SCALING
    for i, t in enumerate(drawn["timesteps"].tolist()):
        expected = math.sqrt(abar[t]) * x0[i] + math.sqrt(1 - abar[t]) * drawn["noise"][i].double()
        torch.testing.assert_close(task.unet.seen[0][i].double(), expected, rtol=1e-5, atol=1e-5)
    assert task.unet.seen[1].tolist() == drawn["timesteps"].tolist()
    # Target: the noise itself; the denoiser said zero, so the loss is the noise's mean square.
    torch.testing.assert_close(loss.double(), per_sample(drawn["noise"]), rtol=1e-5, atol=1e-6)


def test_v_prediction_target(latent_mean):
    task = objective("diffusion.ddpm.prediction_type=v_prediction", "diffusion.ddpm.snr_gamma=0")
    loss = run(task, latent_mean, seed=5)
    drawn, abar = draws(5), hand_alphas_cumprod()
    x0 = latent_mean.double() * SCALING
    targets = torch.stack([math.sqrt(abar[t]) * drawn["noise"][i].double() - math.sqrt(1 - abar[t]) * x0[i]
                           for i, t in enumerate(drawn["timesteps"].tolist())])
    torch.testing.assert_close(loss.double(), per_sample(targets), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_min_snr_weight(latent_mean, prediction):
    gamma = 5.0
    plain = run(objective(f"diffusion.ddpm.prediction_type={prediction}", "diffusion.ddpm.snr_gamma=0"), latent_mean,
                seed=7)
    task = objective(f"diffusion.ddpm.prediction_type={prediction}", f"diffusion.ddpm.snr_gamma={gamma}")
    weighted = run(task, latent_mean, seed=7)
    abar = hand_alphas_cumprod()
    for i, t in enumerate(draws(7)["timesteps"].tolist()):
        snr = abar[t] / (1 - abar[t])
        # min(SNR, gamma) over the loss's own weighting: SNR for epsilon, SNR + 1 for v (Hang et al. 2023).
        weight = min(snr, gamma) / (snr if prediction == "epsilon" else snr + 1)
        assert weighted[i].item() == pytest.approx(plain[i].item() * weight, rel=1e-5)


def test_min_snr_weight_is_finite_at_zero_terminal_snr():
    task = objective("diffusion.ddpm.prediction_type=v_prediction", "diffusion.ddpm.snr_gamma=5",
                     "diffusion.ddpm.zero_terminal_snr=true")
    assert task.objective.alphas_cumprod[-1].item() == pytest.approx(0.0, abs=1e-6)
    weights = task.objective.snr_weight(torch.tensor([0, 500, 999]))
    assert torch.isfinite(weights).all() and weights[-1].item() == pytest.approx(0.0, abs=1e-6)


def test_offset_noise_and_input_perturbation(latent_mean):
    offset, perturbation = 0.1, 0.2
    task = objective("diffusion.ddpm.prediction_type=epsilon", "diffusion.ddpm.snr_gamma=0",
                     f"diffusion.ddpm.noise_offset={offset}", f"diffusion.ddpm.input_perturbation={perturbation}")
    loss = run(task, latent_mean, seed=11)
    drawn, abar = draws(11, "offset", "perturbation"), hand_alphas_cumprod()
    noise = drawn["noise"].double() + offset * drawn["offset"].double()  # one constant per sample and channel
    x0 = latent_mean.double() * SCALING
    for i, t in enumerate(drawn["timesteps"].tolist()):
        # The input is noised a little more than the target says (input perturbation); the target keeps the offset.
        noised_with = noise[i] + perturbation * drawn["perturbation"][i].double()
        expected = math.sqrt(abar[t]) * x0[i] + math.sqrt(1 - abar[t]) * noised_with
        torch.testing.assert_close(task.unet.seen[0][i].double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), per_sample(noise), rtol=1e-5, atol=1e-6)


def _bilinear_by_hand(grid: np.ndarray, size: int) -> np.ndarray:
    """A square grid resized to `size` bilinearly, half-pixel centres (align_corners=False), one pixel at a time."""
    n = grid.shape[0]
    out = np.zeros((size, size))
    for y in range(size):
        for x in range(size):
            sy, sx = max((y + 0.5) * n / size - 0.5, 0.0), max((x + 0.5) * n / size - 0.5, 0.0)
            y0, x0 = int(sy), int(sx)
            y1, x1 = min(y0 + 1, n - 1), min(x0 + 1, n - 1)
            fy, fx = sy - y0, sx - x0
            out[y, x] = ((1 - fy) * ((1 - fx) * grid[y0, x0] + fx * grid[y0, x1])
                         + fy * ((1 - fx) * grid[y1, x0] + fx * grid[y1, x1]))
    return out


def test_multires_noise_is_kohyas_pyramid_noise_computed_by_hand():
    """sd-scripts' pyramid_noise_like: level i (from 0, the first at full resolution) on a grid r**i smaller, r in
    [2, 4) drawn per level, weighted discount**i, the sum divided by its std over the whole batch."""
    generator = torch.Generator().manual_seed(3)
    plain = torch.randn(2, 1, 12, 12, generator=generator)
    noise = multires_noise(plain, 3, 0.5, torch.Generator().manual_seed(7))
    draws = torch.Generator().manual_seed(7)
    factors = (2 + 2 * torch.rand(3, generator=draws)).tolist()
    total = plain.double().numpy().copy()
    for level, factor in enumerate(factors):
        side = max(1, int(12 / factor**level))
        grid = torch.randn(2, 1, side, side, generator=draws).double().numpy()
        for b in range(2):
            total[b, 0] += 0.5**level * _bilinear_by_hand(grid[b, 0], 12)
        if side == 1:
            break
    expected = total / total.std(ddof=1)
    np.testing.assert_allclose(noise.double().numpy(), expected, rtol=1e-5, atol=1e-5)
    assert max(1, int(12 / factors[2] ** 2)) == 1  # the third level is one cell: the loop ends on it


def test_multires_noise_is_the_target_and_puts_power_at_the_image_scale(latent_mean):
    task = objective("diffusion.ddpm.prediction_type=epsilon", "diffusion.ddpm.snr_gamma=0",
                     "diffusion.ddpm.multires_noise_iterations=6", "diffusion.ddpm.multires_noise_discount=0.8")
    loss = run(task, latent_mean, seed=13)
    # Drawn right after the plain noise from the same generator, so a resumed run repeats it.
    generator = torch.Generator().manual_seed(13)
    plain = torch.randn(SHAPE, generator=generator)
    expected = multires_noise(plain, 6, 0.8, generator)
    torch.testing.assert_close(loss.double(), per_sample(expected), rtol=1e-5, atol=1e-6)

    generator = torch.Generator().manual_seed(0)
    plain = torch.randn(256, 4, 16, 16, generator=generator)
    noise = multires_noise(plain, 6, 0.8, generator)
    assert noise.std().item() == pytest.approx(1.0, abs=1e-4)

    # What a model could read the layout from at high noise: the mean of each half of the image. Plain noise
    # averages away there (std 1/sqrt(128) per channel); multi-resolution noise keeps several times more.
    def halves(values: torch.Tensor) -> float:
        return values[..., :8].mean(dim=(2, 3)).std().item()

    assert halves(noise) > 4 * halves(plain)
    assert halves(multires_noise(plain, 6, 0.3, torch.Generator().manual_seed(0))) < halves(noise)


# Flow matching (rectified flow, SD3 and Flux.1): x_t = (1 - sigma) x0 + sigma noise, target noise - x0, the
# sigmas drawn, shifted and weighted as the formulas of SD3's paper and diffusers' scheduler say.

FLOW_BATCH = 6


def diffusion_config(**fields) -> DiffusionConfig:
    """The diffusion section with `fields` set, each in the section that holds it (ddpm, flow or the shared one)."""
    sections = {name: {key: value for key, value in fields.items() if key in cls.__dataclass_fields__}
                for name, cls in (("ddpm", DdpmConfig), ("flow", FlowConfig))}
    shared = {key: value for key, value in fields.items() if not any(key in section for section in sections.values())}
    return DiffusionConfig(**shared, ddpm=DdpmConfig(**sections["ddpm"]), flow=FlowConfig(**sections["flow"]))


def flow(scheduler: FlowMatchEulerDiscreteScheduler | None = None, **fields) -> FlowMatching:
    config = diffusion_config(**fields)
    config.validate()
    return FlowMatching(config, scheduler or FlowMatchEulerDiscreteScheduler(), torch.device("cpu"))


def dynamic_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Flux.1-dev's: mu from 0.5 at 256 image tokens to 1.15 at 4096."""
    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)


def hand_unshifted(sampling: str, seed: int, count: int = FLOW_BATCH, mean: float = 0.0, std: float = 1.0,
                   mode_scale: float = 1.29) -> torch.Tensor:
    """The sigmas before any shift, in float64 from the same generator's draws (one per sample)."""
    generator = torch.Generator().manual_seed(seed)
    if sampling == "logit_normal":
        return torch.sigmoid(mean + std * torch.randn(count, generator=generator).double())
    u = torch.rand(count, generator=generator).double()
    if sampling == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    if sampling == "cosmap":
        return 1 - 1 / (torch.tan(math.pi * u / 2) + 1)
    return u


def hand_static_shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def scheduler_sigmas(scheduler: FlowMatchEulerDiscreteScheduler, unshifted: torch.Tensor, **kwargs) -> torch.Tensor:
    """What the scheduler samples at for these unshifted sigmas (its last, appended terminal 0 dropped)."""
    scheduler.set_timesteps(sigmas=unshifted.float().tolist(), **kwargs)
    return scheduler.sigmas[:-1]


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal", "mode", "cosmap"])
def test_flow_sigma_sampling(sampling):
    fields = {"timestep_mean": 0.4, "timestep_std": 1.3, "mode_scale": 0.8}
    sigmas = flow(timestep_sampling=sampling, **fields).sample_sigmas(FLOW_BATCH, torch.Generator().manual_seed(21))
    expected = hand_unshifted(sampling, 21, mean=0.4, std=1.3, mode_scale=0.8)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (FLOW_BATCH,)
    torch.testing.assert_close(sigmas.double(), expected, rtol=1e-6, atol=1e-6)
    assert ((sigmas >= 0) & (sigmas <= 1)).all()


def test_flow_static_shift_matches_formula_and_scheduler():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sigmas = flow(scheduler).sample_sigmas(FLOW_BATCH, torch.Generator().manual_seed(4))
    unshifted = hand_unshifted("uniform", 4)
    torch.testing.assert_close(sigmas.double(), hand_static_shift(unshifted, 3.0), rtol=1e-6, atol=1e-6)
    # Training and sampling shift alike: the scheduler's own schedule at the same unshifted sigmas.
    torch.testing.assert_close(sigmas, scheduler_sigmas(FlowMatchEulerDiscreteScheduler(shift=3.0), unshifted))
    assert (sigmas.double() >= unshifted - 1e-7).all()  # a shift above 1 moves every sigma towards noise


@pytest.mark.parametrize(("tokens", "mu"), [(256, 0.5), (1024, 0.63), (4096, 1.15)])
def test_flow_dynamic_shift_matches_formula_and_scheduler(tokens, mu):
    objective = flow(dynamic_scheduler())
    assert objective.mu(tokens) == pytest.approx(mu, abs=1e-12)
    sigmas = objective.sample_sigmas(FLOW_BATCH, torch.Generator().manual_seed(8), image_tokens=tokens)
    unshifted = hand_unshifted("uniform", 8)
    expected = math.exp(mu) / (math.exp(mu) + (1 / unshifted - 1))
    torch.testing.assert_close(sigmas.double(), expected, rtol=1e-6, atol=1e-6)
    # The static shift of 3.0 in the same scheduler is not used once the shift is dynamic.
    torch.testing.assert_close(sigmas, scheduler_sigmas(dynamic_scheduler(), unshifted, mu=objective.mu(tokens)))


def test_flow_dynamic_shift_counts_the_latents_tokens():
    objective = flow(dynamic_scheduler())
    latents = torch.zeros(2, 1, 32, 32)  # 2x2 patches: 16 x 16 = 256 tokens, mu = 0.5
    _, timesteps, _ = objective.draw(latents, torch.Generator().manual_seed(6))
    generator = torch.Generator().manual_seed(6)
    torch.randn(latents.shape, generator=generator)  # the noise comes first
    expected = objective.sample_sigmas(2, generator, image_tokens=256) * 1000
    torch.testing.assert_close(timesteps, expected)
    with pytest.raises(ValueError, match="token count"):
        objective.sample_sigmas(2, generator)


def test_flow_noisy_input_and_target(latent_mean):
    objective = flow(FlowMatchEulerDiscreteScheduler(shift=3.0), timestep_sampling="logit_normal")
    noisy, timesteps, target = objective.draw(latent_mean, torch.Generator().manual_seed(9))
    generator = torch.Generator().manual_seed(9)
    noise = torch.randn(SHAPE, generator=generator).double()  # then the sigmas: one normal per sample
    sigmas = hand_static_shift(torch.sigmoid(torch.randn(SHAPE[0], generator=generator).double()), 3.0)
    x0, sigma = latent_mean.double(), sigmas.reshape(-1, 1, 1, 1)
    assert noisy.dtype == timesteps.dtype == target.dtype == torch.float32
    torch.testing.assert_close(timesteps.double(), sigmas * 1000, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(noisy.double(), (1 - sigma) * x0 + sigma * noise, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(target.double(), noise - x0, rtol=1e-6, atol=1e-6)
    assert objective.prediction(target, noisy, timesteps) is target  # unconditioned: the output itself


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
def test_flow_loss_weighting(weighting):
    sigmas = [0.05, 0.3, 0.5, 0.9]
    loss = torch.tensor([1.0, 2.0, 0.5, 3.0])
    weighted = flow(loss_weighting=weighting).weight(loss, torch.tensor(sigmas) * 1000)
    formula = {"none": lambda s: 1.0, "sigma_sqrt": lambda s: s**-2,
               "cosmap": lambda s: 2 / (math.pi * (1 - 2 * s + 2 * s**2))}[weighting]
    expected = [value * formula(s) for value, s in zip(loss.tolist(), sigmas)]
    torch.testing.assert_close(weighted.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=0)


def test_flow_sigma_sqrt_weight_is_finite_at_sigma_zero():
    weighted = flow(loss_weighting="sigma_sqrt").weight(torch.ones(2), torch.tensor([0.0, 1000.0]))
    assert torch.isfinite(weighted).all() and weighted[1].item() == 1.0


def test_flow_preconditioning(latent_mean):
    objective = flow(precondition_outputs=True)
    noisy, timesteps, target = objective.draw(latent_mean, torch.Generator().manual_seed(12))
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(12))
    # The target is the clean latents; the exact velocity, preconditioned, gives them back.
    assert torch.equal(target, latent_mean)
    prediction = objective.prediction(noise - latent_mean, noisy, timesteps)
    torch.testing.assert_close(prediction, latent_mean, rtol=1e-5, atol=1e-5)


def test_flow_draw_at_fixed_sigmas(latent_mean):
    # A shifting scheduler: draw_at must not shift what it is given.
    objective = flow(FlowMatchEulerDiscreteScheduler(shift=3.0))
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    noisy, timesteps, target = objective.draw_at(latent_mean, noise, torch.tensor([0.0, 1.0]))
    assert torch.equal(noisy[0], latent_mean[0]) and torch.equal(noisy[1], noise[1])
    assert timesteps.tolist() == [0.0, 1000.0] and torch.equal(target, noise - latent_mean)
    # MLPerf's Flux validation: sigma = k/8 for k = 0..7, one sigma for the whole batch.
    for k in range(8):
        noisy, timesteps, _ = objective.draw_at(latent_mean, noise, k / 8)
        assert timesteps.tolist() == [k * 125.0] * SHAPE[0]
        torch.testing.assert_close(noisy, (1 - k / 8) * latent_mean + k / 8 * noise)


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal", "mode", "cosmap"])
def test_flow_draws_repeat_bitwise_from_the_same_generator_state(latent_mean, sampling):
    objective = flow(dynamic_scheduler(), timestep_sampling=sampling)
    generator = torch.Generator().manual_seed(30)
    objective.draw(latent_mean, generator)  # a step before the checkpoint
    state = generator.get_state()
    first = objective.draw(latent_mean, generator)
    generator.set_state(state)  # as a resumed run restores it
    second = objective.draw(latent_mean, generator)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_objectives_name_themselves_and_flow_ignores_ddpm_options_out_loud(latent_mean, caplog):
    assert NoisePrediction.name == "noise_prediction" and flow().name == "flow_matching"
    output = torch.ones(SHAPE)
    assert objective("diffusion.ddpm.snr_gamma=0").objective.prediction(output, output, torch.zeros(2)) is output
    # The shared fine-tuning recipes set min-SNR: a flow model trains with them, told what is left out.
    caplog.set_level("WARNING")
    weighted = flow(snr_gamma=5.0, noise_offset=0.1)
    assert "diffusion.ddpm.noise_offset, diffusion.ddpm.snr_gamma" in caplog.text and "ignored" in caplog.text
    plain = flow()
    assert all(torch.equal(a, b) for a, b in zip(weighted.draw(latent_mean, torch.Generator().manual_seed(3)),
                                                 plain.draw(latent_mean, torch.Generator().manual_seed(3))))
    assert torch.equal(weighted.weight(torch.ones(2), torch.tensor([10.0, 900.0])), torch.ones(2))


@pytest.mark.parametrize("option", [{"shift": 3.0}, {"dynamic_shift": True},
                                    {"guidance_range": [1.0, 4.0]}, {"loss_weighting": "cosmap"}])
def test_a_flow_matching_option_on_a_noise_prediction_model_is_one_line(option):
    """A model that trains by noise prediction (SD's) would silently ignore the shift, Flux.1-dev's guidance range
    or flow loss weighting: the key is named instead, before anything trains."""
    from sdtrain.errors import UserError

    config = diffusion_config(**option)
    with pytest.raises(UserError, match=rf"^diffusion\.flow\.{next(iter(option))}: .*flow-matching options.*noise "
                                        r"prediction.*remove them$") as caught:
        NoisePrediction(config, build.build_noise_scheduler(config), torch.device("cpu"))
    assert "\n" not in str(caught.value)
