"""What a denoiser is trained to predict, as a component of its own: how training noise is drawn and mixed
into the latents, the timesteps, the target and each sample's loss weight.

The trainer and the tasks know none of this: a task hands its objective clean latents and gets back the
denoiser's input, its timesteps and the target (`draw`), maps the denoiser's output to what is compared with
that target (`prediction`), then weights the per-sample loss as the objective says (`weight`). Two objectives
share these calls, told apart by their `name`:

- `NoisePrediction` (``noise_prediction``): epsilon or v on a DDPM schedule, as Stable Diffusion 1, 2 and
  SDXL train.
- `FlowMatching` (``flow_matching``): rectified flow, x_t = (1 - sigma) x0 + sigma noise with the velocity
  noise - x0 as target, as SD3 and Flux.1 train, with their sigma samplings, shifts, loss weightings and
  SD3's output preconditioning. Its `draw_at` mixes at given sigmas and noise, for a validation loss at
  fixed timesteps.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from sdtrain.config import DiffusionConfig, FlowConfig
from sdtrain.errors import UserError

log = logging.getLogger(__name__)


def multires_noise(noise: torch.Tensor, iterations: int, discount: float, generator: torch.Generator
                   ) -> torch.Tensor:
    """kohya's pyramid noise (sd-scripts' ``pyramid_noise_like``): `noise` (batch, channels, height, width) plus
    `iterations` levels of noise, level i (from 0) drawn on a grid r_i**i times smaller, r_i uniform in [2, 4)
    and drawn afresh per level (level 0 is a second full-resolution draw), upsampled bilinearly and weighted
    discount**i; the sum divided by its standard deviation over the whole batch. Stops after the first level one
    cell wide or tall. Every draw comes from `generator`, so resumes repeat it."""
    height, width = noise.shape[-2:]
    total = noise.float()
    # The grid sizes must be known on the host: one transfer for all levels, not one sync each.
    factors = (2 + 2 * torch.rand(iterations, generator=generator, device=noise.device)).tolist()
    for level, factor in enumerate(factors):
        size = (max(1, int(height / factor**level)), max(1, int(width / factor**level)))
        coarse = torch.randn((*noise.shape[:2], *size), generator=generator, device=noise.device)
        total = total + discount**level * torch.nn.functional.interpolate(coarse, size=(height, width),
                                                                          mode="bilinear", align_corners=False)
        if min(size) == 1:
            break
    return (total / total.std()).to(noise.dtype)


def option_problems(objective: str, config: DiffusionConfig) -> list[str]:
    """What of the diffusion section (`config`) an objective named `objective` cannot take, one line: flow-matching
    options on a noise-prediction model (noise-prediction options on a flow-matching one are only ignored, with a
    warning: the shared fine-tuning recipes set them)."""
    if objective != NoisePrediction.name:
        return []
    flow = FlowConfig()
    unsupported = [f"diffusion.flow.{f.name}: {getattr(config.flow, f.name)}" for f in dataclasses.fields(flow)
                   if getattr(config.flow, f.name) != getattr(flow, f.name)]
    if config.timestep_sampling not in ("uniform", "logit_normal"):
        unsupported.insert(0, f"diffusion.timestep_sampling: {config.timestep_sampling}")
    if not unsupported:
        return []
    return [f"{', '.join(unsupported)}: flow-matching options, which this model's objective (noise prediction on a "
            "DDPM schedule) does not use; remove them"]


class NoisePrediction:
    """Epsilon or v-prediction on a DDPM noise schedule, with the options the field uses: min-SNR-gamma
    weighting, offset and multi-resolution noise, input perturbation, zero terminal SNR (in the schedule
    itself) and uniform or logit-normal timesteps."""

    name = "noise_prediction"

    def __init__(self, config: DiffusionConfig, scheduler: DDPMScheduler, device: torch.device):
        """`config`: the diffusion section; its ``ddpm`` options apply, ``flow`` ones are refused."""
        problems = option_problems(self.name, config)
        if problems:
            raise UserError(problems[0])
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
        cfg = self.config.ddpm
        noise = torch.randn(latents.shape, generator=generator, device=self.device, dtype=latents.dtype)
        if cfg.multires_noise_iterations > 0:
            noise = multires_noise(noise, cfg.multires_noise_iterations, cfg.multires_noise_discount, generator)
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
        return self._mix(latents, noised_with, noise, timesteps)

    @torch.no_grad()
    def draw_at(self, latents: torch.Tensor, noise: torch.Tensor, fractions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`draw` at given fractions of the schedule (timestep = fraction x num_train_timesteps) and `noise`, with
        no random draw and none of the training-time augmentations (offset noise, input perturbation): for a
        validation loss at fixed timesteps."""
        steps = self.scheduler.config.num_train_timesteps
        timesteps = (torch.as_tensor(fractions) * steps).long().clamp(max=steps - 1).to(latents.device)
        latents, noise = latents.float(), noise.to(latents.device, torch.float32)
        return self._mix(latents, noise, noise, timesteps.expand(latents.shape[0]))

    def _mix(self, latents: torch.Tensor, noised_with: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The noisy input (from `noised_with`) and the target (of `noise`: itself, or v)."""
        noisy = self.scheduler.add_noise(latents, noised_with, timesteps)
        if self.prediction_type == "v_prediction":
            return noisy, timesteps, self.scheduler.get_velocity(latents, noise, timesteps)
        return noisy, timesteps, noise

    def prediction(self, output: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """What is compared with the target: the denoiser's output itself (epsilon or v)."""
        return output

    def sample_timesteps(self, count: int, generator: torch.Generator) -> torch.Tensor:
        cfg = self.config
        steps = self.scheduler.config.num_train_timesteps
        if cfg.timestep_sampling == "logit_normal":
            logits = torch.randn(count, generator=generator, device=self.device)
            fraction = torch.sigmoid(cfg.timestep_mean + cfg.timestep_std * logits)
            return (fraction * steps).long().clamp(max=steps - 1)
        return torch.randint(0, steps, (count,), generator=generator, device=self.device)

    def weight(self, loss: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The per-sample loss as it is optimised: min-SNR weighted when `diffusion.ddpm.snr_gamma` is set."""
        return loss * self.snr_weight(timesteps) if self.config.ddpm.snr_gamma > 0 else loss

    def snr_weight(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Min-SNR-gamma: min(snr, gamma) relative to the loss's own weighting of a timestep, which is snr for
        epsilon and snr + 1 for v. Written so that snr = 0 (the last step of a zero-terminal-SNR schedule)
        gives a finite weight: for epsilon min(snr, gamma) / snr is 1 whenever snr <= gamma."""
        gamma = self.config.ddpm.snr_gamma
        alpha = self.alphas_cumprod[timesteps].float()
        snr = alpha / (1 - alpha)
        if self.prediction_type == "v_prediction":
            return torch.clamp(snr, max=gamma) / (snr + 1)
        return torch.where(snr <= gamma, torch.ones_like(snr), gamma / snr.clamp(min=1e-12))


class FlowMatching:
    """Rectified flow (Liu et al., 2022; Esser et al., 2024): x_t = (1 - sigma) x0 + sigma noise, the denoiser
    predicts the velocity noise - x0, timesteps are sigma * num_train_timesteps as floats.

    Sigmas are continuous (not snapped to the scheduler's 1000-step grid as diffusers' example scripts do),
    drawn by ``diffusion.timestep_sampling`` and then shifted exactly as the scheduler shifts its sampling
    sigmas, read from its config: statically by ``shift``, or with ``use_dynamic_shifting`` by mu linear in
    the image's tokens (Flux.1-dev), so training and sampling see the same schedule; a family whose pipeline
    samples with another mu (Flux.2's, by its step count too) trains at it with ``diffusion.flow.dynamic_shift:
    sampling`` (`sampling_mu`). The scheduler's
    sampling-grid options (``shift_terminal``, Karras, exponential and beta sigmas) do not apply to drawn
    sigmas and are not used."""

    name = "flow_matching"

    def __init__(self, config: DiffusionConfig, scheduler: FlowMatchEulerDiscreteScheduler, device: torch.device,
                 patch_size: int = 2, sampling_mu: Callable[[int], float | None] | None = None,
                 share: tuple[float, float] | None = None):
        """`patch_size`: the side of the latent patch the denoiser makes one token of (Flux packs 2x2, SD3
        patches 2x2), for the image-token count the dynamic shift depends on. `sampling_mu`: the dynamic shift's
        mu at an image's token count where it is not the scheduler's linear one (`mu`; None: it is). `share`: the
        shifted sigmas [low, high) the denoiser takes, an expert's of a model of experts (high 1 includes 1); None:
        all."""
        if share is not None and not 0 <= share[0] < share[1] <= 1:
            raise UserError(f"an expert's share of the sigmas must lie in [0, 1] and be wider than nothing, not "
                            f"{share}: fix the model's boundary_ratio")
        self.share = share
        # These shape the DDPM noise or its loss. The shared fine-tuning recipes set min-SNR for SD, and a Flux or
        # SD3 model fine-tuned with them should train, not stop: said once, then left out.
        ignored = [f"diffusion.ddpm.{name}" for name in ("noise_offset", "input_perturbation", "snr_gamma",
                                                          "multires_noise_iterations")
                   if getattr(config.ddpm, name) > 0]
        if ignored:
            log.warning("%s: noise-prediction options, which flow matching does not use; ignored (set to 0 to "
                        "silence this)", ", ".join(ignored))
        self.config = config
        self.scheduler = scheduler
        self.device = device
        self.patch_size = patch_size
        self.sampling_mu = sampling_mu
        self.num_train_timesteps = scheduler.config.num_train_timesteps

    @torch.no_grad()
    def draw(self, latents: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor]:
        """(the denoiser's noisy input, its timesteps, the target) for clean `latents` (batch, channels,
        height, width). From `generator`, in this order: the noise (like `latents`, in its dtype), then one
        sigma per sample (`sample_sigmas`), so a resumed run draws the same noise."""
        noise = torch.randn(latents.shape, generator=generator, device=self.device, dtype=latents.dtype)
        # A clip's tokens are those of each latent frame times its frames.
        tokens = math.prod(latents.shape[2:-2]) * (latents.shape[-2] // self.patch_size) \
            * (latents.shape[-1] // self.patch_size)
        sigmas = self.sample_sigmas(latents.shape[0], generator, tokens)
        return self.draw_at(latents, noise, sigmas)

    @torch.no_grad()
    def draw_at(self, latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor | float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`draw` at the given `sigmas` (one per sample, or one for all) and `noise`, with no shift and no
        random draw: for a validation loss at fixed timesteps and noise (MLPerf's Flux benchmark evaluates
        sigma = k/8, k = 0..7). An expert's objective (`share`) reads them as fractions of its share: it is scored
        where it denoises, not on sigmas the other expert takes."""
        # fp32 throughout: in bf16 the small sigmas round away and the target is quantised.
        latents = latents.to(self.device, torch.float32)
        noise = noise.to(self.device, torch.float32)
        sigmas = torch.as_tensor(sigmas, dtype=torch.float32, device=self.device).expand(latents.shape[0])
        if self.share is not None:
            sigmas = self.share[0] + sigmas * (self.share[1] - self.share[0])
        sigma = _per_sample(sigmas, latents)
        noisy = (1 - sigma) * latents + sigma * noise
        # Preconditioned, the output becomes an estimate of x0 (`prediction`), so x0 is what it is compared with.
        target = latents if self.config.flow.precondition_outputs else noise - latents
        return noisy, sigmas * self.num_train_timesteps, target

    def prediction(self, output: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """What is compared with the target: the denoiser's output, or with ``diffusion.flow.precondition_outputs``
        SD3's preconditioning x_t - sigma * output, the clean latents it implies."""
        if not self.config.flow.precondition_outputs:
            return output
        return noisy - _per_sample(timesteps.float() / self.num_train_timesteps, noisy) * output

    def sample_sigmas(self, count: int, generator: torch.Generator, image_tokens: int | None = None
                      ) -> torch.Tensor:
        """`count` training sigmas in [0, 1], float32: drawn by ``diffusion.timestep_sampling`` from `generator`
        (one draw per sample: a normal for ``logit_normal``, else a uniform), then shifted as the scheduler
        shifts. `image_tokens`: the image's token count, needed by the dynamic shift only.

        With a `share` (an expert's), only the shifted sigmas inside it are kept and the rest drawn again, round
        after round of `count` draws, until every sample has one: the distribution keeps its shape inside the
        share (musubi-tuner's ``--preserve_distribution_shape``) rather than being squeezed into it, and every
        round comes from `generator` in order, so a resumed run draws the same sigmas."""
        sigmas = self._shifted(count, generator, image_tokens)
        if self.share is None:
            return sigmas
        low, high = self.share

        def inside(values: torch.Tensor) -> torch.Tensor:
            return values[(values >= low) & ((values < high) if high < 1 else (values <= 1))]

        kept = inside(sigmas)
        for _ in range(_SHARE_ROUNDS):
            if kept.numel() >= count:
                return kept[:count]
            kept = torch.cat([kept, inside(self._shifted(count, generator, image_tokens))])
        raise UserError(f"diffusion.timestep_sampling: {self.config.timestep_sampling} after the shift draws almost "
                        f"no sigma in this expert's share [{low:g}, {high:g}); sample more evenly (uniform)")

    def _shifted(self, count: int, generator: torch.Generator, image_tokens: int | None) -> torch.Tensor:
        """One round of `sample_sigmas`: `count` draws, shifted."""
        cfg = self.config
        # diffusers' own sampler, which takes our generator; cosmap is a map of its uniform draw.
        scheme = "uniform" if cfg.timestep_sampling == "cosmap" else cfg.timestep_sampling
        sigmas = compute_density_for_timestep_sampling(scheme, count, logit_mean=cfg.timestep_mean,
                                                       logit_std=cfg.timestep_std, mode_scale=cfg.mode_scale,
                                                       device=self.device, generator=generator)
        if cfg.timestep_sampling == "cosmap":
            sigmas = 1 - 1 / (torch.tan(math.pi * sigmas / 2) + 1)
        return self.shift(sigmas, image_tokens)

    def shift(self, sigmas: torch.Tensor, image_tokens: int | None = None) -> torch.Tensor:
        """`sigmas` shifted as the scheduler's `set_timesteps` shifts its sampling sigmas: by `mu(image_tokens)`
        (or `sampling_mu`'s) with dynamic shifting, else by the static s, s sigma / (1 + (s - 1) sigma)."""
        config = self.scheduler.config
        if config.use_dynamic_shifting:
            if image_tokens is None:
                raise ValueError("the scheduler's dynamic shift needs the image's token count")
            mu = self.sampling_mu(image_tokens) if self.sampling_mu is not None else None
            mu = self.mu(image_tokens) if mu is None else mu
            # The scheduler's own function, so its time_shift_type (exponential, as Flux) holds here as well.
            return self.scheduler.time_shift(mu, 1.0, sigmas)
        s = config.shift
        return s * sigmas / (1 + (s - 1) * sigmas)

    def mu(self, image_tokens: int) -> float:
        """The dynamic shift's log-scale at `image_tokens`: linear from ``base_shift`` at ``base_image_seq_len``
        to ``max_shift`` at ``max_image_seq_len`` (Flux.1-dev: 0.5 at 256, 1.15 at 4096), with the arithmetic
        of diffusers' Flux pipeline (`calculate_shift`), so sampling computes the same value."""
        config = self.scheduler.config
        slope = (config.max_shift - config.base_shift) / (config.max_image_seq_len - config.base_image_seq_len)
        return image_tokens * slope + (config.base_shift - slope * config.base_image_seq_len)

    def weight(self, loss: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The per-sample loss times the ``diffusion.flow.loss_weighting`` weight of each sample's sigma, as
        diffusers' `compute_loss_weighting_for_sd3`: none 1, sigma_sqrt sigma^-2, cosmap
        2 / (pi (1 - 2 sigma + 2 sigma^2))."""
        sigmas = timesteps.float() / self.num_train_timesteps
        if self.config.flow.loss_weighting == "sigma_sqrt":
            # A continuous draw reaches sigma = 0 exactly (p = 2^-24 per sample), where sigma^-2 is infinite;
            # the scheduler's grid, which diffusers' scripts draw from, stops at 1 / num_train_timesteps.
            sigmas = sigmas.clamp(min=1 / self.num_train_timesteps)
        return loss * compute_loss_weighting_for_sd3(self.config.flow.loss_weighting, sigmas)


_SHARE_ROUNDS = 1000
"""Rounds of draws `FlowMatching.sample_sigmas` makes for an expert's share before it says the sampling misses it."""


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """One value per sample, shaped to broadcast over the rest of `like`'s dimensions."""
    return values.reshape(-1, *([1] * (like.dim() - 1)))
