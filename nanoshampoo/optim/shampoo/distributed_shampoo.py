"""``DistributedShampoo``: the optimizer that wires blocks, preconditioners and distributors.

One step for a block (``t`` 1-based, ``s`` = start_preconditioning_step, ``f`` = frequency):

1. L2 decay only: ``G <- G + wd W``.
2. Preconditioner statistics from ``G`` every step (Shampoo: factor matrices).
3. Grafting statistics from ``G`` every step.
4. Roots when ``(t % f == 0 and t > s) or t == s``.
5. Filtered gradient ``M <- b1 M + (1 - b1) G``; ``Gbar = M / (1 - b1^t)`` with bias
   correction (``beta3 != beta1``: ``Gbar = (b3 M_old + (1 - b3) G) / (1 - b3 b1^(t-1))``).
6. ``t >= s``: ``P = P_s * ||P_g|| / (||P_s|| + 1e-16)`` per block (``P_s`` the
   preconditioner's direction, ``P_g`` grafting's); no grafting: ``P = P_s``. ``t < s``:
   ``P = P_g`` (no grafting: ``Gbar``).
7. Decoupled decay ``P <- P + wd W``; momentum ``B <- mu B + (1 - dampening) P`` and
   ``P <- B`` (Nesterov: ``P <- P + mu B``).
8. ``W <- W - lr P`` (through the distributor).

Blocks with the same shape are stacked into buckets and processed by batched kernels
(``baddbmm``/``bmm``/``_foreach_*``; one ``eigh`` per factor size); all buffers are allocated
at construction.

Non-finite gradients: every step runs one fused finiteness check over all gradients before
touching any state. With ``nonfinite_grad_policy="raise"`` (default) it raises
:class:`NonFiniteGradientError` naming the parameters; with ``"skip"`` it logs a warning and
skips the step (parameters, state and step counter unchanged).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from nanoshampoo.optim.shampoo.distributor.ddp_distributor import DDPDistributor
from nanoshampoo.optim.shampoo.distributor.distributor import Distributor
from nanoshampoo.optim.shampoo.distributor.single_device_distributor import (
    SingleDeviceDistributor,
)
from nanoshampoo.optim.shampoo.preconditioner.adagrad_preconditioner import AdaGradPreconditioner
from nanoshampoo.optim.shampoo.preconditioner.eigenvalue_corrected_shampoo_preconditioner import (
    EigenvalueCorrectedShampooPreconditioner,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import (
    BlockBucket,
    BlockStateView,
    Preconditioner,
)
from nanoshampoo.optim.shampoo.preconditioner.sgd_preconditioner import SGDPreconditioner
from nanoshampoo.optim.shampoo.preconditioner.shampoo_preconditioner import (
    ShampooPreconditioner,
)
from nanoshampoo.optim.shampoo.preconditioner.spectral_descent_preconditioner import (
    SpectralDescentPreconditioner,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    GRAFTING_CONFIG_TYPES,
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DefaultShampooConfig,
    DefaultSingleDeviceDistributedConfig,
    DistributedConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    NonFiniteGradientError,
    PreconditionerConfig,
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
# Group entries that fix the block structure: a checkpoint must agree with them.
_STRUCTURAL_KEYS = ("max_preconditioner_dim",)


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
    (Adam corrects, RMSprop and AdaGrad do not).
    """
    if isinstance(config, ShampooPreconditionerConfig):
        return ShampooPreconditioner(buckets, config, beta2, epsilon, use_bias_correction)
    if isinstance(config, EigenvalueCorrectedShampooPreconditionerConfig):
        return EigenvalueCorrectedShampooPreconditioner(
            buckets, config, beta2, epsilon, use_bias_correction
        )
    if isinstance(config, SpectralDescentPreconditionerConfig):
        return SpectralDescentPreconditioner(buckets, config)
    if isinstance(config, AdamPreconditionerConfig):
        return AdaGradPreconditioner(buckets, config.beta2, config.epsilon, True)
    if isinstance(config, RMSpropPreconditionerConfig):
        return AdaGradPreconditioner(buckets, config.beta2, config.epsilon, False)
    if isinstance(config, AdaGradPreconditionerConfig):
        return AdaGradPreconditioner(buckets, 1.0, config.epsilon, False)
    if isinstance(config, SGDPreconditionerConfig):
        return SGDPreconditioner(buckets)
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
    the optimizer talks to it through that interface only.
    """
    if isinstance(config, SingleDeviceDistributedConfig):
        return SingleDeviceDistributor(params, max_preconditioner_dim, first_param_index)
    if isinstance(config, DDPDistributedConfig):
        return DDPDistributor(params, max_preconditioner_dim, first_param_index, config)
    raise ValueError(f"distributed_config: unsupported config {config!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_group(group: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` (message starting with the field name) for an invalid group entry."""

    def check(ok: bool, name: str, requirement: str) -> None:
        if not ok:
            raise ValueError(f"{name} {requirement}, got {group.get(name.split('[')[0])!r}")

    lr, betas, beta3, eps = group["lr"], group["betas"], group["beta3"], group["epsilon"]
    check(_is_number(lr) and lr >= 0.0, "lr", "must be >= 0.0")
    check(isinstance(betas, (tuple, list)) and len(betas) == 2, "betas", "must be a pair")
    check(_is_number(betas[0]) and 0.0 <= betas[0] < 1.0, "betas[0]", "must be in [0.0, 1.0)")
    check(_is_number(betas[1]) and 0.0 < betas[1] <= 1.0, "betas[1]", "must be in (0.0, 1.0]")
    check(_is_number(beta3) and (beta3 == -1.0 or 0.0 <= beta3 < 1.0), "beta3", "must be -1.0 or in [0.0, 1.0)")
    check(_is_number(eps) and eps > 0.0, "epsilon", "must be > 0.0")
    momentum, dampening = group["momentum"], group["dampening"]
    check(_is_number(momentum) and 0.0 <= momentum < 1.0, "momentum", "must be in [0.0, 1.0)")
    check(_is_number(dampening) and 0.0 <= dampening < 1.0, "dampening", "must be in [0.0, 1.0)")
    check(isinstance(group["use_nesterov"], bool), "use_nesterov", "must be a bool")
    check(not group["use_nesterov"] or momentum > 0.0, "use_nesterov", "needs momentum > 0.0")
    wd = group["weight_decay"]
    check(_is_number(wd) and wd >= 0.0, "weight_decay", "must be >= 0.0")
    check(isinstance(group["weight_decay_type"], WeightDecayType), "weight_decay_type", "must be a WeightDecayType")
    max_dim = group["max_preconditioner_dim"]
    check(
        (isinstance(max_dim, int) and not isinstance(max_dim, bool) and max_dim >= 1) or max_dim == math.inf,
        "max_preconditioner_dim",
        "must be an int >= 1 or math.inf",
    )
    frequency, start = group["precondition_frequency"], group["start_preconditioning_step"]
    check(
        isinstance(frequency, int) and not isinstance(frequency, bool) and frequency >= 1,
        "precondition_frequency",
        "must be an int >= 1",
    )
    check(
        isinstance(start, int) and not isinstance(start, bool) and (start == -1 or start >= frequency),
        "start_preconditioning_step",
        f"must be -1 or an int >= precondition_frequency ({frequency})",
    )
    check(isinstance(group["use_bias_correction"], bool), "use_bias_correction", "must be a bool")
    grafting = group["grafting_config"]
    check(
        grafting is None or isinstance(grafting, GRAFTING_CONFIG_TYPES),
        "grafting_config",
        "must be None or an SGD/AdaGrad/RMSprop/Adam PreconditionerConfig",
    )
    check(isinstance(group["preconditioner_config"], PreconditionerConfig), "preconditioner_config", "must be a PreconditionerConfig")
    check(isinstance(group["distributed_config"], DistributedConfig), "distributed_config", "must be a DistributedConfig")
    for index, param in enumerate(group["params"]):
        if not param.is_floating_point():
            raise ValueError(f"params[{index}] must be a floating-point tensor, got {param.dtype}")


class _GroupRuntime:
    """Everything one parameter group needs per step: buckets, buffers, preconditioners.

    Block order: ``local`` = the distributor's local blocks; each bucket lists the local
    indices of its blocks. All per-bucket tensors are ``(B, *shape)`` and allocated once.
    """

    def __init__(self, group: dict[str, Any], group_index: int, first_param_index: int) -> None:
        self.step = 0
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
        beta1, beta2 = group["betas"]
        self.preconditioner = build_preconditioner(
            group["preconditioner_config"], self.buckets, beta2, group["epsilon"], group["use_bias_correction"]
        )
        grafting = group["grafting_config"]
        self.grafting = None if grafting is None else build_preconditioner(grafting, self.buckets, beta2, group["epsilon"], False)
        self.grads = [b.zeros() for b in self.buckets]
        self.updates = [b.zeros() for b in self.buckets]
        self.params = [b.zeros() for b in self.buckets] if group["weight_decay"] > 0.0 else []
        beta3 = beta1 if group["beta3"] == -1.0 else group["beta3"]
        self.filtered = [b.zeros() for b in self.buckets] if beta1 > 0.0 else []
        self.filtered_out = (
            [b.zeros() for b in self.buckets]
            if beta1 > 0.0 and (beta3 != beta1 or group["use_bias_correction"])
            else []
        )
        self.momentum = [b.zeros() for b in self.buckets] if group["momentum"] > 0.0 else []
        self.block_states = [self._block_state(i) for i in range(len(self.block_infos))]
        # Per-block views, built once: parameter blocks per bucket, and each local block's
        # slice of the update buffers (in local block order, as the distributor expects).
        self._bucket_param_views = [self._in_bucket_order(blocked_params, k) for k in range(len(self.buckets))]
        self._param_slices = [list(buffer.unbind(0)) for buffer in self.params]
        self._local_updates: list[torch.Tensor] = [torch.empty(0)] * len(self.block_infos)
        for k, buffer in enumerate(self.updates):
            for position, i in enumerate(self.bucket_members[k]):
                self._local_updates[i] = buffer[position]

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
        bucket_index, position = next(
            (k, m.index(local_index)) for k, m in enumerate(self.bucket_members) if local_index in m
        )
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
            for tensor in _flatten(state.state_dict(), "").values()
        )

    def nonfinite_param_labels(self) -> list[str]:
        """Labels of the parameters whose gradient holds NaN/Inf (slow; only after a failed check)."""
        bad = set()
        for k, buffer in enumerate(self.grads):
            finite = torch.isfinite(buffer).flatten(1).all(dim=1).tolist()
            bad.update(self.local_block_offsets[i] for i, ok in zip(self.bucket_members[k], finite) if not ok)
        return [self.param_labels[o] for o in sorted(bad)]

    def apply_step(self, group: Mapping[str, Any], present: list[bool]) -> None:
        """Steps 1-8 of the module docstring for every local block, then the distributor update."""
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
        beta1, _ = group["betas"]
        wd, decay_type = group["weight_decay"], group["weight_decay_type"]
        frequency = group["precondition_frequency"]
        start = frequency if group["start_preconditioning_step"] == -1 else group["start_preconditioning_step"]
        grads = self.grads
        if wd > 0.0:
            for slices, views in zip(self._param_slices, self._bucket_param_views):
                torch._foreach_copy_(slices, views)
            if decay_type == WeightDecayType.L2:
                torch._foreach_add_(grads, self.params, alpha=wd)

        self.preconditioner.update_statistics(grads, t)
        if self.grafting is not None:
            self.grafting.update_statistics(grads, t)
        if (t % frequency == 0 and t > start) or t == start:
            self.preconditioner.amortized_computation(t)

        filtered = self._filtered_grads(group, t)
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
        momentum = group["momentum"]
        if momentum > 0.0:
            torch._foreach_mul_(self.momentum, momentum)
            torch._foreach_add_(self.momentum, self.updates, alpha=1.0 - group["dampening"])
            if group["use_nesterov"]:
                torch._foreach_add_(self.updates, self.momentum, alpha=momentum)
            else:
                torch._foreach_copy_(self.updates, self.momentum)
        torch._foreach_mul_(self.updates, -float(group["lr"]))

        for i in missing:
            self._local_updates[i].zero_()
            self.block_states[i].load_state_dict(saved[i])
        self.distributor.update_params(self._local_updates)

    def _filtered_grads(self, group: Mapping[str, Any], t: int) -> list[torch.Tensor]:
        beta1, _ = group["betas"]
        if beta1 == 0.0:
            return self.grads
        beta3 = beta1 if group["beta3"] == -1.0 else group["beta3"]
        if beta3 != beta1:
            # The current-step average uses beta3 on the previous M, before M itself moves.
            torch._foreach_copy_(self.filtered_out, self.filtered)
            torch._foreach_lerp_(self.filtered_out, self.grads, 1.0 - beta3)
        torch._foreach_lerp_(self.filtered, self.grads, 1.0 - beta1)
        if beta3 == beta1 and not group["use_bias_correction"]:
            return self.filtered
        source = self.filtered if beta3 == beta1 else self.filtered_out
        correction = 1.0 - beta3 * beta1 ** (t - 1) if group["use_bias_correction"] else 1.0
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


def _flatten(tree: Mapping[Any, Any], prefix: str) -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _is_plain(value: Any) -> bool:
    """Values a checkpoint stores for a param group (loadable with ``weights_only=True``)."""
    if isinstance(value, (tuple, list)):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


class DistributedShampoo(torch.optim.Optimizer):
    """Distributed Shampoo with grafting, momentum and amortized roots (spec in the module doc).

    Args:
        params: parameters or param groups; every keyword below can be overridden per group.
        lr: learning rate, >= 0.
        betas: ``(beta1, beta2)``: filtered-gradient EMA in [0, 1) (0 disables) and factor EMA
            in (0, 1] (1 accumulates).
        beta3: EMA factor of the current step's filtered gradient; -1 means ``beta1``.
        epsilon: ridge of the factor matrices before the root, > 0.
        weight_decay: >= 0.
        weight_decay_type: ``WeightDecayType.DECOUPLED`` (AdamW-style) or ``L2``.
        max_preconditioner_dim: largest block dim (int >= 1 or ``math.inf``).
        precondition_frequency: steps between root computations, >= 1.
        start_preconditioning_step: first step using the preconditioner; -1 means
            ``precondition_frequency``; otherwise >= ``precondition_frequency``.
        use_bias_correction: bias-correct the filtered gradient and the factors.
        grafting_config: None or an SGD/AdaGrad/RMSprop/Adam config: norm of the update per block.
        distributed_config: ``SingleDeviceDistributedConfig()`` (default) or DDP.
        preconditioner_config: ``DefaultShampooConfig`` or another ``PreconditionerConfig``.
        momentum: heavy-ball momentum on the update, in [0, 1).
        dampening: momentum dampening, in [0, 1).
        use_nesterov: Nesterov momentum (needs momentum > 0).
        nonfinite_grad_policy: ``"raise"`` (default) or ``"skip"`` on NaN/Inf gradients.

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
            lr=lr, betas=tuple(betas), beta3=beta3, epsilon=epsilon, momentum=momentum,
            dampening=dampening, use_nesterov=use_nesterov, weight_decay=weight_decay,
            weight_decay_type=weight_decay_type, max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            use_bias_correction=use_bias_correction, grafting_config=grafting_config,
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
            runtime = _GroupRuntime(group, len(self.param_groups) - 1, first_param_index)
        except Exception:
            self.param_groups.pop()
            raise
        self._runtimes.append(runtime)
        for info, state in zip(runtime.block_infos, runtime.block_states):
            self.state[info.param][info.composable_block_ids[1]] = state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step over all groups (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        masks = [runtime.gather_grads() for runtime in self._runtimes]
        active = [(r, g, m) for r, g, m in zip(self._runtimes, self.param_groups, masks) if m is not None]
        sums = [runtime.grad_sum() for runtime, _, _ in active]
        if sums:
            device = sums[0].device
            total = torch.stack([s.to(device) for s in sums]).sum()
            if not bool(torch.isfinite(total)):
                bad = [label for runtime, _, _ in active for label in runtime.nonfinite_param_labels()]
                message = f"non-finite gradient (NaN or Inf) in {', '.join(bad) or 'a parameter'}"
                if self._nonfinite_grad_policy == "raise":
                    raise NonFiniteGradientError(message + "; no parameter or state was changed")
                logger.warning("%s; skipping this step", message)
                return loss
        for runtime, group, mask in active:
            runtime.apply_step(group, mask)
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
        """Restore a :meth:`state_dict` in place (strict: every block key must match).

        Raises:
            ValueError: groups or parameter counts differ, or a structural entry
                (``max_preconditioner_dim``) differs, or a tensor's shape/dtype differs.
            KeyError: a block state entry is missing or unexpected.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, the optimizer has {len(self.param_groups)}"
            )
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param_groups[{index}] has {len(saved['params'])} params in the state_dict, "
                    f"{len(group['params'])} in the optimizer"
                )
            for key in _STRUCTURAL_KEYS:
                if key in saved and saved[key] != group[key]:
                    raise ValueError(
                        f"param_groups[{index}]['{key}'] is {saved[key]!r} in the state_dict but "
                        f"{group[key]!r} in the optimizer (it fixes the block structure)"
                    )
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        trees = {index: _unflatten(flat) for index, flat in saved_state.items()}
        for runtime in self._runtimes:
            for info, block_state in zip(runtime.block_infos, runtime.block_states):
                param_index, block_name = info.composable_block_ids
                # Strict: a stateful block whose entry is absent raises KeyError naming the key.
                block_state.load_state_dict(trees.get(param_index, {}).pop(block_name, {}))
        leftover = [f"{i}.{name}" for i, tree in trees.items() for name in tree]
        if leftover:
            raise KeyError(f"unexpected block state in state_dict: {leftover}")
        for saved, group, runtime in zip(saved_groups, self.param_groups, self._runtimes):
            runtime.step = int(saved["step"])
            for key, value in saved.items():
                if key not in ("params", "step") and key in group:
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
