"""Where the tokens come from: the packaged corpus (prepared on demand) or existing shards,
checked before the first training step.

Example:
    >>> data = resolve_data(TrainConfig(dataset="embedded", data_dir="data/embedded"), ctx)
    ...                                                                  # doctest: +SKIP
    >>> data.train_pattern  # doctest: +SKIP
    'data/embedded/fineweb_train_*.bin'
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanoshampoo.data.loader import DistributedTokenLoader, validation_batches
from nanoshampoo.data.shards import list_shards, read_shard
from nanoshampoo.train.config import TrainConfig, UserError
from nanoshampoo.train.distributed import DistributedContext, first_error_on_any_rank

# Tokens read at once when scanning a shard for its largest token id (bounded memory).
_SCAN_CHUNK = 1 << 24


@dataclass(frozen=True)
class DataSource:
    train_pattern: str
    val_pattern: str
    vocab_size: int


def resolve_data(cfg: TrainConfig, ctx: DistributedContext) -> DataSource:
    """Shard patterns and the model's vocabulary size for this run, checked.

    ``dataset="embedded"``: rank 0 prepares the packaged corpus into ``data_dir`` (cached by a
    settings hash, so a second run is instant), then every rank reads the cached result. A
    non-zero ``vocab_size`` pads the model's vocabulary beyond the tokenizer's (for speed on GPU).
    ``dataset="shards"``: ``train_files``, ``val_files`` and ``vocab_size`` as given.

    Then :func:`check_data`. Any problem raises ``UserError`` on every rank (collective).
    """
    data: DataSource | None = None
    error = None
    if ctx.is_main:
        try:
            data = _data_source(cfg)
        except UserError as exc:
            error = str(exc)
    error = first_error_on_any_rank(error, ctx)  # also the barrier after rank 0's preparation
    if error is None and not ctx.is_main:
        try:
            data = _data_source(cfg)
        except UserError as exc:
            error = str(exc)
    if error is None:
        try:
            check_data(data, cfg, ctx)  # type: ignore[arg-type]
        except UserError as exc:
            error = str(exc)
    error = first_error_on_any_rank(error, ctx)
    if error is not None:
        raise UserError(error)
    assert data is not None
    return data


def _data_source(cfg: TrainConfig) -> DataSource:
    if cfg.data.dataset == "shards":
        return DataSource(cfg.data.train_files, cfg.data.val_files, cfg.data.vocab_size)
    from nanoshampoo.data.prepare import prepare_embedded

    data_dir = Path(cfg.data.data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        raise UserError(f"--data-dir {data_dir}: is a file, not a directory")
    try:
        prepared = prepare_embedded(cfg.data.data_dir)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"--data-dir {data_dir}: cannot prepare the embedded corpus: {exc}"
        ) from exc
    if cfg.data.vocab_size and cfg.data.vocab_size < prepared.vocab_size:
        raise UserError(
            f"--vocab-size {cfg.data.vocab_size}: smaller than the embedded tokenizer's "
            f"vocabulary ({prepared.vocab_size})"
        )
    return DataSource(
        str(prepared.train_pattern),
        str(prepared.val_pattern),
        cfg.data.vocab_size or prepared.vocab_size,
    )


def check_data(data: DataSource, cfg: TrainConfig, ctx: DistributedContext) -> None:
    """Everything a run will read, checked up front (``UserError`` naming flag and file).

    Train and validation shards exist and have valid headers; one step fits in each shard;
    ``val_tokens`` is a multiple of the global batch and fits in the validation set; every token
    is below ``vocab_size`` (else the embedding lookup fails mid-run). A run with
    ``--val-every 0`` must not train for an hour and then fail on its final validation.
    """
    flags = {"train": "--train-files", "val": "--val-files"}
    if cfg.data.dataset == "embedded":
        flags = {"train": "--data-dir", "val": "--data-dir"}
    try:
        DistributedTokenLoader(
            data.train_pattern, cfg.data.batch_size, cfg.data.seq_len, ctx.rank, ctx.world_size
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"{flags['train']} {data.train_pattern}: {exc}") from exc
    try:
        validation_batches(
            data.val_pattern,
            cfg.data.batch_size,
            cfg.data.seq_len,
            ctx.rank,
            ctx.world_size,
            cfg.data.val_tokens,
        )
    except (OSError, ValueError) as exc:
        flag = "--val-tokens" if "val_tokens" in str(exc) else flags["val"]
        raise UserError(f"{flag}: {exc}") from exc
    for kind, pattern in (("train", data.train_pattern), ("val", data.val_pattern)):
        for path in list_shards(pattern):
            largest = _largest_token(path)
            if largest >= data.vocab_size:
                raise UserError(
                    f"{flags[kind]} {path}: holds token id {largest}, not below the "
                    f"model's vocab_size {data.vocab_size} (set --vocab-size)"
                )


def _largest_token(path: Path) -> int:
    tokens = read_shard(path)
    largest = -1
    for start in range(0, tokens.size, _SCAN_CHUNK):
        largest = max(largest, int(np.max(tokens[start : start + _SCAN_CHUNK])))
    return largest
