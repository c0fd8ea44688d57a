"""The shared base of root-inverse Shampoo and eigenvalue-corrected Shampoo.

:class:`KroneckerFactoredPreconditioner` holds the Kronecker factors
(:class:`~nanoshampoo.optim.shampoo.preconditioner.kronecker_factors.KroneckerFactors`), one
amortized result per factor (a root or an eigenbasis) pooled like the factors, the solve loop
with its failure bookkeeping, the schedule of which factors a call solves (shares of
``amortize_roots``, the large-factor rule), bias correction and the per-block state. The
subclasses differ only in the maths: what is solved and how a gradient is preconditioned.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import (
    keep_previous_where_failed,
    solve_dtype,
)
from nanoshampoo.optim.shampoo.preconditioner.kronecker_factors import (
    FactorPool,
    KroneckerFactors,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import (
    BlockBucket,
    BlockStateView,
    Preconditioner,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    EigenvalueCorrectedShampooPreconditionerConfig,
    ShampooPreconditionerConfig,
)


@dataclass(frozen=True)
class FactorHealth:
    """What one dim's factors of a bucket look like now, for inspection (telemetry).

    ``eigenvalues`` ``(B, n)`` float64, ascending: of the bias-corrected factors ``F / bc2``
    (no ridge, no trace scaling); ``off_diagonal`` ``(B,)`` float64: ``off_diagonal_ratio`` of
    the eigenbasis in force against those factors (None: the preconditioner keeps no basis);
    ``failures`` ``(B,)`` int64: consecutive failed amortized computations.
    """

    eigenvalues: torch.Tensor
    off_diagonal: torch.Tensor | None
    failures: torch.Tensor


class KroneckerFactoredPreconditioner(Preconditioner):
    """Base of the preconditioners built on Kronecker factors and one amortized result each.

    Holds the factors (:class:`KroneckerFactors`), the results ``self._results[key]``
    ``(N, n, n)`` matching each factor pool (identity until first computed), and runs the
    amortized computation: per pool, solve on the bias-corrected factors in the solve dtype,
    keep the previous result where the solve failed, count failures.

    Subclasses define ``_pool_key``, ``_result_dtype``, ``_solve`` and ``precondition``, and
    the class attributes ``computation`` / ``kept`` (for failure messages) and
    ``result_state_name`` (the result's key in a block's state); their own state is allocated
    in ``_allocate_state`` (called last by ``__init__``), so none restates the constructor.

    Args:
        buckets: the group's block buckets.
        config: the preconditioner config (factor dtype, failure tolerance, solver).
        beta2: EMA factor of the factors, in (0, 1]; ``1`` accumulates (AdaGrad-like).
        epsilon: the group's epsilon.
        use_bias_correction: divide by ``1 - b2^t`` (when ``b2 < 1`` and the config keeps the
            weighting factor ``1 - b2``).

    The config's ``drop_weighting_factor_on_gsquare`` and trace scaling apply here, to every
    subclass: the statistics weight ``w``
    (:meth:`BaseShampooPreconditionerConfig.statistics_weight`)
    and the scaling of the factors each amortized computation sees (:meth:`_trace_scaled`).
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
        # A dropped weighting factor makes the statistics a discounted sum: nothing to correct.
        self._weight = config.statistics_weight(beta2)
        self._use_bias_correction = (
            use_bias_correction and beta2 < 1.0 and not config.drop_weighting_factor_on_gsquare
        )
        self._solve_dtype = solve_dtype(config.factor_matrix_dtype)
        self._factors = KroneckerFactors(
            self._buckets,
            config.factor_matrix_dtype,
            self._pool_key,
            packed=getattr(config, "use_symmetric_packing", False),
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
            key for key, pool in self._factors.pools.items() if large_dim and pool.size >= large_dim
        )
        self._small_keys = tuple(k for k in self._factors.pools if k not in self._large_keys)
        self._allocate_state()

    def _allocate_state(self) -> None:
        """The subclass's state beyond factors and results (nothing here); runs at the end of
        ``__init__``, when the pools and results exist."""

    def _pool_flags(self) -> dict[Hashable, torch.Tensor]:
        """Per pool, ``(N,)`` bool zeros on the pool's device: a flag per factor, e.g.
        "its result was computed at least once" (see :meth:`_mark_computed`)."""
        return {
            key: torch.zeros(len(pool.labels), dtype=torch.bool, device=pool.factors.device)
            for key, pool in self._factors.pools.items()
        }

    @staticmethod
    def _mark_computed(flags: torch.Tensor, rows: torch.Tensor | None, ok: torch.Tensor) -> None:
        """``flags[rows] |= ok`` in place (``rows`` None: every row): a pool's "computed at
        least once" after a solve of those rows, ``ok`` ``(M,)`` its successes."""
        if rows is None:
            flags.logical_or_(ok)
        else:
            flags.index_copy_(0, rows, flags.index_select(0, rows).logical_or_(ok))

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
        ``(M, n, n)`` of pool ``key``: all of them (``rows`` None) or rows ``rows``.

        ``matrices`` is a temporary of :meth:`amortized_computation` (read nowhere after): a
        solver may overwrite it. The results are stored by :meth:`_keep`."""

    def _solver_reads_upper(self) -> bool:
        """Whether :meth:`_solve` reads only the upper triangle of a packed pool's matrices
        (so :meth:`KroneckerFactors.matrices` may leave the lower one stale). No by default."""
        return False

    def _keep(self, previous: torch.Tensor, results: torch.Tensor, ok: torch.Tensor) -> None:
        """``previous[i] = results[i]`` where ``ok[i]``, in place (``(M, n, n)`` and ``(M,)``):
        the stored results of the solved rows; a failed row keeps its previous result."""
        keep_previous_where_failed(previous, results, ok)

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
        self._factors.update(grads, self._beta2, self._weight)

    def release_step_temporaries(self) -> None:
        self._factors.release_unpacked()

    def _trace_scaled(self, factors: torch.Tensor) -> torch.Tensor:
        """``F max(tr F, eps)^(-a)`` per matrix of ``(M, n, n)`` with ``use_trace_scaling``
        (``a`` its exponent; ``eps`` the group's, or the smallest normal number when 0, so a
        zero factor stays zero), else ``factors`` unchanged."""
        if not self._config.use_trace_scaling:
            return factors
        trace = factors.diagonal(dim1=-2, dim2=-1).sum(-1)
        floor = max(self._epsilon, torch.finfo(factors.dtype).tiny)
        scale = trace.clamp(min=floor).pow(-self._config.trace_scaling_exponent)
        return factors * scale.view(-1, 1, 1)

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
            factors = self._trace_scaled(
                self._factors.matrices(
                    pool, rows, self._solve_dtype, bias_correction, self._solver_reads_upper()
                )
            )
            results, ok = self._solve(key, factors, rows)
            previous = self._results[key]
            if rows is None:
                self._keep(previous, results, ok)
            else:
                kept = previous.index_select(0, rows)
                self._keep(kept, results, ok)
                previous.index_copy_(0, rows, kept)
            self._factors.record_outcome(pool, rows, ok)
            outcomes.append((pool, rows, ok))
        self._factors.check_failures(
            outcomes,
            self._config.num_tolerated_failed_amortized_computations,
            computation=self.computation,
            kept=self.kept,
        )

    def factor_health(self, step: int) -> list[list[FactorHealth | None]]:
        """Per bucket, per dim (None: no factor), the factors' :class:`FactorHealth` after
        ``step`` steps: one batched float64 ``eigvalsh`` per pool. Reads the state, changes
        nothing; called for inspection only, never by the step."""
        # Imported here: a run without eigenbases (root-inverse Shampoo) never loads the module.
        from nanoshampoo.optim.shampoo.preconditioner.eigenbasis import off_diagonal_ratio

        bias_correction = self._bias_correction(step)
        spectra: dict[Hashable, torch.Tensor] = {}
        off: dict[Hashable, torch.Tensor] = {}
        keeps_bases = self.result_state_name == "factor_matrices_eigenvectors"
        for key, pool in self._factors.pools.items():
            factors = self._factors.matrices(pool, None, torch.float64, bias_correction)
            spectra[key] = torch.linalg.eigvalsh(factors)
            if keeps_bases:
                off[key] = off_diagonal_ratio(factors, self._results[key].to(torch.float64))
        health: list[list[FactorHealth | None]] = []
        for index, bucket in enumerate(self._buckets):
            count = bucket.num_blocks
            health.append(
                [
                    None
                    if slot is None
                    else FactorHealth(
                        eigenvalues=KroneckerFactors.rows(slot, count, spectra),
                        off_diagonal=KroneckerFactors.rows(slot, count, off)
                        if keeps_bases
                        else None,
                        failures=self._factors.pools[slot.pool_key].failure_counts[
                            slot.offset : slot.offset + count
                        ],
                    )
                    for slot in self._factors.slots[index]
                ]
            )
        return health

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
