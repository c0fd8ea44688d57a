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
   preconditioner's direction, ``P_g`` grafting's). ``t < s``: ``P = P_g``. No grafting:
   ``P = P_s`` at every step, before ``s`` from the preconditioner's initial state (root-inverse
   Shampoo's identity roots give ``Gbar``; SOAP's identity basis gives diagonal Adam/AdaGrad
   on its corrected eigenvalues, as the reference library does). ``s = math.inf`` never
   computes a root: with grafting every step is ``P_g``.
7. Decoupled decay ``P <- P + alpha W`` (``alpha``: ``wd``, ``CORRECTED`` ``wd lr / peak_lr``,
   ``INDEPENDENT`` ``wd / peak_lr``; see ``WeightDecayType``; under primal averaging
   ``z <- (1 - lr alpha) z`` instead, before step 8); classic momentum
   (``ClassicMomentumConfig``, or the deprecated ``momentum`` arguments)
   ``M <- mu M + (1 - d) P`` and ``P <- M`` (Nesterov: ``P <- (1 - d) P + mu M``).
8. ``W <- W - lr P`` (through the distributor). Under primal averaging (GPA, Schedule-Free;
   ``W`` holds ``y``): ``W <- W + (1 - mu_x)(z - W) - (1 - mu_x mu_y) lr P``, then
   ``z <- z - lr P``; Schedule-Free's ``mu_x = 1 - lr^r / sum_{i<=t} lr_i^r``.

Primal averaging keeps ``z`` per block (state ``weight_buffer``, set to the parameters at the
first step: the reference library takes them at construction, which differs only if the
parameters change in between, e.g. a model checkpoint loaded without the optimizer's);
the evaluation iterate is ``x = (y - (1 - mu_y) z) / mu_y``. :meth:`DistributedShampoo.eval`
moves the parameters to ``x`` (``W <- W + (1 - 1/mu_y)(z - W)``) and
:meth:`DistributedShampoo.train` back to ``y`` (``W <- W + (1 - mu_y)(z - W)``); a step in eval
mode raises ``RuntimeError``. The mode and Schedule-Free's ``sum lr_i^r`` are in every
parameter's state (``train_mode``, ``lr_sum``); a load keeps the mode the optimizer was in.

Blocks with the same shape are stacked into buckets and processed by batched kernels
(``baddbmm``/``bmm``/``_foreach_*``; one ``eigh`` per factor size); the buffers a group's
hyperparameters need are allocated when the group is added.

A block whose parameter has no gradient (``grad`` None) is left as it was: its state and its
parameter do not move, while the group's ``step`` counts on. A group none of whose parameters
has a gradient counts the step too (and Schedule-Free's ``sum lr_i^r``), as the reference
library's does, so bias corrections and root schedules keep its count; nothing else of it moves.

A step is all or nothing. Before anything moves it checks, for every group: the
hyperparameters (validated when the group is added; a step or a load re-checks the entries
that changed since, so that a scheduler's ``lr = inf`` is refused), that
the entries fixed at construction are unchanged (``params``, ``max_preconditioner_dim``,
``preconditioner_config``, ``grafting_config``, ``distributed_config``, ``momentum_dtype``: they
decide the blocks,
which rank holds them and the layout of their state), and that every gradient is dense, real
and of its parameter's shape; a failure raises ``ValueError`` naming the field or parameter.
Then one fused finiteness check over all gradients: with ``nonfinite_grad_policy="raise"``
(default) it raises :class:`NonFiniteGradientError` naming the parameters; with ``"skip"`` it
logs a warning and skips the step (parameters, state and step counter unchanged).

Changed hyperparameters apply from the next step. The ``-1`` sentinels (``beta3``,
``start_preconditioning_step``) are resolved once, when a group is added, and the values are
written into the group (as the reference library does: a later change of ``betas`` leaves
``beta3`` as it is; a ``-1`` set later is resolved at the next step). State follows
the hyperparameters in use: momentum (``momentum > 0``) and the filtered gradient
(``betas[0] > 0``) start from zero when turned on and are dropped when turned off; a change of
``betas[1]``, ``epsilon`` or ``use_bias_correction`` rebuilds the preconditioner for the new
values and carries every block's state over, as a checkpoint round trip would.

State dicts are torch's own: ``state_dict()`` and ``load_state_dict()`` are
``torch.optim.Optimizer``'s (so their hooks run, ``torch.distributed.checkpoint``'s
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` work, FQN keys load), in the
reference library's layout: per parameter one nested dict per block and the group's ``step``
(``state_dict_layout.py``). This optimizer adds a state-dict post-hook (live state to nested
dicts), a load pre-hook, ``__setstate__`` (check everything, then write) and a load post-hook
(the caller's train/eval mode), described in ``state_dict_loading.py``.

Where the parts live: this module holds the ``torch.optim.Optimizer`` (groups, the all-or-nothing
step over them, the state-dict hooks); ``group_runtime.py`` one group's buckets, buffers and the
step order above (``GroupRuntime.apply_step``); ``group_validation.py`` the checks of a group's
entries and their resolution into ``Hyperparameters``; ``component_builders.py`` the
preconditioner and distributor a config names; ``state_dict_layout.py`` the layout of
``optimizer.state`` and of a state dict; ``state_dict_loading.py`` the checks and writes of a
load; ``state_dict_regrouping.py`` a state dict of named parameters onto another grouping;
``step_compilation.py`` the probed ``torch.compile`` of a group's step; ``param_group_split.py``
the split of FSDP2/HSDP groups with ``num_sub_groups > 1`` into sub-groups, applied to the
constructor's groups.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from nanoshampoo.optim.shampoo.config_checks import error_field, field_error
from nanoshampoo.optim.shampoo.group_runtime import GroupRuntime
from nanoshampoo.optim.shampoo.group_validation import (
    check_ordered_params,
    validate_device_kind,
    validate_group,
    validate_group_keys,
    validate_params,
    write_back_sentinels,
)
from nanoshampoo.optim.shampoo.iterate_averaging_types import IterateAveragingConfig
from nanoshampoo.optim.shampoo.param_group_split import split_constructor_params
from nanoshampoo.optim.shampoo.runtime_types import (
    ConcurrencyConfig,
    DefaultConcurrencyConfig,
    DefaultShampooRuntimeConfig,
    ShampooPT2CompileConfig,
    ShampooRuntimeConfig,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    LR_SUM,
    OWNER_RANKS,
    DefaultShampooConfig,
    DefaultSingleDeviceDistributedConfig,
    DistributedConfig,
    NonFiniteGradientError,
    PreconditionerConfig,
    WeightDecayType,
)
from nanoshampoo.optim.shampoo.state_dict_layout import (
    GroupScalars,
    live_block_state,
    loads_back,
    saved_state,
    unloadable_part,
)
from nanoshampoo.optim.shampoo.state_dict_loading import (
    PendingLoad,
    apply_load,
    originals_by_position,
    plan_load,
    prepare_load,
)
from nanoshampoo.optim.shampoo.step_compilation import compile_step

logger = logging.getLogger(__name__)

NONFINITE_GRAD_POLICIES = ("raise", "skip")
# Deprecated group entries, mapped onto ClassicMomentumConfig (group_validation._classic_momentum).
LEGACY_MOMENTUM_KEYS = {"momentum", "dampening", "use_nesterov"}


class DistributedShampoo(torch.optim.Optimizer):
    """Distributed Shampoo with grafting, momentum and amortized roots (spec in the module doc).

    Args:
        params: parameters or param groups; every keyword below can be overridden per group.
        lr: learning rate, finite and >= 0.
        betas: ``(beta1, beta2)``: filtered-gradient EMA in [0, 1) (0 disables) and factor EMA
            in [0, 1] (1 accumulates; 0 keeps only the current gradient's statistics).
        beta3: EMA factor of the current step's filtered gradient; -1 means ``beta1``.
        epsilon: ridge of the factor matrices before the root, finite and > 0; exactly 0 with
            (and only with) a ``PseudoInverseConfig`` rank-deficient stability config.
        weight_decay: finite and >= 0.
        weight_decay_type: ``WeightDecayType.DECOUPLED`` (AdamW-style), ``L2``, ``CORRECTED``
            or ``INDEPENDENT`` (these two divide by the group entry ``peak_lr``, which defaults
            to the group's ``lr`` and must then be > 0; see :class:`WeightDecayType`).
        max_preconditioner_dim: largest block dim (int >= 1 or ``math.inf``).
        precondition_frequency: steps between root computations, >= 1.
        start_preconditioning_step: first step using the preconditioner; -1 means
            ``precondition_frequency``; ``math.inf`` never preconditions (every step is the
            grafting method's, or the filtered gradient without grafting); otherwise an int
            >= ``precondition_frequency``.
        use_bias_correction: bias-correct the filtered gradient and the factors.
        iterate_averaging_config: None, ``ClassicMomentumConfig`` (SGD momentum on the update),
            ``GeneralizedPrimalAveragingConfig`` or ``ScheduleFreeConfig`` (primal averaging:
            call :meth:`train` before training and :meth:`eval` before evaluating).
        amortize_roots: spread the root (or eigenbasis) computations over the
            ``precondition_frequency`` steps, a fixed share per step, instead of all at once
            every ``precondition_frequency`` steps (step 4 of the module docstring: a different,
            deterministic schedule).
        momentum_dtype: storage dtype of the filtered gradient and the momentum (None: the
            block's computation dtype). The filtered gradient is updated in the computation
            dtype and rounded once per step, momentum in its storage dtype. A narrow dtype needs
            ``1 - betas[0] >= finfo(dtype).eps`` (bfloat16: ``betas[0] <= 0.992``). Fixed at
            construction.
        grafting_config: None or an SGD/AdaGrad/RMSprop/Adam config: norm of the update per block.
        use_pin_memory: a bool group entry, accepted for the reference library's scripts and
            without effect: there it pins the CPU copy of ``lr`` sent to the GPU each step;
            here ``lr`` reaches the kernels as a Python float, with no copy to pin.
        shampoo_pt2_compile_config: None (eager) or a :class:`ShampooPT2CompileConfig`:
            ``torch.compile`` of each group's step, probed first (eager, with a logged reason,
            when the backend cannot compile here; :attr:`step_compiled`).
        distributed_config: ``SingleDeviceDistributedConfig()`` (default), DDP, FullyShard or
            HybridShard.
        preconditioner_config: ``DefaultShampooConfig`` or another ``PreconditionerConfig``.
        shampoo_runtime_config: :class:`ShampooRuntimeConfig` (``eager_nan_check``).
        concurrency_config: :class:`ConcurrencyConfig`, accepted, no effect here (its docstring).
        momentum: deprecated (``DeprecationWarning``): with ``momentum > 0`` the group steps as
            with ``iterate_averaging_config=ClassicMomentumConfig(momentum, dampening,
            use_nesterov)``; in [0, 1), and only with ``iterate_averaging_config=None``.
        dampening: deprecated, see ``momentum``; in [0, 1).
        use_nesterov: deprecated, see ``momentum`` (needs momentum > 0).
        nonfinite_grad_policy: ``"raise"`` (default) or ``"skip"`` on NaN/Inf gradients.

    Refused at construction (``add_param_group``), naming the parameter or key: a ``set`` of
    parameters (``TypeError``: its order changes between runs), a parameter given twice, a
    group key that is not one of the keywords above (a typo such as ``learning_rate``),
    parameters of one group on different devices, and meta parameters mixed with real ones.

    Every group entry can be changed between steps (e.g. by a scheduler) and is validated again
    at the next step, except ``params``, ``max_preconditioner_dim``, ``preconditioner_config``,
    ``grafting_config``, ``distributed_config`` and ``momentum_dtype``: changing those raises
    ``ValueError``. An invalid value raises before any parameter or state changes (see the
    module docstring).

    State, as in the reference library: ``optimizer.state[p]["block_j"]`` is a dict of views of
    block ``j``'s live state (``"shampoo"``, ``"adagrad"``, ``"filtered_grad"``...), and
    ``optimizer.state[p]["step"]`` (under primal averaging also ``"lr_sum"``, ``"train_mode"``)
    the group's counter, one tensor aliased under every parameter. ``state_dict()`` and
    ``load_state_dict()`` are torch's (layout: ``state_dict_layout.py``; the load's checks:
    ``state_dict_loading.py``). Under ``DDPDistributedConfig`` a rank's state holds the blocks it
    owns, keyed by their global names: with ``torch.save``, one file per rank; with
    ``torch.distributed.checkpoint``, one checkpoint that loads at another world size too (each
    rank picks its blocks by key from a fresh optimizer's ``state_dict()`` as the template).

    Example:
        >>> from nanoshampoo.optim.shampoo import AdamPreconditionerConfig
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
        start_preconditioning_step: int | float = -1,
        use_bias_correction: bool = True,
        iterate_averaging_config: IterateAveragingConfig | None = None,
        grafting_config: PreconditionerConfig | None = None,
        use_pin_memory: bool = False,
        shampoo_pt2_compile_config: ShampooPT2CompileConfig | None = None,
        distributed_config: DistributedConfig = DefaultSingleDeviceDistributedConfig,
        preconditioner_config: PreconditionerConfig = DefaultShampooConfig,
        shampoo_runtime_config: ShampooRuntimeConfig = DefaultShampooRuntimeConfig,
        concurrency_config: ConcurrencyConfig = DefaultConcurrencyConfig,
        *,
        amortize_roots: bool = False,
        momentum_dtype: torch.dtype | None = None,
        momentum: float = 0.0,
        dampening: float = 0.0,
        use_nesterov: bool = False,
        nonfinite_grad_policy: str = "raise",
    ) -> None:
        # Long for its signature: the reference library's arguments, in its order, plus ours.
        if nonfinite_grad_policy not in NONFINITE_GRAD_POLICIES:
            raise ValueError(
                f"nonfinite_grad_policy must be one of {NONFINITE_GRAD_POLICIES}, got "
                f"{nonfinite_grad_policy!r}"
            )
        check_ordered_params("params", params)
        for name, value, kind in (
            ("shampoo_pt2_compile_config", shampoo_pt2_compile_config, ShampooPT2CompileConfig),
            ("shampoo_runtime_config", shampoo_runtime_config, ShampooRuntimeConfig),
            ("concurrency_config", concurrency_config, ConcurrencyConfig),
        ):
            if not isinstance(value, kind) and not (
                value is None and name == "shampoo_pt2_compile_config"
            ):
                raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}")
        self._nonfinite_grad_policy = nonfinite_grad_policy
        self._compile_config = shampoo_pt2_compile_config
        self._runtime_config = shampoo_runtime_config
        self._concurrency_config = concurrency_config
        self._step_compiled: list[bool] = []
        # Per compiled group: the "has a gradient" masks its step has run with, and the last one.
        # (None: a step without any gradient.)
        self._compiled_masks: list[tuple[set[tuple[bool, ...] | None], list[bool] | None]] = []
        self._runtimes: list[GroupRuntime] = []
        self._scalars: list[GroupScalars] = []
        self._packed_roots: list[bool] = []  # per group: its state dict packs the roots
        self._pending_load: PendingLoad | None = None
        defaults = dict(
            lr=lr,
            betas=betas,
            beta3=beta3,
            epsilon=epsilon,
            momentum=momentum,
            dampening=dampening,
            use_nesterov=use_nesterov,
            weight_decay=weight_decay,
            weight_decay_type=weight_decay_type,
            max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            use_bias_correction=use_bias_correction,
            amortize_roots=amortize_roots,
            momentum_dtype=momentum_dtype,
            iterate_averaging_config=iterate_averaging_config,
            grafting_config=grafting_config,
            use_pin_memory=use_pin_memory,
            distributed_config=distributed_config,
            preconditioner_config=preconditioner_config,
        )
        if not isinstance(params, torch.Tensor):  # torch refuses a bare tensor: keep it whole
            params = list(params)
        groups = params if isinstance(params, list) else []
        if (momentum, dampening, use_nesterov) != (0.0, 0.0, False) or any(
            isinstance(group, dict) and LEGACY_MOMENTUM_KEYS & group.keys() for group in groups
        ):
            warnings.warn(
                "DistributedShampoo's momentum, dampening and use_nesterov are deprecated: pass "
                "iterate_averaging_config=ClassicMomentumConfig(momentum=..., dampening=..., "
                "use_nesterov=...) instead (the same step, except that Nesterov with dampening > 0 "
                "now scales P by 1 - dampening too)",
                DeprecationWarning,
                stacklevel=2,
            )
        if isinstance(params, list):  # the reference's num_sub_groups split (param_group_split.py)
            params = split_constructor_params(params, distributed_config)
        super().__init__(params, defaults)
        # Registered first, so that a user's hooks see the nested layout (state_dict_loading.py).
        self.register_state_dict_post_hook(DistributedShampoo._saved_state)
        self.register_load_state_dict_pre_hook(DistributedShampoo._pre_load)
        self.register_load_state_dict_post_hook(DistributedShampoo._restore_modes)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated; its blocks, buffers and preconditioners are built now).

        A group without ``peak_lr`` gets its own ``lr`` (the well-known library gives it the
        constructor's ``lr``; the two agree unless a group sets its own ``lr``).
        """
        first_param_index = sum(len(g["params"]) for g in self.param_groups)
        check_ordered_params("param_group['params']", param_group.get("params"))
        validate_group_keys(param_group, [*self.defaults, "peak_lr", OWNER_RANKS])
        param_group.setdefault("peak_lr", param_group.get("lr", self.defaults["lr"]))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        # Preformatted, as the reference logs it (record.msg holds the text).
        logger.info(f"Checking param_group {len(self.param_groups) - 1} hyperparameters...")
        try:
            validate_group(group)
            validate_params(group["params"], group.get("param_names"))
            validate_device_kind(group["params"], self.param_groups)
            write_back_sentinels(group)
            runtime = GroupRuntime(group, len(self.param_groups) - 1, first_param_index)
        except Exception:
            self.param_groups.pop()
            raise
        if group["params"] and not runtime.block_infos:
            # As the reference warns (its words), when this rank computes no block of the group.
            logger.warning(
                "There is no params assigned to the current rank. In DDP Shampoo, this may happen "
                "when the value of num_trainers_per_group field in "
                f"group[DISTRIBUTED_CONFIG]={group['distributed_config']!r} is more than the "
                "number "
                "of global blocked params so some trainers get assigned no blocked params. This "
                "will cause idle ranks. Please check the num_trainers_per_group setting and "
                "consider "
                "reducing it. Similarly, in FSDP lossless Shampoo, this can happen under "
                "ROUND_ROBIN "
                "assignment strategy and when the optimizer shard group size is larger than the "
                "number of params."
            )
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        runtime.apply_step, compiled = compile_step(
            runtime.apply_step, self._compile_config, device
        )
        self._step_compiled.append(compiled)
        self._compiled_masks.append((set(), None))
        self._runtimes.append(runtime)
        self._scalars.append(GroupScalars(runtime.hyperparameters.primal_averaging is not None))
        self._packed_roots.append(
            bool(getattr(group["preconditioner_config"], "use_symmetric_packing", False))
        )
        self._register_state(len(self._runtimes) - 1)

    def _register_state(self, g: int) -> None:
        """``self.state[param]``: each local block's live state under ``"block_j"``, and group
        ``g``'s scalar tensors (``step``...) aliased under every parameter of the group
        (layout: ``state_dict_layout.py``)."""
        runtime = self._runtimes[g]
        for param in self.param_groups[g]["params"]:
            self.state[param].update(self._scalars[g].tensors)
        for info, state in zip(runtime.block_infos, runtime.block_states):
            self.state[info.param][info.composable_block_ids[1]] = live_block_state(state)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step over all groups (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for runtime, scalars in zip(self._runtimes, self._scalars):
            scalars.read_into(runtime)
        # Everything that can refuse the step runs before anything moves (see the module doc).
        plans = []
        for index, (runtime, group) in enumerate(zip(self._runtimes, self.param_groups)):
            try:
                plans.append(runtime.plan(group))
                runtime.check_grads(self._runtime_config.eager_nan_check)
            except ValueError as error:
                raise field_error(
                    error_field(error),
                    f"{error} (param_groups[{index}]; no parameter or state was changed)",
                ) from None
            runtime.check_train_mode()
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
                logger.warning(f"{message}; skipping this step")
                return loss
        for g, (runtime, hyperparameters) in enumerate(zip(self._runtimes, plans)):
            if runtime.configure(hyperparameters):
                self._register_state(g)
        for g, mask in enumerate(masks):
            if self._step_compiled[g]:
                self._warn_of_a_recompile(g, mask)
        # A group without any gradient steps too, with the mask None (GroupRuntime.apply_step).
        for runtime, mask in zip(self._runtimes, masks):
            runtime.apply_step(mask)
        for runtime, scalars in zip(self._runtimes, self._scalars):
            scalars.write_from(runtime)
        return loss

    def _warn_of_a_recompile(self, g: int, mask: list[bool] | None) -> None:
        """Warn, in the reference's words, when group ``g``'s compiled step meets a "has a
        gradient" mask it has not run with: the compiled step specializes on the mask, so a new
        one compiles it again (a mask seen before reuses its compiled code). None, a group
        without any gradient, is such a mask too, with no block selected: the reference's step
        recompiles then as well, and says so in these words."""
        selected = [False] * len(self._runtimes[g].block_infos) if mask is None else mask
        key = None if mask is None else tuple(mask)
        seen, last = self._compiled_masks[g]
        self._compiled_masks[g] = (seen, selected)
        if last is not None and key not in seen:
            changed = [i for i, (was, now) in enumerate(zip(last, selected)) if was != now]
            logger.warning(
                "PT2 will recompile because the gradient selection of model parameters have "
                "changed from the previous step. Possible reasons include some gradients are "
                "None. If this is not intended, please check the data and/or model.\nDetails:\n"
                f"- Current step: {self._runtimes[g].step}\n"
                f"- Changed gradient selector indices: {changed}"
            )
        seen.add(key)

    @property
    def step_compiled(self) -> bool:
        """Whether every group's step runs compiled (``shampoo_pt2_compile_config`` given and its
        probe passed; see :class:`ShampooPT2CompileConfig`)."""
        return bool(self._step_compiled) and all(self._step_compiled)

    @torch.no_grad()
    def train(self) -> None:
        """Parameters of primal-averaging groups (GPA, Schedule-Free) to ``y``, the training point.

        ``W <- W + (1 - mu_y)(z - W)`` from the evaluation iterate; no-op for other groups and
        for groups already in train mode. Collective under DDP (every rank calls it).
        """
        for runtime, scalars in zip(self._runtimes, self._scalars):
            runtime.switch_mode(to_train=True)
            scalars.write_from(runtime)

    @torch.no_grad()
    def eval(self) -> None:
        """Parameters of primal-averaging groups (GPA, Schedule-Free) to ``x``, the averaged
        iterate.

        ``W <- W + (1 - 1/mu_y)(z - W)``, i.e. ``x = (y - (1 - mu_y) z) / mu_y``; no-op for other
        groups and for groups already in eval mode. :meth:`step` refuses to run until
        :meth:`train`. Collective under DDP (every rank calls it).
        """
        for runtime, scalars in zip(self._runtimes, self._scalars):
            runtime.switch_mode(to_train=False)
            scalars.write_from(runtime)

    def optimizer_state_bytes(self) -> int:
        """Bytes of this rank's optimizer state: the tensors :meth:`state_dict` returns.

        Under ``DDPDistributedConfig`` only the blocks this rank owns hold state, so this is
        about ``1 / num_trainers_per_group`` of the single-device figure. Work buffers (gradient
        and update buckets) and the DDP exchange buffers are not counted.
        """
        return sum(runtime.state_bytes() for runtime in self._runtimes)

    @staticmethod
    def _saved_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """State-dict post-hook: the live state as nested dicts (``state_dict_layout.py``); a
        warning for each group entry that would not load back under
        ``torch.load(weights_only=True)`` (a lambda, a function or class not registered with
        ``add_safe_globals``; :func:`unloadable_part` names which part)."""
        assert isinstance(optimizer, DistributedShampoo)
        lr_sums = [
            runtime.lr_power_sum if LR_SUM in scalars.tensors else None
            for runtime, scalars in zip(optimizer._runtimes, optimizer._scalars)
        ]
        saved_state(state_dict, optimizer._packed_roots, lr_sums)
        for group in state_dict["param_groups"]:
            if loads_back(group):  # the common case, one round trip per group
                continue
            for key, value in group.items():
                part = unloadable_part(value, key)
                if part is not None:
                    # The reference's sentence (it warns for every function), then which part.
                    logger.warning(
                        f"Found {key}={value!r}. Note that lambda function cannot be pickled. "
                        "torch.save() cannot serialize lambda functions, because it relies on "
                        "Python's pickle module for serialization, and pickle does not support "
                        "lambda functions. Nor does torch.load(weights_only=True) load a "
                        "function or class not registered with "
                        f"torch.serialization.add_safe_globals: {part}, to checkpoint it."
                    )

    @staticmethod
    def _pre_load(optimizer: torch.optim.Optimizer, state_dict: Any) -> dict[str, Any]:
        """Load pre-hook: the dict in the nested layout, keyed onto our grouping; remembers the
        saved tensors before torch's cast and each group's train/eval mode
        (``state_dict_loading.py``)."""
        assert isinstance(optimizer, DistributedShampoo)
        prepared = prepare_load(state_dict, optimizer.param_groups)
        optimizer._pending_load = PendingLoad(
            originals_by_position(prepared, optimizer.param_groups),
            [runtime.train_mode for runtime in optimizer._runtimes],
        )
        return prepared

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Load ``state`` (what ``torch.optim.Optimizer.load_state_dict`` hands over: groups,
        and state keyed by parameter) all or nothing: everything is checked, then written
        (``state_dict_loading.py``). Raises ``ValueError`` or ``KeyError`` naming the group,
        entry or block, and leaves the optimizer as it was."""
        if "_runtimes" not in self.__dict__:  # unpickling: nothing is built to load into
            super().__setstate__(state)
            return
        pending, self._pending_load = self._pending_load, None
        positions = {
            id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])
        }

        def index_of(key: Any) -> int | None:
            if isinstance(key, torch.Tensor):
                return positions.get(id(key))
            return key if isinstance(key, int) and 0 <= key < len(positions) else None

        plans = plan_load(
            self._runtimes,
            self.param_groups,
            state["param_groups"],
            state["state"],
            index_of,
            pending.originals if pending is not None else {},
        )
        if pending is not None:
            pending.originals.clear()
            self._pending_load = pending  # the post-hook restores its train modes
        apply_load(self._runtimes, self.param_groups, plans, self._register_written)

    def _register_written(self, g: int) -> None:
        self._scalars[g].write_from(self._runtimes[g])
        self._register_state(g)

    @staticmethod
    def _restore_modes(optimizer: torch.optim.Optimizer) -> None:
        """Load post-hook: each group back in the train/eval mode it had before the load."""
        assert isinstance(optimizer, DistributedShampoo)
        pending, optimizer._pending_load = optimizer._pending_load, None
        if pending is None:
            return
        for runtime, scalars, train_mode in zip(
            optimizer._runtimes, optimizer._scalars, pending.train_modes
        ):
            runtime.switch_mode(to_train=train_mode)
            scalars.write_from(runtime)
