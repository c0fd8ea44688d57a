"""Which optimizer updates which parameters: the parameter groups, the registered setup's
builder, and the check that every trainable parameter is owned exactly once.

Parameters fall into four named groups (``partition_parameters``):

- ``embed``: the token embedding;  ``head``: the output layer's matrix;
- ``scalar``: every 1-D parameter (biases, norm gains, a non-combined head bias);
- ``matrix``: every block parameter with ``ndim >= 2``.

The setup (``TrainConfig.optimizer``, a name in ``nanoshampoo.train.setups``) builds the
optimizers from these groups. Gradients of every parameter whose optimizer does not reduce its
own (DistAdam does: ``OptimizerPart.reduces_own_gradients``) are averaged across ranks by the
trainer before the step (``OptimizerSetup.all_reduce_params``). Under ``parallel`` ``fsdp2`` /
``hsdp`` FSDP has already averaged every gradient: the trainer reduces none.

Example:
    >>> model = GPT(gpt_preset("tiny", vocab_size=256))
    >>> setup = build_optimizer_setup(model, TrainConfig(optimizer="adamw"), world_size=1)
    >>> [type(o).__name__ for o in setup.optimizers]
    ['AdamW']
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from nanoshampoo.model.gpt import GPT, gpt_preset  # noqa: F401 - gpt_preset: docstring example
from nanoshampoo.train.config import TrainConfig, UserError
from nanoshampoo.train.setups import BuildContext, OptimizerPart

GROUP_NAMES = ("embed", "head", "scalar", "matrix")


@dataclass
class OptimizerSetup:
    """The optimizers of a run, the parameter groups, the parameters whose gradients the
    trainer all-reduces, and those whose optimizer reduces (and checks) them itself."""

    optimizers: list[torch.optim.Optimizer]
    groups: dict[str, list[nn.Parameter]]
    all_reduce_params: list[nn.Parameter]
    self_reducing_params: list[nn.Parameter]

    def trainer_checked_params(self, model: nn.Module) -> list[nn.Parameter]:
        """The parameters whose gradients the trainer checks for NaN/Inf: all but the
        self-reducing ones (their reduction may still be in flight; their optimizer checks)."""
        own = {id(p) for p in self.self_reducing_params}
        return [p for p in model.parameters() if id(p) not in own]

    def set_gradient_sync(self, enabled: bool) -> None:
        """Whether this backward's gradients start syncing across ranks (DistAdam's hooks).

        False on the micro-batches that only accumulate; True on the last one.
        """
        for opt in self.optimizers:
            if hasattr(opt, "should_sync"):
                opt.should_sync = enabled

    def _averaging_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers with a training and an evaluation point (``train()`` / ``eval()``:
        iterate averaging, e.g. Schedule-Free); for the others the two are the same."""
        return [
            opt
            for opt in self.optimizers
            if callable(getattr(opt, "train", None)) and callable(getattr(opt, "eval", None))
        ]

    @contextmanager
    def evaluation_point(self) -> Iterator[None]:
        """Inside: the parameters at the optimizers' evaluation point (``eval()``: the averaged
        iterate), for validation and checkpoints; after: back at the training point (``train()``).

        Collective under DDP (every rank enters). ``train()`` recomputes the training point
        from the evaluation point (not bit-for-bit the one before), exactly as a run resumed
        from a checkpoint written inside does (:meth:`resume_training_point`); so the trainer
        saves a step's checkpoint before that step's validation, and a resumed run repeats
        the uninterrupted run's round trips.
        """
        averaging = self._averaging_optimizers()
        for opt in averaging:
            opt.eval()  # type: ignore[attr-defined]
        try:
            yield
        finally:
            for opt in averaging:
                opt.train()  # type: ignore[attr-defined]

    def resume_training_point(self) -> None:
        """After a restore: a checkpoint holds the evaluation point; move to the training point."""
        for opt in self._averaging_optimizers():
            opt.train()  # type: ignore[attr-defined]


def partition_parameters(model: GPT) -> dict[str, list[nn.Parameter]]:
    """Split the model's parameters into the groups ``embed``, ``head``, ``scalar``, ``matrix``."""
    head_ids = {id(p) for p in model.lm_head.parameters()}
    block_ids = {id(p) for p in model.blocks.parameters()}
    groups: dict[str, list[nn.Parameter]] = {name: [] for name in GROUP_NAMES}
    for p in model.parameters():
        if p is model.embed.weight:
            groups["embed"].append(p)
        elif p.ndim < 2:
            groups["scalar"].append(p)
        elif id(p) in head_ids:
            groups["head"].append(p)
        elif id(p) in block_ids:
            groups["matrix"].append(p)
    check_parameter_partition(model, groups)
    return groups


def check_parameter_partition(
    model: nn.Module, groups: Mapping[str, Sequence[torch.Tensor]]
) -> None:
    """Raise ``ValueError`` unless the groups are disjoint and hold exactly the model's params.

    The message names every offending parameter: those in two groups, those in no group, and
    those that do not belong to the model.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    owner: dict[int, str] = {}
    problems = []
    for group, params in groups.items():
        for p in params:
            if id(p) not in names:
                problems.append(
                    f"group {group!r} holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model"
                )
            elif id(p) in owner:
                problems.append(f"{names[id(p)]} is in both {owner[id(p)]!r} and {group!r}")
            else:
                owner[id(p)] = group
    problems += [f"{name} is in no group" for pid, name in names.items() if pid not in owner]
    if problems:
        raise ValueError(
            "optimizer parameter groups must partition the model: " + "; ".join(problems)
        )


def check_ownership(
    model: nn.Module, setup: str, optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """``UserError`` unless every trainable parameter is in exactly one optimizer, once.

    The one-line message names the parameters that no optimizer owns, those owned twice (two
    optimizers, or twice in one), and tensors that are not trainable parameters of the model.
    """
    names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    owners: dict[int, list[str]] = {}
    foreign = []
    for index, opt in enumerate(optimizers):
        label = f"{index}:{type(opt).__name__}"
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in names:
                    owners.setdefault(id(p), []).append(label)
                else:
                    foreign.append(f"a tensor of shape {tuple(p.shape)} in {label}")
    unowned = [name for pid, name in names.items() if pid not in owners]
    twice = [
        f"{names[pid]} ({', '.join(labels)})" for pid, labels in owners.items() if len(labels) > 1
    ]
    problems = (
        ([f"owned by no optimizer: {', '.join(unowned)}"] if unowned else [])
        + ([f"owned more than once: {', '.join(twice)}"] if twice else [])
        + ([f"not a trainable parameter of the model: {', '.join(foreign)}"] if foreign else [])
    )
    if problems:
        raise UserError(
            f"setup {setup!r}: every trainable parameter must be owned by exactly "
            f"one optimizer; {'; '.join(problems)}"
        )


def build_optimizer_setup(model: GPT, cfg: TrainConfig, world_size: int) -> OptimizerSetup:
    """The registered setup's optimizers for ``model``, checked for ownership.

    ``UserError`` when a setup's builder refuses its inputs (a custom optimizer's arguments)
    or leaves a parameter with no optimizer or with two.
    """
    groups = partition_parameters(model)
    try:
        parts: list[OptimizerPart] = cfg.setup.build(BuildContext(groups, cfg, world_size))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    optimizers = [part.optimizer for part in parts]
    check_ownership(model, cfg.optimizer, optimizers)
    own = {
        id(p)
        for part in parts
        if part.reduces_own_gradients
        for group in part.optimizer.param_groups
        for p in group["params"]
    }
    self_reducing = [p for p in model.parameters() if id(p) in own]
    # FSDP reduces every gradient itself under fsdp2 / hsdp.
    all_reduce = [p for p in model.parameters() if id(p) not in own and cfg.parallel.mode == "ddp"]
    return OptimizerSetup(
        optimizers=optimizers,
        groups=groups,
        all_reduce_params=all_reduce,
        self_reducing_params=self_reducing,
    )


# Param-group keys a resume takes from the new config rather than the checkpoint: the peak
# lr (``--shampoo.lr`` etc. may change on resume; the schedule sets ``lr`` from it each step).
RESUME_MAY_CHANGE = ("params", "lr", "peak_lr")


def param_group_settings(
    optimizers: Sequence[torch.optim.Optimizer],
) -> list[list[dict[str, object]]]:
    """Every param group's settings (all keys but ``params``), per optimizer: what the config
    built, to compare with what a checkpoint restores."""
    return [
        [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        for opt in optimizers
    ]


def apply_resumed_settings(
    built: list[list[dict[str, object]]], optimizers: Sequence[torch.optim.Optimizer], source: str
) -> None:
    """After a checkpoint restored ``optimizers``: keep the config's peak lrs, and refuse
    (``UserError``, one line) any other setting that differs from what the config built.

    A restore brings back the checkpoint's param groups, and some optimizers bake settings into
    their state at construction, so a changed hyper-parameter could not be applied faithfully;
    refusing keeps the run log's config equal to what ran (the run does not start).
    """
    changed = []
    for index, (opt, groups) in enumerate(zip(optimizers, built)):
        for number, (group, wanted) in enumerate(zip(opt.param_groups, groups)):
            keys = sorted((set(group) | set(wanted)) - set(RESUME_MAY_CHANGE), key=str)
            for key in keys:
                old, new = group.get(key, "(absent)"), wanted.get(key, "(absent)")
                if not _same(old, new):
                    changed.append(f"{type(opt).__name__} group {number}: {key} {old!r} -> {new!r}")
        if len(opt.param_groups) != len(groups):
            changed.append(
                f"optimizer {index}: {len(opt.param_groups)} param groups -> {len(groups)}"
            )
    if changed:
        raise UserError(
            f"{source}: a resume continues the checkpoint's optimizer settings; "
            f"this run changes {'; '.join(changed)} (keep the checkpoint's values, "
            "or start a new run)"
        )
    for opt, groups in zip(optimizers, built):
        for group, wanted in zip(opt.param_groups, groups):
            group["peak_lr"] = wanted["peak_lr"]


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors: compare values
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
