"""Model families: one spec per family (see spec.py) says which components it has and of which classes,
how they are built, conditioned and called, their repeated blocks, and their pipeline.

Code outside a family's module asks its spec rather than naming the family's classes. Adding a family is
its module, its tests and its entry in FAMILIES.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from torch import nn

from sdtrain.checkpoint import latest_checkpoint, read_meta
from sdtrain.errors import UserError
from sdtrain.models.families.chroma import CHROMA
from sdtrain.models.families.codec import LatentCodec
from sdtrain.models.families.flux import FLUX
from sdtrain.models.families.flux2 import FLUX2, FLUX2_KLEIN
from sdtrain.models.families.krea2 import KREA2
from sdtrain.models.families.qwenimage import QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS
from sdtrain.models.families.qwenimage21 import QWEN_IMAGE_21
from sdtrain.models.families.sd import SD
from sdtrain.models.families.sd3 import SD3
from sdtrain.models.families.sdxl import SDXL
from sdtrain.models.families.spec import ModelFamily, Variant, of_index
from sdtrain.models.families.wan import WAN
from sdtrain.models.families.wan22 import WAN22_TI2V
from sdtrain.models.families.wan_a14b import WAN22_A14B
from sdtrain.models.families.zimage import ZIMAGE

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (
    SD, SDXL, SD3, FLUX, ZIMAGE, QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS,
    FLUX2, FLUX2_KLEIN, KREA2, CHROMA, QWEN_IMAGE_21, WAN,
    WAN22_A14B,
    WAN22_TI2V,
)}


def get(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise UserError(f"model.family: '{name}' is not one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def for_model(config: Any) -> ModelFamily:
    """The family of a run's model (a ModelConfig): the one it names (`named`), else Stable Diffusion."""
    return named(config) or SD


def named(config: Any) -> ModelFamily | None:
    """The family a model config (a ModelConfig) names: ``model.family`` when set (checked against a pretrained
    model's own files), else the pretrained model's, else the family whose presets alone name ``model.preset``;
    None when nothing says."""
    return _naming(config)[0]


def _naming(config: Any) -> tuple[ModelFamily | None, str]:
    """`named`'s family and what said it, as a log line words it."""
    found, told = _detected(config.pretrained) if config.pretrained else (None, None)
    said = f"recognised from {told}" if told is not None else None
    if config.family:
        family = get(config.family)
        if found is not None and found is not family:
            raise UserError(f"model.family: {family.name}, but model.pretrained {config.pretrained} is {found.title}; "
                            f"set model.family={found.name} or leave it unset")
        return family, said or "as model.family names it"
    if found is not None:
        return found, said or f"the default: nothing in {config.pretrained} names a family"
    owners = [family for family in FAMILIES.values() if config.preset in family.presets]
    if len(owners) == 1:
        return owners[0], f"as model.preset={config.preset} names it"
    return None, "the default: neither model.pretrained, model.family nor model.preset names a family"


@dataclass(frozen=True)
class Recognised:
    """What a run's model is (`recognise`)."""

    family: ModelFamily
    variant: Variant | None
    """Which of the released models the family's title stands for it is; None where the title names one, or
    nothing tells."""
    said: str
    """What told the family, as the log line words it (``recognised from FOLDER/model_index.json``)."""

    def line(self) -> str:
        title = self.variant.title if self.variant else self.family.title
        variant = f", variant {self.variant.name}" if self.variant else ""
        return f"model: {title} (family {self.family.name}{variant}, {self.said})"


def recognise(config: Any) -> Recognised:
    """The family of a model config (a ModelConfig) as `for_model` reads it, and the variant the pretrained model's
    files tell (`Sampling.variant`), which a set ``model.variant`` (a run's saved config given again) must be."""
    family, said = _naming(config)
    family = family or SD
    found = family.sampling.variant(config.pretrained) if config.pretrained else None
    if config.variant is not None and (found is None or found.name != config.variant):
        fix = "leave it unset"
        if found is not None:
            problem = f"model.pretrained {config.pretrained} is {found.title}"
            fix = f"set model.variant={found.name} or {fix}"
        elif config.pretrained:
            problem = f"the files of model.pretrained {config.pretrained} do not tell which {family.title} model it is"
        else:
            problem = "no model.pretrained is set for it to name"
        raise UserError(f"model.variant: {config.variant}, but {problem}; {fix}")
    return Recognised(family, found, said)


def latent_constants(config: Any) -> tuple[dict[str, float | None], str] | None:
    """The latent scaling and shift of the model a VAE serves (a ModelConfig), and where they come from: the
    pretrained pipeline's own VAE config when it has one, else the released values of the family the config
    names (`named`); None when nothing says which model it is."""
    if config.pretrained:
        vae_config = Path(config.pretrained) / "vae" / "config.json"
        if vae_config.is_file():
            try:
                settings = json.loads(vae_config.read_text())
            except (OSError, ValueError) as exc:
                raise UserError(f"{vae_config}: cannot read it ({exc}); fix or replace the pipeline's VAE config") \
                    from exc
            vae_class = (named(config) or SD).components.classes["vae"]
            constants = {key: settings.get(key, _init_default(vae_class, key))
                         for key in ("scaling_factor", "shift_factor")}
            return constants, str(vae_config)
    family = named(config)
    if family is None:
        return None
    return dict(family.codec.released), f"{family.title}'s released values"


def _init_default(cls: type, key: str) -> Any:
    """The value a diffusers class takes for constructor argument `key` when its config.json leaves it out."""
    parameter = inspect.signature(cls.__init__).parameters.get(key)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def mode_spec(family: ModelFamily, mode: str, key: str, cannot: str) -> Any:
    """`family`'s spec for a mode it may host (its attribute `mode`: ``controlnet``, ``instruct``, ``reference``);
    a family without one is one line (`unhosted`)."""
    problem = unhosted(family, mode, key, cannot)
    if problem is not None:
        raise UserError(problem)
    return getattr(family, mode)


def unhosted(family: ModelFamily, mode: str, key: str, cannot: str) -> str | None:
    """None when `family` hosts the mode its attribute `mode` describes, else the line that says it does not: `key`,
    the family that `cannot`, and the families that can."""
    if getattr(family, mode) is not None:
        return None
    hosts = ", ".join(f.title for f in FAMILIES.values() if getattr(f, mode) is not None)
    return f"{key}: {family.title} {cannot} in this release; {hosts} do"


def of_pipeline(pipe: Any) -> ModelFamily:
    """The family whose pipeline class `pipe` is."""
    return of_index([family for family in FAMILIES.values() if isinstance(pipe, family.pipeline_classes())],
                    pipe.config) or SD


def codec_of(vae: nn.Module, served: Any = None) -> LatentCodec:
    """The latent codec that reads `vae`: that of the model it serves (a ModelConfig) when its VAE is of that class,
    else that of the first family whose VAE class it is."""
    family = named(served) if served is not None else None
    if family is None or not isinstance(vae, family.components.classes["vae"]):
        family = next((f for f in FAMILIES.values() if isinstance(vae, f.components.classes["vae"])), None)
    if family is None:
        raise UserError(f"a {type(vae).__name__} autoencoder is no model family's; sdtrain reads "
                        f"{', '.join(sorted({f.components.classes['vae'].__name__ for f in FAMILIES.values()}))}")
    return family.codec


def component_class(name: str, family: ModelFamily | None = None) -> type[nn.Module]:
    """The class of component `name` in `family`, or in whichever family has it."""
    for candidate in [family] if family else FAMILIES.values():
        if name in candidate.components:
            return candidate.components[name].cls
    raise UserError(f"no model family has a component named {name}")


def blocks(root: nn.Module) -> list[nn.Module]:
    """The repeated blocks of whatever family's components `root` holds, in the order of `root.modules()`."""
    found = {id(block) for family in FAMILIES.values() for block in family.blocks(root)}
    return [module for module in root.modules() if id(module) in found]


def family_of_keys(keys: list[str]) -> ModelFamily | None:
    """The family whose single-file layout a file's tensor `keys` are in; None: no family's."""
    # SDXL and SD3 files hold SD's VAE (and SDXL its UNet) prefixes too: the most specific keys decide.
    for candidate in FAMILIES.values():
        if candidate is not SD and candidate.files.holds_file(keys):
            return candidate
    return SD if SD.files.holds_file(keys) else None


def detect(source: str | Path) -> ModelFamily:
    """The family of a pretrained pipeline folder, single file or sdtrain run, from its files alone (the pipeline
    class in model_index.json; a single file's key names; the family a run's checkpoint records). Other sources
    (a component folder, a run of an earlier release) are taken for Stable Diffusion. A model of no model
    family this release knows is one line naming what was found."""
    return _detected(source)[0]


def _detected(source: str | Path) -> tuple[ModelFamily, Path | None]:
    """`detect`'s family of `source`, and the file that told it (None: taken for Stable Diffusion)."""
    path = Path(source)
    checkpoint = path if (path / "meta.json").is_file() else latest_checkpoint(path) if path.is_dir() else None
    if checkpoint is not None:
        recorded = FAMILIES.get(read_meta(checkpoint).get("task", {}).get("family"))
        return (SD, None) if recorded is None else (recorded, checkpoint / "meta.json")
    if (path / "model_index.json").is_file():
        try:
            index = json.loads((path / "model_index.json").read_text())
            found = index.get("_class_name")
        except (OSError, ValueError, AttributeError):
            return SD, None  # the pipeline loader reports what is wrong with the file
        known = of_index([f for f in FAMILIES.values() if found in f.sampling.pipeline_names
                          or found in (c.__name__ for c in f.pipeline_classes())], index)
        if known is not None:
            return known, path / "model_index.json"
    elif path.is_file() and path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as file:
                keys = list(file.keys())
        except (OSError, SafetensorError):
            return SD, None  # the single-file loader reports what is wrong with the file
        known = family_of_keys(keys)
        if known is not None:
            return known, path
        found = f"keys such as {', '.join(keys[:3])}"
    else:
        return SD, None
    trained = ", ".join(f.title for f in FAMILIES.values())
    raise UserError(f"model.pretrained: {path} is of no model family this release knows ({found}); sdtrain trains "
                    f"{trained}")
