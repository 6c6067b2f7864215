"""Stable Diffusion (1.x, 2.x, XL base) checkpoints as ONE file, in the original (CompVis/LDM and Stability's
SGM, A1111/ComfyUI) layout.

Reading: the diffusers configs of the UNet, VAE and text encoder are inferred from the file's tensor
shapes and key names (plus the settings weights cannot tell, from the file's safetensors metadata when
it has them), written into a local cache folder, and the weights are converted by diffusers' own
single-file loaders with ``config=`` that folder and ``local_files_only=True``: nothing is downloaded.

Writing: our own diffusers -> original key mapping (any number of levels, any layers_per_block), with
the settings the loader needs in the metadata, so a file written here loads back exactly.

Original layout, by component:

- UNet: ``model.diffusion_model.*``
- VAE: ``first_stage_model.*`` (a VAE-only file, as A1111 keeps them, has the same keys without prefix)
- text encoder: ``cond_stage_model.transformer.text_model.*`` (CLIP, SD 1.x) or ``cond_stage_model.model.*``
  (OpenCLIP, SD 2.x: fused ``in_proj`` attention, ``transformer.resblocks.N``)

SDXL (``info.family == "sdxl"``; ``"sd"`` otherwise), told by its ``conditioner.embedders.*`` keys (or, for a
UNet alone, by SDXL's added embedding ``label_emb.0.*``): the same UNet and VAE prefixes, the UNet with
``label_emb.0.0``/``label_emb.0.2`` (diffusers' ``add_embedding``, addition_embed_type ``text_time``) and a
transformer depth per level; the text encoders at

- ``conditioner.embedders.0.transformer.text_model.*``: CLIP ViT-L, in the transformers key layout;
- ``conditioner.embedders.1.model.*``: OpenCLIP bigG (diffusers' CLIPTextModelWithProjection ``text_encoder_2``),
  every layer a block (SDXL conditions on the whole tower: the penultimate layer's output, and the pooled last
  one), ``text_projection`` as OpenCLIP multiplies by it (the transpose of the Linear's weight), ``logit_scale``.

Read without metadata, an SDXL file gets SDXL base's settings: 64-wide UNet heads, the time width of the added
embedding from what its projection's input leaves beside the pooled width (else 256), VAE scaling 0.13025,
``gelu`` for bigG, the schedule `SDXL_SCHEDULER` (SD's betas, "leading" timesteps) and epsilon prediction.

Metadata keys written (all strings, as safetensors requires):

- ``prediction_type``: ``epsilon`` / ``v_prediction`` / ``sample``. Without it (nor a ModelSpec
  ``modelspec.prediction_type``), an OpenCLIP (SD 2.x) file is read as ``v_prediction`` and any other as
  ``epsilon``, as diffusers assumes.
- ``scheduler_config``: JSON of the training noise scheduler (beta schedule, betas, timesteps...).
- ``unet_config``, ``vae_config``, ``text_encoder_config``: JSON of each component's settings that its
  weights cannot tell (attention heads, norm groups, the VAE's ``scaling_factor``, activation, token ids...).
  Sizes (channels, levels, layers, vocabulary...) are always read from the tensors, never from these.
- ``text_encoder_layout``: ``clip`` or ``openclip``, informative (the keys say it too).
- SDXL only: ``text_encoder_2_config``; ``text_encoder_2_layout`` (``openclip``); ``model_family``: ``sdxl``
  (the keys say it too; a VAE-only file, whose keys are SD's, is read as SDXL's when its metadata says so).
- ``sdtrain_format``: ``2``; marks a file ``sdtrain export --single-file`` wrote (and may replace). Files of
  format ``1`` (earlier sdtrain) are read and replaced as well: they differ only in the OpenCLIP text tower.

Text encoder layout when writing (`choose_text_layout`): OpenCLIP when the text encoder was loaded from an
SD 2.x-layout single file or is 1024 wide (SD 2.x's ViT-H), else CLIP.

The OpenCLIP tower. SD 2.x conditions on the penultimate of its 24 blocks (after ``ln_final``), so a diffusers
CLIPTextModel keeps 23 layers, and diffusers' converter drops block 23 when reading: the OpenCLIP layout holds
at most 23 layers. Readers of original checkpoints (ComfyUI, A1111) build the whole tower, so we write it whole
(format 2): the N encoder layers as blocks 0..N-1, then

- block N, which SD 2.x does not use: a copy of block N-1 with its attention ``out_proj`` and MLP ``c_proj``
  zeroed, so it passes its input through unchanged (a reader conditioning on the last block's output gets the
  same as on the penultimate's);
- ``text_projection``: an identity of [width, width] (OpenCLIP's ``x @ text_projection``): a CLIPTextModel has
  no projection and SD never uses CLIP's pooled embedding; square as SD 2.x's ViT-H one, and as ComfyUI loads
  it, whatever the config's ``projection_dim`` (which stays in the metadata);
- ``logit_scale``: OpenCLIP's initial log(1/0.07), a scalar; both in the dtype of the other text weights.

Reading, the number of layers: a tower with ``text_projection`` (Stability's files, ours since format 2) is
one block longer than the layers conditioned on; one without (format 1: N blocks for N layers) is all
layers, except that 24 blocks are SD 2.x's own (23 layers) either way. diffusers' converter is handed only
the blocks conditioned on: it drops block 23 alone, and would convert any other unused block as one more layer.

A single file holds no tokenizer: ``sdtrain export --single-file`` writes it beside OUT.safetensors as
OUT.tokenizer/ (and SDXL's second as OUT.tokenizer_2/, `tokenizer_folder(path, 2)`), which the loader finds;
otherwise ``model.tokenizer`` must name one. The inferred configs
are cached in ``<sdtrain cache dir>/single_file/<fingerprint of keys, shapes and metadata>`` (the cache dir
is ``SDTRAIN_CACHE_DIR``, else ``~/.cache/sdtrain``).

Flux.1 (`flux` module): a file of the transformer alone in Black Forest Labs' layout (``double_blocks.*``,
``single_blocks.*``, bare as in flux1-dev.safetensors or under ComfyUI's ``model.diffusion_model.``) is read as
the component ``transformer`` (`flux.load_transformer`: settings from shapes and metadata, our own conversion, no
diffusers converter, which assumes Flux.1's full width); asked for any other component, it says which setting
to name instead. ``sdtrain export --single-file`` of a Flux run writes such a file (`flux.save_original`) and
nothing beside it.

SD3 and SD3.5 (`sd3` module): a whole model in Stability's layout (``model.diffusion_model.joint_blocks.*``,
``first_stage_model.*``, ``text_encoders.clip_l|clip_g|t5xxl.transformer.*``), read component by component through
diffusers' converters with settings from shapes and metadata; ``sdtrain export --single-file`` of an SD3 run writes
one (`sd3.save_original`) with its three tokenizers beside it.

Pickle checkpoints (``.ckpt``, ``.pt``, ``.pth``, ``.bin``) can run code when unpickled: they are refused
unless trusted (``trust_pickle=True``, or ``SDTRAIN_TRUST_PICKLE=1``), and even then read with
``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers.
"""

from __future__ import annotations

from sdtrain.models.single_file.load import load_single_file_component
from sdtrain.models.single_file.read import (
    CLIP_PREFIX,
    FAMILIES,
    FORMAT_KEY,
    FORMAT_VERSION,
    OPENCLIP_PREFIX,
    PICKLE_SUFFIXES,
    PREDICTION_TYPES,
    SAFE_SUFFIXES,
    SD_SCHEDULER,
    SDXL_CLIP_PREFIX,
    SDXL_OPENCLIP_PREFIX,
    SDXL_SCHEDULER,
    SUFFIXES,
    TEXT_ENCODERS,
    TEXT_EXTRA_KEYS,
    TEXT_LAYOUTS,
    TEXT_SHAPE_KEYS,
    TRUST_PICKLE_ENV,
    UNET_PREFIX,
    UNET_SHAPE_KEYS,
    VAE_PREFIX,
    VAE_SHAPE_KEYS,
    SingleFileInfo,
    config_folder,
    family_of,
    inspect_single_file,
    is_single_file,
    looks_like_single_file,
    model_family,
    open_file,
    prediction_type,
    scheduler_config,
    tensor_names,
    text_encoder_layout,
    tokenizer_folder,
    tokenizer_for,
    trust_pickle_from_env,
)
from sdtrain.models.single_file.read import _infer as _infer
from sdtrain.models.single_file.write import _module_config as _module_config
from sdtrain.models.single_file.write import _normalize as _normalize
from sdtrain.models.single_file.write import (
    choose_text_layout,
    original_unet_path,
    save_single_file,
    single_file_metadata,
    to_original_state_dict,
    written_by_sdtrain,
)

# _infer, _module_config and _normalize are private: re-exported (by redundant aliases) for the tests.
__all__ = [
    "CLIP_PREFIX", "FAMILIES", "FORMAT_KEY", "FORMAT_VERSION", "OPENCLIP_PREFIX", "PICKLE_SUFFIXES",
    "PREDICTION_TYPES", "SAFE_SUFFIXES", "SDXL_CLIP_PREFIX", "SDXL_OPENCLIP_PREFIX", "SDXL_SCHEDULER", "SD_SCHEDULER",
    "SUFFIXES", "TEXT_ENCODERS", "TEXT_EXTRA_KEYS", "TEXT_LAYOUTS", "TEXT_SHAPE_KEYS", "TRUST_PICKLE_ENV",
    "UNET_PREFIX", "UNET_SHAPE_KEYS", "VAE_PREFIX", "VAE_SHAPE_KEYS", "SingleFileInfo", "choose_text_layout",
    "config_folder", "family_of", "inspect_single_file", "is_single_file", "load_single_file_component",
    "original_unet_path",
    "looks_like_single_file", "model_family", "open_file", "prediction_type", "save_single_file",
    "scheduler_config", "single_file_metadata", "tensor_names", "text_encoder_layout", "to_original_state_dict",
    "tokenizer_folder", "tokenizer_for", "trust_pickle_from_env", "written_by_sdtrain",
]
