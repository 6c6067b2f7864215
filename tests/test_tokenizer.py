"""The trained tokenizer must behave like SD1.x's CLIP tokenizer, offline, on tiny data."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from sdtrain.errors import UserError
from sdtrain.models.tokenizer import load_clip_tokenizer, train_clip_tokenizer

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
SHAPES = ["circle", "square", "triangle"]
MAX_LENGTH = 16


def _captions(n: int = 200) -> list[str]:
    rng = random.Random(0)

    def shape() -> str:
        return f"a {rng.choice(COLOURS)} {rng.choice(SHAPES)}"

    return [shape() + (f" and {shape()}" if i % 2 else "") for i in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[CLIPTokenizer, Path]:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    return train_clip_tokenizer(_captions(), out, vocab_size=1024, max_length=MAX_LENGTH), out


def test_frequent_words_are_single_tokens_and_decode_round_trips(trained: tuple[CLIPTokenizer, Path]) -> None:
    tok, _ = trained
    ids = tok("a red circle").input_ids
    assert len(ids) == 5  # bos, a, red, circle, eos
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.unk_token_id not in ids[1:-1]
    for word in [*COLOURS, *SHAPES, "and"]:
        assert tok.tokenize(word) == [word + "</w>"]
    text = "a blue square and a yellow triangle"
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    # Unseen words fall back to byte pieces rather than unknown, and CLIP-style normalisation applies.
    assert tok.unk_token_id not in tok("Zebra, 42!").input_ids[1:-1]
    assert tok("A  RED circle").input_ids == ids


def test_from_pretrained_offline_keeps_max_length(
    trained: tuple[CLIPTokenizer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    tok, out = trained
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for loaded in (CLIPTokenizer.from_pretrained(str(out)), load_clip_tokenizer(out)):
        assert loaded.model_max_length == MAX_LENGTH
        padded = loaded("a red circle", padding="max_length", truncation=True).input_ids
        assert len(padded) == MAX_LENGTH
        assert padded[:5] == tok("a red circle").input_ids
        assert len(loaded(" ".join(["red"] * 50), truncation=True).input_ids) == MAX_LENGTH
    assert load_clip_tokenizer(out, max_length=8).model_max_length == 8
    assert (out / "merges.txt").read_text("utf-8").startswith("#version: 0.2\n")
    assert not [p for p in out.parent.iterdir() if p.name != out.name]  # no temp dirs left behind


def test_training_is_deterministic_and_replaces_existing_folder(tmp_path: Path) -> None:
    a = train_clip_tokenizer(_captions(), tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    (b / "stale.txt").write_text("from an older run")
    train_clip_tokenizer(_captions(), b)
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (b / name).read_bytes(), name
    assert not (b / "stale.txt").exists()
    assert len(a) > 512 + 2  # merges were learned beyond the byte alphabet


def test_text_encoder_pools_at_eos_on_padded_batch(trained: tuple[CLIPTokenizer, Path]) -> None:
    tok, _ = trained
    assert tok.pad_token_id == tok.eos_token_id == len(tok) - 1
    config = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=MAX_LENGTH,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = CLIPTextModel(config).eval()
    captions = ["a red circle", "a blue square and a yellow triangle"]
    batch = tok(captions, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=batch.input_ids)
    eos_pos = torch.tensor([len(tok(c).input_ids) - 1 for c in captions])
    assert (batch.input_ids[torch.arange(2), eos_pos] == tok.eos_token_id).all()
    expected = out.last_hidden_state[torch.arange(2), eos_pos]
    torch.testing.assert_close(out.pooler_output, expected)
    # Pooling at the last pad position instead would give a different vector, so the check is meaningful.
    assert not torch.allclose(out.pooler_output, out.last_hidden_state[:, -1])


def test_load_from_empty_folder_names_it(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=re.escape(str(tmp_path))) as err:
        load_clip_tokenizer(tmp_path)
    assert "\n" not in str(err.value)
