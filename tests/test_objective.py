"""Golden values of the diffusion objective: for a fixed latent, noise and timestep, the noisy input the
denoiser sees, the target it is trained towards and the weight of its loss equal what the formulas give,
computed here by hand from the schedule's betas. These pin the objective before it moves into a
component of its own (issue 20), so the move cannot change what any run computes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sdtrain.config import load_config
from sdtrain.models import build, families
from sdtrain.train.objectives import NoisePrediction
from sdtrain.train.tasks import DiffusionTask

from .conftest import config_path

SHAPE = (2, 4, 3, 3)
SCALING = 0.5


class RecordingDenoiser(nn.Module):
    """Predicts zeros and keeps what it was called with: the loss is then the target's mean square."""

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
    task.vae = SimpleNamespace(config=SimpleNamespace(scaling_factor=SCALING))
    task.unet = RecordingDenoiser()
    task.text_embeddings = True
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
    task = objective("diffusion.prediction_type=epsilon", "diffusion.snr_gamma=0")
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
    task = objective("diffusion.prediction_type=v_prediction", "diffusion.snr_gamma=0")
    loss = run(task, latent_mean, seed=5)
    drawn, abar = draws(5), hand_alphas_cumprod()
    x0 = latent_mean.double() * SCALING
    targets = torch.stack([math.sqrt(abar[t]) * drawn["noise"][i].double() - math.sqrt(1 - abar[t]) * x0[i]
                           for i, t in enumerate(drawn["timesteps"].tolist())])
    torch.testing.assert_close(loss.double(), per_sample(targets), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_min_snr_weight(latent_mean, prediction):
    gamma = 5.0
    plain = run(objective(f"diffusion.prediction_type={prediction}", "diffusion.snr_gamma=0"), latent_mean, seed=7)
    task = objective(f"diffusion.prediction_type={prediction}", f"diffusion.snr_gamma={gamma}")
    weighted = run(task, latent_mean, seed=7)
    abar = hand_alphas_cumprod()
    for i, t in enumerate(draws(7)["timesteps"].tolist()):
        snr = abar[t] / (1 - abar[t])
        # min(SNR, gamma) over the loss's own weighting: SNR for epsilon, SNR + 1 for v (Hang et al. 2023).
        weight = min(snr, gamma) / (snr if prediction == "epsilon" else snr + 1)
        assert weighted[i].item() == pytest.approx(plain[i].item() * weight, rel=1e-5)


def test_min_snr_weight_is_finite_at_zero_terminal_snr():
    task = objective("diffusion.prediction_type=v_prediction", "diffusion.snr_gamma=5",
                     "diffusion.zero_terminal_snr=true")
    assert task.objective.alphas_cumprod[-1].item() == pytest.approx(0.0, abs=1e-6)
    weights = task.objective.snr_weight(torch.tensor([0, 500, 999]))
    assert torch.isfinite(weights).all() and weights[-1].item() == pytest.approx(0.0, abs=1e-6)


def test_offset_noise_and_input_perturbation(latent_mean):
    offset, perturbation = 0.1, 0.2
    task = objective("diffusion.prediction_type=epsilon", "diffusion.snr_gamma=0", f"diffusion.noise_offset={offset}",
                     f"diffusion.input_perturbation={perturbation}")
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
