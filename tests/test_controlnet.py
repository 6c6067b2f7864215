"""ControlNet training (``mode: controlnet``, configs/controlnet.yaml) on a tiny pretrained Stable Diffusion with the
shapes dataset's layout maps: made from the frozen UNet as the paper does, trained alone (the base stays out of the
checkpoint), validated with the last batch's maps, exported as a folder diffusers' own ControlNet pipeline samples
with; a family that hosts none says so in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdtrain.checkpoint import latest_checkpoint
from sdtrain.cli.main import main
from sdtrain.export import export_run

from .conftest import TINY, config_path, run_card, warns_nothing

CONFIGS = config_path("diffusion.yaml").parents[1]


def _train(run: Path, pretrained: Path, shards: Path, *extra: str) -> int:
    return main(["train", str(CONFIGS / "controlnet.yaml"), f"run_dir={run}", *TINY, f"model.pretrained={pretrained}",
                 f"data.shards={shards}", "train.max_steps=2", "optim.lr=0.01", "logging.every=1", *extra])


def test_a_controlnet_trains_beside_the_frozen_unet_and_exports_what_diffusers_samples_with(
        tmp_path, pretrained, layouts, caplog):
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, UNet2DConditionModel

    run = tmp_path / "run"
    assert _train(run, pretrained, layouts, "validation.prompts=[a red circle,a blue square]",
                  "validation.steps=2") == 0
    checkpoint = latest_checkpoint(run)
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert weights and all(k.startswith("controlnet.") for k in weights)  # the base is not the run's to save
    assert json.loads((checkpoint / "meta.json").read_text())["modules"]["controlnet"]["class"] == "ControlNetModel"
    # Made from the UNet: its encoder's weights copied, the zero convolutions trained away from zero.
    unet = UNet2DConditionModel.from_pretrained(pretrained, subfolder="unet")
    start = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32, 96)).state_dict()
    assert not start["controlnet_mid_block.weight"].any()
    assert weights["controlnet.controlnet_mid_block.weight"].abs().max() > 0
    assert torch.equal(start["conv_in.weight"], unet.conv_in.weight)
    assert (run / "samples" / "step_00000002.png").is_file()  # drawn with the last batch's maps

    out = export_run(run, tmp_path / "out")
    with warns_nothing(caplog):  # its config is all ControlNetModel's own
        controlnet = ControlNetModel.from_pretrained(out / "controlnet")
    for key, value in controlnet.state_dict().items():
        torch.testing.assert_close(value, weights[f"controlnet.{key}"], rtol=0, atol=0, msg=key)
    pipe = StableDiffusionControlNetPipeline.from_pretrained(pretrained, controlnet=controlnet, safety_checker=None,
                                                             local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    from PIL import Image

    layout = Image.new("RGB", (32, 32))
    layout.paste((230, 30, 30), (4, 8, 14, 18))
    images = [np.asarray(pipe("a red circle", image=layout, num_inference_steps=2, height=32, width=32,
                              controlnet_conditioning_scale=scale, output_type="np",
                              generator=torch.Generator().manual_seed(0)).images[0]) for scale in (0.0, 1.0)]
    assert images[0].shape == (32, 32, 3) and np.abs(images[0] - images[1]).max() > 0  # the ControlNet steers
    layout.save(tmp_path / "layout.png")
    assert main(["generate", "--model", str(pretrained), "--controlnet", str(out / "controlnet"), "--control-image",
                 str(tmp_path / "layout.png"), "--prompt", "a red circle", "--prompt", "a blue square", "--steps", "2",
                 "--size", "32", "--out", str(tmp_path / "images")]) == 0
    assert len(list((tmp_path / "images").glob("*.png"))) == 3  # two images and their grid
    assert main(["generate", "--model", str(pretrained), "--controlnet", str(out / "controlnet"), "--prompt", "x",
                 "--out", str(tmp_path / "none")]) == 2  # no map to follow: one line

    # The model card lists it under its base's task with the tag controlnet, as diffusers' own ControlNet cards do;
    # its code runs as written, loading the ControlNet into the pipeline that samples with it and drawing from a
    # map (one step, at the test's size); it tells ComfyUI's loader.
    data, made = run_card(out, pretrained, sample={"num_inference_steps": 1, "height": 32, "width": 32})
    assert data.pipeline_tag == "text-to-image" and "controlnet" in data.tags and made["image"].size == (32, 32)
    assert type(made["pipe"]) is StableDiffusionControlNetPipeline and type(made["controlnet"]) is ControlNetModel
    assert "Load ControlNet Model" in (out / "README.md").read_text()


def test_a_family_without_a_controlnet_and_data_without_maps_are_one_line(tmp_path, pretrained, shapes_dir, capsys):
    assert _train(tmp_path / "plain", pretrained, shapes_dir) == 2
    error = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert len(error) == 1 and "conditioning images" in error[0] and "KEY.cond.png" in error[0]
    from sdtrain.models import families
    from sdtrain.train.modes.controlnet import ControlNetPart

    with pytest.raises(Exception, match="Z-Image hosts no ControlNet in this release; .*SD3, Flux.1"):
        ControlNetPart(None, families.get("z-image")).make_trainable(torch.nn.Linear(1, 1), {}, [])


def test_encoded_shards_keep_the_maps_cropped_as_their_latents_and_a_controlnet_trains_on_them(
        tmp_path, pretrained, layouts, caplog):
    """`prepare encode` keeps each sample's map; read back, it is cropped as the image was before its latents were
    encoded (the image shards' centre crop, pixel for pixel), and a ControlNet trains on the latents. A UNet's
    ControlNet reads the maps' pixels: the VAE encoder is still skipped."""
    from sdtrain.config import DataConfig
    from sdtrain.data.decode import SampleDecoder
    from sdtrain.data.order import read_shard, resolve_shards

    encoded = tmp_path / "encoded"
    assert main(["prepare", "encode", str(layouts), "--model", str(pretrained), "--out", str(encoded),
                 "--resolution", "24"]) == 0
    plain = SampleDecoder(DataConfig(shards=str(layouts), resolution=24, center_crop=True), None, seed=0)
    reread = SampleDecoder(DataConfig(shards=str(encoded), resolution=24), None, seed=0, encoded=True)
    raw, raw_encoded = read_shard(resolve_shards(str(layouts))[0].url)[0], read_shard(
        resolve_shards(str(encoded))[0].url)[0]
    assert raw["__key__"] == raw_encoded["__key__"]
    torch.testing.assert_close(reread(raw_encoded, (0, 0, 0))["conditioning_pixels"],
                               plain(raw, (0, 0, 0))["conditioning_pixels"], rtol=0, atol=0)
    caplog.set_level("INFO")
    assert _train(tmp_path / "run", pretrained, encoded, "data.resolution=24") == 0
    assert "VAE encoder skipped" in caplog.text
    assert load_file(str(latest_checkpoint(tmp_path / "run") / "model.safetensors"))


def test_each_family_drops_its_own_share_of_captions_unless_the_run_says():
    """The paper drops half the captions (SD 1.5); diffusers' SD3 and Flux.1 ControlNet scripts drop none, and
    Flux.1-dev is never sampled on an empty prompt. The shipped config leaves it to the family; a run's own wins."""
    from sdtrain.config import load_config
    from sdtrain.models import families
    from sdtrain.train.modes.controlnet import ControlNetPart

    def dropped(family: str, *overrides: str) -> float:
        config = load_config(CONFIGS / "controlnet.yaml", ["run_dir=unused", "model.pretrained=unused",
                                                           "data.shards=unused", *overrides])
        data = ControlNetPart(config, families.get(family)).data_config(config.data)
        return data.dropped_captions()

    assert {name: dropped(name) for name in ("sd", "sdxl", "sd3", "flux")} == {
        "sd": 0.5, "sdxl": 0.5, "sd3": 0.0, "flux": 0.0}
    assert dropped("flux", "data.caption_dropout=0.1") == 0.1 and dropped("sd", "data.caption_dropout=0") == 0.0


def test_a_controlnet_and_lora_adapters_on_the_unet_it_steers_train_together_and_load_in_diffusers(
        tmp_path, pretrained, layouts):
    """``mode: [controlnet, lora]``: the ControlNet made from the frozen UNet, adapters on that UNet's attention, both
    trained by one loss; the export holds the ControlNet's folder and the adapters' file, which diffusers' ControlNet
    pipeline loads whole on the base."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline
    from PIL import Image

    run = tmp_path / "run"
    assert _train(run, pretrained, layouts, "mode=[lora,controlnet]", "validation.prompts=[a red circle]",
                  "validation.steps=1") == 0
    checkpoint = latest_checkpoint(run)
    weights = load_file(str(checkpoint / "model.safetensors"))
    adapters = [k for k in weights if k.startswith("unet.")]
    assert adapters and all(".lora_" in k for k in adapters)  # the UNet's base weights stay the base's
    assert any(k.startswith("controlnet.") for k in weights)
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["task"]["mode"] == "controlnet + lora" and meta["task"]["controlnet"] and meta["task"]["lora"]["unet"]

    out = export_run(run, tmp_path / "out")
    assert (out / "controlnet" / "config.json").is_file() and (out / "pytorch_lora_weights.safetensors").is_file()
    pipe = StableDiffusionControlNetPipeline.from_pretrained(
        pretrained, controlnet=ControlNetModel.from_pretrained(out / "controlnet"), safety_checker=None,
        local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    layout = Image.new("RGB", (32, 32))
    layout.paste((230, 30, 30), (4, 8, 14, 18))

    def image() -> np.ndarray:
        return pipe("a red circle", image=layout, num_inference_steps=2, height=32, width=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images[0]

    without = image()
    pipe.load_lora_weights(out)
    loaded = [k for k in pipe.unet.state_dict() if ".lora_" in k]
    assert len(loaded) == len(adapters)  # every adapter the run trained, none left unset
    assert np.abs(image() - without).max() > 0
    card = (out / "README.md").read_text()
    assert "pipe.load_lora_weights(" in card and "lora" in card.split("---")[1]  # its code and its tags
    layout.save(tmp_path / "layout.png")
    assert main(["generate", "--model", str(pretrained), "--controlnet", str(out / "controlnet"), "--lora", str(out),
                 "--control-image", str(tmp_path / "layout.png"), "--prompt", "a red circle", "--steps", "1",
                 "--size", "32", "--out", str(tmp_path / "images")]) == 0


def test_modes_that_do_not_train_together_are_one_line(capsys):
    assert main(["train", str(CONFIGS / "controlnet.yaml"), "--check", "model.pretrained=null", "model.preset=tiny",
                 "mode=[controlnet,textual_inversion]"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == ["sdtrain train: error: mode: [textual_inversion, controlnet] do not train together; modes that "
                     "do: [controlnet, lora]; [instruct_pix2pix, lora]"], error
