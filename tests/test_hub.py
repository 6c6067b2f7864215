"""Hugging Face Hub ids as model sources (sdtrain.models.hub), offline: a Hub cache laid out in huggingface_hub's own
layout in a temporary folder, huggingface_hub's download functions replaced where a test needs the network."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import constants, errors

from sdtrain.cli.main import main
from sdtrain.errors import UserError
from sdtrain.models import hub

from .conftest import TINY

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache that huggingface_hub uses, offline (as conftest sets it for every test)."""
    folder = tmp_path / "hf-cache"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))  # read once, as huggingface_hub is imported
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return folder


def put_in_cache(cache: Path, repo: str, source: Path | None = None, commit: str = COMMIT, ref: str | None = "main",
                 files: dict[str, bytes] | None = None) -> Path:
    """`source`'s files (and `files`) as commit `commit` of `repo` in the cache, `ref` naming it: each file a link
    to its blob, as huggingface_hub writes them."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    contents = {str(p.relative_to(source)): p.read_bytes() for p in source.rglob("*") if p.is_file()} if source else {}
    contents.update(files or {})
    for name, data in sorted(contents.items()):
        link = snapshot / name
        if link.is_symlink():
            continue
        blob = storage / "blobs" / hashlib.sha256(name.encode() + data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def no_downloads(monkeypatch) -> list[dict]:
    """huggingface_hub's downloads, kept to the cache: any call that may reach the network fails the test."""
    calls: list[dict] = []
    real = huggingface_hub.snapshot_download

    def cached_only(repo_id, **kwargs):
        calls.append({"repo_id": repo_id, **kwargs})
        assert kwargs.get("local_files_only"), f"{repo_id}: a download was attempted for what is cached"
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cached_only)
    return calls


def test_what_reads_as_a_hub_id():
    assert hub.parse("black-forest-labs/FLUX.1-dev") == hub.HubId("black-forest-labs/FLUX.1-dev")
    assert hub.parse("org/name@main") == hub.HubId("org/name", "main")
    assert hub.parse("org/name@refs/pr/1") == hub.HubId("org/name", "refs/pr/1")
    assert hub.parse("org/name/sub/model.safetensors") == hub.HubId("org/name", None, "sub/model.safetensors")
    assert hub.parse("org/name@v1/model.safetensors") == hub.HubId("org/name", "v1", "model.safetensors")
    for text in ("name", "./org/name", "../org/name", "/abs/org", "~/org/name", "org/name/folder", "org/name@",
                 "org/file.safetensors", "org--x/name", "org/na me", "https://huggingface.co/org/name",
                 "org/name/../x.safetensors", "-org/name", "org/name."):
        assert hub.parse(text) is None, text


def test_a_cached_snapshot_names_its_id():
    snapshot = f"/home/u/.cache/huggingface/hub/models--black-forest-labs--FLUX.1-dev/snapshots/{COMMIT}"
    assert hub.cached_id(snapshot) == hub.HubId("black-forest-labs/FLUX.1-dev", COMMIT)
    assert str(hub.cached_id(snapshot + "/flux1-dev.safetensors")) == \
        f"black-forest-labs/FLUX.1-dev@{COMMIT}/flux1-dev.safetensors"
    assert hub.cached_id(snapshot + "/vae") == hub.HubId("black-forest-labs/FLUX.1-dev", COMMIT)
    assert hub.cached_id("/data/models/sd15") is None


def test_constants_agree_with_the_modules_they_mirror():
    """hub.py keeps copies, so that importing it loads neither torch nor the families."""
    from sdtrain.models import families, single_file

    assert hub.SINGLE_FILE_SUFFIXES == single_file.SUFFIXES
    assert hub.TRUST_PICKLE_ENV == single_file.TRUST_PICKLE_ENV
    loaded = {name for family in families.FAMILIES.values() for name in family.components}
    assert set(hub.COMPONENTS) <= loaded  # a default for callers that know no family; a run asks its family's


def test_a_local_path_never_asks_huggingface_hub(tmp_path, monkeypatch, cache):
    def refuse(*args, **kwargs):
        raise AssertionError("huggingface_hub was asked about a local path")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    put_in_cache(cache, "org/tiny-sd", files={"model_index.json": b"{}"})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny-sd").mkdir(parents=True)
    # A folder of the id's spelling wins over the cached repository.
    assert hub.resolve("org/tiny-sd", "model.pretrained") == "org/tiny-sd"
    assert hub.resolve(str(tmp_path), "model.vae") == str(tmp_path)
    # Neither a path nor an id: left to the loaders' own "not found" error.
    assert hub.resolve("runs/x/y", "model.vae") == "runs/x/y"
    assert hub.resolve(None, "model.vae") is None


def test_training_from_a_local_folder_never_asks_huggingface_hub(tmp_path, monkeypatch, pretrained, shapes_dir):
    def refuse(*args, **kwargs):
        raise AssertionError("huggingface_hub was asked about a local path")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    assert main(["train", str(CONFIGS / "lora.yaml"), f"model.pretrained={pretrained}", f"data.shards={shapes_dir}",
                 f"run_dir={tmp_path / 'run'}", *TINY, "train.max_steps=1"]) == 0


def test_a_hub_id_trains_resumes_and_exports_from_the_cache_offline(tmp_path, monkeypatch, cache, pretrained,
                                                                    shapes_dir):
    from sdtrain.checkpoint import latest_checkpoint, read_meta

    snapshot = put_in_cache(cache, "org/tiny-sd", pretrained)
    calls = no_downloads(monkeypatch)
    run = tmp_path / "run"

    def train(steps: int) -> int:
        return main(["train", str(CONFIGS / "lora.yaml"), "model.pretrained=org/tiny-sd", f"data.shards={shapes_dir}",
                     f"run_dir={run}", *TINY, f"train.max_steps={steps}"])

    assert train(2) == 0
    assert calls and all(call["repo_id"] == "org/tiny-sd" for call in calls)
    # The run records the snapshot the id resolved to: the same commit's weights on resume and export.
    assert f"pretrained: {snapshot}" in (run / "config.yaml").read_text()
    sources = read_meta(latest_checkpoint(run))["sources"]
    assert sources and all(value == str(snapshot.resolve()) for value in sources.values()), sources
    assert train(3) == 0
    assert latest_checkpoint(run).name == "step_00000003"
    assert main(["export", str(run), "--out", str(tmp_path / "lora")]) == 0
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    # The exported adapter applies on the base named by its id, at a revision.
    out = tmp_path / "images"
    assert main(["generate", "--model", f"org/tiny-sd@{COMMIT}", "--lora", str(tmp_path / "lora"), "--prompt",
                 "a red circle", "--steps", "2", "--out", str(out)]) == 0
    assert len(list(out.glob("*.png"))) == 2


def test_generate_takes_an_id_at_a_branch(tmp_path, monkeypatch, cache, pretrained):
    put_in_cache(cache, "org/tiny-sd", pretrained, commit=OTHER_COMMIT, ref="dev")
    no_downloads(monkeypatch)
    out = tmp_path / "images"
    assert main(["generate", "--model", "org/tiny-sd@dev", "--prompt", "a red circle", "--steps", "2",
                 "--out", str(out)]) == 0
    assert len(list(out.glob("*.png"))) == 2


def test_a_file_in_a_repository_keeps_its_name_when_pinned(cache):
    from sdtrain.models import build

    snapshot = put_in_cache(cache, "org/files", files={"weights/model.safetensors": b"x"})
    found = hub.resolve("org/files/weights/model.safetensors", "model.transformer")
    assert found == str(snapshot / "weights" / "model.safetensors")
    # The snapshot's file links to a blob named by its hash: the pin keeps the file's name (and suffix).
    assert Path(found).resolve().name != "model.safetensors"
    assert build.pin_source(found) == str(snapshot.resolve() / "weights" / "model.safetensors")


def test_an_uncached_id_offline_is_one_line_naming_it_and_hf_hub_offline(tmp_path, cache, capsys, shapes_dir):
    assert main(["generate", "--model", "org/missing", "--prompt", "a red circle"]) == 2
    err = one_line_error(capsys)
    assert "--model: org/missing" in err and "HF_HUB_OFFLINE" in err and str(cache) in err
    assert main(["train", str(CONFIGS / "lora.yaml"), "model.pretrained=org/missing@v2", f"data.shards={shapes_dir}",
                 f"run_dir={tmp_path / 'run'}", *TINY]) == 2
    err = one_line_error(capsys)
    assert "model.pretrained: org/missing@v2" in err and "HF_HUB_OFFLINE" in err
    assert not (tmp_path / "run").exists()
    assert main(["prepare", "encode", str(shapes_dir), "--vae", "org/missing", "--out", str(tmp_path / "enc")]) == 2
    assert "--vae: org/missing" in one_line_error(capsys)


def _http_error(cls: type, status: int) -> Exception:
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return cls(f"{status} Client Error", response=response)


@pytest.mark.parametrize(("raised", "says"), [
    (lambda: _http_error(errors.GatedRepoError, 403), ["org/gated", "HF_TOKEN", "https://huggingface.co/org/gated"]),
    (lambda: _http_error(errors.HfHubHTTPError, 401), ["org/gated", "HF_TOKEN"]),
    (lambda: _http_error(errors.RepositoryNotFoundError, 404), ["org/gated", "no repository org/gated"]),
    (lambda: _http_error(errors.RevisionNotFoundError, 404), ["org/gated", "no revision"]),
    (lambda: errors.LocalEntryNotFoundError("Got: ConnectError: [Errno 101] Network is unreachable\nmore"),
     ["org/gated", "HF_HUB_OFFLINE", "cannot be reached"]),
])
def test_what_the_hub_refuses_is_one_line(monkeypatch, cache, capsys, raised, says):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def download(repo_id, local_files_only=False, **kwargs):
        if local_files_only:
            raise errors.LocalEntryNotFoundError("not cached")
        raise raised()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert main(["generate", "--model", "org/gated", "--prompt", "a red circle"]) == 2
    err = one_line_error(capsys)
    assert all(part in err for part in says), err


def _fake_hub(monkeypatch, cache: Path, remote: dict[str, bytes], repo: str = "org/flux") -> list[list[str]]:
    """huggingface_hub.snapshot_download online, over a repository of files `remote`, in huggingface_hub's way: the
    cache answers local_files_only calls (the snapshot folder of the revision's ref), a download writes the files
    the patterns allow. Returns each download's files."""
    from huggingface_hub.utils import filter_repo_objects

    downloads: list[list[str]] = []
    storage = cache / f"models--{repo.replace('/', '--')}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def download(repo_id, revision=None, allow_patterns=None, local_files_only=False, **kwargs):
        assert repo_id == repo and not kwargs.get("token"), kwargs
        ref = storage / "refs" / (revision or "main")
        if revision and len(revision) == 40:
            commit = revision
        elif ref.is_file():
            commit = ref.read_text()
        elif local_files_only:
            raise errors.LocalEntryNotFoundError("not cached")
        else:
            commit = COMMIT
        folder = storage / "snapshots" / commit
        if local_files_only:
            if not folder.is_dir():
                raise errors.LocalEntryNotFoundError("not cached")
            return str(folder)
        files = sorted(filter_repo_objects(remote, allow_patterns=allow_patterns))
        downloads.append([f for f in files if not (folder / f).exists()])
        put_in_cache(cache, repo, commit=COMMIT, files={f: remote[f] for f in files})
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    return downloads


FLUX_REPO = {
    "model_index.json": json.dumps({"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"],
                                    "transformer": ["diffusers", "FluxTransformer2DModel"],
                                    "text_encoder": ["transformers", "CLIPTextModel"],
                                    "text_encoder_2": ["transformers", "T5EncoderModel"],
                                    "tokenizer": ["transformers", "CLIPTokenizer"],
                                    "tokenizer_2": ["transformers", "T5TokenizerFast"],
                                    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}).encode(),
    "README.md": b"", "flux1-dev.safetensors": b"", "ae.safetensors": b"", "dev_grid.jpg": b"",
    "scheduler/scheduler_config.json": b"{}",
    "vae/config.json": b"{}", "vae/diffusion_pytorch_model.safetensors": b"",
    "vae/diffusion_pytorch_model.fp16.safetensors": b"", "vae/diffusion_pytorch_model.bin": b"",
    "vae/diffusion_flax_model.msgpack": b"",
    "transformer/config.json": b"{}", "transformer/diffusion_pytorch_model.safetensors.index.json": b"{}",
    "transformer/diffusion_pytorch_model-00001-of-00002.safetensors": b"",
    "transformer/diffusion_pytorch_model-00002-of-00002.safetensors": b"",
    "text_encoder/config.json": b"{}", "text_encoder/model.safetensors": b"", "text_encoder/model.onnx": b"",
    "text_encoder_2/config.json": b"{}", "text_encoder_2/model.safetensors.index.json": b"{}",
    "text_encoder_2/model-00001-of-00002.safetensors": b"", "text_encoder_2/model-00002-of-00002.safetensors": b"",
    "text_encoder_2/pytorch_model.bin": b"",
    "tokenizer/vocab.json": b"{}", "tokenizer/merges.txt": b"", "tokenizer/tokenizer_config.json": b"{}",
    "tokenizer_2/spiece.model": b"", "tokenizer_2/tokenizer.json": b"{}", "tokenizer_2/tokenizer_config.json": b"{}",
}
# The small files, the repository's model card among them (an export's card takes its license).
METADATA = sorted(f for f in FLUX_REPO if f.endswith((".json", ".txt", ".model")) or f == "README.md")


def test_only_what_sdtrain_reads_is_downloaded_and_only_once(monkeypatch, cache):
    downloads = _fake_hub(monkeypatch, cache, FLUX_REPO)
    # The VAE alone of a pipeline: every small file, then the VAE's safetensors (no variant, pickle or flax copy).
    folder = hub.resolve("org/flux", "model.vae", ("vae",))
    assert downloads == [METADATA, ["vae/diffusion_pytorch_model.safetensors"]]
    assert folder == str(cache / "models--org--flux" / "snapshots" / COMMIT)
    # The whole pipeline after it: what it lacked, from the same commit; no root single files, pickles or onnx.
    assert hub.resolve("org/flux", "model.pretrained") == folder
    assert downloads[2] == ["text_encoder/model.safetensors", "text_encoder_2/model-00001-of-00002.safetensors",
                            "text_encoder_2/model-00002-of-00002.safetensors",
                            "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
                            "transformer/diffusion_pytorch_model-00002-of-00002.safetensors"]
    # Cached now: neither asks the network again, nor does a tokenizer (configs and tokenizer files only).
    assert hub.resolve("org/flux", "model.pretrained") == folder
    assert hub.resolve("org/flux", "model.tokenizer_2", ()) == folder
    assert len(downloads) == 3


def test_pickled_weights_come_only_where_trusted(monkeypatch, cache):
    downloads = _fake_hub(monkeypatch, cache, {"config.json": b"{}", "pytorch_model.bin": b"",
                                               "flax_model.msgpack": b""}, repo="org/old")
    folder = hub.resolve("org/old", "model.text_encoder", ("text_encoder",))
    assert downloads == [["config.json"], []]
    assert hub.resolve("org/old", "model.text_encoder", ("text_encoder",), pickles=True) == folder
    assert downloads[2] == ["pytorch_model.bin"]


def test_a_model_config_fetches_no_weights_another_source_replaces(monkeypatch, cache):
    from sdtrain.config import ComponentConfig, ModelConfig, RunConfig

    downloads = _fake_hub(monkeypatch, cache, FLUX_REPO)
    local_vae = cache.parent / "my-vae"
    local_vae.mkdir()
    sources = {"vae": str(local_vae), "transformer": "org/flux", "tokenizer": "org/flux"}
    given = RunConfig(model=ModelConfig(pretrained="org/flux", components={
        name: ComponentConfig(source=source) for name, source in sources.items()}))
    model = hub.resolve_model(given).model
    assert given.model.pretrained == "org/flux"  # the loaded config stays as it was
    snapshot = str(cache / "models--org--flux" / "snapshots" / COMMIT)
    assert (model.pretrained, model.source("vae"), model.source("transformer"), model.source("tokenizer")) == \
        (snapshot, str(local_vae), snapshot, snapshot)
    fetched = sorted(f for batch in downloads for f in batch if f not in METADATA)
    assert not any(f.startswith("vae/") for f in fetched)
    assert "transformer/diffusion_pytorch_model-00001-of-00002.safetensors" in fetched


def test_a_cached_snapshot_without_the_weights_asked_for_is_one_line_offline(cache):
    put_in_cache(cache, "org/flux", files={f: FLUX_REPO[f] for f in METADATA})
    with pytest.raises(UserError, match=r"model\.vae: org/flux: .*without the weights .*\(vae\).*HF_HUB_OFFLINE"):
        hub.resolve("org/flux", "model.vae", ("vae",))
    # Tokenizer files are all a tokenizer needs.
    assert hub.resolve("org/flux", "model.tokenizer", ()).endswith(COMMIT)


def test_the_cli_still_starts_without_torch_and_leaves_hf_hub_offline_to_the_user(monkeypatch):
    code = ("import sys\n"
            "from sdtrain.cli.main import main\n"
            "for argv in (['--help'], ['generate', '--bogus'], ['train']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'diffusers', 'transformers', "
            "'huggingface_hub'})\n"
            "assert not heavy, heavy\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    from sdtrain.cli.main import _quiet_libraries

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _quiet_libraries()
    assert "HF_HUB_OFFLINE" not in os.environ


def test_put_in_cache_matches_what_huggingface_hub_reads(cache):
    """The layout the tests above build is one huggingface_hub itself accepts offline."""
    snapshot = put_in_cache(cache, "org/layout", files={"config.json": b"{}"})
    assert huggingface_hub.snapshot_download("org/layout", local_files_only=True) == str(snapshot)
    assert huggingface_hub.try_to_load_from_cache("org/layout", "config.json") == str(snapshot / "config.json")
