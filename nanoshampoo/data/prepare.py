"""Turn text into FineWeb-format token shards plus ``tokenizer.json``.

Output directory layout (the same names as the speedrun's FineWeb data, so the same glob
patterns work for both)::

    out_dir/fineweb_val_000000.bin     validation tokens (more shards if they exceed shard_tokens)
    out_dir/fineweb_train_000001.bin   training tokens, fineweb_train_000002.bin, ...
    out_dir/tokenizer.json             the tokenizer (HF tokenizers format)
    out_dir/manifest.json              settings, their hash, file list and token counts

Each work or file is first cut into passages of at least ``passage_chars`` characters at
paragraph boundaries (``passages``; 2000 by default, about 600 tokens, like a short web page
of FineWeb; ``passage_chars=0`` keeps whole documents). Every passage is then a document: it
starts with the end-of-text token. Passages are split into train and validation and each
split is ordered deterministically, by fixed-key hashes, never by a random seed
(``document_split``): validation is a random sample of about ``val_fraction`` of each
source's characters, and the training stream interleaves all works. The tokenizer is trained
on the training passages only. Preparation is idempotent: when ``manifest.json`` carries the
same settings hash (same source bytes, tokenizer, vocab size, passage size, split and shard
size) and its files are intact, the work is skipped and the recorded result returned.

Entry points:

* ``prepare_embedded(out_dir)``: the embedded public-domain corpus (``embedded_corpus``).
* ``prepare_text_files(paths, out_dir)``: your own UTF-8 text files, cut into passages
  (``passage_chars=0``: one document per file).
* ``python -m nanoshampoo.data.prepare --out-dir data/embedded [--tokenizer gpt2]`` (also
  ``nanoshampoo prepare ...``).

Real FineWeb for the gpt2-124m speedrun is not prepared here and nothing here downloads it:
in a checkout of the speedrun repository (github.com/KellerJordan/modded-nanogpt) run
``python data/cached_fineweb10B.py 8`` yourself, which fetches the GPT-2-tokenized validation
shard and the first 8 training shards (100 M tokens each) into ``data/fineweb10B/``. Point the
trainer at ``data/fineweb10B/fineweb_train_*.bin`` and ``data/fineweb10B/fineweb_val_*.bin``
with the GPT-2 vocabulary (50257 tokens, end-of-text 50256); those files are read by the same
``shards``/``loader`` code.

Example:
    >>> data = prepare_embedded("data/embedded")  # doctest: +SKIP
    >>> data.train_pattern, data.vocab_size  # doctest: +SKIP
    ('data/embedded/fineweb_train_*.bin', 4096)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from nanoshampoo.data.document_split import split_documents
from nanoshampoo.data.documents import Document
from nanoshampoo.data.embedded_corpus import (
    EMBEDDED_SOURCES,
    embedded_corpus_path,
    load_embedded_corpus,
)
from nanoshampoo.data.passages import split_all_into_passages
from nanoshampoo.data.prepare_output import (
    MANIFEST_NAME,
    TOKENIZER_NAME,
    TRAIN_PREFIX,
    VAL_PREFIX,
    check_out_dir,
    manifest_files_intact,
    read_manifest,
    staged_output,
    write_shards,
)
from nanoshampoo.data.shards import MAX_SHARD_TOKENS, TOKEN_DTYPE, read_shard_token_count
from nanoshampoo.data.tokenizer import (
    MAX_VOCAB_SIZE,
    MIN_VOCAB_SIZE,
    TextTokenizer,
    gpt2_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)
from nanoshampoo.errors import EXIT_USER_ERROR, run_command, user_input
from nanoshampoo.io_utils import atomic_output, check_name_lengths
from nanoshampoo.validation import check_float, check_int

# The default run's batch (TrainConfig: 16 sequences of 128 tokens); a split must hold one batch
# and its shifted targets, so at least this many tokens plus one.
DEFAULT_MIN_BATCH_TOKENS = 16 * 128
# Bumped when the output for the same settings would change.
FORMAT_VERSION = 2
DEFAULT_PASSAGE_CHARS = 2000
PROG = "python -m nanoshampoo.data.prepare"


@dataclass(frozen=True)
class PrepareConfig:
    """How to tokenize and split.

    ``tokenizer``: ``"bpe"`` (train a byte-level BPE of ``vocab_size`` tokens on the training
    documents), ``"gpt2"`` (the GPT-2 BPE; ``vocab_size`` is then ignored) or the path of an
    existing ``tokenizer.json``. ``val_fraction`` of the characters go to validation
    (``document_split``). ``shard_tokens`` is the most tokens per shard file (the speedrun's
    FineWeb shards hold 100 M). ``passage_chars`` is the least characters of a passage
    (``passages``: every document is cut at paragraph boundaries into passages of about that
    size, each then a document of its own); 0 keeps whole documents. ``min_batch_tokens`` is
    the smallest training batch (``batch_size * seq_len``) the data must serve: each split needs
    one token more than that.
    """

    tokenizer: str = "bpe"
    vocab_size: int = 4096
    val_fraction: float = 0.05
    shard_tokens: int = 100_000_000
    passage_chars: int = DEFAULT_PASSAGE_CHARS
    min_batch_tokens: int = DEFAULT_MIN_BATCH_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"tokenizer must be 'bpe', 'gpt2' or a path, got {self.tokenizer!r}")
        if self.tokenizer not in ("bpe", "gpt2") and not Path(self.tokenizer).is_file():
            raise ValueError(
                f"tokenizer must be 'bpe', 'gpt2' or the path of a tokenizer.json file; "
                f"{self.tokenizer!r} is neither"
            )
        check_int("vocab_size", self.vocab_size, at_least=MIN_VOCAB_SIZE, at_most=MAX_VOCAB_SIZE)
        check_float("val_fraction", self.val_fraction, greater_than=0.0, less_than=1.0)
        check_int("shard_tokens", self.shard_tokens, at_least=1, at_most=MAX_SHARD_TOKENS)
        check_int("passage_chars (0: whole documents)", self.passage_chars, at_least=0)
        check_int("min_batch_tokens", self.min_batch_tokens, at_least=1)
        # The trainer reads each batch (and its shifted target) from one shard; smaller shards
        # are unusable, and --shard-tokens 1 would write one file per token.
        if self.shard_tokens <= self.min_batch_tokens:
            raise ValueError(
                f"shard_tokens (--shard-tokens) {self.shard_tokens}: a shard must hold one batch "
                f"of --min-batch-tokens {self.min_batch_tokens} plus its shifted target "
                f"({self.min_batch_tokens + 1} tokens)"
            )


@dataclass(frozen=True)
class PreparedData:
    """Where prepared data lives and what the model needs to know about it.

    ``train_pattern`` / ``val_pattern`` are glob patterns for ``DistributedTokenLoader``;
    ``vocab_size`` is the tokenizer's size (ids are ``< vocab_size``) and ``eot_id`` the
    end-of-text id that starts every document. ``train_documents`` / ``val_documents`` count
    the documents written, i.e. passages unless ``passage_chars`` was 0. ``reused`` is True
    when a matching manifest made the call skip the work.
    """

    out_dir: Path
    train_pattern: str
    val_pattern: str
    tokenizer_path: Path
    vocab_size: int
    eot_id: int
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int
    reused: bool


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8")).hexdigest()


def _tokenizer_identity(config: PrepareConfig) -> dict[str, Any]:
    if config.tokenizer == "bpe":
        return {"kind": "bpe", "vocab_size": config.vocab_size}
    if config.tokenizer == "gpt2":
        return {"kind": "gpt2"}
    return {"kind": "file", "sha256": _file_sha256(Path(config.tokenizer))}


def _given_tokenizer(config: PrepareConfig) -> TextTokenizer | None:
    """The tokenizer named by ``config`` (loaded, so a bad file fails first), or None for bpe."""
    if config.tokenizer == "bpe":
        return None
    tokenizer = gpt2_tokenizer() if config.tokenizer == "gpt2" else _load_tokenizer_file(config)
    if tokenizer.vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(
            f"--tokenizer {config.tokenizer}: has {tokenizer.vocab_size} tokens; shards store "
            f"uint16, so at most {MAX_VOCAB_SIZE}"
        )
    return tokenizer


def _load_tokenizer_file(config: PrepareConfig) -> TextTokenizer:
    try:
        return load_tokenizer(config.tokenizer)
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises its own types
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"--tokenizer {config.tokenizer}: not a usable tokenizer file ({first})"
        ) from error


def _check_split_sizes(train_tokens: int, val_tokens: int, config: PrepareConfig) -> None:
    need = config.min_batch_tokens + 1
    if train_tokens < need or val_tokens < need:
        raise ValueError(
            f"corpus too small: {train_tokens} training and {val_tokens} validation tokens, but "
            f"each split needs at least {need} (one batch of --min-batch-tokens "
            f"{config.min_batch_tokens} plus its shifted target); give more text, a larger "
            "--val-fraction or a smaller --min-batch-tokens"
        )


def _token_stream(tokenizer: TextTokenizer, documents: Sequence[Document]) -> np.ndarray:
    """All documents as one uint16 stream, each preceded by the end-of-text token."""
    encoded = tokenizer.encode_batch([d.text for d in documents])
    total = sum(len(ids) + 1 for ids in encoded)
    stream = np.empty(total, dtype=TOKEN_DTYPE)
    offset = 0
    for ids in encoded:
        stream[offset] = tokenizer.eot_id
        stream[offset + 1 : offset + 1 + len(ids)] = ids
        offset += len(ids) + 1
    return stream


def _result(out_dir: Path, manifest: dict[str, Any], reused: bool) -> PreparedData:
    return PreparedData(
        out_dir=out_dir,
        train_pattern=str(out_dir / f"{TRAIN_PREFIX}*.bin"),
        val_pattern=str(out_dir / f"{VAL_PREFIX}*.bin"),
        tokenizer_path=out_dir / TOKENIZER_NAME,
        vocab_size=int(manifest["vocab_size"]),
        eot_id=int(manifest["eot_id"]),
        train_tokens=int(manifest["train_tokens"]),
        val_tokens=int(manifest["val_tokens"]),
        train_documents=int(manifest["train_documents"]),
        val_documents=int(manifest["val_documents"]),
        reused=reused,
    )


def _prepare(
    load_documents: Callable[[], Sequence[Document]],
    source_identity: dict[str, Any],
    out_dir: Path,
    config: PrepareConfig,
) -> PreparedData:
    settings = {
        "format_version": FORMAT_VERSION,
        "source": source_identity,
        "tokenizer": _tokenizer_identity(config),
        "val_fraction": float(config.val_fraction),
        "shard_tokens": config.shard_tokens,
        "passage_chars": config.passage_chars,
    }
    settings_hash = _settings_hash(settings)
    check_name_lengths(out_dir, "--out-dir")
    previous = read_manifest(out_dir) if out_dir.is_dir() else None
    if (
        previous is not None
        and previous.get("settings_hash") == settings_hash
        and manifest_files_intact(out_dir, previous)
    ):
        return _result(out_dir, previous, reused=True)
    # Everything is checked before anything is written; the old data stays until the new is whole.
    check_out_dir(out_dir, previous)
    given_tokenizer = _given_tokenizer(config)
    documents = split_all_into_passages(load_documents(), config.passage_chars)
    train_docs, val_docs = split_documents(documents, float(config.val_fraction))
    tokenizer = given_tokenizer or train_bpe_tokenizer(
        [d.text for d in train_docs], config.vocab_size
    )
    val_stream = _token_stream(tokenizer, val_docs)
    train_stream = _token_stream(tokenizer, train_docs)
    _check_split_sizes(len(train_stream), len(val_stream), config)
    with staged_output(out_dir, previous) as staging:
        # The speedrun numbers the validation shard 000000 and training shards from 000001.
        val_files = write_shards(val_stream, staging, VAL_PREFIX, 0, config.shard_tokens)
        train_files = write_shards(train_stream, staging, TRAIN_PREFIX, 1, config.shard_tokens)
        tokenizer.save(staging / TOKENIZER_NAME)
        manifest = {
            "settings": settings,
            "settings_hash": settings_hash,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "train_tokens": len(train_stream),
            "val_tokens": len(val_stream),
            "train_documents": len(train_docs),
            "val_documents": len(val_docs),
            "val_titles": [d.title for d in val_docs],
            "shard_token_counts": {
                name: read_shard_token_count(staging / name) for name in val_files + train_files
            },
        }
        with atomic_output(staging / MANIFEST_NAME) as tmp:
            tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return _result(out_dir, manifest, reused=False)


def prepare_embedded(
    out_dir: str | os.PathLike[str],
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    tokenizer: str = "bpe",
    shard_tokens: int = 100_000_000,
    sources: Sequence[str] = EMBEDDED_SOURCES,
    passage_chars: int = DEFAULT_PASSAGE_CHARS,
    min_batch_tokens: int = DEFAULT_MIN_BATCH_TOKENS,
) -> PreparedData:
    """Prepare the embedded corpus (``embedded_corpus``) into ``out_dir``; see the module
    docstring for the layout and caching. With the defaults: about 3,300 passages, 2.7 M
    training and 0.15 M validation tokens, vocabulary 4096."""
    config = PrepareConfig(
        tokenizer, vocab_size, val_fraction, shard_tokens, passage_chars, min_batch_tokens
    )
    sources = tuple(sources)
    identity = {
        "embedded": {source: _file_sha256(embedded_corpus_path(source)) for source in sources}
    }
    return _prepare(lambda: load_embedded_corpus(sources), identity, Path(out_dir), config)


def prepare_text_files(
    paths: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    tokenizer: str = "bpe",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    shard_tokens: int = 100_000_000,
    passage_chars: int = DEFAULT_PASSAGE_CHARS,
    min_batch_tokens: int = DEFAULT_MIN_BATCH_TOKENS,
) -> PreparedData:
    """Prepare your own UTF-8 text files into ``out_dir``.

    Each file is cut into passages of at least ``passage_chars`` characters (``passages``),
    then passages are split as in ``document_split``; with ``passage_chars=0`` each file is
    one document, so whole files go to validation (a single file is cut at a line break).
    A missing, empty or non-UTF-8 file raises ``ValueError`` naming it, and so does a corpus
    whose splits are smaller than one batch of ``min_batch_tokens`` (naming the sizes).
    """
    config = PrepareConfig(
        tokenizer, vocab_size, val_fraction, shard_tokens, passage_chars, min_batch_tokens
    )
    if not paths:
        raise ValueError("paths must name at least one text file")
    documents = []
    hashes = {}
    seen: dict[str, Path] = {}
    for path in map(Path, paths):
        if path.is_dir():
            raise ValueError(
                f"text file {path} is a directory; name the files in it, "
                f"e.g. --text-files {path}/*.txt"
            )
        if not path.exists():
            raise ValueError(f"text file {path} does not exist")
        if not path.is_file():  # a FIFO would block the read, a device never end
            raise ValueError(f"text file {path} is not a regular file")
        if str(path.resolve()) in seen:  # its documents would be counted twice, maybe in
            # both splits: validation text the model trained on
            raise ValueError(f"text file {path} is given twice (as {seen[str(path.resolve())]})")
        seen[str(path.resolve())] = path
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not valid UTF-8 text: {error}") from error
        if not text:
            raise ValueError(f"text file {path} is empty")
        documents.append(Document("text_files", str(path), text))
        hashes[str(path)] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return _prepare(lambda: documents, {"text_files": hashes}, Path(out_dir), config)


class _OneLineErrorParser(argparse.ArgumentParser):
    """Argument errors as one line (no usage dump burying the message), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog=PROG,
        description="Tokenize the embedded public-domain corpus (default) or your own text "
        "files into FineWeb-format shards and tokenizer.json. Skips the work when out-dir "
        "already holds the same preparation; otherwise the new data is written beside the old "
        "and swapped in whole.",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("data/embedded"))
    parser.add_argument(
        "--tokenizer", default="bpe", help="'bpe' (train one), 'gpt2', or a tokenizer.json path"
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="for --tokenizer bpe")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--shard-tokens", type=int, default=100_000_000)
    parser.add_argument(
        "--passage-chars",
        type=int,
        default=DEFAULT_PASSAGE_CHARS,
        help="cut documents into passages of at least this many characters at paragraph "
        "boundaries, each its own document; 0 keeps whole documents",
    )
    parser.add_argument(
        "--min-batch-tokens",
        type=int,
        default=DEFAULT_MIN_BATCH_TOKENS,
        help="refuse a corpus whose train or validation split cannot fill one batch of this "
        "many tokens (batch_size * seq_len) plus its target",
    )
    parser.add_argument(
        "--text-files", nargs="+", type=Path, help="prepare these UTF-8 files instead"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; prints the prepared data's patterns and sizes. Returns the exit status
    (2 with one line for a bad flag, file or corpus)."""
    return run_command(PROG, lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    settings = dict(
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        passage_chars=args.passage_chars,
        min_batch_tokens=args.min_batch_tokens,
    )
    # A bad setting or file is the user's: PrepareConfig and the readers raise ValueError
    # naming it; the embedded corpus's absence is FileNotFoundError.
    with user_input(FileNotFoundError):
        if args.text_files:
            data = prepare_text_files(args.text_files, args.out_dir, **settings)
        else:
            data = prepare_embedded(args.out_dir, **settings)
    print("reused existing preparation" if data.reused else f"prepared {data.out_dir}")
    for key, value in asdict(data).items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
