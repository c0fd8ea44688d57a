"""``DistributedShampoo``: the optimizer that wires blocks, preconditioners and distributors.

One step for a block (``t`` 1-based, ``s`` = start_preconditioning_step, ``f`` = frequency):

1. L2 decay only: ``G <- G + wd W``.
2. Preconditioner statistics from ``G`` every step (Shampoo: factor matrices).
3. Grafting statistics from ``G`` every step.
4. Roots when ``(t % f == 0 and t > s) or t == s``. With ``amortize_roots`` (a different,
   deterministic schedule that spreads the work, so no step carries every root): all roots at
   ``t == s``; at each ``t > s`` the roots of share ``t % f`` (a fixed assignment of the
   factors to ``f`` shares balanced by ``n^3``, :meth:`KroneckerFactors.share_rows`), from the
   factors of step ``t``. Every root is still recomputed once per ``f`` steps from the factors
   of the step that solves it, but roots of different shares come from different steps, so the
   parameters differ from the all-at-once schedule (not bit-identical). Making it exact would
   mean snapshotting all factors at the scheduled step (one more copy of the factor state) and
   applying the roots one period later, which is a third schedule anyway. With a large-factor
   rule (``large_factor_dim``, multiplier ``m`` of ``ShampooPreconditionerConfig``) the
   factors of at least that size are solved only every ``m`` periods (at multiples of
   ``f m``), or, amortized, in share ``t % (f m)`` of ``f m`` shares of their own. Under DDP
   each rank assigns shares over the factors it owns.
5. Filtered gradient ``M <- b1 M + (1 - b1) G``; ``Gbar = M / (1 - b1^t)`` with bias
   correction (``beta3 != beta1``: ``Gbar = (b3 M_old + (1 - b3) G) / (1 - b3 b1^(t-1))``).
6. ``t >= s``: ``P = P_s * ||P_g|| / (||P_s|| + 1e-16)`` per block (``P_s`` the
   preconditioner's direction, ``P_g`` grafting's); no grafting: ``P = P_s``. ``t < s``:
   ``P = P_g`` (no grafting: ``Gbar``).
7. Decoupled decay ``P <- P + wd W``; momentum ``B <- mu B + (1 - dampening) P`` and
   ``P <- B`` (Nesterov: ``P <- P + mu B``).
8. ``W <- W - lr P`` (through the distributor).

Blocks with the same shape are stacked into buckets and processed by batched kernels
(``baddbmm``/``bmm``/``_foreach_*``; one ``eigh`` per factor size); the buffers a group's
hyperparameters need are allocated when the group is added.

A step is all or nothing. Before anything moves it checks, for every group: the
hyperparameters (re-validated every step, so that a scheduler's ``lr = inf`` is refused), that
the entries fixed at construction are unchanged (``params``, ``max_preconditioner_dim``,
``preconditioner_config``, ``grafting_config``, ``distributed_config``, ``momentum_dtype``: they decide the blocks,
which rank holds them and the layout of their state), and that every gradient is dense, real
and of its parameter's shape; a failure raises ``ValueError`` naming the field or parameter.
Then one fused finiteness check over all gradients: with ``nonfinite_grad_policy="raise"``
(default) it raises :class:`NonFiniteGradientError` naming the parameters; with ``"skip"`` it
logs a warning and skips the step (parameters, state and step counter unchanged).

Changed hyperparameters apply from the next step. The ``-1`` sentinels (``beta3``,
``start_preconditioning_step``) are resolved when a group is added and again only when one of
its entries changes; ``param_groups`` and ``state_dict`` keep the user's values. State follows
the hyperparameters in use: momentum (``momentum > 0``) and the filtered gradient
(``betas[0] > 0``) start from zero when turned on and are dropped when turned off; a change of
``betas[1]``, ``epsilon`` or ``use_bias_correction`` rebuilds the preconditioner for the new
values and carries every block's state over, as a checkpoint round trip would.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanoshampoo.optim.shampoo.distributor.distributor import Distributor
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import (
    BlockBucket,
    BlockStateView,
    Preconditioner,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    GRAFTING_CONFIG_TYPES,
    check_ema_storage_dtype,
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    FullyShardDistributedConfig,
    HybridShardDistributedConfig,
    DefaultShampooConfig,
    DefaultSingleDeviceDistributedConfig,
    DistributedConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    NonFiniteGradientError,
    PreconditionerConfig,
    PseudoInverseConfig,
    RMSpropPreconditionerConfig,
    SGDPreconditionerConfig,
    ShampooPreconditionerConfig,
    SingleDeviceDistributedConfig,
    SpectralDescentPreconditionerConfig,
    WeightDecayType,
)

logger = logging.getLogger(__name__)

NONFINITE_GRAD_POLICIES = ("raise", "skip")
_GRAFTING_NORM_EPSILON = 1e-16
# Group entries fixed when the group is added: they decide the blocks, which rank holds them and
# the layout of their state. A change after construction (or from a checkpoint) is refused.
_FIXED_KEYS = (
    "max_preconditioner_dim", "preconditioner_config", "grafting_config", "distributed_config",
    "momentum_dtype",
)
# Group entries a step reads; changing them between steps is supported.
_STEP_KEYS = (
    "lr", "betas", "beta3", "epsilon", "momentum", "dampening", "use_nesterov", "weight_decay",
    "weight_decay_type", "precondition_frequency", "start_preconditioning_step",
    "use_bias_correction", "amortize_roots",
)
# Block state entries that exist only while the hyperparameters use them.
_OPTIONAL_BLOCK_STATE = ("filtered_grad", "momentum")


def build_preconditioner(
    config: PreconditionerConfig,
    buckets: Sequence[BlockBucket],
    beta2: float,
    epsilon: float,
    use_bias_correction: bool,
) -> Preconditioner:
    """The preconditioner a config describes, over ``buckets``.

    ``beta2``/``epsilon``/``use_bias_correction`` are the group's and apply to both Shampoo
    kinds (root-inverse and eigenvalue-corrected); spectral descent uses none of them; the
    diagonal preconditioners carry their own ``beta2``/``epsilon`` and bias-correction rule
    (Adam corrects, RMSprop and AdaGrad do not). The module of each kind is imported when a
    config needs it, like the distributors' (:func:`build_distributor`).
    """
    if isinstance(config, ShampooPreconditionerConfig):
        from nanoshampoo.optim.shampoo.preconditioner.shampoo_preconditioner import (
            ShampooPreconditioner,
        )

        return ShampooPreconditioner(buckets, config, beta2, epsilon, use_bias_correction)
    if isinstance(config, EigenvalueCorrectedShampooPreconditionerConfig):
        from nanoshampoo.optim.shampoo.preconditioner.eigenvalue_corrected_shampoo_preconditioner import (
            EigenvalueCorrectedShampooPreconditioner,
        )

        return EigenvalueCorrectedShampooPreconditioner(
            buckets, config, beta2, epsilon, use_bias_correction
        )
    if isinstance(config, SpectralDescentPreconditionerConfig):
        from nanoshampoo.optim.shampoo.preconditioner.spectral_descent_preconditioner import (
            SpectralDescentPreconditioner,
        )

        return SpectralDescentPreconditioner(buckets, config)
    if isinstance(config, SGDPreconditionerConfig):
        from nanoshampoo.optim.shampoo.preconditioner.sgd_preconditioner import SGDPreconditioner

        return SGDPreconditioner(buckets)
    from nanoshampoo.optim.shampoo.preconditioner.adagrad_preconditioner import (
        AdaGradPreconditioner,
    )

    if isinstance(config, AdamPreconditionerConfig):
        return AdaGradPreconditioner(
            buckets, config.beta2, config.epsilon, True, config.second_moment_dtype
        )
    if isinstance(config, RMSpropPreconditionerConfig):
        return AdaGradPreconditioner(
            buckets, config.beta2, config.epsilon, False, config.second_moment_dtype
        )
    if isinstance(config, AdaGradPreconditionerConfig):
        return AdaGradPreconditioner(buckets, 1.0, config.epsilon, False, config.second_moment_dtype)
    raise ValueError(f"preconditioner_config: unsupported config {config!r}")


def build_distributor(
    config: DistributedConfig,
    params: Sequence[torch.Tensor],
    max_preconditioner_dim: int | float,
    first_param_index: int,
) -> Distributor:
    """The distributor a config describes, for one parameter group.

    One branch per kind of ``DistributedConfig``; a config class that subclasses another must
    be tested before its parent. Whatever is built here must implement :class:`Distributor`:
    the optimizer talks to it through that interface only. Each distributor module is imported
    here, when a config needs it: a run imports (and its log records the source of) only the
    one it uses.
    """
    if isinstance(config, SingleDeviceDistributedConfig):
        from nanoshampoo.optim.shampoo.distributor.single_device_distributor import (
            SingleDeviceDistributor,
        )

        return SingleDeviceDistributor(params, max_preconditioner_dim, first_param_index)
    if isinstance(config, DDPDistributedConfig):
        from nanoshampoo.optim.shampoo.distributor.ddp_distributor import DDPDistributor

        return DDPDistributor(params, max_preconditioner_dim, first_param_index, config)
    if isinstance(config, FullyShardDistributedConfig):
        from nanoshampoo.optim.shampoo.distributor.fully_shard_distributor import (
            FullyShardDistributor,
        )

        return FullyShardDistributor(params, max_preconditioner_dim, first_param_index, config)
    if isinstance(config, HybridShardDistributedConfig):
        from nanoshampoo.optim.shampoo.distributor.hybrid_shard_distributor import (
            HybridShardDistributor,
        )

        return HybridShardDistributor(params, max_preconditioner_dim, first_param_index, config)
    raise ValueError(f"distributed_config: unsupported config {config!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


def uses_pseudo_inverse(config: PreconditionerConfig) -> bool:
    """Whether ``config`` drops numerically-zero eigenvalues (then ``epsilon`` must be 0)."""
    solver = getattr(config, "amortized_computation_config", None)
    return isinstance(getattr(solver, "rank_deficient_stability_config", None), PseudoInverseConfig)


def validate_group(group: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` (message starting with the field name) for an invalid group entry.

    Checks every entry but ``params`` (see :func:`validate_params`); cheap Python only, so
    :meth:`DistributedShampoo.step` runs it on every group at every step.
    """

    def check(ok: bool, name: str, requirement: str) -> None:
        if not ok:
            raise ValueError(f"{name} {requirement}, got {group.get(name.split('[')[0])!r}")

    config = group["preconditioner_config"]
    check(isinstance(config, PreconditionerConfig), "preconditioner_config", "must be a PreconditionerConfig")
    grafting = group["grafting_config"]
    check(
        grafting is None or isinstance(grafting, GRAFTING_CONFIG_TYPES),
        "grafting_config",
        "must be None or an SGD/AdaGrad/RMSprop/Adam PreconditionerConfig",
    )
    check(isinstance(group["distributed_config"], DistributedConfig), "distributed_config", "must be a DistributedConfig")
    lr, betas, beta3, eps = group["lr"], group["betas"], group["beta3"], group["epsilon"]
    check(_is_finite_number(lr) and lr >= 0.0, "lr", "must be finite and >= 0.0")
    check(isinstance(betas, (tuple, list)) and len(betas) == 2, "betas", "must be a pair (beta1, beta2)")
    check(_is_number(betas[0]) and 0.0 <= betas[0] < 1.0, "betas[0]", "must be in [0.0, 1.0)")
    check(_is_number(betas[1]) and 0.0 < betas[1] <= 1.0, "betas[1]", "must be in (0.0, 1.0]")
    check(_is_number(beta3) and (beta3 == -1.0 or 0.0 <= beta3 < 1.0), "beta3", "must be -1.0 or in [0.0, 1.0)")
    check(_is_finite_number(eps) and eps >= 0.0, "epsilon", "must be finite and >= 0.0")
    if uses_pseudo_inverse(config):
        check(eps == 0.0, "epsilon", "must be 0.0 with a PseudoInverseConfig (the pseudo-inverse adds no ridge)")
    else:
        check(eps > 0.0, "epsilon", "must be > 0.0 (0.0 only with a PseudoInverseConfig rank_deficient_stability_config)")
    momentum, dampening = group["momentum"], group["dampening"]
    check(_is_number(momentum) and 0.0 <= momentum < 1.0, "momentum", "must be in [0.0, 1.0)")
    check(_is_number(dampening) and 0.0 <= dampening < 1.0, "dampening", "must be in [0.0, 1.0)")
    check(isinstance(group["use_nesterov"], bool), "use_nesterov", "must be a bool")
    check(not group["use_nesterov"] or momentum > 0.0, "use_nesterov", "needs momentum > 0.0")
    wd = group["weight_decay"]
    check(_is_finite_number(wd) and wd >= 0.0, "weight_decay", "must be finite and >= 0.0")
    check(isinstance(group["weight_decay_type"], WeightDecayType), "weight_decay_type", "must be a WeightDecayType")
    max_dim = group["max_preconditioner_dim"]
    check(
        (_is_int(max_dim) and max_dim >= 1) or max_dim == math.inf,
        "max_preconditioner_dim",
        "must be an int >= 1 or math.inf",
    )
    frequency, start = group["precondition_frequency"], group["start_preconditioning_step"]
    check(_is_int(frequency) and frequency >= 1, "precondition_frequency", "must be an int >= 1")
    check(
        _is_int(start) and (start == -1 or start >= frequency),
        "start_preconditioning_step",
        f"must be -1 or an int >= precondition_frequency ({frequency})",
    )
    check(isinstance(group["use_bias_correction"], bool), "use_bias_correction", "must be a bool")
    check(isinstance(group["amortize_roots"], bool), "amortize_roots", "must be a bool")
    # The filtered gradient is an EMA with new-sample weight 1 - beta1; momentum adds whole
    # updates, so only the former limits the storage dtype.
    check_ema_storage_dtype(
        "momentum_dtype", group["momentum_dtype"], 1.0 - betas[0] if betas[0] > 0.0 else 1.0,
        "1 - betas[0]",
    )


def validate_params(params: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming ``params[i]`` for a parameter Shampoo cannot step."""
    for index, param in enumerate(params):
        if param.is_complex():
            raise ValueError(f"params[{index}] is complex ({param.dtype}): DistributedShampoo needs real parameters")
        if not param.is_floating_point():
            raise ValueError(f"params[{index}] must be a floating-point tensor, got {param.dtype}")
        if param.layout != torch.strided:
            raise ValueError(f"params[{index}] must be a dense (strided) tensor, got {param.layout}")


def _step_values(group: Mapping[str, Any]) -> tuple[Any, ...]:
    """The group entries a step reads, as a comparable snapshot (``betas`` as a tuple)."""
    return tuple(tuple(group[k]) if k == "betas" else group[k] for k in _STEP_KEYS)


@dataclass(frozen=True)
class _Hyperparameters:
    """One group's hyperparameters as a step uses them: validated, ``-1`` sentinels resolved.

    ``group_values`` is the snapshot of the group entries they were resolved from; a step
    resolves again only when the group's entries differ from it.
    """

    lr: float
    beta1: float
    beta2: float
    beta3: float
    epsilon: float
    momentum: float
    dampening: float
    use_nesterov: bool
    weight_decay: float
    weight_decay_type: WeightDecayType
    precondition_frequency: int
    start_preconditioning_step: int
    use_bias_correction: bool
    amortize_roots: bool
    momentum_dtype: torch.dtype | None
    group_values: tuple[Any, ...]

    @classmethod
    def resolve(cls, group: Mapping[str, Any]) -> _Hyperparameters:
        """From a group that passed :func:`validate_group`."""
        beta1, beta2 = group["betas"]
        frequency, start = group["precondition_frequency"], group["start_preconditioning_step"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            beta3=float(beta1 if group["beta3"] == -1.0 else group["beta3"]),
            epsilon=float(group["epsilon"]),
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            use_nesterov=group["use_nesterov"],
            weight_decay=float(group["weight_decay"]),
            weight_decay_type=group["weight_decay_type"],
            precondition_frequency=frequency,
            start_preconditioning_step=frequency if start == -1 else start,
            use_bias_correction=group["use_bias_correction"],
            amortize_roots=group["amortize_roots"],
            momentum_dtype=group["momentum_dtype"],
            group_values=_step_values(group),
        )

    def buffers_needed(self) -> dict[str, bool]:
        """Which per-bucket buffers of :class:`_GroupRuntime` a step with these values uses."""
        filtering = self.beta1 > 0.0
        return {
            "params": self.weight_decay > 0.0,
            "filtered": filtering,
            "filtered_out": filtering
            and (self.beta3 != self.beta1 or self.use_bias_correction or self.momentum_dtype is not None),
            "momentum": self.momentum > 0.0,
        }


class _GroupRuntime:
    """Everything one parameter group needs per step: buckets, buffers, preconditioners.

    Block order: ``local`` = the distributor's local blocks; each bucket lists the local
    indices of its blocks. All per-bucket tensors are ``(B, *shape)``; the buffers the
    hyperparameters need are allocated in :meth:`configure` (at construction, and again only
    when a hyperparameter change needs other buffers).

    A step is :meth:`plan` (validate, change nothing), :meth:`check_grads`,
    :meth:`gather_grads`, then, once every group passed, :meth:`configure` and
    :meth:`apply_step`.
    """

    def __init__(self, group: dict[str, Any], group_index: int, first_param_index: int) -> None:
        self.step = 0
        self._fixed = {key: group[key] for key in _FIXED_KEYS}
        self._params = tuple(group["params"])
        self.distributor = build_distributor(
            group["distributed_config"], group["params"], group["max_preconditioner_dim"], first_param_index
        )
        names = group.get("param_names")
        offsets = self.distributor.local_block_param_offsets
        # Whether the group steps depends on every blocked parameter, not only the local ones,
        # so that all ranks of a DDP group take part in the same exchanges.
        self._blocked_params = tuple(
            {id(info.param): info.param for info in self.distributor.global_block_info_list}.values()
        )
        self.block_infos = self.distributor.local_block_info_list
        blocked_params = self.distributor.local_blocked_params
        self.param_labels = [
            f"{names[o]!r} (shape {tuple(group['params'][o].shape)})" if names else
            f"param_groups[{group_index}]['params'][{o}] (shape {tuple(group['params'][o].shape)})"
            for o in range(len(group["params"]))
        ]
        self.local_block_offsets = offsets
        self.buckets, self.bucket_members = self._make_buckets(blocked_params, offsets)
        # (bucket index, position in the bucket) of each local block.
        self._bucket_positions = [(0, 0)] * len(self.block_infos)
        for k, members in enumerate(self.bucket_members):
            for position, i in enumerate(members):
                self._bucket_positions[i] = (k, position)
        hyperparameters = _Hyperparameters.resolve(group)
        self.hyperparameters = hyperparameters
        self.preconditioner = self._build_preconditioner(hyperparameters)
        grafting = group["grafting_config"]
        # The diagonal grafting preconditioners carry their own beta2 and epsilon.
        self.grafting = None if grafting is None else build_preconditioner(
            grafting, self.buckets, hyperparameters.beta2, hyperparameters.epsilon, False
        )
        self.grads = [b.zeros() for b in self.buckets]
        self.updates = [b.zeros() for b in self.buckets]
        self.params: list[torch.Tensor] = []
        self.filtered: list[torch.Tensor] = []
        self.filtered_out: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor] = []
        self._param_slices: list[list[torch.Tensor]] = []
        self._allocate_buffers(hyperparameters)
        self.block_states = [self._block_state(i) for i in range(len(self.block_infos))]
        # Per-block views, built once: parameter blocks per bucket, and each local block's
        # slice of the update buffers (in local block order, as the distributor expects).
        self._bucket_param_views = [self._in_bucket_order(blocked_params, k) for k in range(len(self.buckets))]
        self._local_updates: list[torch.Tensor] = [torch.empty(0)] * len(self.block_infos)
        for k, buffer in enumerate(self.updates):
            for position, i in enumerate(self.bucket_members[k]):
                self._local_updates[i] = buffer[position]

    def _build_preconditioner(self, hyperparameters: _Hyperparameters) -> Preconditioner:
        return build_preconditioner(
            self._fixed["preconditioner_config"],
            self.buckets,
            hyperparameters.beta2,
            hyperparameters.epsilon,
            hyperparameters.use_bias_correction,
        )

    def plan(self, group: Mapping[str, Any]) -> _Hyperparameters:
        """Validate ``group`` for this runtime and return the hyperparameters of its next step.

        Changes nothing. Raises ``ValueError`` naming the field for an invalid entry, or for an
        entry fixed at construction (``params`` and ``_FIXED_KEYS``) that differs.
        """
        validate_group(group)
        for key, built in self._fixed.items():
            value = group[key]
            if value is not built and value != built:
                raise ValueError(
                    f"{key} cannot change after the group is added (it decides the blocks and "
                    f"the layout of their state): built with {built!r}, got {value!r}"
                )
        params = group["params"]
        if len(params) != len(self._params) or any(p is not q for p, q in zip(params, self._params)):
            raise ValueError(
                "params cannot change after the group is added; add a new group with add_param_group"
            )
        if _step_values(group) == self.hyperparameters.group_values:
            return self.hyperparameters
        return _Hyperparameters.resolve(group)

    def configure(self, hyperparameters: _Hyperparameters) -> bool:
        """Make the buffers and the preconditioner match ``hyperparameters`` (from :meth:`plan`).

        Returns whether :attr:`block_states` were rebuilt (the optimizer then re-registers
        them). A new ``beta2``/``epsilon``/``use_bias_correction`` builds a new preconditioner
        and loads every block's state into it: the preconditioners take these values at
        construction, and a block's state is everything a checkpoint needs. This briefly holds
        the preconditioner state twice.
        """
        old = self.hyperparameters
        rebuilt = (old.beta2, old.epsilon, old.use_bias_correction) != (
            hyperparameters.beta2,
            hyperparameters.epsilon,
            hyperparameters.use_bias_correction,
        )
        if rebuilt:
            preconditioner = self._build_preconditioner(hyperparameters)
            for k, bucket in enumerate(self.buckets):
                for position in range(bucket.num_blocks):
                    state = self.preconditioner.block_state(k, position)
                    if state is not None:
                        preconditioner.block_state(k, position).load_state_dict(state.state_dict())
            self.preconditioner = preconditioner
        reallocated = self._allocate_buffers(hyperparameters)
        self.hyperparameters = hyperparameters
        if rebuilt or reallocated:
            self.block_states = [self._block_state(i) for i in range(len(self.block_infos))]
        return rebuilt or reallocated

    def _allocate_buffers(self, hyperparameters: _Hyperparameters) -> bool:
        """Zero-filled buffers where ``hyperparameters`` need one, none where they do not.

        Returns whether any buffer was added or dropped.
        """
        if not self.buckets:  # a DDP rank that owns no block: nothing to hold
            return False
        changed = False
        state_dtype = hyperparameters.momentum_dtype
        for name, needed in hyperparameters.buffers_needed().items():
            present = bool(getattr(self, name))
            if needed != present:
                dtypes = [
                    (state_dtype if name in ("filtered", "momentum") and state_dtype else b.dtype)
                    for b in self.buckets
                ]
                setattr(
                    self,
                    name,
                    [
                        torch.zeros(b.stacked_shape, dtype=dtype, device=b.device)
                        for b, dtype in zip(self.buckets, dtypes)
                    ]
                    if needed
                    else [],
                )
                changed = True
        self._param_slices = [list(buffer.unbind(0)) for buffer in self.params]
        return changed

    def expected_block_state(
        self, local_index: int, hyperparameters: _Hyperparameters
    ) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Flat state keys (``block_j.<path>``) of a local block under ``hyperparameters``,
        each with the shape and dtype a checkpoint must hold for it."""
        _, block_name = self.block_infos[local_index].composable_block_ids
        entries = {
            key: (value.shape, value.dtype)
            for key, value in _flatten(self.block_states[local_index].state_dict(), block_name).items()
            if key.split(".")[1] not in _OPTIONAL_BLOCK_STATE
        }
        k, _ = self._bucket_positions[local_index]
        bucket = self.buckets[k]
        needed = hyperparameters.buffers_needed()
        for entry, buffer in zip(_OPTIONAL_BLOCK_STATE, ("filtered", "momentum")):
            if needed[buffer]:
                dtype = hyperparameters.momentum_dtype or bucket.dtype
                entries[f"{block_name}.{entry}"] = (torch.Size(bucket.shape), dtype)
        return entries

    def check_grads(self) -> None:
        """Raise ``ValueError`` naming the parameter for a gradient Shampoo cannot use.

        About 1 us per parameter (torch itself refuses a ``.grad`` of another shape).
        """
        for label, param in zip(self.param_labels, self._params):
            grad = param.grad
            if grad is None:
                continue
            if grad.layout != torch.strided:
                raise ValueError(
                    f"the gradient of {label} is {grad.layout}: DistributedShampoo needs dense gradients"
                )
            if not grad.is_floating_point():  # complex dtypes are not floating point
                raise ValueError(
                    f"the gradient of {label} has dtype {grad.dtype}: DistributedShampoo needs "
                    "real floating-point gradients"
                )

    def _make_buckets(
        self, blocked_params: Sequence[torch.Tensor], offsets: Sequence[int]
    ) -> tuple[list[BlockBucket], list[list[int]]]:
        members: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[int]] = {}
        for index, view in enumerate(blocked_params):
            dtype = torch.promote_types(view.dtype, torch.float32)
            members.setdefault((tuple(view.shape), dtype, view.device), []).append(index)
        buckets = []
        for (shape, dtype, device), indices in members.items():
            labels = tuple(
                f"{self.param_labels[offsets[i]]} {self.block_infos[i].composable_block_ids[1]}" for i in indices
            )
            buckets.append(BlockBucket(shape, dtype, device, labels))
        return buckets, list(members.values())

    def _block_state(self, local_index: int) -> BlockStateView:
        bucket_index, position = self._bucket_positions[local_index]
        entries: dict[str, Any] = {}
        main = self.preconditioner.block_state(bucket_index, position)
        if main is not None:
            entries[self.preconditioner.name] = main
        if self.grafting is not None:
            grafting = self.grafting.block_state(bucket_index, position)
            if grafting is not None:
                entries["grafting"] = grafting
        if self.filtered:
            entries["filtered_grad"] = self.filtered[bucket_index][position]
        if self.momentum:
            entries["momentum"] = self.momentum[bucket_index][position]
        return BlockStateView(**entries)

    def _in_bucket_order(self, items: Sequence[Any], bucket_index: int) -> list[Any]:
        return [items[i] for i in self.bucket_members[bucket_index]]

    def gather_grads(self) -> list[bool] | None:
        """Copy this step's block gradients into the bucket buffers.

        Returns the per-local-block "has a gradient" mask, or None when no block of the group
        (on any rank) has one.
        """
        if all(param.grad is None for param in self._blocked_params):
            return None
        grads = self.distributor.local_blocked_grads()
        present = [g is not None for g in grads]
        for k, buffer in enumerate(self.grads):
            targets, sources = [], []
            for position, i in enumerate(self.bucket_members[k]):
                if grads[i] is None:
                    buffer[position].zero_()
                else:
                    targets.append(buffer[position])
                    sources.append(grads[i])
            if targets:
                torch._foreach_copy_(targets, sources)
        return present

    def grad_sum(self) -> torch.Tensor:
        """Float64 sum of the group's gradients: finite iff every entry is (barring overflow).

        The distributor adds the local sums over the ranks that hold the group's blocks, so every
        rank sees every block (collective under DDP).
        """
        total = torch.zeros((), dtype=torch.float64, device=self._blocked_params[0].device)
        for buffer in self.grads:
            total += buffer.sum(dtype=torch.float64)
        self.distributor.all_reduce_grad_sum_(total)
        return total

    def state_bytes(self) -> int:
        """Bytes of this rank's per-block optimizer state (what :meth:`state_dict` holds)."""
        return sum(
            tensor.numel() * tensor.element_size()
            for state in self.block_states
            for tensor in _flatten(state.state_dict()).values()
        )

    def nonfinite_param_labels(self) -> list[str]:
        """Labels of the parameters whose gradient holds NaN/Inf (slow; only after a failed check)."""
        bad = set()
        for k, buffer in enumerate(self.grads):
            finite = torch.isfinite(buffer).flatten(1).all(dim=1).tolist()
            bad.update(self.local_block_offsets[i] for i, ok in zip(self.bucket_members[k], finite) if not ok)
        return [self.param_labels[o] for o in sorted(bad)]

    def apply_step(self, present: list[bool]) -> None:
        """Steps 1-8 of the module docstring for every local block, then the distributor update.

        Uses :attr:`hyperparameters` (set by :meth:`configure`); ``present`` is
        :meth:`gather_grads`' mask.
        """
        if not self.block_infos:
            # A DDP rank that owns no block still takes part in the exchange.
            self.step += 1
            self.distributor.update_params([])
            return
        # Blocks without a gradient this step (zeros in the gradient buffer) are stepped with
        # the others and rolled back afterwards, rather than left out: a bucket is processed by
        # batched kernels over all of its blocks (one baddbmm per bucket, one eigh per factor
        # size), and under DDP every rank must enter the same exchanges with the same buffers.
        # So their state is saved here, restored after the step, and their update is zero.
        missing = [i for i, has in enumerate(present) if not has]
        saved = {i: _clone_tree(self.block_states[i].state_dict()) for i in missing}
        self.step += 1
        t = self.step
        h = self.hyperparameters
        wd, decay_type = h.weight_decay, h.weight_decay_type
        frequency, start = h.precondition_frequency, h.start_preconditioning_step
        grads = self.grads
        if wd > 0.0:
            for slices, views in zip(self._param_slices, self._bucket_param_views):
                torch._foreach_copy_(slices, views)
            if decay_type == WeightDecayType.L2:
                torch._foreach_add_(grads, self.params, alpha=wd)

        self.preconditioner.update_statistics(grads, t)
        if self.grafting is not None:
            self.grafting.update_statistics(grads, t)
        if t == start:
            self.preconditioner.amortized_computation(t)
        elif t > start and h.amortize_roots:
            self.preconditioner.amortized_computation(t, t % frequency, frequency, t // frequency)
        elif t > start and t % frequency == 0:
            self.preconditioner.amortized_computation(t, period=t // frequency)

        filtered = self._filtered_grads(t)
        if t >= start:
            directions = self.preconditioner.precondition(filtered, t)
            if self.grafting is not None:
                self._graft(directions, self.grafting.precondition(filtered, t))
            else:
                torch._foreach_copy_(self.updates, directions)
        else:
            source = filtered if self.grafting is None else self.grafting.precondition(filtered, t)
            torch._foreach_copy_(self.updates, source)

        if wd > 0.0 and decay_type == WeightDecayType.DECOUPLED:
            torch._foreach_add_(self.updates, self.params, alpha=wd)
        momentum = h.momentum
        if momentum > 0.0:
            torch._foreach_mul_(self.momentum, momentum)
            torch._foreach_add_(self.momentum, self.updates, alpha=1.0 - h.dampening)
            if h.use_nesterov:
                torch._foreach_add_(self.updates, self.momentum, alpha=momentum)
            else:
                torch._foreach_copy_(self.updates, self.momentum)
        torch._foreach_mul_(self.updates, -h.lr)

        for i in missing:
            self._local_updates[i].zero_()
            self.block_states[i].load_state_dict(saved[i])
        self.distributor.update_params(self._local_updates)

    def _filtered_grads(self, t: int) -> list[torch.Tensor]:
        h = self.hyperparameters
        beta1, beta3 = h.beta1, h.beta3
        if beta1 == 0.0:
            return self.grads
        if beta3 != beta1:
            # The current-step average uses beta3 on the previous M, before M itself moves.
            torch._foreach_copy_(self.filtered_out, self.filtered)
            torch._foreach_lerp_(self.filtered_out, self.grads, 1.0 - beta3)
        if h.momentum_dtype is None:
            torch._foreach_lerp_(self.filtered, self.grads, 1.0 - beta1)
            updated = self.filtered
        else:
            # M is stored narrower: update it in the (still free) update buffers in the
            # computation dtype and round it once into storage; this step uses the unrounded M.
            torch._foreach_copy_(self.updates, self.filtered)
            torch._foreach_lerp_(self.updates, self.grads, 1.0 - beta1)
            torch._foreach_copy_(self.filtered, self.updates)
            updated = self.updates
        if beta3 == beta1 and not h.use_bias_correction and h.momentum_dtype is None:
            return self.filtered
        source = updated if beta3 == beta1 else self.filtered_out
        correction = 1.0 - beta3 * beta1 ** (t - 1) if h.use_bias_correction else 1.0
        for out, value in zip(self.filtered_out, source):
            torch.div(value, correction, out=out)
        return self.filtered_out

    def _graft(self, directions: Sequence[torch.Tensor], grafted: Sequence[torch.Tensor]) -> None:
        """``updates = P_s * ||P_g|| / (||P_s|| + 1e-16)``, norms per block."""
        for out, direction, graft in zip(self.updates, directions, grafted):
            dims = tuple(range(1, direction.dim()))
            scale = torch.linalg.vector_norm(graft, dim=dims) / (
                torch.linalg.vector_norm(direction, dim=dims) + _GRAFTING_NORM_EPSILON
            )
            torch.mul(direction, scale.view(-1, *([1] * len(dims))), out=out)


def _clone_tree(tree: Mapping[Any, Any]) -> dict[Any, Any]:
    return {k: _clone_tree(v) if isinstance(v, Mapping) else v.clone() for k, v in tree.items()}


def _flatten(tree: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict of dotted names (``prefix.key.subkey``); leaves kept as they are."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def _is_plain(value: Any) -> bool:
    """Values a checkpoint stores for a param group (loadable with ``weights_only=True``)."""
    if isinstance(value, (tuple, list)):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


class DistributedShampoo(torch.optim.Optimizer):
    """Distributed Shampoo with grafting, momentum and amortized roots (spec in the module doc).

    Args:
        params: parameters or param groups; every keyword below can be overridden per group.
        lr: learning rate, finite and >= 0.
        betas: ``(beta1, beta2)``: filtered-gradient EMA in [0, 1) (0 disables) and factor EMA
            in (0, 1] (1 accumulates).
        beta3: EMA factor of the current step's filtered gradient; -1 means ``beta1``.
        epsilon: ridge of the factor matrices before the root, finite and > 0; exactly 0 with
            (and only with) a ``PseudoInverseConfig`` rank-deficient stability config.
        weight_decay: finite and >= 0.
        weight_decay_type: ``WeightDecayType.DECOUPLED`` (AdamW-style) or ``L2``.
        max_preconditioner_dim: largest block dim (int >= 1 or ``math.inf``).
        precondition_frequency: steps between root computations, >= 1.
        start_preconditioning_step: first step using the preconditioner; -1 means
            ``precondition_frequency``; otherwise >= ``precondition_frequency``.
        use_bias_correction: bias-correct the filtered gradient and the factors.
        amortize_roots: spread the root (or eigenbasis) computations over the
            ``precondition_frequency`` steps, a fixed share per step, instead of all at once
            every ``precondition_frequency`` steps (step 4 of the module docstring: a different,
            deterministic schedule).
        momentum_dtype: storage dtype of the filtered gradient and the momentum (None: the
            block's computation dtype). The filtered gradient is updated in the computation
            dtype and rounded once per step, momentum in its storage dtype. A narrow dtype needs ``1 - betas[0] >= finfo(dtype).eps`` (bfloat16:
            ``betas[0] <= 0.992``). Fixed at construction.
        grafting_config: None or an SGD/AdaGrad/RMSprop/Adam config: norm of the update per block.
        distributed_config: ``SingleDeviceDistributedConfig()`` (default) or DDP.
        preconditioner_config: ``DefaultShampooConfig`` or another ``PreconditionerConfig``.
        momentum: heavy-ball momentum on the update, in [0, 1).
        dampening: momentum dampening, in [0, 1).
        use_nesterov: Nesterov momentum (needs momentum > 0).
        nonfinite_grad_policy: ``"raise"`` (default) or ``"skip"`` on NaN/Inf gradients.

    Every group entry can be changed between steps (e.g. by a scheduler) and is validated again
    at the next step, except ``params``, ``max_preconditioner_dim``, ``preconditioner_config``,
    ``grafting_config``, ``distributed_config`` and ``momentum_dtype``: changing those raises
    ``ValueError``. An invalid value raises before any parameter or state changes (see the
    module docstring).

    Example:
        >>> model = torch.nn.Linear(8, 4)
        >>> opt = DistributedShampoo(model.parameters(), lr=1e-3, betas=(0.9, 0.999),
        ...                          epsilon=1e-12, grafting_config=AdamPreconditionerConfig())
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        beta3: float = -1.0,
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        weight_decay_type: WeightDecayType = WeightDecayType.DECOUPLED,
        max_preconditioner_dim: int | float = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int = -1,
        use_bias_correction: bool = True,
        grafting_config: PreconditionerConfig | None = None,
        distributed_config: DistributedConfig = DefaultSingleDeviceDistributedConfig,
        preconditioner_config: PreconditionerConfig = DefaultShampooConfig,
        *,
        amortize_roots: bool = False,
        momentum_dtype: torch.dtype | None = None,
        momentum: float = 0.0,
        dampening: float = 0.0,
        use_nesterov: bool = False,
        nonfinite_grad_policy: str = "raise",
    ) -> None:
        if nonfinite_grad_policy not in NONFINITE_GRAD_POLICIES:
            raise ValueError(
                f"nonfinite_grad_policy must be one of {NONFINITE_GRAD_POLICIES}, got {nonfinite_grad_policy!r}"
            )
        self._nonfinite_grad_policy = nonfinite_grad_policy
        self._runtimes: list[_GroupRuntime] = []
        defaults = dict(
            lr=lr, betas=betas, beta3=beta3, epsilon=epsilon, momentum=momentum,
            dampening=dampening, use_nesterov=use_nesterov, weight_decay=weight_decay,
            weight_decay_type=weight_decay_type, max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            use_bias_correction=use_bias_correction, amortize_roots=amortize_roots,
            momentum_dtype=momentum_dtype,
            grafting_config=grafting_config,
            distributed_config=distributed_config, preconditioner_config=preconditioner_config,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated; its blocks, buffers and preconditioners are built now)."""
        first_param_index = sum(len(g["params"]) for g in self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            validate_group(group)
            validate_params(group["params"])
            runtime = _GroupRuntime(group, len(self.param_groups) - 1, first_param_index)
        except Exception:
            self.param_groups.pop()
            raise
        self._runtimes.append(runtime)
        self._register_block_states(runtime)

    def _register_block_states(self, runtime: _GroupRuntime) -> None:
        """``self.state[param]["block_j"]``: the live state of each local block."""
        for info, state in zip(runtime.block_infos, runtime.block_states):
            self.state[info.param][info.composable_block_ids[1]] = state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step over all groups (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Everything that can refuse the step runs before anything moves (see the module doc).
        plans = []
        for index, (runtime, group) in enumerate(zip(self._runtimes, self.param_groups)):
            try:
                plans.append(runtime.plan(group))
                runtime.check_grads()
            except ValueError as error:
                raise ValueError(f"{error} (param_groups[{index}]; no parameter or state was changed)") from None
        masks = [runtime.gather_grads() for runtime in self._runtimes]
        active = [(r, m) for r, m in zip(self._runtimes, masks) if m is not None]
        sums = [runtime.grad_sum() for runtime, _ in active]
        if sums:
            device = sums[0].device
            total = torch.stack([s.to(device) for s in sums]).sum()
            if not bool(torch.isfinite(total)):
                bad = [label for runtime, _ in active for label in runtime.nonfinite_param_labels()]
                message = f"non-finite gradient (NaN or Inf) in {', '.join(bad) or 'a parameter'}"
                if self._nonfinite_grad_policy == "raise":
                    raise NonFiniteGradientError(message + "; no parameter or state was changed")
                logger.warning("%s; skipping this step", message)
                return loss
        for runtime, hyperparameters in zip(self._runtimes, plans):
            if runtime.configure(hyperparameters):
                self._register_block_states(runtime)
        for runtime, mask in active:
            runtime.apply_step(mask)
        return loss

    def optimizer_state_bytes(self) -> int:
        """Bytes of this rank's optimizer state: the tensors :meth:`state_dict` returns.

        Under ``DDPDistributedConfig`` only the blocks this rank owns hold state, so this is
        about ``1 / num_trainers_per_group`` of the single-device figure. Work buffers (gradient
        and update buckets) and the DDP exchange buffers are not counted.
        """
        return sum(runtime.state_bytes() for runtime in self._runtimes)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": {param_index: {"block_j.<path>": tensor}}, "param_groups": [...]}``.

        Tensors are views of the live state (like ``torch.optim``); ``param_groups`` keep the
        plain hyperparameters, the param indices and the group's ``step``. Loadable with
        ``torch.load(weights_only=True)``. Under ``DDPDistributedConfig`` the state is per rank:
        it holds only the blocks this rank owns (with ``torch.save``: one file per rank, loaded
        on the same rank with the same world size and ``num_trainers_per_group``).

        With ``torch.distributed.checkpoint`` every rank saves into one checkpoint: block keys
        are global (param index, ``block_j``), so ranks' keys are disjoint and replicas (when
        ``num_trainers_per_group`` < world size) hold identical copies; to load, pass a fresh
        optimizer's ``state_dict()`` as the template to ``dcp.load`` (it holds every key the
        rank owns, as state is allocated at construction), then :meth:`load_state_dict` it.
        Such a checkpoint loads at another world size too (each rank picks its blocks by key;
        tested from two DDP ranks into one single-device process).

        Example:
            >>> dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)  # doctest: +SKIP
            >>> template = {"optim": fresh_opt.state_dict()}  # doctest: +SKIP
            >>> dcp.load(template, checkpoint_id=path)  # doctest: +SKIP
            >>> fresh_opt.load_state_dict(template["optim"])  # doctest: +SKIP
        """
        state: dict[int, dict[str, torch.Tensor]] = {}
        for runtime in self._runtimes:
            for info, block_state in zip(runtime.block_infos, runtime.block_states):
                param_index, block_name = info.composable_block_ids
                state.setdefault(param_index, {}).update(_flatten(block_state.state_dict(), block_name))
        groups = []
        first = 0
        for group, runtime in zip(self.param_groups, self._runtimes):
            entry = {k: v for k, v in group.items() if k != "params" and _is_plain(v)}
            entry["params"] = list(range(first, first + len(group["params"])))
            entry["step"] = runtime.step
            first += len(group["params"])
            groups.append(entry)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict` in place, all or nothing.

        The whole state dict is checked before anything is written: the number of groups and
        of their parameters, each group's ``step`` and hyperparameters (validated like the
        constructor's; the saved values replace the optimizer's, and entries fixed at
        construction such as ``max_preconditioner_dim`` must agree), and every block's state:
        exactly the keys the blocks have under the loaded hyperparameters (momentum and filtered
        gradient only where they are in use), each a tensor of the block state's shape and dtype.

        Raises:
            ValueError: a group, a hyperparameter, a step, or a tensor's kind, shape or dtype
                is wrong.
            KeyError: a block state entry is missing or unexpected.
            Either way the optimizer is left as it was.
        """
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
            raise ValueError("state_dict must be a mapping with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, the optimizer has {len(self.param_groups)}"
            )
        plans: list[tuple[dict[str, Any], _Hyperparameters, int]] = []
        for index, (saved, group, runtime) in enumerate(zip(saved_groups, self.param_groups, self._runtimes)):
            where = f"state_dict param_groups[{index}]"
            if len(saved.get("params", ())) != len(group["params"]):
                raise ValueError(
                    f"{where} has {len(saved.get('params', ()))} params, the optimizer's group has "
                    f"{len(group['params'])}"
                )
            step = saved.get("step")
            if not _is_int(step) or step < 0:
                raise ValueError(f"{where}['step'] must be an int >= 0, got {step!r}")
            merged = dict(group)
            for key, value in saved.items():
                if key not in ("params", "step") and key in group:
                    merged[key] = tuple(value) if isinstance(value, list) and isinstance(group[key], tuple) else value
            try:
                hyperparameters = runtime.plan(merged)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            plans.append((merged, hyperparameters, step))

        try:
            saved_state = {int(k): _flatten(v) for k, v in state_dict["state"].items()}
        except (TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"state_dict['state'] must map param indices to dicts of tensors: {error}") from None
        unexpected = {index: set(entries) for index, entries in saved_state.items()}
        for runtime, (_, hyperparameters, _) in zip(self._runtimes, plans):
            for local_index, info in enumerate(runtime.block_infos):
                param_index = info.composable_block_ids[0]
                entries = saved_state.get(param_index, {})
                for key, (shape, dtype) in runtime.expected_block_state(local_index, hyperparameters).items():
                    if key not in entries:
                        raise KeyError(f"missing block state {param_index}.{key} in state_dict")
                    value = entries[key]
                    if not isinstance(value, torch.Tensor) or value.shape != shape or value.dtype != dtype:
                        got = (
                            f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                            else type(value).__name__
                        )
                        raise ValueError(
                            f"state_dict block state {param_index}.{key} must be a {dtype} tensor of "
                            f"shape {tuple(shape)}, got {got}"
                        )
                    unexpected[param_index].discard(key)
        leftover = sorted(f"{index}.{key}" for index, keys in unexpected.items() for key in keys)
        if leftover:
            raise KeyError(f"unexpected block state in state_dict: {leftover}")

        # Everything checked: write.
        for (merged, hyperparameters, step), group, runtime in zip(plans, self.param_groups, self._runtimes):
            for key in group:
                if key != "params":
                    group[key] = merged[key]
            if runtime.configure(hyperparameters):
                self._register_block_states(runtime)
            runtime.step = step
            for info, block_state in zip(runtime.block_infos, runtime.block_states):
                param_index, block_name = info.composable_block_ids
                entries = saved_state[param_index]
                for key, target in _flatten(block_state.state_dict(), block_name).items():
                    target.copy_(entries[key])
