"""DistAdam: ZeRO-2-style sharded AdamW whose gradient reduce-scatters start during backward.

Each rank keeps the Adam moments of one dim-0 slice of every parameter, updates only that slice
with the rank-averaged gradient slice, then all-gathers the full parameter back. The gradient
reduce-scatter of a parameter is launched by its post-accumulate-grad hook, so the last layers'
gradients (produced first by backward) start syncing while earlier layers still differentiate.
``step()`` walks parameters in reverse order, waiting first on what was launched first.

Layout (world size ``W``, rank ``r``):
- Parameters are grouped by shape, one param group per distinct shape in first-seen order (a
  dict param group given by the caller is split by shape the same way, keeping its options).
- A parameter is *sharded* when ``W > 1``, it is contiguous, ``shape[0] % W == 0`` and it has at
  least ``shard_min_numel`` elements: rank ``r`` owns rows ``[r*n, (r+1)*n)`` with
  ``n = shape[0] // W`` and holds ``exp_avg``/``exp_avg_sq`` of shape ``(n, *shape[1:])``.
- Every other parameter (dim 0 not divisible by ``W``, 0-D, or small) is *replicated*: its
  gradient is all-reduced (AVG) in place in ``param.grad`` (in a contiguous copy when
  ``param.grad`` is not contiguous) and every rank applies the full,
  identical update with full-size moments; no all-gather is needed. Small tensors are replicated
  because one all-reduce costs one collective latency where reduce-scatter + all-gather cost two,
  and their optimizer state is too small to be worth sharding. Sharded parameters' ``.grad``
  keeps the local (unaveraged) gradient.

Update, per parameter slice with the averaged gradient slice: ``adamw_update_`` (its module
states the equations) with ``lr = group["lr"] * param.lr_mul`` and
``wd = group["weight_decay"] * param.wd_mul``, both multipliers optional attributes defaulting
to 1. Complex moments are stored complex, of the parameter's shape.

Validation (all-or-nothing; the checks live in ``dist_adam_validation``): options at
construction, in ``add_param_group`` (a group that fails is not added, and its parameters get no
hook) and at the start of every ``step()``; a ``set`` of parameters is refused (no stable order);
``step()`` checks every gradient (dense, of its parameter's shape, dtype and device) and every
parameter's state before it syncs a gradient or changes anything; ``load_state_dict`` checks the
whole state (steps ``>= 1``, finite moments of the local shard shape) before it writes.

Non-finite gradients: every gradient sync records the float64 sum of the local gradient before
the collective starts (a finite float32/bfloat16 tensor cannot overflow it, so the sum is finite
iff every entry is); with world size 1 no collective starts and ``step()`` sums the gradient as
it is then (with world size > 1 a gradient changed after its sync launched is not what the
update uses anyway: the collective has already read it). ``step()`` launches what is still
unlaunched, then all-reduces the vector of these sums (one small collective issued after every
gradient collective, so the ranks' collective order stays the same) and reads it on the host.
If any entry is NaN or Inf on any rank, every rank waits for its in-flight collectives, forgets
them, and with ``nonfinite_grad_policy="raise"`` (default) raises
:class:`NonFiniteGradientError` naming the parameters, or with ``"skip"`` logs a warning and
returns: parameters, moments and step counts are unchanged on every rank (the gradients of
replicated parameters have been averaged in place). Reading the flag synchronizes the
host with the device once per step.

Schedules (``launch``):
- ``"hook"``: the post-accumulate-grad hook launches the reduce-scatter when ``should_sync`` is
  true. Set ``should_sync = False`` on micro-batches that only accumulate gradients.
- ``"step"``: the baseline; ``step()`` launches every reduce-scatter itself (all of them up front,
  in the order it then consumes them) so communication overlaps only the optimizer math.
In either mode a parameter that has a gradient but no launched sync is reduced inside ``step()``;
a parameter whose ``.grad`` is ``None`` and has no launched sync is skipped. A hook-launched
sync that ``step()`` never consumed raises ``RuntimeError`` at the next launch for that parameter
or at ``zero_grad()``: it means a synced backward was not followed by ``step()``.

Collectives: ``nanoshampoo.optim.collectives`` (``reduce_scatter_single``/``all_gather_single`` on
torch >= 2.13, the deprecated older names before). On gloo (CPU) a reduce-scatter's ``Work``
has no future (``get_future()`` raises "Work::getFuture not implemented") and gloo runs it as a
full all-reduce, so this module waits on ``Work`` handles, never on futures. The same code runs on
NCCL, where ``Work.wait()`` makes the current CUDA stream wait instead of blocking the host.
With world size 1, or without an initialized process group, no collective is issued.

State dict: each rank saves and loads its own shard state (moments of its slices, plus the full
moments of replicated parameters) and the ``(world_size, rank)`` it was saved under; loading on a
different world size or rank raises ``ValueError``. Checkpoint one file per rank.

Example (one process, so no collective is issued; the same code runs on every rank):
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = DistAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    >>> for micro in range(2):  # accumulate; the hooks sync only on the last micro-batch
    ...     opt.should_sync = micro == 1
    ...     model(torch.randn(8, 4)).square().mean().backward()
    >>> opt.step()
    >>> opt.zero_grad(set_to_none=True)
    >>> DistAdam(model.parameters(), eps=0.0)
    Traceback (most recent call last):
    ...
    ValueError: eps must be finite and > 0.0, got 0.0
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup, ReduceOp, Work
from torch.utils.hooks import RemovableHandle

from nanoshampoo.optim.adamw_update import adamw_update_, real_view
from nanoshampoo.optim.collectives import (
    all_gather_into_tensor,
    reduce_scatter_tensor,
    wait_all,
    wait_work,
)
from nanoshampoo.optim.dist_adam_validation import (
    validate_gradient,
    validate_group,
    validate_multipliers,
    validate_options,
    validate_param,
    validate_param_collection,
    validate_param_state,
    validate_settings,
    validate_state_dict,
)
from nanoshampoo.optim.errors import NonFiniteGradientError

logger = logging.getLogger(__name__)

Launch = Literal["hook", "step"]
_LAUNCH_MODES: tuple[str, ...] = ("hook", "step")
# Below this many elements a parameter is replicated (see module docstring).
DEFAULT_SHARD_MIN_NUMEL = 1024


@dataclass
class _PendingSync:
    """A launched gradient sync: ``grad`` holds this rank's averaged gradient once ``work`` is done.

    ``source`` keeps the reduce-scatter input alive until the collective completes.
    ``local_sum`` is the 0-D float64 sum of this rank's gradient taken before the collective
    started (finite iff the local gradient is); ``None`` when no collective was launched
    (``work`` is ``None``), in which case ``step()`` sums ``grad`` itself.
    """

    work: Work | None
    grad: Tensor
    source: Tensor
    launched_by_hook: bool
    local_sum: Tensor | None


class DistAdam(torch.optim.Optimizer):
    """Sharded AdamW for data parallelism with hook-launched gradient reduce-scatters.

    Args:
        params: tensors (grouped by shape here) or dicts of param groups with optional ``lr``,
            ``betas``, ``eps``, ``weight_decay`` (each split by shape).
        lr, betas, eps, weight_decay: AdamW hyper-parameters (defaults of every group).
        launch: ``"hook"`` (reduce-scatter launched in backward) or ``"step"`` (baseline).
        shard_min_numel: parameters with fewer elements are replicated, not sharded.
        process_group: the data-parallel group; ``None`` is the default group (or no group).
        nonfinite_grad_policy: ``"raise"`` (default) or ``"skip"`` when a gradient holds NaN/Inf
            on any rank (see the module docstring); nothing is changed either way.

    Attributes:
        should_sync: when false, the backward hooks launch nothing (accumulation micro-batches).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        launch: Launch = "hook",
        *,
        shard_min_numel: int = DEFAULT_SHARD_MIN_NUMEL,
        process_group: ProcessGroup | None = None,
        nonfinite_grad_policy: str = "raise",
    ) -> None:
        validate_param_collection(params)
        validate_options({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}, "")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        validate_settings(shard_min_numel, nonfinite_grad_policy)
        self._nonfinite_grad_policy = nonfinite_grad_policy
        self.launch = launch
        self.should_sync: bool = True
        self._shard_min_numel = shard_min_numel
        self._process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self._world_size = dist.get_world_size(process_group)
            self._rank = dist.get_rank(process_group)
        else:
            self._world_size, self._rank = 1, 0
        self._pending: dict[Tensor, _PendingSync] = {}
        self._hook_handles: list[RemovableHandle] = []
        super().__init__(params, defaults)

    @property
    def launch(self) -> Launch:
        """Which schedule launches the gradient reduce-scatters; may be switched between steps."""
        return self._launch

    @launch.setter
    def launch(self, value: Launch) -> None:
        if value not in _LAUNCH_MODES:
            raise ValueError(f"launch must be one of {_LAUNCH_MODES}, got {value!r}")
        self._launch = value

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        return self._rank

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add ``param_group`` split into one group per distinct shape, and hook its params.

        All or nothing: the options (the group's, else the defaults) and the parameters are
        checked first; if anything fails, ``param_groups`` and the hooks are left as they were.
        """
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        validate_param_collection(params)
        params = list(params)  # a generator is read twice below
        by_shape: dict[torch.Size, list[Any]] = {}
        for item in params:
            tensor = item[1] if isinstance(item, tuple) else item
            if not isinstance(tensor, Tensor):
                raise TypeError(f"params must hold tensors, got {type(tensor).__name__}")
            by_shape.setdefault(tensor.shape, []).append(item)
        if not by_shape:
            raise ValueError("params: a param group must hold at least one tensor")
        first_new = len(self.param_groups)
        where = f"param group {first_new}: "
        validate_group(
            param_group, [item[1] if isinstance(item, tuple) else item for item in params], where
        )
        validate_options({**self.defaults, **param_group}, where)
        for same_shape in by_shape.values():
            for item in same_shape:
                validate_param(item[1] if isinstance(item, tuple) else item, where)
        try:
            for same_shape in by_shape.values():
                super().add_param_group({**param_group, "params": same_shape})
        except BaseException:
            # torch's own checks (non-leaf tensor, a parameter already in another group) may
            # fail after the first shape group was appended: drop every group this call added.
            del self.param_groups[first_new:]
            raise
        for group in self.param_groups[first_new:]:
            for param in group["params"]:
                self._hook_handles.append(
                    param.register_post_accumulate_grad_hook(self._sync_gradient)
                )

    def _validate_step(self) -> None:
        """Before ``step()`` changes anything: every group's options (schedulers change them),
        every parameter's multipliers, unlaunched gradient and existing state."""
        for index, group in enumerate(self.param_groups):
            where = f"param group {index}: "
            validate_options(group, where)
            for param in group["params"]:
                validate_multipliers(param, where)
                if param.grad is not None and param not in self._pending:
                    validate_gradient(param, param.grad, self._describe(param))
                if self.state.get(param):
                    validate_param_state(
                        self.state[param],
                        param,
                        self.local_shape(param),
                        f"DistAdam: state of {self._describe(param)}",
                    )

    def remove_hooks(self) -> None:
        """Detach the backward hooks (e.g. before building another optimizer on these params)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def is_sharded(self, param: Tensor) -> bool:
        """Whether ``param`` is split along dim 0 across ranks (else it is replicated)."""
        return (
            self._world_size > 1
            and param.dim() >= 1
            and param.shape[0] % self._world_size == 0
            and param.numel() >= self._shard_min_numel
            and param.is_contiguous()
        )

    def local_shape(self, param: Tensor) -> torch.Size:
        """Shape of the slice of ``param`` (and of its Adam moments) that this rank updates."""
        if self.is_sharded(param):
            return torch.Size((param.shape[0] // self._world_size, *param.shape[1:]))
        return param.shape

    def _local_slice(self, param: Tensor) -> Tensor:
        if self.is_sharded(param):
            rows = param.shape[0] // self._world_size
            return param[self._rank * rows : (self._rank + 1) * rows]
        return param

    def _describe(self, param: Tensor) -> str:
        for group_index, group in enumerate(self.param_groups):
            for param_index, candidate in enumerate(group["params"]):
                if candidate is param:
                    return (
                        f"param {param_index} of group {group_index} (shape {tuple(param.shape)})"
                    )
        return f"a parameter of shape {tuple(param.shape)}"

    def _unconsumed_error(self, param: Tensor) -> RuntimeError:
        return RuntimeError(
            f"DistAdam: the gradient reduce-scatter launched in backward for "
            f"{self._describe(param)} was never consumed by step(). Call step() after every "
            f"backward run with should_sync=True, and set should_sync=False on micro-batches "
            f"that only accumulate gradients."
        )

    @torch.no_grad()
    def _launch_gradient_sync(self, param: Tensor, by_hook: bool) -> _PendingSync:
        grad = param.grad
        if grad is None:
            raise RuntimeError(f"DistAdam: {self._describe(param)} has no gradient to sync")
        validate_gradient(param, grad, self._describe(param))
        if self._world_size == 1:
            return _PendingSync(None, grad, grad, by_hook, None)
        # Taken before the collective may average ``grad`` in place; float64 cannot overflow.
        local_sum = real_view(grad).sum(dtype=torch.float64)
        # Complex gradients travel as their real views: the collectives then handle only real
        # dtypes, and dim 0 (the sharded dim) is unchanged by the view.
        if self.is_sharded(param):
            source = grad.contiguous()
            local = torch.empty(self.local_shape(param), dtype=grad.dtype, device=grad.device)
            work = reduce_scatter_tensor(
                real_view(local),
                real_view(source),
                ReduceOp.AVG,
                group=self._process_group,
                async_op=True,
            )
            return _PendingSync(work, local, source, by_hook, local_sum)
        # Averaged in place: a replicated gradient needs no second buffer.
        source = grad if grad.is_contiguous() else grad.contiguous()
        work = dist.all_reduce(
            real_view(source), op=ReduceOp.AVG, group=self._process_group, async_op=True
        )
        return _PendingSync(work, source, source, by_hook, local_sum)

    def _sync_gradient(self, param: Tensor) -> None:
        """Post-accumulate-grad hook: launch ``param``'s gradient sync if this backward syncs."""
        if self._launch != "hook" or not self.should_sync:
            return
        if param in self._pending:
            raise self._unconsumed_error(param)
        self._pending[param] = self._launch_gradient_sync(param, by_hook=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients; raises if a hook-launched sync is still waiting for ``step()``."""
        for param, pending in self._pending.items():
            if pending.launched_by_hook:
                raise self._unconsumed_error(param)
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        """Wait for each gradient sync (last-launched-last), update this rank's slices, gather.

        Walks ``reversed(param_groups)`` and each group's params in reverse: backward produced
        (and the hooks launched) the last parameters' syncs first. Options are validated and
        gradients checked for NaN/Inf on every rank before any parameter or state changes.
        """
        self._validate_step()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        order = [
            (group, param)
            for group in reversed(self.param_groups)
            for param in reversed(group["params"])
        ]
        for _, param in order:
            if param not in self._pending and param.grad is not None:
                self._pending[param] = self._launch_gradient_sync(param, by_hook=False)
        nonfinite = self._nonfinite_params()
        if nonfinite:
            for pending in self._pending.values():
                wait_work(pending.work)
            self._pending.clear()
            message = f"DistAdam: non-finite gradient (NaN or Inf) in {', '.join(nonfinite)}" + (
                f" on at least one of {self._world_size} ranks" if self._world_size > 1 else ""
            )
            if self._nonfinite_grad_policy == "raise":
                raise NonFiniteGradientError(message + "; no parameter or state was changed")
            logger.warning("%s; skipping this step", message)
            return loss
        gathers: list[Work | None] = []
        for group, param in order:
            pending = self._pending.pop(param, None)
            if pending is None:
                continue
            wait_work(pending.work)
            local = self._local_slice(param)
            self._update_slice(group, param, local, pending.grad)
            if self.is_sharded(param):
                gathers.append(
                    all_gather_into_tensor(
                        real_view(param),
                        real_view(local),
                        group=self._process_group,
                        async_op=True,
                    )
                )
        wait_all(gathers)
        return loss

    def _nonfinite_params(self) -> list[str]:
        """Descriptions of the parameters whose gradient holds NaN/Inf on any rank.

        One all-reduce (SUM) of the per-parameter local sums, indexed by position in
        ``param_groups`` so that every rank reduces the same layout; NaN and Inf survive the sum.
        """
        params = [param for group in self.param_groups for param in group["params"]]
        device = params[0].device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        sums = torch.stack(
            [self._local_sum(p).to(device) if p in self._pending else zero for p in params]
        )
        if self._world_size > 1:
            dist.all_reduce(sums, op=ReduceOp.SUM, group=self._process_group)
        finite = torch.isfinite(sums)
        if bool(finite.all()):
            return []
        return [self._describe(param) for param, ok in zip(params, finite.tolist()) if not ok]

    def _local_sum(self, param: Tensor) -> Tensor:
        pending = self._pending[param]
        if pending.local_sum is None:
            return real_view(pending.grad).sum(dtype=torch.float64)
        return pending.local_sum

    def _update_slice(
        self, group: dict[str, Any], param: Tensor, local: Tensor, grad: Tensor
    ) -> None:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(local, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(local, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        lr = group["lr"] * getattr(param, "lr_mul", 1.0)
        adamw_update_(
            local,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            step=state["step"],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"] * getattr(param, "wd_mul", 1.0),
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard state, tagged with the ``world_size`` and ``rank`` it belongs to."""
        state_dict = super().state_dict()
        state_dict["dist_adam"] = {"world_size": self._world_size, "rank": self._rank}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by ``state_dict()`` on this same rank of the same world size.

        Everything is checked before anything is written (``dist_adam_validation``): the layout
        tag, every saved group's options, and every saved entry's step, shapes, kind and values.
        """
        params = [param for group in self.param_groups for param in group["params"]]
        validate_state_dict(
            state_dict, params, [self.local_shape(p) for p in params], self._world_size, self._rank
        )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "dist_adam"})
