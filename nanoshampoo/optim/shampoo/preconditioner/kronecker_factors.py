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

Packed storage (``packed=True``; root-inverse Shampoo's ``use_symmetric_packing``): a factor is
symmetric, so a pool keeps less than ``n^2`` per factor, in one of two layouts by size:

- Below ``TILED_UPDATE_MIN_SIZE`` (512), one triangle, ``(N, n (n + 1) / 2)`` in the reference
  library's order (the row-major upper triangle of ``torch.triu_indices(n, n)``;
  :class:`SymmetricPacking`), half the bytes. Every use unpacks to full symmetric ``(M, n, n)``
  matrices first (during the update, one pool's temporary, filled a bucket at a time; during
  the amortized computation, one pool's, which copies the factors anyway). The amortized
  computation of the same step starts from the update's temporary, its computed tiles mirrored
  (:meth:`SymmetricPacking.mirror_updated_`), instead of unpacking the rows just packed again.
  It is kept only until :meth:`KroneckerFactors.release_unpacked` (the end of the step's
  amortized work) and only while the packed rows are unchanged (their version counter), so a
  loaded state dict is never shadowed.
- From 512 on, the tiles on and above the diagonal of the tiled update, each whole
  (:class:`TiledPacking`): the update's products are written into them in place, so a step
  neither unpacks nor packs (what that saves: docs/results/shampoo-step.md), for a third
  (``n = 768``) to a quarter (1024) more bytes than the triangle. The amortized computation
  assembles full matrices from the tiles, cast and divided on the way.

Either way the statistics and the solves see exactly what the full layout gives them: ``eigh``
reads the lower triangle, and the packed values are the lower triangle's, which evolves bit for
bit like that of a full factor (``packed_factors_test.py``). A state dict holds the triangle's
layout for both (:meth:`KroneckerFactors.reference_layout`; ``state_dict_layout.py``).

A failed amortized computation (solver error or non-finite result) keeps the previous result
and is counted per factor; more than ``num_tolerated_failed_amortized_computations``
consecutive failures raise. The counts are updated on the device; the success path reads one
device scalar per amortized computation (all pools together), and only a failure reads more.

The amortized computation runs for all factors at once, or for one of ``k`` fixed shares
(:meth:`KroneckerFactors.share_rows`, balanced by ``n^3``) when the optimizer spreads it over
``k`` steps (``amortize_roots``). A preconditioner may solve its largest factors only every
``m`` periods (``KroneckerFactoredPreconditioner.solved_rows``; root-inverse Shampoo's
``large_factor_dim``). Statistics of factors of size >= 512 are computed by tiles,
one triangle (:func:`symmetric_rank_update_`): torch has no ``syrk``.

:class:`KroneckerFactors` holds the statistics and the failure bookkeeping; the tensor operations
on stacked factors (unfolding, the tiled rank update, packing) are in ``factor_matrix_ops.py``,
and the base class of the preconditioners built on these factors in
``kronecker_factored_preconditioner.py``.

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
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import (
    SymmetricPacking,
    TiledPacking,
    symmetric_rank_update_,
    tiled_packing,
    tiles_pack,
    unfold,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket

logger = logging.getLogger(__name__)


@dataclass
class FactorPool:
    """All factors of one pool key.

    ``factors`` ``(N, n, n)`` in the factor dtype, or when ``packed`` (see the module doc)
    ``(N, n (n + 1) / 2)`` lower triangles below 512 and ``(N, TiledPacking.storage_size)``
    bands of tiles from 512 on; ``size`` is ``n``; ``failure_counts`` ``(N,)`` int64,
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


class KroneckerFactors:
    """The Kronecker factors of the buckets of one parameter group, pooled by key.

    Args:
        buckets: the group's block buckets.
        factor_dtype: dtype of the factor matrices.
        pool_key: ``pool_key(bucket, dim)`` is the key of the pool holding the factors of that
            dim, or None where the dim has no factor (ignored, or exponent 0). Keys must
            determine the factor size ``bucket.shape[dim]``.
        packed: keep one triangle (:class:`SymmetricPacking`; half the bytes) below 512, the
            tiles on and above the diagonal (:class:`TiledPacking`) from 512 on.

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
        self._packings: dict[int, SymmetricPacking | TiledPacking] = {}
        if packed:
            for size, _, _ in plan.values():
                if size not in self._packings:
                    self._packings[size] = (
                        tiled_packing(size, device)
                        if tiles_pack(size)
                        else SymmetricPacking(size, device)
                    )

        def shape(n: int) -> tuple[int, ...]:
            return (self._packings[n].storage_size,) if packed else (n, n)

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
        # Per triangle-packed pool (by id), the full factors the last update() unpacked and
        # updated, and the version of the packed rows it then wrote (module doc).
        self._updated_full: dict[int, tuple[torch.Tensor, int]] = {}

    def matrices(
        self,
        pool: FactorPool,
        rows: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        divisor: float = 1.0,
        upper_only: bool = False,
    ) -> torch.Tensor:
        """New full ``(M, n, n)`` factors of ``pool`` (all rows, or rows ``rows``), cast to
        ``dtype`` (None: the factor dtype) and divided by ``divisor``.

        A triangle-packed pool is cast and divided before it is unpacked (half the elements,
        and one full-size temporary instead of two); elementwise, so the values are the same.
        Right after an update, its factors come from the update's full factors instead (module
        doc). A tiled pool is assembled from its tiles, cast and divided on the way. With
        ``upper_only`` only the upper triangle is made the factors' (what ``eigh`` reads of the
        transposed view) in both, and the lower one may hold other numbers or none.
        """
        packing = self._packings.get(pool.size) if pool.packed else None
        if isinstance(packing, TiledPacking):
            factors = pool.factors if rows is None else pool.factors.index_select(0, rows)
            return packing.full(factors, dtype, divisor, upper_only)
        if packing is not None and (updated := self._take_updated_full(pool)) is not None:
            # The same numbers as the branch below: mirroring is a copy, the cast and the
            # division are elementwise (so before or after unpacking alike).
            full = updated if rows is None else updated.index_select(0, rows)
            full = packing.mirror_updated_(full, lower=not upper_only)
            full = full.to(dtype or full.dtype)
            return full.div_(divisor) if divisor != 1.0 else full
        factors = pool.factors if rows is None else pool.factors.index_select(0, rows)
        factors = factors.to(dtype or factors.dtype) / divisor
        return packing.unpack(factors) if packing is not None else factors

    def reference_layout(self, pool: FactorPool) -> torch.Tensor:
        """``pool``'s factors as a state dict keeps them: full ``(N, n, n)``, or packed
        ``(N, n (n + 1) / 2)`` in :class:`SymmetricPacking`'s layout (tiled pools converted; a
        new tensor then, else the pool's own)."""
        packing = self._packings.get(pool.size) if pool.packed else None
        if isinstance(packing, TiledPacking):
            return packing.to_reference(pool.factors)
        return pool.factors

    def _take_updated_full(self, pool: FactorPool) -> torch.Tensor | None:
        """The update's full factors of packed ``pool`` (once: they are the caller's to
        overwrite), or None when there are none or the packed rows changed since."""
        if not self._updated_full or torch.compiler.is_compiling():
            return None  # (dynamo cannot trace the id and version checks)
        kept = self._updated_full.pop(id(pool), None)
        if kept is None or kept[1] != pool.factors._version:
            return None
        return kept[0]

    def release_unpacked(self) -> None:
        """Drop the update's full factors that no amortized computation took (a step
        without one): between steps a packed pool holds its packed rows only."""
        self._updated_full.clear()

    @staticmethod
    def rows(slot: FactorSlot, count: int, tensors: dict[Hashable, torch.Tensor]) -> torch.Tensor:
        """The ``count`` rows of ``tensors[slot.pool_key]`` that belong to ``slot`` (a view)."""
        return tensors[slot.pool_key][slot.offset : slot.offset + count]

    def update(
        self,
        grads: Sequence[torch.Tensor | Sequence[torch.Tensor | None]],
        beta2: float,
        weight: float | None = None,
    ) -> None:
        """``F_i <- b2 F_i + w G_(i) G_(i)^T`` for every bucket and dim with a factor.

        ``grads`` is one ``(B, *shape)`` tensor per bucket, in any float dtype (cast to the
        factor dtype), or per bucket one such tensor per dim (the dim's factor is updated from
        its own tensor: KL-Shampoo's preconditioned gradients). ``weight`` defaults to 1 for
        ``beta2 == 1`` and ``1 - beta2`` otherwise. Large factors are updated one triangle of
        tiles at a time (see :func:`symmetric_rank_update_`).
        """
        if weight is None:
            weight = 1.0 if beta2 == 1.0 else 1.0 - beta2
        self._updated_full.clear()
        # Per packed pool, its full factors, unpacked and updated a bucket at a time: every
        # slot of a pool is visited below, so each buffer is whole at the end.
        unpacked: dict[Hashable, torch.Tensor] = {}
        for bucket, bucket_slots, bucket_grads in zip(self._buckets, self.slots, grads):
            per_dim = not isinstance(bucket_grads, torch.Tensor)
            count = bucket.num_blocks
            for dim, slot in enumerate(bucket_slots):
                if slot is None:
                    continue
                source = bucket_grads[dim] if per_dim else bucket_grads
                grad = source.to(self._factor_dtype)
                pool = self.pools[slot.pool_key]
                factors = pool.factors[slot.offset : slot.offset + count]
                if not pool.packed:
                    symmetric_rank_update_(factors, unfold(grad, dim), beta2, weight)
                    continue
                packing = self._packings[pool.size]
                if isinstance(packing, TiledPacking):
                    packing.update_(factors, unfold(grad, dim), beta2, weight)
                    continue
                if slot.pool_key not in unpacked:
                    rows = len(pool.labels)
                    unpacked[slot.pool_key] = factors.new_empty(rows, pool.size, pool.size)
                buffer = unpacked[slot.pool_key]
                full = symmetric_rank_update_(
                    packing.unpack(factors, out=buffer[slot.offset : slot.offset + count]),
                    unfold(grad, dim),
                    beta2,
                    weight,
                    mirror=False,
                )
                # Straight into the packed rows (a contiguous slice of the pool).
                packing.pack_updated(full, out=factors)
        if torch.compiler.is_compiling():
            return  # dynamo cannot trace a version counter: a compiled step unpacks again
        for key, buffer in unpacked.items():
            pool = self.pools[key]
            self._updated_full[id(pool)] = (buffer, pool.factors._version)

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
                    f"{computation} failed for {pool.labels[index]} ({counts[index]} "
                    f"consecutive); keeping the previous {kept}"
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
