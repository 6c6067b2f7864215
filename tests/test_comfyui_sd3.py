"""SD3 LoRA in ComfyUI (slow, with a local ComfyUI): sdtrain writes SD3's adapters as diffusers' LoRA file alone
(no kohya file), on the claim that ComfyUI reads that file for SD3 itself. Checked with ComfyUI's own code, as its
LoraLoader runs it (comfy.sd.load_lora_for_models: model_lora_keys_unet and model_lora_keys_clip build the key map,
lora_convert.convert_lora, lora.load_lora, add_patches) on a tiny SD3 run's LoRA (transformer and both CLIPs):

* every key of the file loads ("lora key not loaded" never logged): the transformer's adapters through the
  ``transformer.transformer_blocks.N.attn[2].*`` names ComfyUI maps for SD3 (comfy/lora.py, ``isinstance(model,
  comfy.model_base.SD3)``, from comfy.utils.mmdit_to_diffusers), q/k/v onto their slices of the fused
  ``joint_blocks.N.{x,context}_block.attn[2].qkv``; the CLIPs' through ``text_encoder[_2].text_model.encoder.
  layers.N.self_attn.*`` onto clip_l and clip_g;
* patched, ComfyUI's weights are the ones sdtrain merges: ComfyUI reads an adapter's alpha only from a
  ``<module>.alpha`` key, which diffusers' file does not have (diffusers keeps lora_alpha in the file's metadata),
  and applies up @ down at scale 1; sdtrain's export puts alpha / rank into the up weights and says alpha = rank in
  the metadata, so every reader applies the trained delta. The run here trains rank 4 at alpha 8 to show it.

ComfyUI builds SD3's MMDiT 64 wide per block with as many heads as blocks (comfy/ldm/modules/diffusionmodules/
mmdit.py: ``self.hidden_size = 64 * depth; num_heads = depth``) and the CLIPs' penultimate layer must exist
(layer_idx -2): the tiny run is 2 blocks of 2 heads x 64 and 3-layer CLIPs so ComfyUI's model is the run's, loaded
from the exported diffusers transformer (comfy.sd.load_diffusion_model converts its layout) and ComfyUI's SD3 text
model (clip_l, clip_g) at the CLIPs' sizes through its ``clip_{l,g}_model_config`` options."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdtrain.cli.main import main
from sdtrain.loaders.adapters import merge_partial
from sdtrain.loaders.components import load_component, load_run_modules
from sdtrain.models.families.sd3 import SD3

from . import comfyui
from .conftest import TINY_CLI, config_path

CONFIGS = config_path("diffusion.yaml").parents[1]
# ComfyUI's SD3 sizes at 2 blocks (64 x depth wide, depth heads), CLIPs deep enough for their penultimate layer.
COMFY_SIZES = ["model.transformer_overrides.num_attention_heads=2", "model.transformer_overrides.attention_head_dim=64",
               "model.transformer_overrides.caption_projection_dim=128",
               "model.text_encoder_overrides.num_hidden_layers=3", "model.text_encoder_2_overrides.num_hidden_layers=3"]
RANK, ALPHA = 4, 8

pytestmark = [pytest.mark.slow,
              comfyui.needs_comfyui]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_scratch_run) -> Path:
    """A tiny SD3 run from scratch at ComfyUI's sizes, exported as a pipeline to fine-tune."""
    root = tmp_path_factory.mktemp("comfy-sd3")
    scratch = tiny_scratch_run("sd3", root / "scratch", 1, "model.t5_text_length=12", *COMFY_SIZES)
    assert main(["export", str(scratch), str(root / "pipeline")]) == 0
    return root / "pipeline"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, pipeline, shapes_dir) -> tuple[Path, Path]:
    """The SD3 recipe (configs/sd3-lora.yaml) with the CLIPs adapted, at rank 4 and alpha 8; and its export."""
    root = tmp_path_factory.mktemp("comfy-sd3-lora")
    run, out = root / "lora", root / "out"
    assert main(["train", str(CONFIGS / "sd3-lora.yaml"), f"run_dir={run}", *TINY_CLI, f"model.pretrained={pipeline}",
                 f"data.shards={shapes_dir}", "train.max_steps=2", "lora.text_encoder=true", f"lora.rank={RANK}",
                 f"lora.alpha={ALPHA}", "optim.lr=0.01", "data.aspect_buckets=false"]) == 0
    assert main(["export", str(run), str(out)]) == 0
    return run, out


_COMFY_SCRIPT = comfyui.PREAMBLE + textwrap.dedent('''
    transformer_path, lora_path, expected_path, te_configs = sys.argv[1:5]
    import comfy.lora, comfy.lora_convert, comfy.model_detection, comfy.model_patcher, comfy.sd, comfy.utils
    import comfy.text_encoders.sd3_clip
    collect_messages()

    # The exported diffusers transformer, which ComfyUI converts to its MMDiT layout itself.
    patcher = comfy.sd.load_diffusion_model(transformer_path, model_options={"dtype": torch.float32})
    report = {"model": type(patcher.model).__name__, "config": type(patcher.model.model_config).__name__,
              "load_warnings": [m for m in messages if "missing" in m.lower() or "unexpected" in m.lower()]}

    # ComfyUI's SD3 text model (clip_l, clip_g; T5 is not adapted) at the tiny CLIPs' sizes, with their weights
    # (but the token table: ComfyUI's is CLIP's vocabulary, ours a tiny one).
    configs = json.loads(te_configs)
    clip = comfy.text_encoders.sd3_clip.SD3ClipModel(
        clip_l=True, clip_g=True, t5=False, dtype=torch.float32,
        model_options={"clip_l_model_config": configs["l"], "clip_g_model_config": configs["g"]})
    expected = load_file(expected_path)
    for tag in ("l", "g"):
        weights = {k[len(f"te_{tag}."):]: v for k, v in expected.items()
                   if k.startswith(f"te_{tag}.") and "token_embedding" not in k}
        missing, unexpected = getattr(clip, f"clip_{tag}").transformer.load_state_dict(weights, strict=False)
        report[f"clip_{tag}_unexpected"] = unexpected
        report[f"clip_{tag}_missing"] = [k for k in missing if "token_embedding" not in k]

    # What comfy.sd.load_lora_for_models does.
    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    key_map = comfy.lora.model_lora_keys_clip(clip, key_map)
    lora = comfy.lora_convert.convert_lora(comfy.utils.load_torch_file(lora_path))
    messages.clear()
    patches = comfy.lora.load_lora(lora, key_map)
    def shown(target):
        return target if isinstance(target, str) else f"{target[0]}{list(target[1])}"
    report.update(lora_keys=len(lora), patched=len(patches),
                  not_loaded=sorted(m for m in messages if "not loaded" in m),
                  mapping={k: shown(v) for k, v in key_map.items() if any(x.startswith(k + ".") for x in lora)},
                  alphas=sorted({str(p.weights[2]) for p in patches.values()}))

    unet = {k: v for k, v in patches.items() if shown(k).startswith("diffusion_model.")}
    text = {k: v for k, v in patches.items() if k not in unet}
    base = {k: v.clone() for k, v in patcher.model.diffusion_model.state_dict().items()}
    added = set(patcher.add_patches(unet, 1.0))
    patcher.patch_model()
    clip_patcher = comfy.model_patcher.ModelPatcher(clip, load_device=torch.device("cpu"),
                                                    offload_device=torch.device("cpu"))
    clip_base = {k: v.clone() for k, v in clip.state_dict().items()}
    added |= set(clip_patcher.add_patches(text, 1.0))
    report["not_applied"] = sorted(shown(k) for k in patches if k not in added)
    clip_patcher.patch_model()

    # ComfyUI's change to each weight against sdtrain's merged one (the diffusers layout converted by ComfyUI).
    merged = comfy.model_detection.convert_diffusers_mmdit(
        {k[len("merged."):]: v for k, v in expected.items() if k.startswith("merged.")}, "")
    state = patcher.model.diffusion_model.state_dict()
    pairs = {f"diffusion_model.{k}": (state[k] - base[k], merged[k] - base[k]) for k in state}
    report["unet_layout_differs"] = sorted(set(state) ^ set(merged))
    clip_state = clip.state_dict()
    for tag in ("l", "g"):
        for k, v in expected.items():
            if k.startswith(f"merged_te_{tag}.text_model.encoder."):
                name = f"clip_{tag}.transformer.{k[len(f'merged_te_{tag}.'):]}"
                pairs[name] = (clip_state[name] - clip_base[name], v - clip_base[name])
    report["changed_by_comfy"] = sorted(k for k, (ours, _) in pairs.items() if ours.abs().max() > 0)
    report["changed_by_sdtrain"] = sorted(k for k, (_, theirs) in pairs.items() if theirs.abs().max() > 0)
    ratio = float(sys.argv[5])
    report["max_diff_scaled"] = max((c * ratio - s).abs().max().item() for c, s in pairs.values())
    report["max_diff_unscaled"] = max((c - s).abs().max().item() for c, s in pairs.values())
    report["max_delta"] = max(s.abs().max().item() for _, s in pairs.values())
    print("REPORT " + json.dumps(report))
''')


def _clip_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CLIP's weights as ComfyUI (and transformers 4) name them: under text_model., the projection beside it."""
    return {k if k.startswith(("text_model.", "text_projection.")) else f"text_model.{k}": v for k, v in state.items()}


def _save_expected(run: Path, pipeline: Path, path: Path) -> dict[str, dict]:
    """The run's merged weights at `path` (the transformer's as ``merged.*``, each CLIP's base and merged as
    ``te_l.*``/``merged_te_l.*`` and ``_g``), for the ComfyUI script to compare its patched ones with; returns
    the CLIPs' configs it builds them from."""
    modules = load_run_modules(run, ["transformer", "text_encoder", "text_encoder_2"])
    expected = {f"merged.{k}": v for k, v in merge_partial(modules["transformer"]).state_dict().items()}
    te_configs = {}
    for name, tag in (("text_encoder", "l"), ("text_encoder_2", "g")):
        base = load_component(name, pipeline, family=SD3)
        expected.update({f"te_{tag}.{k}": v for k, v in _clip_names(base.state_dict()).items()})
        expected.update({f"merged_te_{tag}.{k}": v
                         for k, v in _clip_names(merge_partial(modules[name]).state_dict()).items()})
        c = base.config
        te_configs[tag] = {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
                           "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
                           "projection_dim": c.projection_dim, "hidden_act": c.hidden_act,
                           "eos_token_id": c.eos_token_id}
    save_file({k: v.contiguous() for k, v in expected.items()}, str(path))
    return te_configs


def test_comfyui_loads_every_key_of_the_sd3_diffusers_lora_at_its_trained_scale(tmp_path, pipeline, lora_run):
    run, out = lora_run
    lora_file = out / "pytorch_lora_weights.safetensors"
    ours = load_file(str(lora_file))
    assert {k.split(".")[0] for k in ours} == {"transformer", "text_encoder", "text_encoder_2"}
    assert not (out / "lora_kohya.safetensors").exists()  # diffusers' file is all SD3 gets

    te_configs = _save_expected(run, pipeline, tmp_path / "expected.safetensors")

    report = comfyui.run_comfyui(
        _COMFY_SCRIPT, str(pipeline / "transformer" / "diffusion_pytorch_model.safetensors"),
        str(lora_file),
        str(tmp_path / "expected.safetensors"),
        json.dumps(te_configs),
        "1.0")
    print(json.dumps(report, indent=1))

    # ComfyUI's model is the run's: an SD3 model, every weight of the export placed; the CLIPs load whole.
    assert report["model"] == "SD3" and report["config"] == "SD3" and report["load_warnings"] == []
    assert report["unet_layout_differs"] == []
    for tag in ("l", "g"):
        assert report[f"clip_{tag}_missing"] == [] and report[f"clip_{tag}_unexpected"] == []

    # Every key loads: one patch per adapted module (2 blocks: 8 + 4 for block 0's second attention, 7 for the
    # context-pre-only last block; 3 layers x 4 projections in each CLIP), none left, none unapplied.
    file_modules = {k.split(".lora")[0] for k in ours}
    assert len(file_modules) == 19 + 2 * 12 and len(ours) == 2 * len(file_modules)
    assert report["lora_keys"] == len(ours) and report["not_loaded"] == [] and report["not_applied"] == []
    assert report["patched"] == len(file_modules) and set(report["mapping"]) == file_modules
    # diffusers' names onto ComfyUI's MMDiT: q, k, v onto their 128-row slices of the fused qkv.
    block, te = "transformer.transformer_blocks.0.", "text_model.encoder.layers."
    for module, target in {
        "attn.to_k": "x_block.attn.qkv.weight[0, 128, 128]",
        "attn.add_v_proj": "context_block.attn.qkv.weight[0, 256, 128]",
        "attn.to_out.0": "x_block.attn.proj.weight",
        "attn.to_add_out": "context_block.attn.proj.weight",
        "attn2.to_q": "x_block.attn2.qkv.weight[0, 0, 128]",
    }.items():
        assert report["mapping"][block + module] == f"diffusion_model.joint_blocks.0.{target}", module
    assert (report["mapping"][f"text_encoder.{te}2.self_attn.out_proj"]
            == f"clip_l.transformer.{te}2.self_attn.out_proj.weight")
    assert (report["mapping"][f"text_encoder_2.{te}0.self_attn.q_proj"]
            == f"clip_g.transformer.{te}0.self_attn.q_proj.weight")

    # Patched: ComfyUI changes exactly the weights sdtrain's merge changes, by as much: no alpha reaches ComfyUI
    # from diffusers' file, so it applies up @ down at scale 1, and the export's up weights carry alpha / rank.
    assert report["alphas"] == ["None"]
    assert report["changed_by_comfy"] == report["changed_by_sdtrain"]
    # 5 fused qkv weights (3 adapters each) and 4 output projections; 24 CLIP projections.
    assert len(report["changed_by_comfy"]) == 5 + 4 + 24
    assert report["max_delta"] > 1e-3  # the adapters trained
    assert report["max_diff_unscaled"] < 1e-5


_CHECKPOINT_SCRIPT = comfyui.PREAMBLE + textwrap.dedent('''
    path, te_configs = sys.argv[1:3]
    import comfy.model_detection, comfy.sd, comfy.utils
    import comfy.text_encoders.sd3_clip
    collect_messages()

    # Load Checkpoint's own path for the model: the type detected from the keys, the MMDiT built and loaded.
    sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    ours = dict(sd)
    patcher, _, _, _ = comfy.sd.load_state_dict_guess_config(dict(sd), output_vae=False, output_clip=False,
                                                            model_options={"dtype": torch.float32}, metadata=metadata)
    state = patcher.model.diffusion_model.state_dict()
    prefix = "model.diffusion_model."
    report = {"model": type(patcher.model).__name__, "config": type(patcher.model.model_config).__name__,
              "load_warnings": [m for m in messages if "missing" in m.lower() or "unexpected" in m.lower()],
              "unet_not_loaded": sorted(k[len(prefix):] for k in ours if k.startswith(prefix)
                                        and k[len(prefix):] not in state),
              "unet_differs": sorted(k for k, v in state.items() if not torch.equal(v, ours[prefix + k]))}

    # Its text encoders as Load Checkpoint hands them over (process_clip_state_dict), into ComfyUI's SD3 text model
    # at the tiny encoders' sizes.
    config = comfy.model_detection.model_config_from_unet(ours, prefix, metadata=metadata)
    clip_sd = config.process_clip_state_dict(dict(ours))
    target = config.clip_target(state_dict=ours)
    clip = target.clip(dtype=torch.float32, model_options=json.loads(te_configs))
    # Tables ComfyUI sizes as the released encoders whatever the config says (CLIP's 49,408 tokens, T5's vocabulary
    # and 32 relative-position buckets): left out at the tiny sizes, compared by name only.
    fixed = (".token_embedding.weight", ".relative_attention_bias.weight", "t5xxl.transformer.shared.weight")
    clip_state = clip.state_dict()
    report_fixed = sorted(k for k in clip_sd if k.endswith(fixed) and k not in clip_state)
    clip_sd = {k: v for k, v in clip_sd.items() if not k.endswith(fixed)}
    missing, unexpected = clip.load_state_dict(clip_sd, strict=False)
    missing = [k for k in missing if not k.endswith(fixed)]
    clip_state = clip.state_dict()
    report.update(
        clip_parts=[n for n in ("clip_l", "clip_g", "t5xxl") if getattr(clip, n) is not None],
        fixed_not_in_comfy=report_fixed,
        clip_missing=[k for k in missing if not k.endswith((".logit_scale", ".transformer.text_projection.weight"))],
        clip_unexpected=unexpected,
        clip_differs=sorted(k for k, v in clip_sd.items() if k in clip_state and not torch.equal(clip_state[k], v)))
    print("REPORT " + json.dumps(report))
''')


def test_comfyui_loads_the_sd3_single_file_export_with_every_key_placed(tmp_path, pipeline):
    """`sdtrain export --single-file` of an SD3 run as ComfyUI's Load Checkpoint reads it: detected as SD3, every
    MMDiT weight placed as trained, and the three text encoders (CLIP-L, CLIP-G, T5) each whole, at the tiny run's
    sizes."""
    scratch = pipeline.parent / "scratch"
    out = tmp_path / "sd3.safetensors"
    assert main(["export", str(scratch), str(out), "--single-file"]) == 0
    te_configs = {}
    for name, tag in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        c = load_component(name, pipeline, family=SD3).config
        te_configs[f"{tag}_model_config"] = {
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "projection_dim": c.projection_dim, "hidden_act": c.hidden_act, "eos_token_id": c.eos_token_id}
    t5 = load_component("text_encoder_3", pipeline, family=SD3).config
    te_configs["t5xxl_model_config"] = {k: getattr(t5, k) for k in ("d_ff", "d_kv", "d_model", "num_heads",
                                                                    "num_layers", "vocab_size",
                                                                    "relative_attention_num_buckets")}
    report = comfyui.run_comfyui(_CHECKPOINT_SCRIPT, str(out), json.dumps(te_configs))
    print(json.dumps(report, indent=1))
    assert report["model"] == "SD3" and report["config"] == "SD3" and report["load_warnings"] == []
    assert report["unet_not_loaded"] == [] and report["unet_differs"] == []
    assert report["clip_parts"] == ["clip_l", "clip_g", "t5xxl"]
    assert report["clip_missing"] == [] and report["clip_differs"] == []
    assert report["fixed_not_in_comfy"] == []  # ComfyUI has each of them, at its own size
    # The one key ComfyUI leaves: the copy of T5's shared embedding under the encoder's name, which diffusers'
    # reader loads (and fails without); ComfyUI's T5 reads `shared` alone.
    assert report["clip_unexpected"] == ["t5xxl.transformer.encoder.embed_tokens.weight"]


def test_comfyui_applies_an_sd3_dora_file_as_peft_merged_it(tmp_path, pipeline, shapes_dir):
    """DoRA on SD3 (transformer and both CLIPs): ComfyUI reads its magnitudes only as dora_scale, so the export adds
    lora_kohya.safetensors of diffusers' module names; loaded as LoraLoader loads it, every key is read and each
    patched weight is the one peft merged."""
    run, out = tmp_path / "dora", tmp_path / "out"
    assert main(["train", str(CONFIGS / "sd3-lora.yaml"), f"run_dir={run}", *TINY_CLI, f"model.pretrained={pipeline}",
                 f"data.shards={shapes_dir}", "train.max_steps=2", "lora.text_encoder=true", f"lora.rank={RANK}",
                 f"lora.alpha={ALPHA}", "lora.type=dora", "optim.lr=0.01", "data.aspect_buckets=false"]) == 0
    assert main(["export", str(run), str(out)]) == 0
    te_configs = _save_expected(run, pipeline, tmp_path / "expected.safetensors")
    report = comfyui.run_comfyui(
        _COMFY_SCRIPT, str(pipeline / "transformer" / "diffusion_pytorch_model.safetensors"),
        str(out / "lora_kohya.safetensors"), str(tmp_path / "expected.safetensors"), json.dumps(te_configs), "1.0")
    print(json.dumps({k: v for k, v in report.items() if k != "mapping"}, indent=1))
    assert report["not_loaded"] == [] and report["not_applied"] == [] and report["patched"] == 19 + 2 * 12
    assert report["changed_by_comfy"] == report["changed_by_sdtrain"]
    assert report["max_diff_unscaled"] < 1e-5 < report["max_delta"]
