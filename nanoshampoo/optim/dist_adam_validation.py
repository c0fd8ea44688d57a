"""DistAdam's checks of what it is given, apart from its step: options, parameters, gradients and
loaded state. Every check raises before anything changes, naming the group, parameter or state
entry (``ValueError`` for a bad value, ``TypeError`` for a bad kind).

* Options (:func:`validate_options`), at construction, in ``add_param_group`` and again at the
  start of every ``step()`` (a scheduler may have changed them): ``lr >= 0``,
  ``weight_decay >= 0`` and ``eps > 0`` finite, ``betas`` a pair in ``[0, 1)``; the optional
  ``lr_mul``/``wd_mul`` of a parameter finite and ``>= 0`` (:func:`validate_multipliers`).
  Comparisons are written so that NaN fails them.
* Parameters (:func:`validate_param_collection`, :func:`validate_group`,
  :func:`validate_param`): an ordered collection of tensors (a ``set`` has no stable order, so
  the ranks could disagree on it), each listed once, requiring grad; a complex parameter with
  unit stride in its last dim; a group holds only DistAdam's options (``GROUP_KEYS``).
* Gradients (:func:`validate_gradient`), in ``step()`` before any gradient is synced or any
  parameter or state changes: dense, of the parameter's shape, dtype and device.
* Per-parameter state (:func:`validate_param_state`), in ``load_state_dict`` before anything is
  written and in ``step()`` before anything changes: ``step`` an int ``>= 1``; ``exp_avg`` and
  ``exp_avg_sq`` tensors of the local shard shape, real or complex like the parameter, finite,
  and ``exp_avg_sq >= 0`` (it is a running mean of squares). A state that fails would divide by
  zero in the bias correction, or turn the parameters NaN at the next step.

These checks are local (no collective): options and state are assumed the same on every rank,
as they are when every rank runs the same schedule and loads its own checkpoint, so every rank
raises alike.

Example:
    >>> validate_options({"lr": 1e-3, "betas": (0.9, 1.0), "eps": 1e-8, "weight_decay": 0.0}, "")
    Traceback (most recent call last):
    ...
    ValueError: betas[1] must be in [0.0, 1.0), got 1.0
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nanoshampoo.validation import check_choice, check_float, check_int

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")
# What a caller's param group may hold (torch adds ``param_names`` for named parameters).
GROUP_KEYS = ("params", "lr", "betas", "eps", "weight_decay", "param_names")
NONFINITE_GRAD_POLICIES: tuple[str, ...] = ("raise", "skip")


def validate_options(options: dict[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming the field (prefixed by ``where``) for a bad AdamW option."""
    lr, betas, eps, weight_decay = (
        options["lr"],
        options["betas"],
        options["eps"],
        options["weight_decay"],
    )
    check_float(f"{where}lr", lr, at_least=0.0)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        check_float(f"{where}betas[{index}]", beta, at_least=0.0, less_than=1.0)
    check_float(f"{where}eps", eps, greater_than=0.0)
    check_float(f"{where}weight_decay", weight_decay, at_least=0.0)


def validate_settings(shard_min_numel: object, nonfinite_grad_policy: object) -> None:
    """The constructor's own settings (not AdamW options)."""
    check_int("shard_min_numel", shard_min_numel, at_least=0)
    check_choice("nonfinite_grad_policy", nonfinite_grad_policy, NONFINITE_GRAD_POLICIES)


def validate_multipliers(param: Tensor, where: str) -> None:
    """Raise ``ValueError`` for a non-finite or negative ``lr_mul``/``wd_mul`` of ``param``."""
    for name in ("lr_mul", "wd_mul"):
        check_float(f"{where}{name}", getattr(param, name, 1.0), at_least=0.0)


def validate_param_collection(params: object) -> None:
    """``TypeError`` for a ``set`` of parameters (or of param groups): it has no stable order."""
    if isinstance(params, (set, frozenset)):
        raise TypeError(
            "params must be an ordered collection (a list or a model's "
            "parameters()), not a set: its order differs between processes"
        )


def validate_group(param_group: dict[str, Any], tensors: list[Tensor], where: str) -> None:
    """``ValueError`` for a key DistAdam does not read (a typo such as ``learning_rate``
    would otherwise leave the option at its default) or a tensor listed twice (it would be
    updated twice per step)."""
    unknown = sorted(set(param_group) - set(GROUP_KEYS))
    if unknown:
        raise ValueError(
            f"{where}unknown option(s) {unknown}; DistAdam's are "
            f"{[k for k in GROUP_KEYS if k != 'params']}"
        )
    seen: dict[int, int] = {}
    for index, tensor in enumerate(tensors):
        if seen.setdefault(id(tensor), index) != index:
            raise ValueError(
                f"{where}params: entries {seen[id(tensor)]} and {index} are the "
                "same tensor (it would be updated twice per step)"
            )


def validate_param(param: Tensor, where: str) -> None:
    """Raise ``ValueError`` for a parameter DistAdam cannot update."""
    validate_multipliers(param, where)
    if not param.requires_grad:
        raise ValueError(
            f"{where}params: a tensor of shape {tuple(param.shape)} does not "
            "require grad (an integer tensor never can): it would never be updated"
        )
    if param.is_complex() and param.dim() > 0 and param.stride(-1) != 1:
        # The update goes through torch.view_as_real, which needs a unit last stride.
        raise ValueError(
            f"{where}params: a complex parameter needs stride 1 in its last dim, "
            f"got strides {param.stride()}"
        )


def validate_gradient(param: Tensor, grad: Tensor, name: str) -> None:
    """``TypeError`` for a sparse gradient, ``ValueError`` for one unlike its parameter."""
    if grad.is_sparse or grad.layout != torch.strided:
        raise TypeError(
            f"DistAdam: {name} has a {grad.layout} gradient; DistAdam takes dense "
            "gradients only (use a dense embedding, sparse=False)"
        )
    if grad.shape != param.shape:
        raise ValueError(
            f"DistAdam: {name} has a gradient of shape {tuple(grad.shape)}, "
            f"expected the parameter's {tuple(param.shape)}"
        )
    if grad.dtype != param.dtype or grad.device != param.device:
        raise ValueError(
            f"DistAdam: {name} has a {grad.dtype} gradient on {grad.device}, "
            f"expected {param.dtype} on {param.device} like the parameter"
        )


def validate_param_state(state: Any, param: Tensor, local_shape: torch.Size, name: str) -> None:
    """Raise for a per-parameter state that ``step()`` could not continue from (module docstring).

    ``name`` says where the state is (``"state_dict state[3]"``, ``"param 0 of group 1"``).
    """
    if not isinstance(state, dict):
        raise TypeError(f"{name} must be a dict of {list(STATE_KEYS)}, got {type(state).__name__}")
    missing = set(STATE_KEYS) - set(state)
    if missing:
        raise ValueError(f"{name} lacks {sorted(missing)}")
    check_int(f"{name}['step']", state["step"], at_least=1)  # the steps taken
    for key in ("exp_avg", "exp_avg_sq"):
        value = state[key]
        if not isinstance(value, Tensor):
            raise TypeError(f"{name}[{key!r}] must be a tensor, got {type(value).__name__}")
        if value.shape != local_shape:
            raise ValueError(
                f"{name}[{key!r}] has shape {tuple(value.shape)}, "
                f"expected the local shard shape {tuple(local_shape)}"
            )
        if not (value.is_complex() if param.is_complex() else value.is_floating_point()):
            raise ValueError(
                f"{name}[{key!r}] has dtype {value.dtype}, "
                f"expected one like the parameter's {param.dtype}"
            )
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name}[{key!r}] holds NaN or Inf")
    if not bool(
        (torch.view_as_real(state["exp_avg_sq"]) if param.is_complex() else state["exp_avg_sq"])
        .ge(0)
        .all()
    ):
        raise ValueError(f"{name}['exp_avg_sq'] holds negative values (a mean of squares)")


def validate_state_dict(
    state_dict: Any,
    params: list[Tensor],
    local_shapes: list[torch.Size],
    world_size: int,
    rank: int,
) -> None:
    """Check a DistAdam state dict for ``params`` (whose local shapes are ``local_shapes``) on
    rank ``rank`` of ``world_size``: each rank loads the shard state it saved."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    layout = state_dict.get("dist_adam")
    if not isinstance(layout, dict):
        raise ValueError("state_dict has no 'dist_adam' entry: not saved by DistAdam")
    if layout != {"world_size": world_size, "rank": rank}:
        raise ValueError(
            f"state_dict was saved by rank {layout.get('rank')} of world size "
            f"{layout.get('world_size')}, but this is rank {rank} of world size "
            f"{world_size}: each rank must load the shard state it saved"
        )
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError("state_dict['param_groups'] must be a list of dicts")
    if not isinstance(state, dict):
        raise ValueError("state_dict['state'] must be a dict")
    for index, saved_group in enumerate(groups):
        where = f"state_dict param group {index}: "
        missing = {"lr", "betas", "eps", "weight_decay", "params"} - set(saved_group)
        if missing:
            raise ValueError(f"{where}lacks {sorted(missing)}")
        validate_options(saved_group, where)
    for index, saved in state.items():
        check_int(
            f"state_dict state index (of {len(params)} params)",
            index,
            at_least=0,
            less_than=len(params),
        )
        validate_param_state(
            saved, params[index], local_shapes[index], f"state_dict state[{index}]"
        )
