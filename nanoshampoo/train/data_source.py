"""Where the tokens come from: the packaged corpus (prepared on demand) or existing shards.

Example:
    >>> data = resolve_data(TrainConfig(dataset="embedded", data_dir="data/embedded"), ctx)
    ...                                                                  # doctest: +SKIP
    >>> data.train_pattern  # doctest: +SKIP
    'data/embedded/fineweb_train_*.bin'
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.distributed import DistributedContext, barrier


@dataclass(frozen=True)
class DataSource:
    train_pattern: str
    val_pattern: str
    vocab_size: int


def resolve_data(cfg: TrainConfig, ctx: DistributedContext) -> DataSource:
    """Shard patterns and the model's vocabulary size for this run.

    ``dataset="embedded"``: rank 0 prepares the packaged corpus into ``data_dir`` (cached by a
    settings hash, so a second run is instant), then every rank reads the cached result. A
    non-zero ``vocab_size`` pads the model's vocabulary beyond the tokenizer's (for speed on GPU).
    ``dataset="shards"``: ``train_files``, ``val_files`` and ``vocab_size`` as given.
    """
    if cfg.dataset == "shards":
        return DataSource(cfg.train_files, cfg.val_files, cfg.vocab_size)
    from nanoshampoo.data.prepare import prepare_embedded

    if ctx.is_main:
        prepared = prepare_embedded(cfg.data_dir)
    barrier(ctx)
    if not ctx.is_main:
        prepared = prepare_embedded(cfg.data_dir)
    if cfg.vocab_size and cfg.vocab_size < prepared.vocab_size:
        raise ValueError(f"TrainConfig.vocab_size ({cfg.vocab_size}) is smaller than the "
                         f"embedded tokenizer's vocabulary ({prepared.vocab_size})")
    return DataSource(str(prepared.train_pattern), str(prepared.val_pattern),
                      cfg.vocab_size or prepared.vocab_size)
