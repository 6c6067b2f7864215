"""What Stable Diffusion's UNet families (1.x/2.x, SDXL) share: the UNet2DConditionModel's repeated blocks, and
the original checkpoint layout their single files are in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from diffusers import UNet2DConditionModel
from torch import nn

from sdtrain.models import single_file
from sdtrain.models.families.spec import SingleFileLayout


def unet_blocks(unet: UNet2DConditionModel) -> list:
    """Its levels in forward order: each down block, the mid block (None when the config has none), each up block."""
    return [*unet.down_blocks, unet.mid_block, *unet.up_blocks]


class OriginalCheckpoint(SingleFileLayout):
    """Stable Diffusion's original checkpoint (CompVis/LDM, Stability's SGM for SDXL): UNet, VAE and text
    encoders in one file, as A1111 and ComfyUI load it (`sdtrain.models.single_file`). Its VAE-only files (Flux's
    ae.safetensors, sdxl_vae.safetensors) serve every family."""

    family_bound = False
    text_layouts = single_file.TEXT_LAYOUTS

    def load(self, name: str, path: Path, *, trust_pickle: bool | None, frozen_precision: str, weights: bool,
             latent_constants: Callable[[], dict[str, float | None]]) -> nn.Module:
        return single_file.load_single_file_component(name, path, trust_pickle, weights=weights,
                                                      latent_constants=latent_constants)

    def write(self, out: Path, components: dict[str, nn.Module], *, half: bool, scheduler: Any,
              text_layout: str, text_source: str | Path | None) -> None:
        single_file.save_single_file(out, unet=components.get("unet"), vae=components.get("vae"),
                                     text_encoder=components.get("text_encoder"),
                                     text_encoder_2=components.get("text_encoder_2"), scheduler=scheduler,
                                     text_layout=text_layout, text_source=text_source, half=half)


ORIGINAL_CHECKPOINT = OriginalCheckpoint()
