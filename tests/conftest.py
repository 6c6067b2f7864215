"""Shared fixtures: tiny datasets and tiny trained runs, made once per test session."""

from __future__ import annotations

import ast
import faulthandler
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Measured precisions are cached per machine; the tests keep theirs apart from the user's.
os.environ["SDTRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="sdtrain-test-cache-")
# Two cores: tests that run training must not oversubscribe them with a full thread pool each.
torch.set_num_threads(2)

TINY = [
    "data.resolution=32",
    "data.batch_size=4",
    "data.num_workers=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    # Fixed, so runs the tests compare train alike whatever the machine measures (autotune has its own tests).
    "train.mixed_precision=fp32",
    # The demo configs follow the cores other processes leave; a test's runs keep one thread count to compare.
    "train.threads=0",
    "train.gradient_checkpointing=false",
    # Likewise the autoencoder's encode in a step (measured per machine otherwise).
    "train.encode=fp32",
]
# A family's tests through the CLI: TINY in batches of 2, no validation previews and no evaluation unless asked.
TINY_CLI = [*TINY, "data.batch_size=2", "validation.prompts=[]", "evaluation.every_samples=0"]
# Each fine-tuning mode of a family's tests: its shared config and what makes two tiny steps change the model.
FINE_TUNE_MODES = {
    "lora": ("lora.yaml", ["lora.rank=4", "optim.lr=0.01"]),
    "full": ("finetune-full.yaml", ["optim.lr=0.01", "optim.warmup_steps=0"]),
    "dreambooth": ("dreambooth.yaml", ["dreambooth.instance_prompt=a sks shape", "dreambooth.class_prompt=a shape",
                                       "dreambooth.num_class_images=2", "dreambooth.generation_steps=2",
                                       "optim.lr=0.01", "optim.warmup_steps=0"]),
}


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory) -> Path:
    from sdtrain.data.shapes import write_shapes_dataset

    out = tmp_path_factory.mktemp("shapes")
    write_shapes_dataset(out, num=48, seed=0, samples_per_shard=16, size=32)
    return out


def same_checkpoints(a: Path, b: Path) -> None:
    """Two checkpoints' weights (and EMA, where the first has one) are bitwise equal, tensor for tensor, whether
    saved whole or sharded."""
    from sdtrain.checkpoint import read_weights
    from sdtrain.errors import UserError

    for group in ("model", "ema"):
        try:
            first = read_weights(a, group)
        except UserError:
            if group == "model":
                raise
            continue
        second = read_weights(b, group)
        assert first.keys() == second.keys()
        different = [k for k in first if not torch.equal(first[k], second[k])]
        assert not different, f"{group}: {len(different)} tensors differ, e.g. {different[:3]}"


# The sdtrain CLI in a fresh process with this one's thread setting: on some CPUs a process that called
# torch.set_num_threads(2) (as this conftest does) and one left at torch's default of 2 threads compute a Qwen2.5-VL
# vision block's gradients a rounding apart; two fresh processes agree bit for bit, as a user's run and its resume.
SDTRAIN_AS_HERE = [sys.executable, "-c", "import sys, torch; torch.set_num_threads(2); "
                   "from sdtrain.cli.main import main; sys.exit(main(sys.argv[1:]))"]


def resumes_bitwise_after_kill_9(command, tmp_path: Path, steps: int = 3) -> None:
    """`command(run)` (a 3-step `sdtrain train` argument list) run straight, and run again SIGKILLed right after
    step 2 with no chance to save beyond that checkpoint, then resumed: both end with the same checkpoint."""
    import subprocess

    from sdtrain.cli.main import main

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(command(straight)) == 0
    result = subprocess.run([*SDTRAIN_AS_HERE, *command(killed)],
                            env={**os.environ, "OMP_NUM_THREADS": "2", "SDTRAIN_KILL_AT_STEP": str(steps - 1)},
                            capture_output=True, text=True)
    assert result.returncode == -9, result.stderr[-2000:]
    final = f"step_{steps:08d}"
    assert not (killed / "checkpoints" / final).exists()
    assert main(command(killed)) == 0
    same_checkpoints(straight / "checkpoints" / final, killed / "checkpoints" / final)


def flat_tensors(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors in nested dicts and lists (an optimizer's state), by their path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return {k: v for key, item in items for k, v in flat_tensors(item, f"{prefix}/{key}").items()}


def t5_tokenizer(folder: Path, captions: list[str], length: int):
    """A T5TokenizerFast (SentencePiece Unigram, ``</s>`` after every caption, ``<pad>`` id 0) learnt from
    `captions`, saved to `folder` as a released T5 (or umT5) tokenizer folder is laid out, and read back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import T5TokenizerFast

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.decoder = decoders.Metaspace()
    unigram.train_from_iterator(captions * 8, trainers.UnigramTrainer(
        vocab_size=64, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    unigram.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = T5TokenizerFast(tokenizer_object=unigram, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                extra_ids=0, model_max_length=length)
    tokenizer.save_pretrained(folder)
    return T5TokenizerFast.from_pretrained(folder)


def tiny_components(family: str, folder: Path, captions: list[str], length: int) -> dict:
    """`family`'s tiny preset as a run from scratch builds it: its tokenizer learnt from `captions` into `folder`
    (tokens per caption: `length`), then its VAE, text encoders and denoiser. Returns the ModelConfig, the
    tokenizers and the components by name."""
    from sdtrain.config import ComponentConfig, ModelConfig
    from sdtrain.models import build, families

    spec = families.get(family)
    torch.manual_seed(0)
    spec.conditioner.train_tokenizer(captions, folder / "tokenizer", 600, length)
    config = ModelConfig(family=family, preset="tiny", t5_text_length=length,
                         components={"tokenizer": ComponentConfig(source=str(folder / "tokenizer"))})
    tokenizers = build.load_text_tokenizers(config)
    vae = build.build_vae(config)
    text_encoders = {name: build.build_text_encoder(config, tokenizer, name)
                     for name, tokenizer in zip(spec.components.text_encoders, tokenizers)}
    denoiser = build.build_denoiser(config, spec.codec.channels(vae.config), 8, text_encoders)
    return {"config": config, "tokenizers": tokenizers,
            "components": {"vae": vae, **text_encoders, spec.components.denoiser: denoiser}}


def run_card(export: Path, base: Path | None = None, sample: dict[str, Any] | None = None, **loading: Any
             ) -> tuple[Any, dict[str, Any]]:
    """An export's model card as the Hub reads it (its front matter) and what its python code makes, run as written
    beside the export (the code names it by its folder's name): a local base's stand-in replaced by `base` (given
    `loading` too), and each image it loads made under the name it loads it by. Its last statement, the sample, is
    left out, or with `sample` run with those arguments added to the pipeline's call (a tiny size, one step).
    Returns the card's metadata and the code's variables."""
    from huggingface_hub import ModelCard
    from PIL import Image

    card = ModelCard.load(export / "README.md")
    code = card.text.split("```python\n", 1)[1].split("```", 1)[0]
    if base is not None:
        code = re.sub(r'"path/to/[^"]*"', "BASE, **LOADING", code)
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "load_image":
            Image.new("RGB", (32, 32), (230, 30, 30)).save(export.parent / node.args[0].value)
    if sample is None:
        tree.body.pop()
    else:
        call = next(node for node in ast.walk(tree.body[-1])
                    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "pipe")
        call.keywords += [ast.keyword(arg=key, value=ast.Constant(value)) for key, value in sample.items()]
        ast.fix_missing_locations(tree)
    variables: dict[str, Any] = {"BASE": str(base), "LOADING": loading}
    here = os.getcwd()
    os.chdir(export.parent)
    try:
        exec(compile(tree, "README.md", "exec"), variables)  # noqa: S102 - the card's own code, written by the export
    finally:
        os.chdir(here)
    return card.data, variables


@contextmanager
def warns_nothing(caplog) -> Iterator[None]:
    """Every warning an error within, and none logged by diffusers, which warns of a config's keys through its own
    logger (one that does not propagate to the root, where caplog listens)."""
    logger = logging.getLogger("diffusers")
    logger.addHandler(caplog.handler)
    start = len(caplog.records)
    try:
        with caplog.at_level(logging.WARNING, logger="diffusers"), warnings.catch_warnings():
            warnings.simplefilter("error")
            # diffusers' FluxControlNetModel builds its position embedder from the name diffusers deprecated: a
            # FutureWarning at every construction, whatever the folder holds.
            warnings.filterwarnings("ignore", "`FluxPosEmbed` is deprecated", FutureWarning)
            yield
    finally:
        logger.removeHandler(caplog.handler)
    logged = [record.getMessage() for record in caplog.records[start:]
              if record.name.startswith("diffusers") and record.levelno >= logging.WARNING]
    assert not logged, logged


def config_path(name: str) -> Path:
    return Path(__file__).resolve().parents[1] / "configs" / "demo" / name


def train(config: str, run_dir: Path, *overrides: str) -> None:
    from sdtrain.cli.main import main

    code = main(["train", str(config_path(config)), f"run_dir={run_dir}", *TINY, *overrides])
    assert code == 0


@pytest.fixture(scope="session")
def autoencoder_run(tmp_path_factory, shapes_dir) -> Path:
    run = tmp_path_factory.mktemp("runs") / "autoencoder"
    train("autoencoder.yaml", run, f"data.shards={shapes_dir}", "train.max_steps=4", "checkpoint.every=2")
    return run


@pytest.fixture(scope="session")
def diffusion_run(tmp_path_factory, shapes_dir, autoencoder_run) -> Path:
    run = tmp_path_factory.mktemp("runs") / "diffusion"
    train("diffusion.yaml", run, f"data.shards={shapes_dir}", f"model.vae={autoencoder_run}",
          "train.max_steps=4", "checkpoint.every=2", "validation.prompts=[a red circle,a blue square]",
          "validation.steps=2")
    return run


def _contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def tiny_autoencoder(tmp_path_factory, shapes_dir) -> Iterator[Callable[[str], Path]]:
    """`tiny_autoencoder(family)`: a 2-step run of the autoencoder `family`'s tiny preset builds, the ``model.vae``
    of a tiny diffusion run of `family` from scratch. One run a session serves every family whose tiny preset builds
    the same autoencoder (Flux.1, SD3 and Z-Image: TINY_FLUX_VAE, 16 channels), trained as the first such family in
    families.FAMILIES: the stage trains the same weights whichever family it is told, and a diffusion run reads an
    autoencoder run's module and weights, not the family it recorded. Shared, so read-only: a test that would write
    into it copies it first, and the session ends in an error if one changed it."""
    from sdtrain.models import families

    def build(name: str) -> tuple[str, str]:
        spec = families.get(name)
        return spec.components.classes["vae"].__name__, json.dumps(spec.preset("tiny", "vae"), sort_keys=True)

    runs: dict[tuple[str, str], tuple[Path, dict[str, str]]] = {}

    def autoencoder(family: str) -> Path:
        key = build(family)
        if key not in runs:
            trained_as = next(name for name, spec in families.FAMILIES.items()
                              if "tiny" in spec.presets and build(name) == key)
            run = tmp_path_factory.mktemp(f"autoencoder-{trained_as}") / "autoencoder"
            train("autoencoder.yaml", run, f"model.family={trained_as}", f"data.shards={shapes_dir}",
                  "train.max_steps=2")
            runs[key] = run, _contents(run)
        return runs[key][0]

    yield autoencoder
    for run, contents in runs.values():
        assert _contents(run) == contents, f"{run}: a test changed the shared autoencoder run"


@pytest.fixture(scope="session")
def tiny_scratch_command(tiny_autoencoder, shapes_dir, edits) -> Callable[..., list[str]]:
    """`tiny_scratch_command(family, run, steps, *overrides)`: the `sdtrain train` arguments of a tiny diffusion
    run of `family` from scratch into `run` (configs/demo/diffusion.yaml, TINY_CLI, the session's shapes, or its
    `edits` by reference for a family whose models only edit, and its `tiny_autoencoder`): the text encoders and
    the denoiser built from the tiny preset and trained, the tokenizers trained on the captions; `overrides` come
    last, so they win."""
    from sdtrain.models import families

    def command(family: str, run: Path, steps: int, *overrides: str) -> list[str]:
        edits_only = families.get(family).edits_only
        data = [f"data.shards={edits}", "edit.reference=true"] if edits_only else [f"data.shards={shapes_dir}"]
        return ["train", str(config_path("diffusion.yaml")), f"run_dir={run}", *TINY_CLI, f"model.family={family}",
                f"model.vae={tiny_autoencoder(family)}", *data, f"train.max_steps={steps}", *overrides]

    return command


@pytest.fixture(scope="session")
def tiny_scratch_run(tiny_scratch_command) -> Callable[..., Path]:
    """`tiny_scratch_run(family, run, steps, *overrides)`: `tiny_scratch_command`'s run trained (it must exit 0);
    returns `run`."""
    from sdtrain.cli.main import main

    def scratch(family: str, run: Path, steps: int, *overrides: str) -> Path:
        assert main(tiny_scratch_command(family, run, steps, *overrides)) == 0
        return run

    return scratch


@pytest.fixture(scope="session")
def layouts(tmp_path_factory) -> Path:
    """Shards of 16 shapes images at 32 px, each with its layout map (``KEY.cond.png``): a ControlNet's data."""
    from sdtrain.cli.main import main

    out = tmp_path_factory.mktemp("layouts")
    assert main(["prepare", "shapes", "--out", str(out), "--num", "16", "--size", "32", "--seed", "1",
                 "--conditioning", "layout"]) == 0
    return out


@pytest.fixture(scope="session")
def edits(tmp_path_factory) -> Path:
    """Shards of eight edits (each image beside its source, ``KEY.src.png``, in `edits.parent / "images"`): a shape
    recoloured, the instruction naming the new colour."""
    import numpy as np
    from PIL import Image, ImageDraw

    from sdtrain.cli.main import main

    folder = tmp_path_factory.mktemp("edits") / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    colours = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60)}
    for i in range(8):
        box = [int(v) for v in rng.integers(2, 14, 2)]
        box += [box[0] + 16, box[1] + 16]
        before, after = rng.choice(list(colours), 2, replace=False)
        for name, colour in ((f"{i}.src.png", before), (f"{i}.png", after)):
            image = Image.new("RGB", (32, 32), (240, 240, 240))
            ImageDraw.Draw(image).ellipse(box, fill=colours[colour])
            image.save(folder / name)
        (folder / f"{i}.txt").write_text(f"make it {after}")
    out = folder.parent / "shards"
    assert main(["prepare", "folder", str(folder), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory, diffusion_run) -> Path:
    """A tiny pretrained pipeline folder to fine-tune: the diffusion run, exported."""
    from sdtrain.export import export_run

    return export_run(diffusion_run, tmp_path_factory.mktemp("pretrained") / "pipeline")


def pytest_unconfigure(config) -> None:
    """If the interpreter does not exit soon after the session, say what holds it, then leave.

    Everything a test starts must end with it; a thread or child process that does not would make
    CI wait until its time limit with no word of why. This prints the culprits and ends with the
    session's own status, so the report shows in the log of a run whose tests passed.
    """
    status = getattr(config, "_sdtrain_exit_status", 0)

    def report_and_exit() -> None:
        import multiprocessing

        print("\n[conftest] interpreter exit stalled; still alive:", file=sys.stderr)
        print(f"  threads: {[t.name for t in threading.enumerate()]}", file=sys.stderr)
        print(f"  children: {multiprocessing.active_children()}", file=sys.stderr)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(status)

    timer = threading.Timer(120, report_and_exit)
    timer.daemon = True
    timer.start()


def pytest_sessionfinish(session, exitstatus) -> None:
    session.config._sdtrain_exit_status = int(exitstatus)
