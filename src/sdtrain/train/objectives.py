"""What a denoiser is trained to predict, as a component of its own: how training noise is drawn and mixed
into the latents, the timesteps, the target and each sample's loss weight.

The trainer and the tasks know none of this: a task hands its objective clean latents and gets back the
denoiser's input, its timesteps and the target, then weights the per-sample loss as the objective says.
Today's objective is noise prediction on a DDPM schedule (epsilon or v, as Stable Diffusion 1 and 2
train); flow matching (SD3, Flux) is another class with the same three calls.
"""

from __future__ import annotations

import torch
from diffusers import DDPMScheduler

from sdtrain.config import DiffusionConfig


class NoisePrediction:
    """Epsilon or v-prediction on a DDPM noise schedule, with the options the field uses: min-SNR-gamma
    weighting, offset noise, input perturbation, zero terminal SNR (in the schedule itself) and uniform or
    logit-normal timesteps."""

    def __init__(self, config: DiffusionConfig, scheduler: DDPMScheduler, device: torch.device):
        self.config = config
        self.scheduler = scheduler
        self.device = device
        self.alphas_cumprod = scheduler.alphas_cumprod.to(device)

    @property
    def prediction_type(self) -> str:
        return self.scheduler.config.prediction_type

    @torch.no_grad()
    def draw(self, latents: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor]:
        """(the denoiser's noisy input, its timesteps, the target) for clean `latents`. The draws come from
        `generator` in a fixed order, so a resumed run draws the same noise."""
        cfg = self.config
        noise = torch.randn(latents.shape, generator=generator, device=self.device, dtype=latents.dtype)
        if cfg.noise_offset > 0:
            # One constant per sample and channel: plain noise has zero mean, so the model never
            # learns to move an image's overall brightness.
            offset = torch.randn((*latents.shape[:2], 1, 1), generator=generator, device=self.device)
            noise = noise + cfg.noise_offset * offset
        timesteps = self.sample_timesteps(latents.shape[0], generator)
        noised_with = noise
        if cfg.input_perturbation > 0:
            extra = torch.randn(latents.shape, generator=generator, device=self.device, dtype=latents.dtype)
            noised_with = noise + cfg.input_perturbation * extra
        noisy = self.scheduler.add_noise(latents, noised_with, timesteps)
        if self.prediction_type == "v_prediction":
            return noisy, timesteps, self.scheduler.get_velocity(latents, noise, timesteps)
        return noisy, timesteps, noise

    def sample_timesteps(self, count: int, generator: torch.Generator) -> torch.Tensor:
        cfg = self.config
        steps = self.scheduler.config.num_train_timesteps
        if cfg.timestep_sampling == "logit_normal":
            logits = torch.randn(count, generator=generator, device=self.device)
            fraction = torch.sigmoid(cfg.timestep_mean + cfg.timestep_std * logits)
            return (fraction * steps).long().clamp(max=steps - 1)
        return torch.randint(0, steps, (count,), generator=generator, device=self.device)

    def weight(self, loss: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The per-sample loss as it is optimised: min-SNR weighted when `diffusion.snr_gamma` is set."""
        return loss * self.snr_weight(timesteps) if self.config.snr_gamma > 0 else loss

    def snr_weight(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Min-SNR-gamma: min(snr, gamma) relative to the loss's own weighting of a timestep, which is snr for
        epsilon and snr + 1 for v. Written so that snr = 0 (the last step of a zero-terminal-SNR schedule)
        gives a finite weight: for epsilon min(snr, gamma) / snr is 1 whenever snr <= gamma."""
        gamma = self.config.snr_gamma
        alpha = self.alphas_cumprod[timesteps].float()
        snr = alpha / (1 - alpha)
        if self.prediction_type == "v_prediction":
            return torch.clamp(snr, max=gamma) / (snr + 1)
        return torch.where(snr <= gamma, torch.ones_like(snr), gamma / snr.clamp(min=1e-12))
