"""Validation of a parameter group's entries, and their resolution into :class:`Hyperparameters`.

:func:`validate_group` and :func:`validate_params` raise ``ValueError`` naming the field (or
``params[i]``), when a group is added; :func:`validate_changes` re-checks, at a step or a load,
only the entries that changed since; :func:`write_back_sentinels` writes what the ``-1``
sentinels stand for into a new group, once; :meth:`Hyperparameters.resolve` turns a valid group
into the values a step uses (resolving a ``-1`` set after construction too).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanoshampoo.optim.errors import NonFiniteGradientError
from nanoshampoo.optim.shampoo.config_checks import check_rule, field_error, refuse
from nanoshampoo.optim.shampoo.iterate_averaging_types import (
    PRIMAL_AVERAGING_CONFIG_TYPES,
    ClassicMomentumConfig,
    GeneralizedPrimalAveragingConfig,
    IterateAveragingConfig,
    ScheduleFreeConfig,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    GRAFTING_CONFIG_TYPES,
    DistributedConfig,
    PreconditionerConfig,
    PseudoInverseConfig,
    SignDescentPreconditionerConfig,
    SpectralDescentPreconditionerConfig,
    UnsupportedConfigError,
    WeightDecayType,
    check_ema_storage_dtype,
)
from nanoshampoo.validation import is_int, is_real

logger = logging.getLogger(__name__)

# Group entries fixed when the group is added: they decide the blocks, which rank holds them and
# the layout of their state. A change after construction (or from a checkpoint) is refused.
FIXED_GROUP_KEYS = (
    "max_preconditioner_dim",
    "preconditioner_config",
    "grafting_config",
    "distributed_config",
    "momentum_dtype",
)
# Group entries a step reads; changing them between steps is supported.
STEP_GROUP_KEYS = (
    "lr",
    "betas",
    "beta3",
    "epsilon",
    "momentum",
    "dampening",
    "use_nesterov",
    "weight_decay",
    "weight_decay_type",
    "peak_lr",
    "precondition_frequency",
    "start_preconditioning_step",
    "use_bias_correction",
    "amortize_roots",
    "iterate_averaging_config",
)
# Weight decay types whose coefficient is divided by the group's peak learning rate.
_PEAK_LR_DECAY_TYPES = (WeightDecayType.CORRECTED, WeightDecayType.INDEPENDENT)
ITERATE_AVERAGING_CONFIG_TYPES = (ClassicMomentumConfig, *PRIMAL_AVERAGING_CONFIG_TYPES)
# Preconditioners without an amortized computation: their groups step with
# precondition_frequency 1 whatever the entry says (so start_preconditioning_step -1 means 1),
# as in the reference library.
STATELESS_PRECONDITIONER_TYPES = (
    SignDescentPreconditionerConfig,
    SpectralDescentPreconditionerConfig,
)


def uses_pseudo_inverse(config: PreconditionerConfig) -> bool:
    """Whether ``config`` drops numerically-zero eigenvalues (then ``epsilon`` must be 0)."""
    solver = getattr(config, "amortized_computation_config", None)
    return isinstance(getattr(solver, "rank_deficient_stability_config", None), PseudoInverseConfig)


def _require(group: Mapping[str, Any], ok: bool, name: str, requirement: str) -> None:
    """Raise ``ValueError("<name> <requirement>, got <value>")`` unless ``ok``."""
    if not ok:
        raise field_error(name, f"{name} {requirement}, got {group.get(name.split('[')[0])!r}")


def validate_group(group: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` (message starting with the field name) for an invalid group entry.

    Checks every entry but ``params`` (see :func:`validate_params`). Run when a group is added;
    afterwards a step or a load re-checks only what changed (:func:`validate_changes`).
    """
    config = group["preconditioner_config"]
    _require(
        group,
        isinstance(config, PreconditionerConfig),
        "preconditioner_config",
        "must be a PreconditionerConfig",
    )
    grafting = group["grafting_config"]
    if not (grafting is None or isinstance(grafting, GRAFTING_CONFIG_TYPES)):
        error = UnsupportedConfigError if isinstance(grafting, PreconditionerConfig) else ValueError
        raise error(
            "grafting_config must be None or an SGD/AdaGrad/RMSprop/Adam PreconditionerConfig, "
            f"got {grafting!r}"
        )
    _require(
        group,
        isinstance(group["distributed_config"], DistributedConfig),
        "distributed_config",
        "must be a DistributedConfig",
    )
    _require(
        group,
        isinstance(group.get("use_pin_memory", False), bool),
        "use_pin_memory",
        "must be a bool",
    )
    _validate_step_sizes(group)
    _validate_iterate_averaging(group)
    _validate_schedule(group)


def _check_entry(
    group: Mapping[str, Any],
    field: str,
    requirement: str,
    ok: Callable[[Any], bool],
    *,
    integer: bool = False,
    finite: bool = True,
    hint: str = "",
) -> None:
    """The reference's rule for the group entry ``field`` (``"betas[0]"``), its sentence
    ``"Invalid param_group[BETAS][0]=<value>. <requirement>"`` first (``check_rule``)."""
    key, _, index = field.partition("[")
    value = group[key][int(index[:-1])] if index else group[key]
    expression = f"param_group[{key.upper()}]" + (f"[{index}" if index else "")
    check_rule(
        field,
        f"Invalid {expression}={value!r}.",
        value,
        requirement,
        ok,
        integer=integer,
        finite=finite,
        hint=hint,
    )


def _validate_step_sizes(group: Mapping[str, Any]) -> None:
    """The entries that scale a step: lr, betas, beta3, epsilon, momentum, weight decay."""
    betas, beta3 = group["betas"], group["beta3"]
    _validate_lr(group)
    _require(
        group,
        isinstance(betas, (tuple, list)) and len(betas) == 2,
        "betas",
        "must be a pair (beta1, beta2)",
    )
    _check_entry(group, "betas[0]", "Must be in [0.0, 1.0).", lambda b: 0.0 <= b < 1.0)
    _check_entry(group, "betas[1]", "Must be in [0.0, 1.0].", lambda b: 0.0 <= b <= 1.0)
    if beta3 != -1.0:  # the sentinel for betas[0], resolved when the group is added
        _check_entry(
            group,
            "beta3",
            "Must be in [0.0, 1.0).",
            lambda b: 0.0 <= b < 1.0,
            hint="(-1.0: betas[0])",
        )
    if uses_pseudo_inverse(group["preconditioner_config"]):
        _check_entry(
            group,
            "epsilon",
            "Must be == 0.0 when PseudoInverseConfig is used.",
            lambda e: e == 0.0,
            hint="(the pseudo-inverse adds no ridge)",
        )
    else:
        _check_entry(
            group,
            "epsilon",
            "Must be > 0.0.",
            lambda e: e > 0.0,
            hint="(0.0 only with a PseudoInverseConfig rank_deficient_stability_config)",
        )
    momentum, dampening = group["momentum"], group["dampening"]
    _require(
        group, is_real(momentum) and 0.0 <= momentum < 1.0, "momentum", "must be in [0.0, 1.0)"
    )
    _require(
        group, is_real(dampening) and 0.0 <= dampening < 1.0, "dampening", "must be in [0.0, 1.0)"
    )
    _require(group, isinstance(group["use_nesterov"], bool), "use_nesterov", "must be a bool")
    _require(
        group, not group["use_nesterov"] or momentum > 0.0, "use_nesterov", "needs momentum > 0.0"
    )
    _check_entry(group, "weight_decay", "Must be >= 0.0.", lambda wd: wd >= 0.0)
    _require(
        group,
        isinstance(group["weight_decay_type"], WeightDecayType),
        "weight_decay_type",
        "must be a WeightDecayType",
    )
    if group["weight_decay_type"] in _PEAK_LR_DECAY_TYPES:
        _check_entry(
            group,
            "peak_lr",
            "Must be > 0.0 when using WeightDecayType.CORRECTED or WeightDecayType.INDEPENDENT.",
            lambda peak: peak > 0.0,
        )
    else:  # unused by the other types; still a number, so that a switch of type can use it
        _check_entry(group, "peak_lr", "Must be >= 0.0.", lambda peak: peak >= 0.0)
    # The filtered gradient is an EMA with new-sample weight 1 - beta1; momentum adds whole
    # updates, so only the former limits the storage dtype.
    check_ema_storage_dtype(
        "momentum_dtype",
        group["momentum_dtype"],
        1.0 - betas[0] if betas[0] > 0.0 else 1.0,
        "1 - betas[0]",
    )


def _validate_lr(group: Mapping[str, Any]) -> None:
    _check_entry(group, "lr", "Must be >= 0.0.", lambda lr: lr >= 0.0)


def validate_changes(
    group: Mapping[str, Any], values: tuple[Any, ...], validated: tuple[Any, ...]
) -> None:
    """Re-validate ``group``, whose step entries are ``values`` (:func:`step_values`), where
    they differ from ``validated`` (the snapshot of entries that last passed
    :func:`validate_group`): nothing when none changed; the ``lr`` rule alone when only ``lr``
    did (a schedule's write each step: ``lr`` takes part in no other rule); else every rule
    (rules relate entries: ``epsilon`` and the preconditioner, the schedule's steps)."""
    changed = [k for k, new, old in zip(STEP_GROUP_KEYS, values, validated) if new != old]
    if changed == ["lr"]:
        _validate_lr(group)
    elif changed:
        validate_group(group)


def _validate_iterate_averaging(group: Mapping[str, Any]) -> None:
    """``iterate_averaging_config``, and that the deprecated momentum entries are not set with
    it."""
    config = group["iterate_averaging_config"]
    if not (config is None or isinstance(config, ITERATE_AVERAGING_CONFIG_TYPES)):
        # Another IterateAveragingConfig subclass: the reference raises NotImplementedError.
        error = UnsupportedConfigError if isinstance(config, IterateAveragingConfig) else ValueError
        raise field_error(
            "iterate_averaging_config",
            f"group[ITERATE_AVERAGING_CONFIG]={config!r} is not supported! Supported configs: "
            "ClassicMomentumConfig, GeneralizedPrimalAveragingConfig, ScheduleFreeConfig. "
            "(None: no averaging)",
            error,
        )
    legacy = (group["momentum"], group["dampening"], group["use_nesterov"]) != (0.0, 0.0, False)
    _require(
        group,
        config is None or not legacy,
        "momentum",
        "(with dampening and use_nesterov; deprecated) must keep its defaults when "
        "iterate_averaging_config is set: put them into a ClassicMomentumConfig",
    )


def _validate_schedule(group: Mapping[str, Any]) -> None:
    """The entries that decide blocks and when roots are computed."""
    _check_entry(
        group,
        "max_preconditioner_dim",
        "Must be an integer or math.inf.",
        lambda dim: is_int(dim) or dim == math.inf,
        finite=False,
    )
    _check_entry(
        group, "max_preconditioner_dim", "Must be >= 1.", lambda dim: dim >= 1, finite=False
    )
    _check_entry(group, "precondition_frequency", "Must be >= 1.", lambda f: f >= 1, integer=True)
    never = "(-1 means precondition_frequency; math.inf: never, grafting only)"
    _check_entry(
        group,
        "start_preconditioning_step",
        "Must be an integer or math.inf.",
        lambda start: is_int(start) or start == math.inf,
        finite=False,
        hint=never,
    )
    _check_entry(
        group,
        "start_preconditioning_step",
        "Must be >= -1.",
        lambda start: start >= -1,
        finite=False,
        hint=never,
    )
    # Sign and spectral descent step with frequency 1 whatever the entry says (the reference
    # writes 1 into the group before this check).
    frequency = (
        1
        if isinstance(group["preconditioner_config"], STATELESS_PRECONDITIONER_TYPES)
        else group["precondition_frequency"]
    )
    start = group["start_preconditioning_step"]
    if start != -1 and start < frequency:
        raise refuse(
            "start_preconditioning_step",
            f"Invalid param_group[START_PRECONDITIONING_STEP]={start!r}. Must be >= "
            f"param_group[PRECONDITION_FREQUENCY]={frequency!r}.",
            never,
        )
    _require(
        group,
        isinstance(group["use_bias_correction"], bool),
        "use_bias_correction",
        "must be a bool",
    )
    _require(group, isinstance(group["amortize_roots"], bool), "amortize_roots", "must be a bool")


def validate_group_keys(group: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raise ``ValueError`` naming the keys of ``group`` that DistributedShampoo does not read
    (a typo such as ``"learning_rate"`` would otherwise be ignored in silence)."""
    unknown = sorted(set(group) - set(known) - {"params", "param_names"})
    if unknown:
        raise ValueError(
            f"param group keys {unknown} are not DistributedShampoo hyperparameters (known: "
            f"{sorted(known)})"
        )


def validate_params(params: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> None:
    """Raise ``ValueError`` naming ``params[i]`` (and its name, given ``names``) for a parameter
    Shampoo cannot step: not a real dense float tensor, given twice (it would be stepped twice),
    or on another device than ``params[0]`` (a group's blocks are stacked into buckets of one
    device)."""
    first_seen: dict[int, int] = {}

    def label(i: int) -> str:
        return f"params[{i}] ({names[i]!r})" if names and i < len(names) else f"params[{i}]"

    for index, param in enumerate(params):
        if id(param) in first_seen:
            raise ValueError(
                f"{label(index)} is {label(first_seen[id(param)])} again: each parameter may "
                "appear once (it would be stepped twice)"
            )
        first_seen[id(param)] = index
        if param.device != params[0].device:
            raise ValueError(
                f"{label(index)} is on {param.device}, {label(0)} on {params[0].device}: a param "
                "group's parameters must share one device"
            )
        if param.is_complex():
            raise ValueError(
                f"{label(index)} is complex ({param.dtype}): DistributedShampoo needs real "
                "parameters"
            )
        if not param.is_floating_point():
            raise ValueError(f"{label(index)} must be a floating-point tensor, got {param.dtype}")
        if param.layout != torch.strided:
            raise ValueError(f"{label(index)} must be a dense (strided) tensor, got {param.layout}")


def step_values(group: Mapping[str, Any]) -> tuple[Any, ...]:
    """The group entries a step reads, as a comparable snapshot (a ``betas`` list as a tuple;
    anything else as it is, so that a bad value reaches the validation that names it)."""
    return tuple(
        tuple(group[k]) if k == "betas" and isinstance(group[k], list) else group[k]
        for k in STEP_GROUP_KEYS
    )


@dataclass(frozen=True)
class Hyperparameters:
    """One group's hyperparameters as a step uses them: validated, ``-1`` sentinels resolved.

    ``group_values`` is the snapshot of the group entries they were resolved from; a step
    resolves again only when the group's entries differ from it.
    """

    lr: float
    beta1: float
    beta2: float
    beta3: float
    epsilon: float
    classic_momentum: ClassicMomentumConfig | None
    primal_averaging: GeneralizedPrimalAveragingConfig | ScheduleFreeConfig | None
    weight_decay: float
    weight_decay_type: WeightDecayType
    peak_lr: float
    precondition_frequency: int
    start_preconditioning_step: int | float
    use_bias_correction: bool
    amortize_roots: bool
    momentum_dtype: torch.dtype | None
    group_values: tuple[Any, ...]

    @classmethod
    def resolve(cls, group: Mapping[str, Any]) -> Hyperparameters:
        """From a group that passed :func:`validate_group`."""
        beta1, beta2 = group["betas"]
        frequency, start = group["precondition_frequency"], group["start_preconditioning_step"]
        if isinstance(group["preconditioner_config"], STATELESS_PRECONDITIONER_TYPES):
            frequency = 1
        config = group["iterate_averaging_config"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            beta3=float(beta1 if group["beta3"] == -1.0 else group["beta3"]),
            epsilon=float(group["epsilon"]),
            classic_momentum=_classic_momentum(group),
            primal_averaging=config if isinstance(config, PRIMAL_AVERAGING_CONFIG_TYPES) else None,
            weight_decay=float(group["weight_decay"]),
            weight_decay_type=group["weight_decay_type"],
            peak_lr=float(group["peak_lr"]),
            precondition_frequency=frequency,
            start_preconditioning_step=frequency if start == -1 else start,
            use_bias_correction=group["use_bias_correction"],
            amortize_roots=group["amortize_roots"],
            momentum_dtype=group["momentum_dtype"],
            group_values=step_values(group),
        )

    def decoupled_weight_decay(self) -> float:
        """``alpha`` of step 7's ``P <- P + alpha W`` (0 for L2 decay, applied to ``G`` instead).

        ``DECOUPLED``: ``wd``; ``CORRECTED``: ``wd * lr / peak_lr`` (the decay follows the lr
        schedule twice over); ``INDEPENDENT``: ``wd / peak_lr`` (after step 8's ``lr`` factor,
        the shrinkage is ``lr / peak_lr * wd``: ``wd`` at the peak, whatever the peak is).
        """
        match self.weight_decay_type:
            case WeightDecayType.L2:
                return 0.0
            case WeightDecayType.DECOUPLED:
                return self.weight_decay
            case WeightDecayType.CORRECTED:
                return self.weight_decay * self.lr / self.peak_lr
            case WeightDecayType.INDEPENDENT:
                return self.weight_decay / self.peak_lr
        raise ValueError(f"weight_decay_type: unsupported {self.weight_decay_type!r}")

    def buffers_needed(self) -> dict[str, bool]:
        """Which per-bucket buffers of :class:`GroupRuntime` a step with these values uses."""
        filtering = self.beta1 > 0.0
        return {
            # Parameter copies: for weight decay, and for primal averaging's y.
            "params": self.weight_decay > 0.0 or self.primal_averaging is not None,
            "filtered": filtering,
            "filtered_out": filtering
            and (
                self.beta3 != self.beta1
                or self.use_bias_correction
                or self.momentum_dtype is not None
            ),
            "momentum": self.classic_momentum is not None,
            "weights": self.primal_averaging is not None,
        }


def _classic_momentum(group: Mapping[str, Any]) -> ClassicMomentumConfig | None:
    """The group's ``ClassicMomentumConfig``: its ``iterate_averaging_config``, or the one the
    deprecated ``momentum``/``dampening``/``use_nesterov`` entries map onto (the constructor
    warns about them)."""
    config = group["iterate_averaging_config"]
    if isinstance(config, ClassicMomentumConfig):
        return config
    if group["momentum"] == 0.0:
        return None
    return ClassicMomentumConfig(
        momentum=float(group["momentum"]),
        dampening=float(group["dampening"]),
        use_nesterov=group["use_nesterov"],
    )


def check_ordered_params(name: str, params: object) -> None:
    """Raise ``TypeError`` for a set of parameters (torch itself lets a frozenset through)."""
    if isinstance(params, (set, frozenset)):
        raise TypeError(
            f"{name} must be an ordered collection (a list, or model.parameters()), got a "
            f"{type(params).__name__}: a set's order changes between runs, and with it the "
            "blocks and the state dict"
        )


def validate_device_kind(
    params: Sequence[torch.Tensor], param_groups: Sequence[Mapping[str, Any]]
) -> None:
    """Raise ``ValueError`` when the newest group (``param_groups[-1]``, holding ``params``) mixes
    meta parameters (shapes without data) with real ones of the first group that has parameters
    (groups may be empty): a step adds up every group's gradient check on one device."""
    if not params:
        return
    index, first = next((i, g["params"][0]) for i, g in enumerate(param_groups) if g["params"])
    if params[0].is_meta != first.is_meta:
        raise ValueError(
            f"params[0] of param_groups[{len(param_groups) - 1}] is on {params[0].device}, "
            f"param_groups[{index}]'s on {first.device}: meta and real parameters cannot be mixed"
        )


def write_back_sentinels(group: dict[str, Any]) -> None:
    """Write into a new, validated ``group`` the values its sentinels stand for, as the reference
    library does when a group is added: ``beta3`` -1 becomes ``betas[0]`` and
    ``start_preconditioning_step`` -1 becomes ``precondition_frequency``; under sign or spectral
    descent (stateless: ``betas[1]``, ``epsilon`` and ``precondition_frequency`` have no effect, and
    each is logged as a warning) ``precondition_frequency`` becomes 1 first."""
    config = group["preconditioner_config"]
    if isinstance(config, STATELESS_PRECONDITIONER_TYPES):
        name = type(config).__name__
        for entry, value in (("BETAS][1", group["betas"][1]), ("EPSILON", group["epsilon"])):
            logger.warning(
                f"param_group[{entry}]={value!r} does not have any effect when {name} is used."
            )
        logger.warning(
            f"param_group[PRECONDITION_FREQUENCY]={group['precondition_frequency']!r} does not "
            "have "
            f"any effect when {name} is used. Setting precondition_frequency to 1..."
        )
        group["precondition_frequency"] = 1
    if group["beta3"] == -1.0:
        group["beta3"] = group["betas"][0]
    if group["start_preconditioning_step"] == -1:
        group["start_preconditioning_step"] = group["precondition_frequency"]


def check_grads(
    labels: Sequence[str], params: Sequence[torch.Tensor], eager_nan_check: bool = False
) -> None:
    """Raise ``ValueError`` naming the parameter (``labels[i]``) for a gradient Shampoo cannot
    use: sparse, of another shape than its parameter (torch refuses to assign one, but
    ``grad.data = ...`` gets through), or not real floating point. About 1 us per parameter.

    With ``eager_nan_check`` (``ShampooRuntimeConfig``), also raise ``NonFiniteGradientError``
    naming the first parameter whose gradient (its local shard under FSDP) holds NaN or Inf:
    one host sync per parameter.
    """
    for label, param in zip(labels, params):
        grad = param.grad
        if grad is None:
            continue
        if grad.layout != torch.strided:
            raise ValueError(
                f"the gradient of {label} is {grad.layout}: DistributedShampoo needs dense "
                "gradients"
            )
        if grad.shape != param.shape:
            raise ValueError(
                f"the gradient of {label} has shape {tuple(grad.shape)}: DistributedShampoo needs "
                "a "
                "gradient of its parameter's shape"
            )
        if not grad.is_floating_point():  # complex dtypes are not floating point
            raise ValueError(
                f"the gradient of {label} has dtype {grad.dtype}: DistributedShampoo needs real "
                "floating-point gradients"
            )
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if eager_nan_check and not bool(torch.isfinite(local).all()):
            raise NonFiniteGradientError(
                f"non-finite gradient (NaN or Inf) in {label} (eager_nan_check); no parameter or "
                "state was changed"
            )
