"""Telemetry: per-layer numerical health of the optimizer, one record per block matrix.

Every ``telemetry_every`` steps (-1, the default: at the validation steps, every
``val_every``; 0: never) the trainer records, for each matrix of the transformer blocks (the
``matrix`` parameter group), one JSONL record ``{"kind": "telemetry", "step": s, "layer":
NAME, ...}`` about the ``s``-th optimizer step:

- every setup: ``grad_rms``, ``weight_rms`` (after the step), ``update_rms`` (the update is the
  parameter's change over the step, whatever the optimizer did), ``update_ratio`` (update RMS
  over the weight RMS before the step) and ``update_top_sv`` (the update's largest singular
  value, 8 power-iteration steps);
- ``DistributedShampoo`` setups (Shampoo, KL-Shampoo, SOAP, Muon): per factor ``d`` of a block,
  ``factor{d}.condition_number`` (of ``F + eps I``), ``factor{d}.effective_rank``,
  ``factor{d}.share_below_epsilon``, ``factor{d}.failures`` (consecutive failed roots or bases)
  and, where the preconditioner keeps an eigenbasis (SOAP), ``factor{d}.off_diagonal`` (how far
  the basis in force is from diagonalizing the current factor: with ``telemetry_every`` a
  multiple of the precondition frequency, the basis about to be refreshed); ``graft_ratio``
  (``||P_s|| / ||P_g||``, grafted Shampoo); spectral descent: ``ns_orthogonality_error``
  (``||U^T U - I||_F / sqrt(n)`` of the orthogonalized direction, ``n = min(rows, cols)``),
  ``ns_sigma_min``, ``ns_sigma_max``, on every block (no sampling). A parameter cut into
  several blocks prefixes the keys of blocks after the first with ``block_j.``;
- the Muon family outside Shampoo (``Muon`` with cautious weight decay, ``NorMuon``,
  ``SOAPMuon``): the same three ``ns_*`` statistics of every matrix's Newton-Schulz output
  ``NS(U)`` (before the aspect-ratio scale, NorMuon's row normalization), which the optimizer
  keeps for the recorded step only (``keep_orthogonalized``);
- AdamW / DistAdam: ``sqrt_v_spread`` (``max / median`` of ``sqrt(v)``).

The statistics are defined and tested in :mod:`telemetry_stats`. Cost: with telemetry off
the trainer calls nothing here. On a recorded step, the step itself gains a copy of the block
matrices (taken before the optimizers step) and, in the Muon family, of their Newton-Schulz
outputs; the statistics are computed after the timed step,
like validation (``bench/telemetry_overhead.py`` measures both).

Where things are computed: parameter ``i`` of the matrix group by rank ``i % world_size``
(under FSDP2 every rank first gathers the full tensors, a collective), a ``DistributedShampoo``
block by the rank that holds its state, DistAdam's moments from every rank's slice; rank 0
gathers the per-rank dicts (``gather_object``) and writes the records.

:class:`DepartureWatch` follows every (layer, statistic) series and the train loss, so that a
diverged run can name the first series that left its own running range before the loss did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanoshampoo.train.distributed import DistributedContext
from nanoshampoo.train.telemetry_stats import (
    orthogonality_error,
    rms,
    singular_value_range,
    spectrum_health,
    spread,
    top_singular_value,
)

GENERIC_STATISTICS = ("grad_rms", "weight_rms", "update_rms", "update_ratio", "update_top_sv")
FACTOR_STATISTICS = (
    "condition_number",
    "effective_rank",
    "share_below_epsilon",
    "failures",
    "off_diagonal",
)


def resolve_every(telemetry_every: int, val_every: int) -> int:
    """Steps between records: ``telemetry_every``, or ``val_every`` for -1 (0: off)."""
    return val_every if telemetry_every < 0 else telemetry_every


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's ``full_tensor()`` (collective), a plain tensor as is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def generic_statistics(
    before: torch.Tensor, after: torch.Tensor, grad: torch.Tensor | None
) -> dict[str, float]:
    """The every-setup statistics of one matrix from its weights before and after a step and
    the gradient the step used (None: the parameter had none)."""
    update = after.float() - before.float()
    weight_before = rms(before)
    update_rms = rms(update)
    return {
        "grad_rms": math.nan if grad is None else rms(grad),
        "weight_rms": rms(after),
        "update_rms": update_rms,
        "update_ratio": update_rms / weight_before if weight_before > 0.0 else math.inf,
        "update_top_sv": top_singular_value(update),
    }


def shampoo_statistics(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, float]]:
    """Per parameter id, the statistics of the ``DistributedShampoo`` blocks this rank holds."""
    from nanoshampoo.optim.shampoo.health import block_health

    out: dict[int, dict[str, float]] = {}
    for view in block_health(optimizer):  # type: ignore[arg-type]
        prefix = "" if view.block == "block_0" else f"{view.block}."
        stats = out.setdefault(id(view.param), {})
        for factor in view.factors:
            condition, effective_rank, below = spectrum_health(factor.eigenvalues, view.epsilon)
            key = f"{prefix}factor{factor.dim}."
            stats[key + "condition_number"] = condition
            stats[key + "effective_rank"] = effective_rank
            stats[key + "share_below_epsilon"] = below
            stats[key + "failures"] = float(factor.failures)
            if factor.off_diagonal is not None:
                stats[key + "off_diagonal"] = factor.off_diagonal
        if view.graft_ratio is not None:
            stats[prefix + "graft_ratio"] = view.graft_ratio
        if view.direction is not None:
            stats.update(spectral_statistics(view.direction, prefix))
    return out


def spectral_statistics(direction: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """``ns_orthogonality_error``, ``ns_sigma_min``, ``ns_sigma_max`` of one orthogonalized
    direction ``(rows, cols)`` (keys after ``prefix``)."""
    low, high = singular_value_range(direction)
    return {
        prefix + "ns_orthogonality_error": orthogonality_error(direction),
        prefix + "ns_sigma_min": low,
        prefix + "ns_sigma_max": high,
    }


def _is_distributed_shampoo(optimizer: torch.optim.Optimizer) -> bool:
    # By module, so that a run without Shampoo never imports it (its log holds only what ran).
    return type(optimizer).__module__.startswith("nanoshampoo.optim.shampoo")


def _is_adam(optimizer: torch.optim.Optimizer) -> bool:
    from_torch = isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam))
    return from_torch or type(optimizer).__name__ == "DistAdam"


@dataclass
class _Snapshot:
    """The matrices before a recorded step (clones) and the gradients it used (references)."""

    weights: list[torch.Tensor]
    grads: list[torch.Tensor | None]


class Telemetry:
    """The records of one run. ``every`` > 0 (0 builds nothing: the trainer does not call it).

    Per recorded step: :meth:`snapshot` right before the optimizers step, then :meth:`record`
    (collective: every rank calls it) after the step; rank 0 gets the records.
    """

    def __init__(
        self,
        every: int,
        model: nn.Module,
        matrices: Sequence[nn.Parameter],
        optimizers: Sequence[torch.optim.Optimizer],
        self_reducing: Sequence[nn.Parameter],
        ctx: DistributedContext,
    ) -> None:
        self.every = every
        self.ctx = ctx
        names = {id(p): name for name, p in model.named_parameters()}
        self.matrices = list(matrices)
        self.names = [names[id(p)] for p in self.matrices]
        self.optimizers = list(optimizers)
        self._self_reducing = {id(p) for p in self_reducing}
        self._snapshot: _Snapshot | None = None
        self.watch = DepartureWatch()

    def due(self, steps_done: int) -> bool:
        """Whether the step that completes ``steps_done`` steps is recorded."""
        return steps_done % self.every == 0

    @torch.no_grad()
    def snapshot(self) -> None:
        """Before the optimizers step: clone the matrices, keep references to their gradients,
        and ask the Muon-family optimizers to keep this step's Newton-Schulz outputs."""
        self._snapshot = _Snapshot(
            weights=[p.detach().clone() for p in self.matrices],
            grads=[p.grad for p in self.matrices],
        )
        for optimizer in self.optimizers:
            keep = getattr(optimizer, "keep_orthogonalized", None)
            if keep is not None:
                keep()

    @torch.no_grad()
    def record(self, step: int) -> list[dict[str, Any]]:
        """The records of step ``step`` (rank 0; ``[]`` elsewhere), from the snapshot taken
        before it; feeds :attr:`watch`. Collective under more than one rank."""
        snapshot, self._snapshot = self._snapshot, None
        assert snapshot is not None, "record() without snapshot()"
        local: dict[str, dict[str, float]] = {name: {} for name in self.names}
        rank, world = self.ctx.rank, self.ctx.world_size
        for index, (p, before, grad) in enumerate(
            zip(self.matrices, snapshot.weights, snapshot.grads)
        ):
            grad = self._averaged_gradient(p, grad)
            full_before, full_after = _full(before), _full(p.detach())
            full_grad = None if grad is None else _full(grad)
            if index % world == rank:
                local[self.names[index]].update(
                    generic_statistics(full_before, full_after, full_grad)
                )
        by_id = {id(p): name for p, name in zip(self.matrices, self.names)}
        for optimizer in self.optimizers:
            if _is_distributed_shampoo(optimizer):
                for pid, stats in shampoo_statistics(optimizer).items():
                    if pid in by_id:
                        local[by_id[pid]].update(stats)
            elif _is_adam(optimizer):
                self._adam_statistics(optimizer, by_id, local)
            elif hasattr(optimizer, "pop_orthogonalized"):
                self._orthogonalized_statistics(optimizer, local)
        merged = self._gather(local)
        if not self.ctx.is_main:
            return []
        records = [
            {"kind": "telemetry", "step": step, "layer": name, **merged[name]}
            for name in self.names
        ]
        for record in records:
            for key, value in record.items():
                if key not in ("kind", "step", "layer"):
                    self.watch.add(step, record["layer"], key, float(value))
        return records

    def _averaged_gradient(self, p: nn.Parameter, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient the step used: DistAdam leaves the rank's own in ``.grad`` (it averaged
        its slice elsewhere), so that one is averaged here (a collective per such matrix)."""
        if grad is None or self.ctx.world_size == 1 or id(p) not in self._self_reducing:
            return grad
        averaged = grad.detach().clone()
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
        return averaged

    def _adam_statistics(
        self,
        optimizer: torch.optim.Optimizer,
        by_id: dict[int, str],
        local: dict[str, dict[str, float]],
    ) -> None:
        """``sqrt_v_spread`` of the matrices an Adam holds; DistAdam's slices are gathered
        from every rank (in rank order, the rows they own) where the matrix is sharded."""
        sharded = getattr(optimizer, "is_sharded", lambda p: False)
        for group in optimizer.param_groups:
            for index, p in enumerate(group["params"]):
                if id(p) not in by_id:
                    continue
                v = optimizer.state.get(p, {}).get("exp_avg_sq")
                if sharded(p):
                    slices: list[Any] = [None] * self.ctx.world_size
                    dist.all_gather_object(slices, None if v is None else v.detach().cpu())
                    if any(s is None for s in slices):
                        continue
                    v = torch.cat(slices)
                elif v is None:
                    continue
                v = _full(v)  # FSDP2's AdamW holds DTensor moments: a collective, every rank
                if sharded(p) or index % self.ctx.world_size == self.ctx.rank:
                    local[by_id[id(p)]]["sqrt_v_spread"] = spread(v)

    def _orthogonalized_statistics(
        self, optimizer: torch.optim.Optimizer, local: dict[str, dict[str, float]]
    ) -> None:
        """The spectral statistics of the Newton-Schulz outputs a Muon-family optimizer kept
        (every rank ran the same replicated step: matrix ``i`` is measured by rank
        ``i % world_size``)."""
        kept = {id(p): u for p, u in optimizer.pop_orthogonalized().items()}  # type: ignore[attr-defined]
        for index, p in enumerate(self.matrices):
            u = kept.get(id(p))
            if u is not None and index % self.ctx.world_size == self.ctx.rank:
                local[self.names[index]].update(spectral_statistics(u))

    def _gather(self, local: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """Every rank's dicts merged on rank 0 (in rank order; equal keys: the later rank)."""
        if self.ctx.world_size == 1:
            return local
        parts: list[Any] = [None] * self.ctx.world_size if self.ctx.is_main else []
        dist.gather_object(local, parts if self.ctx.is_main else None, dst=0)
        merged: dict[str, dict[str, float]] = {name: {} for name in self.names}
        for part in parts:
            for name, stats in (part or {}).items():
                merged[name].update(stats)
        return merged


@dataclass
class _Departure:
    step: int
    layer: str
    statistic: str
    value: float
    low: float
    high: float


@dataclass
class DepartureWatch:
    """Which series left its own running range first (rank 0's records and the train loss).

    A series' running range at a record is ``[low, high]``, the extremes of its finite values
    up to ``lag`` records earlier (at least ``min_history`` of them): so a steady blow-up
    (say 5x per record) leaves it although each step stays within ``margin`` of the last. A
    value *departs* when it is non-finite or outside ``[low / margin, high * margin]``; the
    departure stays open while the later values stay outside that frozen range (a transient
    that comes back is forgotten). The loss departs when it is non-finite or more than
    ``loss_margin`` (relative) above its running range's top.
    """

    min_history: int = 3
    lag: int = 2
    margin: float = 10.0
    loss_margin: float = 0.05
    _history: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    _open: dict[tuple[str, str], _Departure] = field(default_factory=dict)
    _losses: list[float] = field(default_factory=list)
    loss_departure: int | None = None

    def _reference(self, history: list[float]) -> list[float]:
        """The finite values the running range is taken over (empty: too few)."""
        finite = [v for v in history[: max(0, len(history) - self.lag)] if math.isfinite(v)]
        return finite if len(finite) >= self.min_history else []

    def add(self, step: int, layer: str, statistic: str, value: float) -> None:
        key = (layer, statistic)
        history = self._history.setdefault(key, [])
        reference = self._reference(history)
        opened = self._open.get(key)
        if opened is not None and not outside_range(value, opened, self.margin):
            del self._open[key]
        elif opened is None and reference:
            departure = _Departure(step, layer, statistic, value, min(reference), max(reference))
            if outside_range(value, departure, self.margin):
                self._open[key] = departure
        history.append(value)

    def add_loss(self, step: int, loss: float) -> None:
        reference = self._reference(self._losses)
        if self.loss_departure is None and (
            not math.isfinite(loss)
            or (reference and loss > max(reference) + self.loss_margin * abs(max(reference)))
        ):
            self.loss_departure = step
        self._losses.append(loss)

    def first_departure(self, stop_step: int) -> str | None:
        """The line naming the earliest open departure at or before the loss's (or
        ``stop_step`` when the loss never departed before it), None when there is none."""
        limit = stop_step if self.loss_departure is None else min(stop_step, self.loss_departure)
        candidates = [d for d in self._open.values() if d.step <= limit]
        if not candidates:
            return None
        first = min(candidates, key=lambda d: (d.step, -_excursion(d)))
        label = statistic_label(first.statistic)
        return (
            f"first to leave its running range before the loss: {first.layer} {label} "
            f"{first.value:.3g} at step {first.step} (range {first.low:.3g}-{first.high:.3g})"
        )


def outside_range(value: float, departure: _Departure, margin: float) -> bool:
    """Whether ``value`` is still outside the range frozen at ``departure``."""
    if not math.isfinite(value):
        return True
    return not (departure.low / margin <= value <= departure.high * margin)


def _excursion(departure: _Departure) -> float:
    """How far out a departure went, in decades past the nearer bound (inf: non-finite)."""
    value = departure.value
    if not math.isfinite(value):
        return math.inf
    bound = departure.high if value > departure.high else departure.low
    if value <= 0.0 or bound <= 0.0:
        return abs(value - bound)
    return abs(math.log10(value / bound))


def statistic_label(key: str) -> str:
    """``"factor0.condition_number"`` -> ``"factor 0 condition number"``."""
    parts = []
    for part in key.split("."):
        if part.startswith("factor") and part[6:].isdigit():
            part = f"factor {part[6:]}"
        parts.append(part.replace("_", " "))
    return " ".join(parts)
