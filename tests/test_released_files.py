"""Files as users download them: a VAE file in the original layout with no metadata (Flux's ae.safetensors, SDXL's
fp16-fix VAE, SD3's VAE) takes the latent constants of the model it serves, never SD 1.x's by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from sdtrain.cli.main import main
from sdtrain.config import ModelConfig
from sdtrain.data.shards import read_manifest
from sdtrain.errors import UserError
from sdtrain.loaders.components import load_component
from sdtrain.models import families
from sdtrain.models.families.ldm_checkpoint import to_original_state_dict

FLUX_RELEASED = {"scaling_factor": 0.3611, "shift_factor": 0.1159}


def _tiny_vae(family: str, **constants):
    from diffusers import AutoencoderKL

    return AutoencoderKL(**{**families.get(family).preset("tiny", "vae"), **constants})


def _released_vae_file(vae, path: Path) -> Path:
    """The VAE alone in the original layout, bare keys and no metadata: as ae.safetensors and sdxl_vae.safetensors
    are released."""
    save_file({k: v.contiguous() for k, v in to_original_state_dict(vae=vae).items()}, str(path))
    return path


@pytest.fixture(scope="module")
def flux_model(tmp_path_factory) -> tuple[Path, Path]:
    """A Flux.1 model folder whose VAE config has the released constants, and its VAE as a bare file."""
    root = tmp_path_factory.mktemp("flux-released")
    vae = _tiny_vae("flux", **FLUX_RELEASED)
    pipeline = root / "FLUX.1-tiny"
    vae.save_pretrained(pipeline / "vae")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    return pipeline, _released_vae_file(vae, root / "ae.safetensors")


def _constants(vae) -> dict:
    return {"scaling_factor": vae.config.scaling_factor, "shift_factor": vae.config.get("shift_factor")}


def test_prepare_encode_takes_a_vae_files_constants_from_the_model(tmp_path, shapes_dir, flux_model):
    pipeline, ae = flux_model
    out = tmp_path / "encoded"
    assert main(["prepare", "encode", str(shapes_dir), "--model", str(pipeline), "--vae", str(ae), "--no-text",
                 "--out", str(out), "--resolution", "32", "--device", "cpu"]) == 0
    encoding = read_manifest(out)["encoding"]
    assert (encoding["scaling_factor"], encoding["shift_factor"]) == pytest.approx((0.3611, 0.1159))


def test_a_vae_file_takes_the_pipelines_config_then_the_familys_released_values(tmp_path, flux_model):
    pipeline, ae = flux_model
    # The pipeline's own VAE config first, whatever the family's released values are.
    custom = tmp_path / "custom"
    _tiny_vae("flux", scaling_factor=0.5, shift_factor=0.25).save_pretrained(custom / "vae")
    (custom / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert _constants(load_component("vae", ae, served=ModelConfig(pretrained=str(custom)))) == \
        {"scaling_factor": 0.5, "shift_factor": 0.25}
    # The family's released values where the model is only named.
    expected = {"flux": FLUX_RELEASED, "sd3": {"scaling_factor": 1.5305, "shift_factor": 0.0609},
                "sdxl": {"scaling_factor": 0.13025, "shift_factor": None},
                "sd": {"scaling_factor": 0.18215, "shift_factor": None}}
    for family, constants in expected.items():
        vae = _tiny_vae(family)
        path = _released_vae_file(vae, tmp_path / f"{family}_vae.safetensors")
        assert _constants(load_component("vae", path, served=ModelConfig(family=family))) == constants, family
    # A preset names its family too.
    assert _constants(load_component("vae", ae, served=ModelConfig(preset="flux-schnell"))) == FLUX_RELEASED


def test_a_vae_file_with_no_model_to_serve_is_one_line_asking_for_the_family(tmp_path, shapes_dir, flux_model):
    _, ae = flux_model
    with pytest.raises(UserError, match="set model.family") as caught:
        load_component("vae", ae, served=ModelConfig())
    assert str(ae) in str(caught.value) and "\n" not in str(caught.value)
    # From the CLI: one line, exit 2, no shard written.
    out = tmp_path / "encoded"
    assert main(["prepare", "encode", str(shapes_dir), "--vae", str(ae), "--no-text", "--out", str(out),
                 "--resolution", "32", "--device", "cpu"]) == 2
    assert not list(out.glob("*.tar"))
    # --family says which.
    assert main(["prepare", "encode", str(shapes_dir), "--vae", str(ae), "--family", "flux", "--no-text",
                 "--out", str(out), "--resolution", "32", "--device", "cpu"]) == 0
    assert read_manifest(out)["encoding"]["scaling_factor"] == pytest.approx(0.3611)


def test_files_that_state_their_constants_keep_them(tmp_path):
    from sdtrain.models.families.ldm_checkpoint import save

    # sdtrain's own VAE file says its constants in its metadata: they win over the family's.
    vae = _tiny_vae("sd", scaling_factor=0.7)
    ours = save(tmp_path / "vae.safetensors", vae=vae)
    assert load_component("vae", ours, served=ModelConfig(family="sdxl")).config.scaling_factor == 0.7
