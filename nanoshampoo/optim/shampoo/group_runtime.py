"""``GroupRuntime``: one parameter group's buckets, buffers and preconditioners, and its step.

:meth:`GroupRuntime.apply_step` is the step order of
:mod:`~nanoshampoo.optim.shampoo.distributed_shampoo`'s
module docstring, line by line; new optimizer features belong in that list and in that function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nanoshampoo.optim.shampoo.component_builders import (
    build_distributor,
    build_preconditioner,
)
from nanoshampoo.optim.shampoo.filtered_input import bias_correction_divisor, filtered_input
from nanoshampoo.optim.shampoo.group_validation import (
    FIXED_GROUP_KEYS,
    Hyperparameters,
    check_grads,
    step_values,
    validate_changes,
)
from nanoshampoo.optim.shampoo.iterate_averaging import (
    classic_momentum_,
    interp_coeffs,
    mode_switch_updates_,
    primal_averaging_step_,
    shrink_,
)
from nanoshampoo.optim.shampoo.iterate_averaging_types import (
    PRIMAL_AVERAGING_CONFIG_TYPES,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import (
    BlockBucket,
    BlockStateView,
    Preconditioner,
)
from nanoshampoo.optim.shampoo.shampoo_types import OWNER_RANKS, WeightDecayType
from nanoshampoo.optim.shampoo.state_dict_trees import clone_tree, flatten_tree

_GRAFTING_NORM_EPSILON = 1e-16
# Block state entries that exist only while the hyperparameters use them: entry -> the buffer
# that holds it, and whether it is stored in ``momentum_dtype`` (else the computation dtype).
_OPTIONAL_BLOCK_STATE = {
    "filtered_grad": ("filtered", True),
    "momentum": ("momentum", True),
    "weight_buffer": ("weights", False),
}


class GroupRuntime:
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
        # Primal averaging (GPA, Schedule-Free): whether the parameters hold y (train mode) or
        # x (eval mode), and Schedule-Free's sum of lr^r over the steps taken.
        self.train_mode = True
        self.lr_power_sum = 0.0
        self._fixed = {key: group[key] for key in FIXED_GROUP_KEYS}
        self._params = tuple(group["params"])
        self.distributor = build_distributor(
            group["distributed_config"],
            group["params"],
            group["max_preconditioner_dim"],
            first_param_index,
            group["preconditioner_config"],
            group.get(OWNER_RANKS),
        )
        self._fix_owner_ranks(group)
        names = group.get("param_names")
        offsets = self.distributor.local_block_param_offsets
        # Whether the group steps depends on every blocked parameter, not only the local ones,
        # so that all ranks of a DDP group take part in the same exchanges.
        self._blocked_params = tuple(
            {
                id(info.param): info.param for info in self.distributor.global_block_info_list
            }.values()
        )
        self.block_infos = self.distributor.local_block_info_list
        blocked_params = self.distributor.local_blocked_params
        shapes = [tuple(p.shape) for p in group["params"]]
        self.param_labels = [
            f"{names[o]!r} (shape {shapes[o]})"
            if names
            else f"param_groups[{group_index}]['params'][{o}] (shape {shapes[o]})"
            for o in range(len(group["params"]))
        ]
        self.local_block_offsets = offsets
        self.buckets, self.bucket_members = self._make_buckets(blocked_params, offsets)
        # (bucket index, position in the bucket) of each local block.
        self._bucket_positions = [(0, 0)] * len(self.block_infos)
        for k, members in enumerate(self.bucket_members):
            for position, i in enumerate(members):
                self._bucket_positions[i] = (k, position)
        hyperparameters = Hyperparameters.resolve(group)
        self.hyperparameters = hyperparameters
        self._primal_averaging = hyperparameters.primal_averaging is not None
        self.preconditioner = self._build_preconditioner(hyperparameters)
        grafting = group["grafting_config"]
        # The diagonal grafting preconditioners carry their own beta2 and epsilon.
        self.grafting = (
            None
            if grafting is None
            else build_preconditioner(
                grafting, self.buckets, hyperparameters.beta2, hyperparameters.epsilon, False
            )
        )
        self.grads = [b.zeros() for b in self.buckets]
        # Per bucket, the last step's grafting scale ``||P_g|| / ||P_s||`` (B,): kept, not
        # computed, for inspection (empty until a grafted step).
        self.graft_scales: list[torch.Tensor] = []
        self.updates = [b.zeros() for b in self.buckets]
        self.params: list[torch.Tensor] = []
        self.filtered: list[torch.Tensor] = []
        self.filtered_out: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []  # primal averaging's z
        self._param_slices: list[list[torch.Tensor]] = []
        # Per-block views, built once: parameter blocks per bucket, and each local block's
        # slice of the update buffers (in local block order, as the distributor expects).
        self._bucket_param_views = [
            self._in_bucket_order(blocked_params, k) for k in range(len(self.buckets))
        ]
        self._allocate_buffers(hyperparameters)
        self.block_states = [self._block_state(i) for i in range(len(self.block_infos))]
        self._local_updates: list[torch.Tensor] = [torch.empty(0)] * len(self.block_infos)
        for k, buffer in enumerate(self.updates):
            for position, i in enumerate(self.bucket_members[k]):
                self._local_updates[i] = buffer[position]

    def _fix_owner_ranks(self, group: dict[str, Any]) -> None:
        """ROUND_ROBIN (FSDP2/HSDP): the group carries the owner map its distributor uses, as
        ``split_param_groups`` attaches it (written here for a group added without one); like
        the fixed entries, it cannot change afterwards."""
        owner_ranks = getattr(self.distributor, "owner_ranks", None)
        if owner_ranks is not None:
            if group.get(OWNER_RANKS) is None:
                group[OWNER_RANKS] = owner_ranks
            self._fixed[OWNER_RANKS] = tuple(owner_ranks)

    def _build_preconditioner(self, hyperparameters: Hyperparameters) -> Preconditioner:
        return build_preconditioner(
            self._fixed["preconditioner_config"],
            self.buckets,
            hyperparameters.beta2,
            hyperparameters.epsilon,
            hyperparameters.use_bias_correction,
        )

    def plan(self, group: Mapping[str, Any]) -> Hyperparameters:
        """Validate ``group`` for this runtime and return the hyperparameters of its next step.

        Changes nothing. Raises ``ValueError`` naming the field for an invalid entry (re-checked
        only where it changed since the last validated step entries: ``validate_changes``), or
        for an entry fixed at construction (``params``, ``FIXED_GROUP_KEYS`` and a
        ``ROUND_ROBIN`` group's ``owner_ranks``) that differs.
        """
        values = step_values(group)
        validate_changes(group, values, self.hyperparameters.group_values)
        for key, built in self._fixed.items():
            value = group.get(key)
            if key == OWNER_RANKS and isinstance(value, list):
                value = tuple(value)  # given as a list or a tuple, compared by its entries
            if value is not built and value != built:
                decides = (
                    "which rank computes each parameter"
                    if key == OWNER_RANKS
                    else "the blocks and the layout of their state"
                )
                raise ValueError(
                    f"{key} cannot change after the group is added (it decides {decides}): "
                    f"built with {built!r}, got {value!r}"
                )
        params = group["params"]
        if len(params) != len(self._params) or any(
            p is not q for p, q in zip(params, self._params)
        ):
            raise ValueError(
                "params cannot change after the group is added; add a new group with "
                "add_param_group"
            )
        averaging = group["iterate_averaging_config"]
        if isinstance(averaging, PRIMAL_AVERAGING_CONFIG_TYPES) != self._primal_averaging:
            raise ValueError(
                "iterate_averaging_config cannot turn primal averaging (GPA, Schedule-Free) on or "
                f"off after the group is added (it decides the block state), got {averaging!r}"
            )
        if values == self.hyperparameters.group_values:
            return self.hyperparameters
        return Hyperparameters.resolve(group)

    def check_train_mode(self) -> None:
        """Raise ``RuntimeError`` if primal averaging's parameters hold ``x`` (after ``eval()``)."""
        if not self.train_mode:
            # The reference's message names its private method; its instruction is kept.
            raise RuntimeError(
                "Called optimizer.step() when not in train mode: the parameters hold the "
                "averaged (evaluation) iterate. Call optimizer.train() before calling "
                "optimizer.step()!"
            )

    def configure(self, hyperparameters: Hyperparameters) -> bool:
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
        if reallocated:  # a new (zero) filtered gradient: nothing derived from the old one holds
            self.preconditioner.forget_filtered()
        return rebuilt or reallocated

    def _allocate_buffers(self, hyperparameters: Hyperparameters) -> bool:
        """Zero-filled buffers where ``hyperparameters`` need one, none where they do not.

        Returns whether any buffer was added or dropped.
        """
        if not self.buckets:  # a DDP rank that owns no block: nothing to hold
            return False
        changed = False
        state_dtype = hyperparameters.momentum_dtype
        narrow = {
            buffer for buffer, in_state_dtype in _OPTIONAL_BLOCK_STATE.values() if in_state_dtype
        }
        for name, needed in hyperparameters.buffers_needed().items():
            present = bool(getattr(self, name))
            if needed != present:
                dtypes = [
                    (state_dtype if name in narrow and state_dtype else b.dtype)
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
        self, local_index: int, hyperparameters: Hyperparameters
    ) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Flat state keys (``block_j.<path>``) of a local block under ``hyperparameters``,
        each with the shape and dtype a checkpoint must hold for it."""
        _, block_name = self.block_infos[local_index].composable_block_ids
        entries = {
            key: (value.shape, value.dtype)
            for key, value in flatten_tree(
                self.block_states[local_index].state_dict(), block_name
            ).items()
            if key.split(".")[1] not in _OPTIONAL_BLOCK_STATE
        }
        k, _ = self._bucket_positions[local_index]
        bucket = self.buckets[k]
        needed = hyperparameters.buffers_needed()
        for entry, (buffer, in_state_dtype) in _OPTIONAL_BLOCK_STATE.items():
            if needed[buffer]:
                dtype = (hyperparameters.momentum_dtype if in_state_dtype else None) or bucket.dtype
                entries[f"{block_name}.{entry}"] = (torch.Size(bucket.shape), dtype)
        return entries

    def check_grads(self, eager_nan_check: bool = False) -> None:
        """Raise naming the parameter for a gradient Shampoo cannot use (``ValueError``), or,
        with ``eager_nan_check``, one holding NaN/Inf (``NonFiniteGradientError``); see
        :func:`~nanoshampoo.optim.shampoo.group_validation.check_grads`."""
        check_grads(self.param_labels, self._params, eager_nan_check)

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
                f"{self.param_labels[offsets[i]]} {self.block_infos[i].composable_block_ids[1]}"
                for i in indices
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
        if self.weights:
            entries["weight_buffer"] = self.weights[bucket_index][position]
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
        """Float64 scalar, finite iff every gradient entry is (barring a float64 overflow): the
        sum of the group's gradients, each bucket's in float32 where that sum is finite
        (:func:`_finite_if_entries_are`; only its finiteness is read).

        The distributor adds the local sums over the ranks that hold the group's blocks, so every
        rank sees every block (collective under DDP).
        """
        total = torch.zeros((), dtype=torch.float64, device=self._blocked_params[0].device)
        for buffer in self.grads:
            total += _finite_if_entries_are(buffer)
        self.distributor.all_reduce_grad_sum_(total)
        return total

    def state_bytes(self) -> int:
        """Bytes of this rank's per-block optimizer state (what :meth:`state_dict` holds)."""
        return sum(
            tensor.numel() * tensor.element_size()
            for state in self.block_states
            for tensor in flatten_tree(state.state_dict()).values()
        )

    def nonfinite_param_labels(self) -> list[str]:
        """Labels of the parameters whose gradient holds NaN/Inf (slow; only after a failed
        check)."""
        bad = set()
        for k, buffer in enumerate(self.grads):
            finite = torch.isfinite(buffer).flatten(1).all(dim=1).tolist()
            bad.update(
                self.local_block_offsets[i]
                for i, ok in zip(self.bucket_members[k], finite)
                if not ok
            )
        return [self.param_labels[o] for o in sorted(bad)]

    def apply_step(self, present: list[bool] | None) -> None:
        """Steps 1-8 of the module docstring for every local block, then the distributor update.

        Uses :attr:`hyperparameters` (set by :meth:`configure`); ``present`` is
        :meth:`gather_grads`' mask. None (no block of the group has a gradient, on any rank):
        the step still counts, as the reference library's does (its ``step`` and Schedule-Free's
        ``sum lr^r`` move on, so bias corrections and schedules stay in step with its), and
        nothing else moves: no statistics, roots, momentum, decay or exchange.
        """
        averaging_coeffs = self._advance_averaging()
        if present is None:
            if self.step == 0 and self.hyperparameters.primal_averaging is not None:
                # z is read at the first step, whether or not it has gradients (collective
                # under the lossless FSDP2/HSDP2 distributors, which fill their blocks here).
                self.distributor.local_blocked_grads()
                self._start_averaged_iterate()
            self.step += 1
            return
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
        if self.step == 0:
            self._start_averaged_iterate()
        missing = [i for i, has in enumerate(present) if not has]
        saved = {i: clone_tree(self.block_states[i].state_dict()) for i in missing}
        self.step += 1
        t = self.step
        h = self.hyperparameters
        wd, decay_type = h.weight_decay, h.weight_decay_type
        start = h.start_preconditioning_step
        grads = self.grads
        for slices, views in zip(self._param_slices, self._bucket_param_views):
            torch._foreach_copy_(slices, views)
        if wd > 0.0 and decay_type == WeightDecayType.L2:
            torch._foreach_add_(grads, self.params, alpha=wd)

        self.preconditioner.update_statistics(grads, t)
        if self.grafting is not None:
            self.grafting.update_statistics(grads, t)
        self._compute_roots(t)
        self.preconditioner.release_step_temporaries()

        self._precondition(self._filtered_grads(t), t, start)
        self._decay_and_average(averaging_coeffs)

        for i in missing:
            self._local_updates[i].zero_()
            self.block_states[i].load_state_dict(saved[i])
        if missing:  # their filtered gradient went back a step
            self.preconditioner.forget_filtered()
        self.distributor.update_params(self._local_updates)

    def _start_averaged_iterate(self) -> None:
        """Under primal averaging, z = the parameters (x = y = z), at the first step, after the
        gather: the lossless FSDP2/HSDP2 distributors fill their blocks only there."""
        for buffer, views in zip(self.weights, self._bucket_param_views):
            torch._foreach_copy_(list(buffer.unbind(0)), views)

    def _precondition(self, filtered: list[torch.Tensor], t: int, start: int | float) -> None:
        """Step 6 of the module docstring: :attr:`updates` = the (grafted) direction of
        ``filtered``."""
        if self.grafting is not None and t < start:
            self.preconditioner.complete_statistics()
            torch._foreach_copy_(self.updates, self.grafting.precondition(filtered, t))
            return
        # Without grafting the preconditioner also steps before ``s``, from its initial state
        # (identity roots: the gradient; SOAP: diagonal Adam in the identity basis).
        self.preconditioner.expect_filtered(filtered_input(self.hyperparameters, t), t)
        directions = self.preconditioner.precondition(filtered, t)
        if self.grafting is not None:
            self._graft(directions, self.grafting.precondition(filtered, t))
        else:
            torch._foreach_copy_(self.updates, directions)

    def _compute_roots(self, t: int) -> None:
        """Step 4 of the module docstring: the roots (or eigenbases) scheduled at step ``t``."""
        h = self.hyperparameters
        frequency, start = h.precondition_frequency, h.start_preconditioning_step
        if t == start:
            self.preconditioner.amortized_computation(t)
        elif t > start and h.amortize_roots:
            self.preconditioner.amortized_computation(t, t % frequency, frequency, t // frequency)
        elif t > start and t % frequency == 0:
            self.preconditioner.amortized_computation(t, period=t // frequency)

    def _decay_and_average(self, averaging_coeffs: tuple[float, float] | None) -> None:
        """Steps 7-8 of the module docstring on :attr:`updates` (``P`` on entry, the change of
        the parameters on return): decoupled decay, iterate averaging and the learning rate."""
        h = self.hyperparameters
        alpha = h.decoupled_weight_decay() if h.weight_decay > 0.0 else 0.0
        if alpha != 0.0 and averaging_coeffs is None:
            torch._foreach_add_(self.updates, self.params, alpha=alpha)
        if h.classic_momentum is not None:
            classic_momentum_(self.updates, self.momentum, h.classic_momentum)
        torch._foreach_mul_(self.updates, -h.lr)
        if averaging_coeffs is not None:
            if alpha != 0.0:
                shrink_(self.weights, 1.0 - h.lr * alpha)
            primal_averaging_step_(self.updates, self.weights, self.params, *averaging_coeffs)

    def _advance_averaging(self) -> tuple[float, float] | None:
        """Step 8's ``(mu_x, mu_y)`` under primal averaging (None without), and Schedule-Free's
        sum of ``lr^r`` moved to include this step (on every rank, so that checkpoints agree)."""
        averaging = self.hyperparameters.primal_averaging
        if averaging is None:
            return None
        mu_x, mu_y, self.lr_power_sum = interp_coeffs(
            averaging, self.hyperparameters.lr, self.lr_power_sum
        )
        return mu_x, mu_y

    def switch_mode(self, to_train: bool) -> None:
        """Move the parameters between ``y`` (train) and ``x`` (eval) under primal averaging.

        ``W <- W + c (z - W)``
        (:func:`~nanoshampoo.optim.shampoo.iterate_averaging.mode_switch_updates_`)
        through the distributor (collective: every rank calls it). Does nothing without primal
        averaging or when already in that mode.
        """
        averaging = self.hyperparameters.primal_averaging
        if averaging is None or self.train_mode == to_train:
            return
        if self.step > 0:  # before the first step x = y = z: nothing to move
            # Lossless FSDP2/HSDP2 distributors refresh their blocks' values only in this gather
            # (collective, like the update); other distributors' blocks are parameter views.
            self.distributor.local_blocked_grads()
            if self.block_infos:
                for slices, views in zip(self._param_slices, self._bucket_param_views):
                    torch._foreach_copy_(slices, views)
                mu_y = averaging.train_interp_coeff
                mode_switch_updates_(self.updates, self.weights, self.params, mu_y, to_train)
            self.distributor.update_params(self._local_updates)
        self.train_mode = to_train

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
        correction = bias_correction_divisor(h, t)
        for out, value in zip(self.filtered_out, source):
            torch.div(value, correction, out=out)
        return self.filtered_out

    def _graft(self, directions: Sequence[torch.Tensor], grafted: Sequence[torch.Tensor]) -> None:
        """``updates = P_s * ||P_g|| / (||P_s|| + 1e-16)``, norms per block; the scales are
        kept in :attr:`graft_scales`."""
        self.graft_scales = []
        for out, direction, graft in zip(self.updates, directions, grafted):
            dims = tuple(range(1, direction.dim()))
            scale = torch.linalg.vector_norm(graft, dim=dims) / (
                torch.linalg.vector_norm(direction, dim=dims) + _GRAFTING_NORM_EPSILON
            )
            torch.mul(direction, scale.view(-1, *([1] * len(dims))), out=out)
            self.graft_scales.append(scale)


def _finite_if_entries_are(buffer: torch.Tensor) -> torch.Tensor:
    """A scalar sum of ``buffer`` that is finite iff every entry is.

    A NaN or Inf entry makes any sum non-finite; only an overflow of finite entries could make
    a float32 sum non-finite too, and the float64 sum tells the two apart. On a CPU the float64
    sum of a float32 tensor first writes a float64 copy of it, so a float32 CPU buffer is
    summed in float32 and summed again in float64 only where that sum is not finite (a host
    read, free on a CPU). Elsewhere the float64 sum, which a GPU computes without the copy."""
    if buffer.device.type == "cpu" and buffer.dtype == torch.float32:
        partial = buffer.sum()
        if bool(torch.isfinite(partial)):
            return partial
    return buffer.sum(dtype=torch.float64)
