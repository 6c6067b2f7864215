"""Wan 2.1's original file layout (sdtrain.models.families.wan_file): the names both ways, checked against
diffusers' own converter; the transformer file written and read by diffusers' from_single_file weight for weight;
a file in Wan's layout (bare, and under ComfyUI's prefix) read back weight for weight; bad files refused in one
line; and a LoRA file in ComfyUI's Wan names that diffusers' Wan loader reads whole, every adapter set to the
trained delta. ComfyUI's own loaders run on the same files in test_wan_comfyui.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import save_file

from sdtrain.errors import UserError
from sdtrain.models.families import wan_file
from sdtrain.models.single_file.write import LAYOUT_CONFIG_KEY

TINY = {"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 4,
        "out_channels": 4, "text_dim": 24, "freq_dim": 16, "ffn_dim": 48, "num_layers": 2, "rope_max_seq_len": 64}
I2V = {"image_dim": 20, "added_kv_proj_dim": 32}
FLF2V = {**I2V, "pos_embed_seq_len": 6}
VARIANTS = {"t2v": {}, "i2v": I2V, "flf2v": FLF2V}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2",
                "proj_out", "time_proj", "text_embedder.linear_1", "time_embedder.linear_2",
                "image_embedder.ff.net.0.proj"]
"""The blocks' attention (I2V's image keys too) and feed-forward layers, and layers outside the blocks, where
diffusers reads no alpha."""


def _tiny(seed: int = 0, **extra) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**TINY, **extra})
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.05)
    return model.eval()


def _inputs(model: WanTransformer3DModel, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    inputs = {"hidden_states": torch.randn(1, config.in_channels, 2, 4, 4, generator=generator),
              "timestep": torch.tensor([500.0]),
              "encoder_hidden_states": torch.randn(1, 5, config.text_dim, generator=generator)}
    if config.pos_embed_seq_len:
        # FLF2V's two frames' image tokens, which its embedder lays side by side for its position table.
        image = torch.randn(2, config.pos_embed_seq_len // 2, config.image_dim, generator=generator)
        inputs["encoder_hidden_states_image"] = image
    elif config.image_dim:
        inputs["encoder_hidden_states_image"] = torch.randn(1, 6, config.image_dim, generator=generator)
    return inputs


def _output(model: WanTransformer3DModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def _original_file(model: WanTransformer3DModel, path, prefix: str = "", metadata: dict | None = None):
    """A file as Wan-AI's and ComfyUI's are made: Wan's names under `prefix`, no sdtrain metadata unless given."""
    state = wan_file.to_original(model.state_dict())
    save_file({prefix + key: value.contiguous() for key, value in state.items()}, str(path), metadata=metadata)
    return path


# ---------------------------------------------------------------------------------------------------------- names
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_names_go_both_ways_and_diffusers_converter_reads_them_back(variant):
    state = _tiny(**VARIANTS[variant]).state_dict()
    original = wan_file.to_original(state)
    assert len(original) == len(state)
    assert dict(wan_file.from_original(list(original), original.__getitem__)).keys() == state.keys()
    # diffusers' own converter (what its from_single_file runs) takes every name back to the model's; FLF2V's
    # position table it leaves under Wan's name, which diffusers has no rule for.
    converted = convert_wan_transformer_to_diffusers(dict(original))
    if variant == "flf2v":
        assert converted.pop("img_emb.emb_pos") is original["img_emb.emb_pos"]
        del state["condition_embedder.image_embedder.pos_embed"]
    assert converted.keys() == state.keys()
    assert all(converted[key] is original[wan_file.original_module_path(key)] for key in state)


def test_known_names():
    """Facts of the two layouts, as Wan's code, diffusers' converter and ComfyUI's model name them."""
    pairs = {"patch_embedding": "patch_embedding", "condition_embedder.text_embedder.linear_2": "text_embedding.2",
             "condition_embedder.time_embedder.linear_1": "time_embedding.0",
             "condition_embedder.time_proj": "time_projection.1", "proj_out": "head.head",
             "scale_shift_table": "head.modulation", "blocks.3.scale_shift_table": "blocks.3.modulation",
             "blocks.0.attn1.to_out.0": "blocks.0.self_attn.o", "blocks.1.attn2.norm_k": "blocks.1.cross_attn.norm_k",
             "blocks.0.attn2.add_v_proj": "blocks.0.cross_attn.v_img",
             "blocks.0.attn2.norm_added_k": "blocks.0.cross_attn.norm_k_img",
             # diffusers' second norm of a block is Wan's third (Wan's second has no weights).
             "blocks.12.norm2": "blocks.12.norm3", "blocks.0.ffn.net.0.proj": "blocks.0.ffn.0",
             "blocks.0.ffn.net.2": "blocks.0.ffn.2", "condition_embedder.image_embedder.norm2": "img_emb.proj.4"}
    for ours, theirs in pairs.items():
        assert wan_file.original_module_path(ours) == theirs
        assert wan_file.diffusers_module_path(theirs) == ours
        assert wan_file.original_module_path(ours + ".weight") == theirs + ".weight"
    assert wan_file.lora_name("blocks.0.attn1.to_q") == "diffusion_model.blocks.0.self_attn.q"
    for unplaced in ("blocks.0.attn1.to_qkv", "rope", "vace_blocks.0.proj_out"):
        with pytest.raises(ValueError, match="not a diffusers module"):
            wan_file.original_module_path(unplaced)


# --------------------------------------------------------------------------------------------------- single files
@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_what_sdtrain_writes_diffusers_from_single_file_reads_weight_for_weight(tmp_path, variant):
    model = _tiny(**VARIANTS[variant])
    out = tmp_path / "wan.safetensors"
    wan_file.TRANSFORMER_FILE.write(out, {"transformer": model}, half=False, scheduler=None, text_layout="",
                                    text_source=None)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "the temporary file was left"
    with safe_open(str(out), framework="pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
    assert keys == set(wan_file.to_original(model.state_dict())) and "head.modulation" in keys
    assert metadata["model_family"] == wan_file.FAMILY
    # The settings the shapes cannot tell travel in the metadata, the rest not at all.
    assert json.loads(metadata[LAYOUT_CONFIG_KEY]) == {"attention_head_dim": 16, "eps": 1e-6,
                                                       "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 64}
    config = tmp_path / "config"
    model.save_config(config)
    loaded = WanTransformer3DModel.from_single_file(str(out), config=str(config), local_files_only=True,
                                                    torch_dtype=torch.float32)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    # And sdtrain reads its own file back to the same model, config and all.
    again = wan_file.load_transformer_file(out)
    assert {k: v for k, v in again.config.items() if not k.startswith("_")} == {
        k: v for k, v in model.config.items() if not k.startswith("_")}
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("prefix", wan_file.PREFIXES, ids=["comfyui", "bare"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_file_in_wans_layout_reads_back_weight_for_weight(tmp_path, variant, prefix):
    """A release-like file: no sdtrain metadata, so the released models' 128-wide heads."""
    released = {"num_attention_heads": 1, "attention_head_dim": 128, "rope_max_seq_len": 1024}
    # I2V's image keys project the image tokens, as wide as the model once embedded.
    model = _tiny(**{**VARIANTS[variant], **released, **({"added_kv_proj_dim": 128} if variant != "t2v" else {})})
    path = _original_file(model, tmp_path / "wan2.1_tiny.safetensors", prefix)
    loaded = wan_file.load_transformer_file(path)
    assert isinstance(loaded, WanTransformer3DModel) and not loaded.training
    assert {k: v for k, v in loaded.config.items() if not k.startswith("_")} == {
        k: v for k, v in model.config.items() if not k.startswith("_")}
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    inputs = _inputs(model)
    assert torch.equal(_output(loaded, inputs), _output(model, inputs))
    header = wan_file.load_transformer_file(path, weights=False)
    assert all(p.is_meta for p in header.parameters())
    low = wan_file.load_transformer_file(path, frozen_precision="bf16")
    assert torch.allclose(_output(low, inputs), _output(model, inputs), atol=0.05)


def test_the_layout_is_told_by_its_keys():
    keys = wan_file.to_original(_tiny().state_dict())
    assert wan_file.prefix_of(keys) == ""
    assert wan_file.prefix_of("model.diffusion_model." + k for k in keys) == "model.diffusion_model."
    assert wan_file.prefix_of(["transformer_blocks.0.img_mod.1.weight"]) is None
    assert wan_file.SINGLE_FILE_KEYS == ("model.diffusion_model.head.modulation", "head.modulation")
    assert "head.modulation" in keys


def test_bad_files_are_one_line_naming_the_file_and_the_fix(tmp_path):
    other = tmp_path / "qwen.safetensors"
    save_file({"transformer_blocks.0.img_mod.1.weight": torch.zeros(2, 2)}, str(other))
    with pytest.raises(UserError, match=r"qwen.safetensors: holds no Wan 2.1 transformer .*; pass a Wan 2.1") as err:
        wan_file.load_transformer_file(other)
    assert "\n" not in str(err.value)

    model = _tiny()
    state = wan_file.to_original(model.state_dict())
    del state["blocks.1.ffn.2.weight"]
    lacking = tmp_path / "lacking.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(lacking),
              metadata={LAYOUT_CONFIG_KEY: json.dumps({"attention_head_dim": 16})})
    with pytest.raises(UserError, match=r"lacking.safetensors: .*lacks 1 weights \(e\.g\. blocks\.1\.ffn\.2\.weight"
                                        r"\); the file is incomplete\); pass a Wan 2.1") as err:
        wan_file.load_transformer_file(lacking, weights=False)
    assert "\n" not in str(err.value)

    heads = tmp_path / "heads.safetensors"
    _original_file(model, heads)
    with pytest.raises(UserError, match=r"heads.safetensors: .*width 32 is not a whole number of 128-wide heads"):
        wan_file.load_transformer_file(heads)

    state = wan_file.to_original(model.state_dict())
    state["vace_blocks.0.after_proj.weight"] = torch.zeros(2, 2)
    vace = tmp_path / "vace.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(vace))
    with pytest.raises(UserError, match=r"vace.safetensors: .*1 tensors have no place .*vace_blocks\.0\.after_proj"):
        wan_file.load_transformer_file(vace)

    # diffusers' fused projections have no place in Wan's layout, whose q, k and v are separate.
    fused = _tiny()
    fused.fuse_qkv_projections()
    with pytest.raises(UserError, match=r"fused.safetensors: .* cannot be written .*attn1.to_qkv"):
        wan_file.TRANSFORMER_FILE.write(tmp_path / "fused.safetensors", {"transformer": fused}, half=False,
                                        scheduler=None, text_layout="", text_source=None)


# ------------------------------------------------------------------------------------------------------------ LoRA
def _adapted(base: WanTransformer3DModel) -> tuple[WanTransformer3DModel, dict]:
    """`base` with peft LoRA adapters (rank 4, alpha 8; a random up factor, so each has a delta) on LORA_TARGETS,
    and its factors as sdtrain's writers hand them over: (down, up, alpha) by diffusers module path."""
    adapted = copy.deepcopy(base)
    adapted.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False))
    layers = {path: (layer.lora_A["default"].weight.detach().clone(), layer.lora_B["default"].weight.detach().clone(),
                     float(layer.lora_alpha["default"]))
              for path, layer in adapted.named_modules() if isinstance(layer, LoraLayer)}
    return adapted, layers


def _delta(layer: LoraLayer, adapter: str) -> torch.Tensor:
    down, up = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    return layer.scaling[adapter] * (up.flatten(1) @ down.flatten(1))


@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_the_lora_file_is_in_comfyuis_names_and_diffusers_wan_loader_sets_every_adapter(tmp_path, variant):
    from diffusers import WanPipeline

    base = _tiny(**VARIANTS[variant])
    adapted, layers = _adapted(base)
    kinds = {"attn1", "attn2", "ffn", "proj_out", "condition_embedder"}
    assert {next(p for p in path.split(".") if not p.isdigit() and p != "blocks") for path in layers} == kinds
    state = wan_file.lora_state(layers)

    # Every key names one of Wan's modules (a weight of the model in Wan's layout) under ComfyUI's
    # ``diffusion_model.``, as lora_down/lora_up and, in the blocks, alpha.
    weights = set(wan_file.to_original(base.state_dict()))
    modules = {key.rsplit(".lora_", 1)[0].removesuffix(".alpha") for key in state}
    assert len(modules) == len(layers) and all(m.startswith("diffusion_model.") for m in modules)
    assert all(m.removeprefix("diffusion_model.") + ".weight" in weights for m in modules)
    assert {k for k in state if k.endswith(".alpha")} == {
        wan_file.lora_name(p) + ".alpha" for p in layers if p.startswith("blocks.")}
    path = tmp_path / "wan_lora.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))

    # diffusers' Wan pipeline reads the file whole (its converter refuses any key left over) and sets an adapter
    # on every layer sdtrain trained, each with the trained delta.
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=copy.deepcopy(base))
    pipe.load_lora_weights(str(path), adapter_name="wan")
    loaded = {name: layer for name, layer in pipe.transformer.named_modules()
              if isinstance(layer, LoraLayer) and "wan" in layer.lora_A}
    assert loaded.keys() == layers.keys()
    trained = dict(adapted.named_modules())
    for name, layer in loaded.items():
        assert torch.allclose(_delta(layer, "wan"), _delta(trained[name], "default"), atol=1e-6), name
    inputs = _inputs(base)
    assert torch.allclose(_output(pipe.transformer, inputs), _output(adapted, inputs), atol=1e-5)
    assert not torch.allclose(_output(base, inputs), _output(adapted, inputs), atol=1e-3)
