"""Reading a single file, whatever its layout: opening it (safetensors, or a trusted pickle), its tensor names,
shapes and metadata, the tokenizer folders beside it, helpers a layout infers settings from shapes with, and the
cache of config folders a layout hands diffusers' loaders. The layouts themselves are their families' (in
`sdtrain.models.families`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sdtrain.errors import UserError
from sdtrain.paths import cache_dir

SAFE_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
SUFFIXES = SAFE_SUFFIXES + PICKLE_SUFFIXES
TRUST_PICKLE_ENV = "SDTRAIN_TRUST_PICKLE"
FORMAT_KEY, FORMAT_VERSION = "sdtrain_format", "2"
FORMAT_VERSIONS = ("1", FORMAT_VERSION)
"""Every format sdtrain has written: "1" differs only in Stable Diffusion 2's OpenCLIP text tower (no
``text_projection``, one block fewer), which its layout tells apart by the keys alone."""


class Unrecognized(Exception):
    """A key a layout needs is missing, or the structure is not one its converters handle."""


# --------------------------------------------------------------------------------------------------- files


def is_single_file(path: str | Path) -> bool:
    """Whether `path` is an existing file with a single-file checkpoint suffix."""
    path = Path(path)
    return path.suffix.lower() in SUFFIXES and path.is_file()


def looks_like_single_file(path: str | Path) -> bool:
    """Whether `path` is named like a single-file checkpoint (it may not exist)."""
    return Path(path).suffix.lower() in SUFFIXES and not Path(path).is_dir()


def trust_pickle_from_env() -> bool:
    """The only switch for now: ``SDTRAIN_TRUST_PICKLE=1``."""
    return os.environ.get(TRUST_PICKLE_ENV, "").strip() == "1"


def tokenizer_folder(path: str | Path, index: int = 1) -> Path:
    """Where ``sdtrain export --single-file`` puts the tokenizers of OUT.safetensors: OUT.tokenizer/ for the first
    text encoder, OUT.tokenizer_2/ for SDXL's and SD3's second (`index` 2), OUT.tokenizer_3/ for SD3's T5, named as
    a diffusers pipeline's folders."""
    if index not in (1, 2, 3):
        raise ValueError(f"tokenizer index {index} is not 1, 2 or 3")
    return Path(path).with_suffix(".tokenizer" if index == 1 else f".tokenizer_{index}")


def tokenizer_for(path: str | Path, index: int = 1) -> str:
    """The tokenizer folder beside a single file; a UserError says how to name one otherwise."""
    folder = tokenizer_folder(path, index)
    if folder.is_dir():
        return str(folder)
    name = "tokenizer" if index == 1 else f"tokenizer_{index}"
    setting, pipeline_folder = f"model.components.{name}.source", f"{name}/"
    raise UserError(
        f"{path}: a single-file checkpoint holds no tokenizer; set {setting} to a tokenizer folder "
        f"(e.g. the {pipeline_folder} of a diffusers pipeline), or put one at {folder}"
    )


@dataclass
class OpenFile:
    """A single file's tensor names and shapes, its metadata, and its tensors on demand."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    metadata: dict[str, str]
    fingerprint: str
    state: dict[str, torch.Tensor] | None = None
    """The tensors of a pickle file (a safetensors file is read lazily)."""
    inferred: Any = field(default=None, repr=False)
    """What the file's layout made of its header, kept so that it is worked out once per file."""

    def floats(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors `keys`, floating ones in fp32 (a file in fp16, bf16 or fp8 trains from fp32 master weights
        like any other source), read one at a time so a half-precision file is never in memory twice over."""
        state = {}
        for key in keys:
            tensor = self.tensors([key])[key]
            state[key] = tensor.float() if tensor.is_floating_point() else tensor
        return state

    def tensors(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        if self.state is not None:
            return {k: self.state[k] for k in keys}
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as f:
                return {k: f.get_tensor(k) for k in keys}
        except Exception as exc:  # the Rust error type has no stable import path
            raise UserError(f"{self.path}: cannot read its tensors ({error_line(exc)}); the file may be damaged, "
                            "download or export it again") from exc


def error_line(exc: BaseException) -> str:
    """The line of an error's message that says why a file could not be read."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # torch.load's weights_only refusal puts the reason on a later line.
    reason = next((line for line in lines if "WeightsUnpickler error" in line), None)
    return reason or (lines[0] if lines else type(exc).__name__)


def _fingerprint(shapes: dict[str, tuple[int, ...]], metadata: dict[str, str]) -> str:
    """What the inferred configs depend on: key names, shapes and metadata (not the weights' values)."""
    text = json.dumps([sorted((k, list(v)) for k, v in shapes.items()), sorted(metadata.items())])
    return hashlib.sha256(text.encode()).hexdigest()


def _read_safetensors(path: Path) -> OpenFile:
    from safetensors import safe_open

    try:
        # Checks the header against the file size too, so a truncated download stops here.
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as exc:  # SafetensorError, or OSError when unreadable
        raise UserError(f"{path}: not a readable safetensors file ({error_line(exc)}); the file may be truncated, "
                        "download or export it again") from exc
    return OpenFile(path, shapes, metadata, _fingerprint(shapes, metadata))


def _read_pickle(path: Path, trust_pickle: bool | None) -> OpenFile:
    trusted = trust_pickle_from_env() if trust_pickle is None else trust_pickle
    if not trusted:
        raise UserError(
            f"{path}: a pickle checkpoint ({path.suffix}) can run code when loaded; convert it to .safetensors, "
            f"or set {TRUST_PICKLE_ENV}=1 to read its tensors with torch.load(weights_only=True)"
        )
    import pickle

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UserError(f"{path}: holds more than tensors, so it was not loaded ({error_line(exc)}); convert it "
                        "to .safetensors with a tool you trust") from exc
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise UserError(f"{path}: not a readable torch checkpoint ({error_line(exc)}); the file may be "
                        "truncated, download it again") from exc
    while isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: holds a {type(loaded).__name__}, not a dictionary of tensors")
    state = {k: v for k, v in loaded.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    return OpenFile(path, shapes, {}, _fingerprint(shapes, {}), state=state)


def _open(path: str | Path, trust_pickle: bool | None = None) -> OpenFile:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file; fix the path")
    suffix = path.suffix.lower()
    if suffix in SAFE_SUFFIXES:
        return _read_safetensors(path)
    if suffix in PICKLE_SUFFIXES:
        return _read_pickle(path, trust_pickle)
    raise UserError(f"{path}: not a single-file checkpoint; use a {', '.join(SUFFIXES)} file")


def open_file(path: str | Path, trust_pickle: bool | None = None) -> OpenFile:
    """A single file's tensor names and shapes (`shapes`), its safetensors metadata and its tensors on demand
    (`floats`, read one at a time): what a family's own layout reads a file through. A pickle is read whole, and
    only when trusted; an unreadable file is one line."""
    return _open(path, trust_pickle)


def tensor_names(path: str | Path, trust_pickle: bool | None = None) -> list[str]:
    """The keys of a single file's tensors, from its header (a pickle file, once trusted, is read whole)."""
    return list(_open(path, trust_pickle).shapes)


# --------------------------------------------------------------------------------------------------- shapes


def indices(shapes: dict[str, Any], prefix: str) -> list[int]:
    """The sorted numbers N of keys `prefix`N.*; they must run 0, 1, 2... ."""
    found = sorted({int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))})
    if found != list(range(len(found))):
        raise Unrecognized(f"{prefix}N numbering has gaps: {found}")
    return found


def need(shapes: dict[str, tuple[int, ...]], key: str) -> tuple[int, ...]:
    """The shape of `key`; Unrecognized when the file has no such tensor."""
    if key not in shapes:
        raise Unrecognized(f"no {key}")
    return shapes[key]


def strip(shapes: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The entries under `prefix`, without it."""
    return {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}


def metadata_json(file: OpenFile | None, metadata: dict[str, str], key: str) -> dict[str, Any]:
    """The JSON object a layout's metadata `key` holds (empty when absent); anything else is one line."""
    if key not in metadata:
        return {}
    try:
        value = json.loads(metadata[key])
    except json.JSONDecodeError as exc:
        raise UserError(f"{file.path if file else 'file'}: metadata {key} is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise UserError(f"{file.path if file else 'file'}: metadata {key} is not a JSON object")
    return value


def default_heads(hidden: int) -> int:
    """Attention heads of a `hidden`-wide CLIP tower that does not say its own: 64 wide each, as released ones."""
    return hidden // 64 if hidden % 64 == 0 else 1


# --------------------------------------------------------------------------------------------------- config folders


def _cache_root() -> Path:
    return cache_dir() / "single_file"


def write_json(path: Path, value: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def cached_folder(fingerprint: str, fill: Callable[[Path], None]) -> Path:
    """A local folder that `fill` writes once per `fingerprint` (a file's header, as its layout reads it: the configs
    diffusers' loaders are handed) and is found again next time; complete once ``model_index.json``, which `fill`
    writes last, is in it."""
    final = _cache_root() / fingerprint
    if (final / "model_index.json").is_file():
        return final
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError:
        # An unwritable cache (a read-only home on a cluster node): a private temporary folder does as well.
        final = Path(tempfile.mkdtemp(prefix="sdtrain-single-file-")) / fingerprint
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        tmp.mkdir()
    fill(tmp)
    try:
        os.replace(tmp, final)
    except OSError:
        # Another process finished the same folder first.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "model_index.json").is_file():
            raise
    return final


def fingerprint(file: OpenFile, version: str) -> str:
    """A short name for what a layout infers from `file`'s header, at the layout's inference `version`."""
    return hashlib.sha256(f"{version}:{file.fingerprint}".encode()).hexdigest()[:24]
