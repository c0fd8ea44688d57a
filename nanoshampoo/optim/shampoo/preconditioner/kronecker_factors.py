"""Kronecker factor statistics of Shampoo-family preconditioners, pooled by factor size.

For a block ``G`` of order ``k`` with dims ``n_1..n_k``, factor ``i`` is
``F_i <- b2 F_i + w G_(i) G_(i)^T`` where ``G_(i)`` is ``G`` unfolded along dim ``i``
(``n_i x prod(other dims)``) and ``w = 1`` if ``b2 == 1`` else ``1 - b2``. Root-inverse Shampoo
takes inverse roots of these factors, eigenvalue-corrected Shampoo their eigenbases; both keep
the statistics and the failure bookkeeping here.

Layout, chosen for speed: all factors that share a *pool key* (the factor size ``n``, plus what
else the preconditioner batches by) live in one stacked ``(N, n, n)`` tensor, a *factor pool*.
A bucket's factors for one dim are a contiguous slice of a pool, so statistics are one
``baddbmm_`` per bucket and dim, and the amortized computation is one batched call per pool.

Packed storage (``packed=True``; root-inverse Shampoo's ``pack_factor_matrices``): a factor is
symmetric, so a pool may keep only its lower triangles, ``(N, n (n + 1) / 2)`` in the order of
``torch.tril_indices(n, n)`` (row-major), half the bytes. Every use unpacks to full symmetric
``(M, n, n)`` matrices first (a temporary of one bucket's factors during the update, one pool's
during the amortized computation, which copies the factors anyway), so the statistics and the
solves see exactly what the full layout gives them: ``eigh`` reads the lower triangle, and the
lower triangle of a packed factor evolves bit for bit like that of a full one
(``packed_factors_test.py``).

A failed amortized computation (solver error or non-finite result) keeps the previous result
and is counted per factor; more than ``num_tolerated_failed_amortized_computations``
consecutive failures raise. The counts are updated on the device; the success path reads one
device scalar per amortized computation (all pools together), and only a failure reads more.

The amortized computation runs for all factors at once, or for one of ``k`` fixed shares
(:meth:`KroneckerFactors.share_rows`, balanced by ``n^3``) when the optimizer spreads it over
``k`` steps (``amortize_roots``). A preconditioner may solve its largest factors only every
``m`` periods (:meth:`KroneckerFactoredPreconditioner.solved_rows`; root-inverse Shampoo's
``large_factor_dim``). Statistics of factors of size >= 512 are computed by tiles,
one triangle (:func:`symmetric_rank_update_`): torch has no ``syrk``.

:class:`KroneckerFactoredPreconditioner` is the shared base of root-inverse Shampoo and
eigenvalue-corrected Shampoo: factors, one amortized result per factor (a root or an
eigenbasis) pooled like the factors, the solve loop with its failure bookkeeping, bias
correction and the per-block state. The subclasses differ only in the maths: what is solved
and how a gradient is preconditioned.

Example:
    >>> from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket
    >>> bucket = BlockBucket((3, 2), torch.float32, torch.device("cpu"), ("w block_0",))
    >>> stats = KroneckerFactors([bucket], torch.float32, lambda bucket, dim: bucket.shape[dim])
    >>> stats.update([torch.ones(1, 3, 2)], beta2=1.0)
    >>> stats.pools[3].factors[0].tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    >>> stats.pools[2].labels
    ['w block_0 dim 1']
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from nanoshampoo.optim.shampoo.preconditioner.preconditioner import (
    BlockBucket,
    BlockStateView,
    Preconditioner,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    EigenvalueCorrectedShampooPreconditionerConfig,
    ShampooPreconditionerConfig,
)

logger = logging.getLogger(__name__)


@dataclass
class FactorPool:
    """All factors of one pool key.

    ``factors`` ``(N, n, n)`` in the factor dtype, or ``(N, n (n + 1) / 2)`` lower triangles
    when ``packed`` (see the module doc); ``size`` is ``n``; ``failure_counts`` ``(N,)`` int64,
    consecutive failed amortized computations; ``labels[r]`` names factor ``r`` (block label
    and dim) for error messages; ``positions[r]`` is its ``(block order, dim)``.
    """

    factors: torch.Tensor
    failure_counts: torch.Tensor
    labels: list[str]
    positions: list[tuple[int, int]]
    size: int
    packed: bool = False


@dataclass(frozen=True)
class FactorSlot:
    """Where the factors of one dim of one bucket live: ``pools[pool_key]`` rows
    ``offset:offset + B``."""

    pool_key: Hashable
    offset: int


def solve_dtype(factor_dtype: torch.dtype) -> torch.dtype:
    """Amortized computations run in at least float32 (``eigh``/``qr`` have no half kernels)."""
    return torch.promote_types(factor_dtype, torch.float32)


def unfold(grad: torch.Tensor, dim: int) -> torch.Tensor:
    """``(B, n_dim, prod(other dims))`` from stacked blocks ``(B, *shape)``.

    A view (no copy) for the first and the last dim of the block.
    """
    count, size = grad.shape[0], grad.shape[dim + 1]
    if dim + 2 == grad.dim():
        return grad.reshape(count, -1, size).mT
    return grad.movedim(dim + 1, 1).reshape(count, size, -1)


def multiply_along_dim(matrices: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x x_dim M``: ``matrices`` ``(B, n, n)`` applied along dim ``dim`` of blocks ``x``.

    ``x`` is ``(B, *shape)`` with ``shape[dim] == n``; the result has the same shape (a new
    tensor). For matrix blocks, dim 0 is ``M @ X`` and dim 1 is ``X @ M^T``.
    """
    moved = x.movedim(dim + 1, 1)
    product = matrices @ moved.reshape(x.shape[0], moved.shape[1], -1)
    return product.view(moved.shape).movedim(1, dim + 1)


# Factors at least this large are updated by tiles (one triangle); smaller ones by one baddbmm,
# where the per-tile launches cost more than the halved flops save.
TILED_UPDATE_MIN_SIZE = 512
TILE_SIZE = 256


def symmetric_rank_update_(
    factors: torch.Tensor, unfolded: torch.Tensor, beta: float, alpha: float
) -> torch.Tensor:
    """``F <- beta F + alpha U U^T`` in place, computing only the upper triangle of tiles.

    ``factors`` ``(B, n, n)`` symmetric, ``unfolded`` ``(B, n, m)``. torch has no ``syrk``,
    so for ``n >= TILED_UPDATE_MIN_SIZE`` the rows are cut into ``k = n // TILE_SIZE`` tiles;
    tile ``(i, j)`` with ``i <= j`` is one ``baddbmm_`` and tile ``(j, i)`` its transpose:
    ``(k + 1) / 2k`` of the flops. Tiles below the diagonal are exact copies of their mirrors. Measured on the 2-core
    EPYC (1 thread, float32, GPT-small blocks): 768-factors of 768x768 blocks 161 -> 133 ms,
    1024-factors of 1024x768 blocks 241-310 -> 183-203 ms, per bucket update.
    """
    size = factors.shape[-1]
    tiles = size // TILE_SIZE if size >= TILED_UPDATE_MIN_SIZE else 1
    if tiles <= 1:
        return factors.baddbmm_(unfolded, unfolded.mT, beta=beta, alpha=alpha)
    edges = [size * i // tiles for i in range(tiles + 1)]
    spans = list(zip(edges[:-1], edges[1:]))
    for i, (r0, r1) in enumerate(spans):
        for c0, c1 in spans[i:]:
            factors[:, r0:r1, c0:c1].baddbmm_(
                unfolded[:, r0:r1], unfolded[:, c0:c1].mT, beta=beta, alpha=alpha
            )
    for i, (r0, r1) in enumerate(spans):
        for c0, c1 in spans[i + 1 :]:
            factors[:, c0:c1, r0:r1].copy_(factors[:, r0:r1, c0:c1].mT)
    return factors


class SymmetricPacking:
    """Lower-triangle storage of stacked symmetric ``n x n`` matrices (one per ``(n, device)``).

    ``pack(full)`` reads ``full[:, i, j]`` for ``i >= j`` into ``(M, n (n + 1) / 2)`` in the order
    of ``torch.tril_indices(n, n)``; ``unpack(packed)`` returns new full ``(M, n, n)`` matrices,
    symmetric by construction (``A[i, j] = A[j, i]`` = the stored ``(max, min)`` entry).
    ``unpack(pack(A))`` equals ``A`` wherever ``A``'s lower triangle is mirrored.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        rows, cols = torch.tril_indices(size, size, device=device)
        # Flat positions of the lower triangle in an n x n matrix: index_select on the
        # flattened matrices packs about 2x faster than advanced indexing on a CPU.
        self.flat_lower = rows * size + cols
        index = torch.empty(size, size, dtype=torch.int64, device=device)
        index[rows, cols] = torch.arange(rows.numel(), device=device)
        index[cols, rows] = torch.arange(rows.numel(), device=device)
        self.index = index

    @staticmethod
    def packed_size(size: int) -> int:
        return size * (size + 1) // 2

    def pack(self, full: torch.Tensor) -> torch.Tensor:
        return full.flatten(1).index_select(1, self.flat_lower)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        return packed[:, self.index]


def keep_previous_where_failed(
    previous: torch.Tensor, computed: torch.Tensor, ok: torch.Tensor
) -> None:
    """``previous[i] = computed[i]`` where ``ok[i]``, in place; ``(N, n, n)`` and ``(N,)``."""
    previous.copy_(torch.where(ok.view(-1, 1, 1), computed.to(previous.dtype), previous))


class KroneckerFactors:
    """The Kronecker factors of the buckets of one parameter group, pooled by key.

    Args:
        buckets: the group's block buckets.
        factor_dtype: dtype of the factor matrices.
        pool_key: ``pool_key(bucket, dim)`` is the key of the pool holding the factors of that
            dim, or None where the dim has no factor (ignored, or exponent 0). Keys must
            determine the factor size ``bucket.shape[dim]``.
        packed: keep only the lower triangles (:class:`SymmetricPacking`; half the bytes).

    Attributes:
        slots: per bucket, per dim, a :class:`FactorSlot` (None: no factor).
        pools: the factor pools by key, in the order their keys first appear.
    """

    def __init__(
        self,
        buckets: Sequence[BlockBucket],
        factor_dtype: torch.dtype,
        pool_key: Callable[[BlockBucket, int], Hashable | None],
        packed: bool = False,
    ) -> None:
        self._buckets = tuple(buckets)
        self._factor_dtype = factor_dtype
        plan: dict[Hashable, tuple[int, list[str], list[tuple[int, int]]]] = {}
        self.slots: list[list[FactorSlot | None]] = []
        for bucket in self._buckets:
            order = len(bucket.shape)
            bucket_slots: list[FactorSlot | None] = []
            for dim, size in enumerate(bucket.shape):
                key = pool_key(bucket, dim)
                if key is None:
                    bucket_slots.append(None)
                    continue
                _, labels, positions = plan.setdefault(key, (size, [], []))
                bucket_slots.append(FactorSlot(key, len(labels)))
                labels.extend(f"{label} dim {dim}" for label in bucket.block_labels)
                positions.extend((order, dim) for _ in bucket.block_labels)
            self.slots.append(bucket_slots)
        device = self._buckets[0].device if self._buckets else torch.device("cpu")
        shape = (lambda n: (SymmetricPacking.packed_size(n),)) if packed else (lambda n: (n, n))
        self.pools = {
            key: FactorPool(
                factors=torch.zeros(len(labels), *shape(size), dtype=factor_dtype, device=device),
                failure_counts=torch.zeros(len(labels), dtype=torch.int64, device=device),
                labels=labels,
                positions=positions,
                size=size,
                packed=packed,
            )
            for key, (size, labels, positions) in plan.items()
        }
        self._packings: dict[int, SymmetricPacking] = {}
        if packed:
            for pool in self.pools.values():
                if pool.size not in self._packings:
                    self._packings[pool.size] = SymmetricPacking(pool.size, device)

    def matrices(
        self,
        pool: FactorPool,
        rows: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        divisor: float = 1.0,
    ) -> torch.Tensor:
        """New full ``(M, n, n)`` factors of ``pool`` (all rows, or rows ``rows``), cast to
        ``dtype`` (None: the factor dtype) and divided by ``divisor``.

        A packed pool is cast and divided before it is unpacked (half the elements, and one
        full-size temporary instead of two); elementwise, so the values are the same.
        """
        factors = pool.factors if rows is None else pool.factors.index_select(0, rows)
        factors = factors.to(dtype or factors.dtype) / divisor
        return self._packings[pool.size].unpack(factors) if pool.packed else factors

    @staticmethod
    def rows(slot: FactorSlot, count: int, tensors: dict[Hashable, torch.Tensor]) -> torch.Tensor:
        """The ``count`` rows of ``tensors[slot.pool_key]`` that belong to ``slot`` (a view)."""
        return tensors[slot.pool_key][slot.offset : slot.offset + count]

    def update(self, grads: Sequence[torch.Tensor], beta2: float) -> None:
        """``F_i <- b2 F_i + w G_(i) G_(i)^T`` for every bucket and dim with a factor.

        ``grads`` is one ``(B, *shape)`` tensor per bucket, in any float dtype (cast to the
        factor dtype). Large factors are updated one triangle of tiles at a time (see
        :func:`symmetric_rank_update_`).
        """
        weight = 1.0 if beta2 == 1.0 else 1.0 - beta2
        for bucket, bucket_slots, grad in zip(self._buckets, self.slots, grads):
            grad = grad.to(self._factor_dtype)
            count = bucket.num_blocks
            for dim, slot in enumerate(bucket_slots):
                if slot is None:
                    continue
                pool = self.pools[slot.pool_key]
                factors = pool.factors[slot.offset : slot.offset + count]
                if not pool.packed:
                    symmetric_rank_update_(factors, unfold(grad, dim), beta2, weight)
                    continue
                packing = self._packings[pool.size]
                full = symmetric_rank_update_(
                    packing.unpack(factors), unfold(grad, dim), beta2, weight
                )
                factors.copy_(packing.pack(full))

    @staticmethod
    def record_outcome(pool: FactorPool, rows: torch.Tensor | None, ok: torch.Tensor) -> None:
        """On the device, no host synchronization: reset the failure counts of the solved rows
        (``rows``; None: all) that succeeded (``ok``), add one to the others."""
        counts = pool.failure_counts
        if rows is None:
            counts.add_(1).masked_fill_(ok, 0)
        else:
            counts.index_copy_(0, rows, (counts.index_select(0, rows) + 1).masked_fill_(ok, 0))

    @staticmethod
    def check_failures(
        outcomes: Sequence[tuple[FactorPool, torch.Tensor | None, torch.Tensor]],
        tolerated: int,
        computation: str,
        kept: str,
    ) -> None:
        """Warn about the factors whose amortized computation failed, or raise past
        ``tolerated`` consecutive failures; the counts were already updated on the device.

        Args:
            outcomes: per pool solved, ``(pool, rows, ok)``: the rows solved (None: all) and
                ``ok`` bool, one per solved row, True where it succeeded.
            tolerated: ``num_tolerated_failed_amortized_computations``.
            computation: what failed, for messages (e.g. ``"Shampoo root computation"``).
            kept: what is kept instead, for the warning (e.g. ``"root"``).

        The success path reads one device scalar for all pools together (one host
        synchronization per amortized computation, not one per pool).

        Raises:
            RuntimeError: naming the first factor that failed more than ``tolerated`` times.
        """
        if not outcomes or bool(torch.stack([ok.all() for _, _, ok in outcomes]).all()):
            return
        for pool, rows, ok in outcomes:
            counts = pool.failure_counts.tolist()
            failed = (~ok).nonzero().squeeze(1)
            if rows is not None:
                failed = rows[failed]
            for index in failed.tolist():
                if counts[index] > tolerated:
                    raise RuntimeError(
                        f"{computation} failed for {pool.labels[index]} {counts[index]} "
                        "consecutive times, more than "
                        f"num_tolerated_failed_amortized_computations={tolerated}; the factor "
                        "matrix is probably non-finite (check the gradients and the loss)"
                    )
                logger.warning(
                    "%s failed for %s (%d consecutive); keeping the previous %s",
                    computation,
                    pool.labels[index],
                    counts[index],
                    kept,
                )

    def share_rows(
        self, num_shares: int, keys: Sequence[Hashable] | None = None
    ) -> list[dict[Hashable, torch.Tensor]]:
        """Per share ``0..num_shares-1``, the pool rows whose amortized computation it runs.

        A fixed, deterministic assignment balanced by cost (``n^3`` for an ``n x n`` factor):
        factors by decreasing size (then pool order, then row) each go to the share with the
        least cost so far (ties: the lowest share). Only the pools ``keys`` take part (None:
        all). Pools without a row in a share are absent from its dict; row tensors are int64
        on the factors' device, ascending.
        """
        items = sorted(
            (-(pool.size**3), order, row, key)
            for order, (key, pool) in enumerate(self.pools.items())
            if keys is None or key in keys
            for row in range(len(pool.labels))
        )
        loads = [0] * num_shares
        chosen: list[dict[Hashable, list[int]]] = [{} for _ in range(num_shares)]
        for negative_cost, _, row, key in items:
            share = loads.index(min(loads))
            loads[share] -= negative_cost
            chosen[share].setdefault(key, []).append(row)
        return [
            {
                key: torch.tensor(
                    sorted(rows), dtype=torch.int64, device=self.pools[key].factors.device
                )
                for key, rows in share.items()
            }
            for share in chosen
        ]


class KroneckerFactoredPreconditioner(Preconditioner):
    """Base of the preconditioners built on Kronecker factors and one amortized result each.

    Holds the factors (:class:`KroneckerFactors`), the results ``self._results[key]``
    ``(N, n, n)`` matching each factor pool (identity until first computed), and runs the
    amortized computation: per pool, solve on the bias-corrected factors in the solve dtype,
    keep the previous result where the solve failed, count failures.

    Subclasses define ``_pool_key``, ``_result_dtype``, ``_solve`` and ``precondition``, and
    the class attributes ``computation`` / ``kept`` (for failure messages) and
    ``result_state_name`` (the result's key in a block's state).

    Args:
        buckets: the group's block buckets.
        config: the preconditioner config (factor dtype, failure tolerance, solver).
        beta2: EMA factor of the factors, in (0, 1]; ``1`` accumulates (AdaGrad-like).
        epsilon: the group's epsilon.
        use_bias_correction: divide by ``1 - b2^t`` (when ``b2 < 1``).
    """

    name = "shampoo"
    computation: str
    kept: str
    result_state_name: str
    extra_dim_state_names: tuple[str, ...] = ()

    def __init__(
        self,
        buckets: Sequence[BlockBucket],
        config: ShampooPreconditionerConfig | EigenvalueCorrectedShampooPreconditionerConfig,
        beta2: float,
        epsilon: float,
        use_bias_correction: bool,
    ) -> None:
        super().__init__(buckets)
        self._config = config
        self._beta2 = beta2
        self._epsilon = epsilon
        self._use_bias_correction = use_bias_correction and beta2 < 1.0
        self._solve_dtype = solve_dtype(config.factor_matrix_dtype)
        self._factors = KroneckerFactors(
            self._buckets,
            config.factor_matrix_dtype,
            self._pool_key,
            packed=getattr(config, "pack_factor_matrices", False),
        )
        self._results = {
            key: torch.eye(
                pool.size, dtype=self._result_dtype(key), device=pool.factors.device
            ).repeat(len(pool.labels), 1, 1)
            for key, pool in self._factors.pools.items()
        }
        # (num_shares, pool keys or None) -> share_rows, for the frequency in use.
        self._share_cache: dict[
            tuple[int, tuple[Hashable, ...] | None], list[dict[Hashable, torch.Tensor]]
        ] = {}
        # The pools of large factors, solved every `multiplier` periods (see large_factor_schedule).
        large_dim, self._large_multiplier = self._large_factor_schedule()
        self._large_keys = tuple(
            key for key, pool in self._factors.pools.items()
            if large_dim and pool.size >= large_dim
        )
        self._small_keys = tuple(k for k in self._factors.pools if k not in self._large_keys)

    @abstractmethod
    def _pool_key(self, bucket: BlockBucket, dim: int) -> Hashable | None:
        """The pool of the factor of ``dim`` of ``bucket``'s blocks (None: no factor)."""

    @abstractmethod
    def _result_dtype(self, key: Hashable) -> torch.dtype:
        """Storage dtype of the results of pool ``key``."""

    @abstractmethod
    def _solve(
        self, key: Hashable, matrices: torch.Tensor, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(results (M, n, n), ok (M,) bool)`` from the bias-corrected factors ``matrices``
        ``(M, n, n)`` of pool ``key``: all of them (``rows`` None) or rows ``rows``."""

    def _large_factor_schedule(self) -> tuple[int, int]:
        """``(size, multiplier)``: factors of at least ``size`` are solved every ``multiplier``
        periods; ``(0, 1)``: no such rule (the default)."""
        return 0, 1

    def shares(
        self, num_shares: int, keys: tuple[Hashable, ...] | None = None
    ) -> list[dict[Hashable, torch.Tensor]]:
        """:meth:`KroneckerFactors.share_rows`, cached for the frequency in use."""
        if (num_shares, keys) not in self._share_cache:
            if len(self._share_cache) > 2:  # the frequency changed: drop the old assignments
                self._share_cache = {}
            self._share_cache[(num_shares, keys)] = self._factors.share_rows(num_shares, keys)
        return self._share_cache[(num_shares, keys)]

    def solved_rows(
        self, share: int, num_shares: int, period: int | None
    ) -> dict[Hashable, torch.Tensor | None] | None:
        """The pool rows a call of :meth:`amortized_computation` solves: None for every row of
        every pool, else ``{pool key: rows}`` (rows None: all of that pool's rows; pools absent
        are not solved).

        Without large factors: everything (``num_shares == 1``) or share ``share``. With large
        factors (multiplier ``m``): the others as before; the large ones only every ``m``
        periods (``num_shares == 1``: when ``period % m == 0``), or, spread, in share
        ``(period % m) * num_shares + share`` of ``num_shares * m`` (i.e. ``step % (f m)``).
        """
        if period is None:
            return None
        if not self._large_keys:
            return None if num_shares == 1 else dict(self.shares(num_shares)[share])
        multiplier = self._large_multiplier
        if num_shares == 1:
            due = self._small_keys + (self._large_keys if period % multiplier == 0 else ())
            return {key: None for key in due}
        chosen: dict[Hashable, torch.Tensor | None] = {}
        if self._small_keys:
            chosen.update(self.shares(num_shares, self._small_keys)[share])
        large_share = (period % multiplier) * num_shares + share
        chosen.update(self.shares(num_shares * multiplier, self._large_keys)[large_share])
        return chosen

    def _bias_correction(self, step: int) -> float:
        return 1.0 - self._beta2**step if self._use_bias_correction else 1.0

    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        self._factors.update(grads, self._beta2)

    def amortized_computation(
        self, step: int, share: int = 0, num_shares: int = 1, period: int | None = None
    ) -> None:
        """Recompute the results of the rows :meth:`solved_rows` names (all factors when
        ``num_shares == 1`` and there is no large-factor rule); failed ones keep their previous
        value (see the module doc)."""
        bias_correction = self._bias_correction(step)
        selected = self.solved_rows(share, num_shares, period)
        outcomes: list[tuple[FactorPool, torch.Tensor | None, torch.Tensor]] = []
        for key, pool in self._factors.pools.items():
            if selected is not None and key not in selected:
                continue
            rows = None if selected is None else selected[key]
            factors = self._factors.matrices(pool, rows, self._solve_dtype, bias_correction)
            results, ok = self._solve(key, factors, rows)
            previous = self._results[key]
            if rows is None:
                keep_previous_where_failed(previous, results, ok)
            else:
                kept = previous.index_select(0, rows)
                keep_previous_where_failed(kept, results, ok)
                previous.index_copy_(0, rows, kept)
            self._factors.record_outcome(pool, rows, ok)
            outcomes.append((pool, rows, ok))
        self._factors.check_failures(
            outcomes,
            self._config.num_tolerated_failed_amortized_computations,
            computation=self.computation,
            kept=self.kept,
        )

    def _bucket_results(self, bucket_index: int) -> list[torch.Tensor | None]:
        """Per dim, the ``(B, n, n)`` results of bucket ``bucket_index`` (None: no factor)."""
        count = self._buckets[bucket_index].num_blocks
        return [
            None if slot is None else KroneckerFactors.rows(slot, count, self._results)
            for slot in self._factors.slots[bucket_index]
        ]

    def _extra_dim_state(self, key: Hashable, row: int) -> dict[str, torch.Tensor]:
        """Per-factor state named in ``extra_dim_state_names`` (none by default)."""
        return {}

    def _extra_block_state(self, bucket_index: int, position: int) -> dict[str, torch.Tensor]:
        """Per-block state beyond the per-factor dicts (none by default)."""
        return {}

    def block_state(self, bucket_index: int, position: int) -> BlockStateView:
        names = ("factor_matrices", self.result_state_name, *self.extra_dim_state_names)
        state: dict[str, dict[int, torch.Tensor]] = {name: {} for name in names}
        failures: dict[int, torch.Tensor] = {}
        for dim, slot in enumerate(self._factors.slots[bucket_index]):
            if slot is None:
                continue
            pool = self._factors.pools[slot.pool_key]
            row = slot.offset + position
            state["factor_matrices"][dim] = pool.factors[row]
            state[self.result_state_name][dim] = self._results[slot.pool_key][row]
            for name, value in self._extra_dim_state(slot.pool_key, row).items():
                state[name][dim] = value
            failures[dim] = pool.failure_counts[row]
        return BlockStateView(
            **state, failure_counts=failures, **self._extra_block_state(bucket_index, position)
        )
