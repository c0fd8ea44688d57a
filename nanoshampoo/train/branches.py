"""Decay branches: the final loss of several training budgets from one run.

A branch at fraction ``b`` of a run of ``N`` steps IS the run of ``N_b = round(b * N)`` steps
with the same seed, data, setup, ``cooldown_frac`` and warmup. The two schedules agree up to
the fork, the first step ``t`` at which ``lr_multiplier(t, N_b, ...)`` differs from
``lr_multiplier(t, N, ...)`` (with a cooldown ``c`` and no warmup: the first step past
``(1 - c) N_b``, inside the main run's stable phase), so up to the fork the main run has
already trained the branch. There the trainer takes a :class:`TrainingSnapshot`, trains the
branch on its own schedule to ``N_b``, validates it as a run's final validation, restores the
snapshot, and the main run continues exactly as if the branch had never happened. A branch is a
different run: if it diverges, it is recorded as diverged and the main run goes on. Each branch
costs ``N_b - fork`` extra steps: the run with branches takes about ``N (1 + c sum(b))`` steps
where separate runs take ``N (1 + sum(b))``.

The snapshot holds everything the main run's future depends on: parameter values, gradients
and buffers (cloned; restored in place, so every reference to them stays valid), each
stateful component's ``__dict__`` (the optimizers, the divergence guard, the thread tuner), the
data loader's position, the torch RNG states and the intra-op thread count. A component's
``__dict__`` is deep-copied once at the fork and that copy is put back into the same object
afterwards; the copy's memo maps the model, its parameters, every tensor that views a
parameter's memory, hook handles, process groups and the components themselves to themselves,
so the restored state refers to the live parameters and hooks that close over a component
(DistAdam's) stay valid. ``state_dict`` / ``load_state_dict`` are not used: a load rebuilds
caches some optimizers keep between steps (SOAP's rotated momentum), which changes rounding.

Example (cooldown 0.5: each branch forks at its first step past N_b / 2):
    >>> [(b.steps, b.fork_step) for b in plan_branches((0.25, 0.5, 0.75), 16, cooldown_frac=0.5)]
    [(4, 3), (8, 5), (12, 7)]
"""

from __future__ import annotations

import copy
import types
import weakref
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from nanoshampoo.train.distributed import local_tensor
from nanoshampoo.train.schedule import lr_multiplier


@dataclass(frozen=True)
class Branch:
    """One decay branch: the run of ``steps`` steps, forked after ``fork_step`` main steps."""

    fraction: float
    steps: int
    fork_step: int


def branch_steps(fraction: float, total_steps: int) -> int:
    """The length of the branch at ``fraction`` of a ``total_steps`` run: ``round(b * N)``."""
    return round(fraction * total_steps)


def fork_step(steps: int, total_steps: int, cooldown_frac: float, warmup_steps: int) -> int:
    """The first step at which the ``steps``-step schedule's multiplier differs from the
    ``total_steps`` one's; ``steps`` when none before it does (no cooldown: the branch is the
    main run's first ``steps`` steps, validated)."""
    return next(
        (
            t
            for t in range(steps)
            if lr_multiplier(t, steps, cooldown_frac, warmup_steps)
            != lr_multiplier(t, total_steps, cooldown_frac, warmup_steps)
        ),
        steps,
    )


def plan_branches(
    fractions: Sequence[float], total_steps: int, cooldown_frac: float, warmup_steps: int = 0
) -> tuple[Branch, ...]:
    """The branches of a run, in the order the run reaches their forks (then by length)."""
    branches = []
    for fraction in fractions:
        steps = branch_steps(fraction, total_steps)
        branches.append(
            Branch(fraction, steps, fork_step(steps, total_steps, cooldown_frac, warmup_steps))
        )
    return tuple(sorted(branches, key=lambda b: (b.fork_step, b.steps)))


def branches_to_make(
    branches: Sequence[Branch], recorded_steps: Collection[int], start_step: int
) -> tuple[tuple[Branch, ...], tuple[Branch, ...]]:
    """``(made, missed)``: the branches a run that starts at ``start_step`` (a resume) makes,
    and those it cannot make because they fork before it; a branch whose length is in
    ``recorded_steps`` (its record is in the run's log already) is neither."""
    todo = [b for b in branches if b.steps not in recorded_steps]
    return (
        tuple(b for b in todo if b.fork_step >= start_step),
        tuple(b for b in todo if b.fork_step < start_step),
    )


# Objects a snapshot refers to rather than copies: what lives outside the components' state.
_SHARED_TYPES: tuple[type, ...] = (nn.Module, RemovableHandle)
# What the walk of a component's state does not descend into (deepcopy keeps these as they are,
# or they are tensors, whose references the walk does not follow).
_LEAF_TYPES = (
    torch.Tensor,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.ModuleType,
    weakref.ref,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    torch.device,
    torch.dtype,
)


def _distributed_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """Process groups and device meshes (shared), and in-flight collectives (waited on)."""
    if not torch.distributed.is_available():
        return (), ()
    from torch.distributed.device_mesh import DeviceMesh

    return (torch.distributed.ProcessGroup, DeviceMesh), (torch.distributed.Work,)


def _walk(root: Any, stop: set[int]) -> Iterable[Any]:
    """Every object reachable from ``root`` through containers, instance attributes (``__dict__``
    and ``__slots__``) and bound methods, as deepcopy reaches them; not into ``stop`` ids."""
    seen, stack = set(stop), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, _LEAF_TYPES) or isinstance(obj, _SHARED_TYPES):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        else:
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))


def _storage_ptr(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    return local.untyped_storage().data_ptr() if local.device.type != "meta" else 0


class TrainingSnapshot:
    """The state of a training run at one point, restorable once (see the module docstring).

    ``components``: objects whose whole ``__dict__`` is state (optimizers, divergence guard,
    thread tuner); ``loader``: anything with ``state_dict`` / ``load_state_dict``; ``shared``:
    further objects the components refer to that are not theirs (the distributed context).
    """

    def __init__(
        self, model: nn.Module, components: Sequence[Any], loader: Any, shared: Sequence[Any] = ()
    ) -> None:
        self.model = model
        tensors = [*model.parameters(), *model.buffers()]
        self.values = [t.detach().clone() for t in tensors]
        self.grads = [None if t.grad is None else t.grad.detach().clone() for t in tensors]
        self.tensors = tensors
        memo = self._memo(components, shared)
        self.states = [(c, copy.deepcopy(vars(c), memo)) for c in components]
        self.loader, self.loader_state = loader, copy.deepcopy(loader.state_dict())
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.threads = torch.get_num_threads()

    def _memo(self, components: Sequence[Any], shared: Sequence[Any]) -> dict[int, Any]:
        """deepcopy's memo: every object the copies must refer to, mapped to itself."""
        keep, _ = _distributed_types()
        params = {_storage_ptr(t) for t in self.tensors} - {0}
        memo: dict[int, Any] = {
            id(obj): obj for obj in (self.model, *self.tensors, *components, *shared)
        }
        for component in components:
            for obj in _walk(vars(component), stop=set(memo)):
                views_a_param = isinstance(obj, torch.Tensor) and _storage_ptr(obj) in params
                if views_a_param or isinstance(obj, _SHARED_TYPES + keep):
                    memo[id(obj)] = obj
        return memo

    @torch.no_grad()
    def restore(self) -> None:
        """Put the state back: wait for collectives the branch left in flight (DistAdam's
        gradient syncs, when the branch diverged after its hooks launched them), then values in
        place, component state, loader, RNG, threads."""
        _, in_flight = _distributed_types()
        for component, _ in self.states:
            for obj in _walk(vars(component), stop={id(self.model)}):
                if in_flight and isinstance(obj, in_flight):
                    obj.wait()
        for tensor, value, grad in zip(self.tensors, self.values, self.grads):
            tensor.copy_(value)
            tensor.grad = grad
        for component, state in self.states:
            vars(component).clear()
            vars(component).update(state)
        self.loader.load_state_dict(self.loader_state)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        torch.set_num_threads(self.threads)
