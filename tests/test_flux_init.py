"""model.denoiser_init: a Flux.1 transformer built from scratch starts as the MLPerf reference's does (torchtitan's
FluxModel.init_weights), while SD's UNet and any `library` build keep diffusers' own initialisation, bitwise."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from sdtrain.config import load_config
from sdtrain.models import build
from sdtrain.models.families.flux import FLUX

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "mlperf-flux1-schnell-256.yaml"
# The tiny preset's transformer reads T5 and CLIP widths of 32 (its text encoders' at that preset).
TEXT = {"joint_attention_dim": 32, "pooled_projection_dim": 32}


def _model(*overrides: str):
    return load_config(None, ["stage=diffusion", "run_dir=/runs/x", "data.shards=/data", "model.preset=tiny",
                              *overrides]).model


def _flux(*overrides: str) -> nn.Module:
    torch.manual_seed(0)
    return build.build_denoiser(_model("model.family=flux", *overrides), 16, 8, derived=TEXT)


def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {name: layer for name, layer in module.named_modules() if isinstance(layer, nn.Linear)}


def _zeroed(name: str) -> bool:
    """The adaLN modulations (double blocks' norm1 and norm1_context, single blocks' norm, the final norm_out) and
    the output projection."""
    return name.endswith((".norm1.linear", ".norm1_context.linear", ".norm.linear")) or name in ("norm_out.linear",
                                                                                                "proj_out")


def _xavier_fan_out(transformer: nn.Module, name: str, layer: nn.Linear) -> int:
    """The output width of the layer the reference initialises: BFL's fused qkv (and, in a single block, qkv with
    the MLP's input: linear1)."""
    config = transformer.config
    width = config.num_attention_heads * config.attention_head_dim
    if name.startswith("single_transformer_blocks.") and name.endswith(("attn.to_q", "attn.to_k", "attn.to_v",
                                                                        "proj_mlp")):
        return 3 * width + transformer.single_transformer_blocks[0].proj_mlp.out_features
    if name.endswith(("attn.to_q", "attn.to_k", "attn.to_v", "add_q_proj", "add_k_proj", "add_v_proj")):
        return 3 * width
    return layer.out_features


@pytest.mark.parametrize("init", ["auto", "reference"])
def test_a_flux_transformer_from_scratch_starts_as_the_reference_initialises_it(init):
    transformer = _flux(f"model.denoiser_init={init}")
    linears = _linears(transformer)
    zeroed = {name for name in linears if _zeroed(name)}
    embedders = {name for name in linears if name.startswith("time_text_embed.")}
    # Every modulation of every block, the final one and the output projection; all three embedder MLPs (the
    # tiny preset has dev's guidance embedding).
    config = transformer.config
    assert len(zeroed) == 2 * config.num_layers + config.num_single_layers + 2
    assert {name.split(".")[1] for name in embedders} == {"timestep_embedder", "guidance_embedder", "text_embedder"}
    for name, layer in linears.items():
        weight = layer.weight.detach()
        assert layer.bias is not None and not layer.bias.any(), name
        std = float(weight.std())
        if name in zeroed:
            assert not weight.any(), name
        elif name in embedders:
            assert std == pytest.approx(0.02, rel=0.15), name
            assert abs(float(weight.mean())) < 0.005, name
        else:
            fan_out = _xavier_fan_out(transformer, name, layer)
            bound = math.sqrt(6 / (layer.in_features + fan_out))
            assert std == pytest.approx(math.sqrt(2 / (layer.in_features + fan_out)), rel=0.15), name
            assert float(weight.abs().max()) <= bound, name  # uniform within Xavier's bound
    assert len(linears) > len(zeroed) + len(embedders) + 10  # the attention and MLP layers were checked too
    # The q and k RMSNorm scales are one.
    scales = [p for name, p in transformer.named_parameters() if ".norm_" in name]
    assert scales and all(bool((p == 1).all()) for p in scales)


def test_library_keeps_diffusers_initialisation_with_no_layer_zero():
    transformer = _flux("model.denoiser_init=library")
    for name, layer in _linears(transformer).items():
        assert layer.weight.any() and layer.bias.any(), name
        assert float(layer.weight.detach().std()) > 0, name


def test_auto_and_reference_draw_alike_and_a_flux_recipe_asks_for_the_reference():
    auto, reference = _flux(), _flux("model.denoiser_init=reference")
    assert all(torch.equal(a, b) for a, b in zip(auto.state_dict().values(), reference.state_dict().values()))
    config = load_config(RECIPE, ["run_dir=/runs/flux", "data.shards=/d", "evaluation.val_shards=/v",
                                  *(f"model.{c}=/m" for c in ("vae", "text_encoder", "text_encoder_2"))])
    assert config.model.denoiser_init == "reference"


@pytest.mark.parametrize("init", ["auto", "reference"])
def test_an_sd_unet_from_scratch_is_bitwise_diffusers_own_and_draws_nothing_more(init):
    built = {}
    for mode in ("library", init):
        torch.manual_seed(0)
        unet = build.build_unet(_model(f"model.denoiser_init={mode}"), 4, 8, cross_attention_dim=32)
        built[mode] = (unet.state_dict(), torch.get_rng_state())
    (library, library_rng), (other, other_rng) = built["library"], built[init]
    assert library.keys() == other.keys() and all(torch.equal(library[k], other[k]) for k in library)
    assert torch.equal(library_rng, other_rng)


def test_the_reference_initialised_transformer_trains():
    transformer = _flux()
    batch = 2
    noisy = torch.randn(batch, 16, 8, 8)
    condition = {"encoder_hidden_states": torch.randn(batch, 6, 32), "pooled_projections": torch.randn(batch, 32),
                 "guidance": torch.full((batch,), 3.5)}
    target = torch.randn(batch, 16, 8, 8)
    timesteps = torch.tensor([250.0, 750.0])
    optimizer = torch.optim.SGD(transformer.parameters(), lr=0.1)
    zeroed = {name: layer for name, layer in _linears(transformer).items() if _zeroed(name)}

    output = FLUX.denoising.denoise(transformer, noisy, timesteps, condition)
    assert torch.isfinite(output).all() and not output.any()  # the output starts at zero
    torch.nn.functional.mse_loss(output, target).backward()
    # Gradients reach the output projection first (the layers behind it see a zero weight).
    assert transformer.proj_out.weight.grad.abs().sum() > 0
    # Then, step by step, to the layers behind it: the final adaLN and the image stream's gates at the next step,
    # the text stream's (which reaches the output through the single blocks' gated attention) at the one after.
    reached = set()
    for _ in range(2):
        optimizer.step()
        optimizer.zero_grad()
        output = FLUX.denoising.denoise(transformer, noisy, timesteps, condition)
        assert torch.isfinite(output).all() and output.any()
        torch.nn.functional.mse_loss(output, target).backward()
        reached |= {name for name, layer in zeroed.items() if layer.weight.grad.abs().sum() > 0}
    assert reached == set(zeroed)
