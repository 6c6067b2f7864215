"""Train a CLIP-compatible byte-level BPE tokenizer offline and load it back as a ``CLIPTokenizer``; load CLIP
and T5 tokenizer folders offline; tokenize captions for every text encoder of a family at once.

The files written (vocab.json, merges.txt, tokenizer.json, tokenizer_config.json) are what
``CLIPTokenizer.from_pretrained`` and a diffusers pipeline's ``tokenizer/`` folder expect.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, trainers
from transformers import AutoTokenizer, CLIPTokenizer, T5Tokenizer

from sdtrain.errors import UserError

BOS, EOS, SUFFIX = "<|startoftext|>", "<|endoftext|>", "</w>"
# 256 byte characters + the same with the end-of-word suffix + bos + eos: the vocabulary before any merge.
_BASE_SIZE = 2 * 256 + 2


def _byte_chars() -> list[str]:
    """GPT-2/CLIP ``bytes_to_unicode`` characters, in CLIP's vocabulary order (printable bytes first)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def _learn_merges(captions: Iterable[str], n_merges: int) -> list[tuple[str, str]]:
    """Learn up to ``n_merges`` BPE merges on byte-level, end-of-word-suffixed words."""
    chars = _byte_chars()
    # Reuse CLIPTokenizer's own normalizer and pre-tokenizer so training sees exactly the words
    # (lowercased, whitespace-collapsed, split on punctuation) that encoding will later feed to BPE.
    clip = CLIPTokenizer().backend_tokenizer
    tok = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix=SUFFIX))
    tok.normalizer, tok.pre_tokenizer = clip.normalizer, clip.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=2 * 256 + n_merges,
        initial_alphabet=chars,
        # The trainer breaks count ties by token id; suffixed characters otherwise get ids in Rust
        # hash-map order, which changes between processes. Pre-registering them fixes every id.
        special_tokens=[c + SUFFIX for c in chars],
        end_of_word_suffix=SUFFIX,
        show_progress=False,
    )
    tok.train_from_iterator(captions, trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges][:n_merges]


def train_clip_tokenizer(
    captions: Iterable[str], out_dir: str | Path, vocab_size: int = 1024, max_length: int = 77
) -> CLIPTokenizer:
    """Train a CLIP-layout BPE tokenizer on ``captions`` and save it to ``out_dir``.

    The folder is built in a temporary sibling and renamed into place, so an interrupted run
    never leaves a half-written tokenizer. Same captions give byte-identical files.
    """
    if vocab_size <= _BASE_SIZE:
        raise UserError(f"tokenizer vocab_size={vocab_size} is too small: use more than {_BASE_SIZE}")
    out_dir = Path(out_dir)
    chars = _byte_chars()
    merges = _learn_merges(captions, vocab_size - _BASE_SIZE)
    tokens = chars + [c + SUFFIX for c in chars] + [a + b for a, b in merges] + [BOS, EOS]
    # Two different merges can build the same string; keep its first id so ids stay contiguous.
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    # EOS is the highest id and doubles as pad (as in SD1.x): CLIPTextModel pools at the first
    # eos_token_id, so padding with EOS still pools the real end of the caption.
    tok = CLIPTokenizer(vocab=vocab, merges=merges, pad_token=EOS, model_max_length=max_length)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # The pid keeps concurrent writers apart; a plain mkdir (unlike mkdtemp) keeps the umask's permissions.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    old = tmp.with_name(tmp.name + ".old")
    for leftover in (tmp, old):  # from a run with the same pid that was killed mid-way
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir()
    try:
        tok.save_pretrained(tmp)
        (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=2) + "\n", "utf-8")
        (tmp / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), "utf-8")
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_clip_tokenizer(out_dir, max_length)


def load_clip_tokenizer(path: str | Path, max_length: int | None = None) -> CLIPTokenizer:
    """Load a tokenizer folder (ours or a pipeline's ``tokenizer/``) without touching the network.

    ``max_length`` overrides the saved ``model_max_length``.
    """
    path = Path(path)
    has_files = (path / "tokenizer.json").is_file() or (
        (path / "vocab.json").is_file() and (path / "merges.txt").is_file()
    )
    if not has_files:
        raise UserError(
            f"no tokenizer in {path}: expected tokenizer.json or vocab.json + merges.txt; "
            "train one with train_clip_tokenizer or point to a pipeline's tokenizer/ folder"
        )
    kwargs = {} if max_length is None else {"model_max_length": max_length}
    try:
        tok = CLIPTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
    except Exception as e:  # the Rust backend reports corrupt files as a bare Exception
        reason = " ".join(str(e).split())  # the CLI prints one line
        raise UserError(
            f"cannot load the tokenizer in {path} ({reason}); re-train it with train_clip_tokenizer"
        ) from e
    # Without tokenizer_config.json the length defaults to 1e30, which would silently disable truncation.
    if tok.model_max_length > 100_000:
        raise UserError(f"tokenizer in {path} has no model_max_length: pass max_length or re-train it")
    return tok


def _tokenizer_class(path: Path) -> str:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class") or ""
    except (OSError, ValueError, AttributeError):
        return ""


def is_t5_tokenizer(path: str | Path) -> bool:
    """Whether a tokenizer folder holds a T5 (SentencePiece) tokenizer rather than CLIP's BPE."""
    path = Path(path)
    return (path / "spiece.model").is_file() or _tokenizer_class(path).startswith("T5")


def load_tokenizer_folder(path: str | Path, max_length: int | None = None) -> Any:
    """A tokenizer folder, offline: CLIP's (the default: its files alone say little), T5's (a pipeline's
    ``tokenizer_2/`` of Flux.1), or any other class its tokenizer_config.json names (a language model's, Qwen2's
    for Z-Image), through transformers' AutoTokenizer. ``max_length`` overrides the saved ``model_max_length``."""
    path = Path(path)
    named, t5 = _tokenizer_class(path), is_t5_tokenizer(path)
    if not t5 and (not named or named.startswith("CLIP")):
        return load_clip_tokenizer(path, max_length)
    kwargs = {} if max_length is None else {"model_max_length": max_length}
    try:
        if t5:
            return T5Tokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
    except Exception as e:  # the Rust backend reports corrupt files as a bare Exception
        raise UserError(f"cannot load the {named or 'T5'} tokenizer in {path} ({' '.join(str(e).split())}); "
                        "point the model at a pipeline's tokenizer folder") from e


class CaptionTokenizer:
    """A family's tokenizers as one callable, which the loader runs when it collates a batch: captions -> the
    token ids of each text encoder (and an attention mask, for an encoder that reads one), under the batch keys
    the family reads them by (input_ids, input_ids_2), as `family.conditioner.tokenize` makes them. Picklable, so loader
    workers receive it (the family by reference to its module)."""

    def __init__(self, tokenizers: list[Any], family: Any):
        self.tokenizers = tokenizers
        self.family = family

    @property
    def modules(self) -> list[str]:
        """What a fresh loader process imports to run it (see data.pipeline.worker_context)."""
        family = [type(self.family).__module__] if self.family is not None else []
        return list(dict.fromkeys([__name__, *family, *(type(t).__module__ for t in self.tokenizers)]))

    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {}
        for index, tokenizer in enumerate(self.tokenizers):
            batch |= self.family.conditioner.tokenize(tokenizer, index, captions)
        return batch
