"""Hugging Face Hub ids as model sources, resolved to folders of huggingface_hub's cache before anything loads.

Wherever sdtrain takes a model source (``model.pretrained`` and the other ``model.*`` sources, ``prepare encode
--model/--vae/--text-encoder``, ``generate --model``, ``evaluate MODEL``) it also takes a Hub id:

* ``org/name``: the repository's default branch (``main``);
* ``org/name@REVISION``: a branch, tag or commit hash;
* ``org/name/PATH.safetensors`` (or ``org/name@REVISION/PATH.safetensors``): one single-file checkpoint in it.

`resolve` turns the id into its snapshot folder (or file) in the cache (``HF_HUB_CACHE``, by default
``~/.cache/huggingface/hub``), after which it loads exactly as a local folder does; no loader ever downloads.

Rules:

* A path that exists locally always wins over an id of the same spelling; a local path never touches
  huggingface_hub. A string that is neither an existing path nor an id is returned as it is, for the loaders'
  own "not found" errors.
* Cache first: a cached snapshot is used without asking the Hub (so ``main`` stays the commit first fetched
  until the cache is refreshed, e.g. by ``hf download``); the network is reached only for an id not cached
  yet, or cached without the weights asked for. ``HF_HUB_OFFLINE=1`` keeps resolution to the cache.
* Only what sdtrain reads is downloaded: every folder's small files (configs, tokenizer files) and the
  safetensors weights (``diffusion_pytorch_model*.safetensors``, ``model*.safetensors``; no fp16 or other
  variants, no root-level single files beside a pipeline, no flax/onnx/openvino copies) of the components the
  source is used for. Pickled ``.bin`` weights come too only where pickles are trusted (``model.trust_pickle``,
  ``SDTRAIN_TRUST_PICKLE=1``).
* A gated or private repository needs a token: huggingface_hub's own, from ``HF_TOKEN`` (or ``hf auth login``).
  A config never holds one.

A run records the resolved snapshot path (``snapshots/<commit>``) in its config.yaml and checkpoints, so
resuming and exporting read the very same weights from the cache, offline included.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdtrain.errors import UserError, first_line

log = logging.getLogger(__name__)

TOKEN_ENV = "HF_TOKEN"
OFFLINE_ENV = "HF_HUB_OFFLINE"
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
"""What sdtrain.models.single_file reads (its SUFFIXES; a test keeps them equal, as importing it loads torch)."""
TRUST_PICKLE_ENV = "SDTRAIN_TRUST_PICKLE"
"""sdtrain.models.single_file's TRUST_PICKLE_ENV."""

COMPONENTS = ("vae", "unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
"""The pipeline folders whose weights a source is fetched for when the caller does not say (its family's
components, `build.resolve_sources`), as the families released before open components have them."""
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
DENOISERS = ("unet", "transformer")

METADATA = ("*.json", "*.txt", "*.model", "README.md")
"""Configs (config.json, model_index.json, scheduler_config.json, the weights' index files) and tokenizer files
(vocab.json, merges.txt, tokenizer.json, spiece.model), and the model card (its license, for an export's card): small,
and read whatever the source is used for."""
WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model-*.safetensors", "model.safetensors",
           "model-*.safetensors")
"""diffusers' and transformers' weight files, whole or sharded; a variant (``.fp16.``) matches none of them."""
PICKLED_WEIGHTS = ("diffusion_pytorch_model.bin", "diffusion_pytorch_model-*.bin", "pytorch_model.bin",
                   "pytorch_model-*.bin")

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SNAPSHOT = re.compile(r"/models--([^/]+?)--([^/]+)/snapshots/([0-9a-f]{40})(?:/(.+?))?/?$")


@dataclass(frozen=True)
class HubId:
    repo: str
    """``org/name``."""
    revision: str | None = None
    """A branch, tag or commit; None: the default branch."""
    file: str | None = None
    """A single file's path in the repository, or None for the repository's folder."""

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f"/{self.file}" if self.file else "")


def _valid_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name)) and not name.endswith((".", "-")) and "--" not in name and ".." not in name


def _single_file(name: str) -> bool:
    return name.lower().endswith(SINGLE_FILE_SUFFIXES)


def parse(text: str) -> HubId | None:
    """`text` as a Hub id (``org/name``, ``org/name@REVISION``, ``org/name[@REVISION]/PATH.safetensors``), or None
    when it is not one (a relative or absolute path, a URL, a bare name, a plain file name)."""
    if not text or any(c.isspace() for c in text) or "\\" in text or "://" in text or text.startswith(("/", "~")):
        return None
    head, at, tail = text.partition("@")
    revision = file = None
    if at:
        repo = head
        # A revision may hold slashes (refs/pr/1); one before a single file may not.
        if "/" in tail and _single_file(tail):
            revision, file = tail.split("/", 1)
        else:
            revision = tail
        if not revision:
            return None
    else:
        parts = text.split("/")
        if len(parts) > 2 and _single_file(parts[-1]):
            repo, file = "/".join(parts[:2]), "/".join(parts[2:])
        elif len(parts) == 2 and not _single_file(parts[1]):
            repo = text
        else:
            return None
    names = repo.split("/")
    if len(names) != 2 or not all(_valid_name(n) for n in names) or len(repo) > 96:
        return None
    if file is not None and any(part in ("", ".", "..") for part in file.split("/")):
        return None
    return HubId(repo, revision, file)


def cached_id(path: str | Path) -> HubId | None:
    """The Hub id, at its commit, whose cached snapshot `path` is (or lies in: a single file's id names it), e.g. for
    a model card or a log to name instead of the cache path; None for any other path."""
    found = _SNAPSHOT.search(Path(path).as_posix())
    if found is None:
        return None
    org, name, commit, inside = found.groups()
    return HubId(f"{org}/{name}", commit, inside if inside and _single_file(inside) else None)


def offline() -> bool:
    """Whether huggingface_hub is in offline mode (HF_HUB_OFFLINE, read as it was imported)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_folder() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def pickles_trusted(trust_pickle: bool = False) -> bool:
    return bool(trust_pickle) or os.environ.get(TRUST_PICKLE_ENV, "").strip() == "1"


def resolve(source: str | Path | None, key: str, weights: Collection[str] | None = None,
            pickles: bool = False) -> str | None:
    """`source` as a local path: itself when it exists locally or is no Hub id (None stays None), else the id's
    folder (or file) in the Hub cache, downloaded first if it is not cached. `key` names the source in errors
    (``model.pretrained``, ``--model``); `weights`: the pipeline components whose weights are read (None:
    every one sdtrain loads; (): none, configs and tokenizers only); `pickles`: fetch ``.bin`` weights too.
    Whatever keeps an id from resolving is a UserError naming `key`, the id and the fix."""
    if source is None:
        return None
    text = str(source)
    if Path(text).exists():
        return text
    hub_id = parse(text)
    if hub_id is None:
        return text
    is_offline = offline()
    try:
        if hub_id.file is not None:
            path = _fetch_file(hub_id, is_offline)
        else:
            path = _fetch_snapshot(hub_id, key, weights, pickles, is_offline)
    except UserError:
        raise
    except Exception as exc:
        refusal = _refusal(exc, hub_id, key, is_offline)
        if refusal is None:
            raise
        raise refusal from exc
    log.info("%s: %s is %s", key, hub_id, path)
    return path


def resolve_model(config: Any, fetch_weights: bool = True, weighted: Collection[str] = COMPONENTS) -> Any:
    """A copy of a RunConfig whose model sources (``model.pretrained`` and each ``model.components.NAME.source``)
    are resolved with `resolve` (the config itself is left as loaded). Only the weights of the `weighted`
    components (the family's; a tokenizer has none) are fetched: a component's source for its own, `pretrained`
    for those no component source names; without `fetch_weights`, every source with its configs and tokenizers
    alone."""
    model = config.model
    pickles = pickles_trusted(getattr(model, "trust_pickle", False))
    components = dict(model.components)
    for name, component in model.components.items():
        if component.source is not None:
            weights = (name,) if fetch_weights and name in weighted else ()
            source = resolve(component.source, f"model.components.{name}.source", weights, pickles)
            components[name] = dataclasses.replace(component, source=source)
    pretrained = model.pretrained
    if pretrained is not None:
        named = {name for name, component in model.components.items() if component.source is not None}
        wanted = tuple(c for c in weighted if c not in named) if fetch_weights else ()
        pretrained = resolve(pretrained, "model.pretrained", wanted, pickles)
    return dataclasses.replace(config, model=dataclasses.replace(model, pretrained=pretrained, components=components))


def _cached_first(fetch: Callable[[bool], str], is_offline: bool,
                  complete: Callable[[str], bool] = lambda path: True) -> str:
    """`fetch(local_files_only)`'s path: from the cache when it is there (and `complete`), else downloaded,
    unless offline."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = fetch(True)
        if is_offline or complete(path):
            return path
    except LocalEntryNotFoundError:
        if is_offline:
            raise
    return fetch(False)


def _fetch_file(hub_id: HubId, is_offline: bool) -> str:
    from huggingface_hub import hf_hub_download

    assert hub_id.file is not None
    return _cached_first(lambda local: hf_hub_download(hub_id.repo, hub_id.file, revision=hub_id.revision,
                                                       local_files_only=local), is_offline)


def _components(folder: Path) -> list[str] | None:
    """The component folders a pipeline's model_index.json names (None when it is no pipeline folder)."""
    index = folder / "model_index.json"
    if not index.is_file():
        return None
    try:
        entries = json.loads(index.read_text())
    except (OSError, ValueError):
        return []  # the pipeline loader reports what is wrong with it
    if not isinstance(entries, dict):
        return []
    return [name for name, value in entries.items()
            if not name.startswith("_") and isinstance(value, list) and value and value[0] is not None]


def _weight_plan(folder: Path, weights: Collection[str] | None, pickles: bool) -> list[tuple[str, str]]:
    """(folder prefix, weight file pattern) pairs of what is to be read from snapshot `folder`."""
    names = WEIGHTS + (PICKLED_WEIGHTS if pickles else ())
    components = _components(folder)
    if components is None:  # a component (or tokenizer) repository: its weights lie at its root
        return [("", name) for name in names] if weights is None or weights else []
    wanted = COMPONENTS if weights is None else weights
    return [(f"{c}/", name) for c in components if c in wanted for name in names]


def _has_weights(folder: Path, plan: list[tuple[str, str]]) -> bool:
    """Whether every folder of `plan` that holds a model (a config.json) has weights matching it."""
    prefixes = dict.fromkeys(prefix for prefix, _ in plan)
    for prefix in prefixes:
        where = folder / prefix
        if not (where / "config.json").is_file():
            continue
        patterns = [name for p, name in plan if p == prefix]
        if not any(any(where.glob(pattern)) for pattern in patterns):
            return False
    return True


def _fetch_snapshot(hub_id: HubId, key: str, weights: Collection[str] | None, pickles: bool,
                    is_offline: bool) -> str:
    """The repository's snapshot folder: first its small files (which say what it holds), then the weights of
    the components it is read for, from the commit those came from."""
    from huggingface_hub import snapshot_download

    def fetch(revision: str | None, patterns: list[str]) -> Callable[[bool], str]:
        return lambda local: snapshot_download(hub_id.repo, revision=revision, allow_patterns=patterns,
                                               local_files_only=local)

    metadata = list(METADATA)
    folder = Path(_cached_first(fetch(hub_id.revision, metadata), is_offline))
    if not any((folder / name).is_file() for name in ("model_index.json", "config.json", "tokenizer_config.json")):
        raise UserError(f"{key}: {hub_id} holds no diffusers pipeline (model_index.json), component (config.json) or "
                        f"tokenizer at its top; name a single file in it as {hub_id.repo}/FILE.safetensors, or fix "
                        "the id")
    plan = _weight_plan(folder, weights, pickles)
    if not plan:
        return str(folder)
    commit = folder.name if _COMMIT.fullmatch(folder.name) else hub_id.revision
    patterns = metadata + [prefix + name for prefix, name in plan]
    path = _cached_first(fetch(commit, patterns), is_offline, lambda found: _has_weights(Path(found), plan))
    if is_offline and not _has_weights(Path(path), plan):
        wanted = ", ".join(dict.fromkeys(prefix.rstrip("/") or "its own" for prefix, _ in plan))
        raise UserError(f"{key}: {hub_id}: the Hugging Face cache holds {path} without the weights it is read for "
                        f"({wanted}), while {OFFLINE_ENV}=1 forbids downloading them; unset {OFFLINE_ENV} to "
                        "download them")
    return path


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _networkish(exc: BaseException) -> bool:
    """A failure to reach the Hub: OS and connection errors, and the HTTP clients' own (httpx, requests)."""
    return isinstance(exc, (OSError, ConnectionError, TimeoutError)) or \
        type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")


def _refusal(exc: BaseException, hub_id: HubId, key: str, is_offline: bool) -> UserError | None:
    """The one-line UserError for what huggingface_hub raised resolving `hub_id`; None for what is no Hub or
    network failure (a bug, which keeps its traceback)."""
    from huggingface_hub import errors

    where = f"{key}: {hub_id}"
    repo = hub_id.repo
    if isinstance(exc, errors.GatedRepoError) or (isinstance(exc, errors.HfHubHTTPError) and _status(exc) in (401, 403)
                                                   and not isinstance(exc, errors.RepositoryNotFoundError)):
        return UserError(f"{where}: the Hugging Face Hub refuses access to this gated or private repository; accept "
                         f"its terms at https://huggingface.co/{repo} and set {TOKEN_ENV} to an access token of that "
                         "account")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return UserError(f"{where}: no such local file or folder, and no repository {repo} on the Hugging Face Hub "
                         f"(a private one needs {TOKEN_ENV} set to a token with access to it); fix the path or the id")
    if isinstance(exc, errors.RevisionNotFoundError):
        return UserError(f"{where}: {repo} has no revision {hub_id.revision or 'main'}; name a branch, tag or commit "
                         "of it")
    if isinstance(exc, errors.EntryNotFoundError) and not isinstance(exc, errors.LocalEntryNotFoundError):
        return UserError(f"{where}: {repo} has no file {hub_id.file}; fix the file's path in the repository")
    if isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)) or _networkish(exc):
        if is_offline:
            return UserError(f"{where}: no such local file or folder, and not in the Hugging Face cache "
                             f"({cache_folder()}), while {OFFLINE_ENV}=1 forbids downloading it; unset {OFFLINE_ENV} "
                             "to download it, or fix the path")
        cause = exc.__cause__ if isinstance(exc, errors.LocalEntryNotFoundError) and exc.__cause__ else exc
        return UserError(f"{where}: no such local file or folder, not in the Hugging Face cache ({cache_folder()}), "
                         f"and the Hub cannot be reached ({type(cause).__name__}: {first_line(cause)}); check the "
                         f"network, or download it where there is one (hf download {repo}) into the cache here and "
                         f"set {OFFLINE_ENV}=1")
    return None
