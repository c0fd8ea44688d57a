"""Configs of how a step runs (not what it computes): compilation, eager checks, concurrency.

None of them is checkpointed and none changes the numbers of a step. Each validates in
``__post_init__`` (``ValueError`` naming the field). Names and fields follow the reference
Distributed Shampoo library; what each does here is in its docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanoshampoo.optim.shampoo.config_checks import check_bool

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(kw_only=True)
class ShampooPT2CompileConfig:
    """``torch.compile`` of each param group's step (``GroupRuntime.apply_step``).

    The fields are ``torch.compile``'s keyword arguments (those shared by torch 2.6 to 2.13)
    and are passed to it unchanged. What is compiled is the math of a step: statistics, roots,
    grafting, filtered gradient, decay, momentum and the update; the host syncs (failure
    checks of the roots) and the distributors' collectives are graph breaks and run eagerly.
    The step counter becomes a dynamic int after its first change, so a step does not
    recompile for each new step number.

    Before compiling, the optimizer probes the backend by compiling a one-line function on the
    parameters' device (inductor on CPU needs a C++ compiler, on CUDA Triton). When the probe
    fails, the optimizer logs the reason and runs eagerly, with the same numbers
    (:attr:`DistributedShampoo.step_compiled` says which).

    Fields:
        fullgraph: refuse graph breaks (the collectives and host syncs make this fail).
        dynamic: ``torch.compile``'s dynamic-shape switch (None: automatic).
        backend: a backend name or callable (``"inductor"``; ``"aot_eager"`` needs no compiler).
        mode: None or one of ``COMPILE_MODES`` (not together with ``options``).
        options: None or a dict of backend options.
        disable: turn compilation off (the step runs eagerly, without a probe).

    Example:
        >>> ShampooPT2CompileConfig(backend="aot_eager").backend
        'aot_eager'
    """

    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    options: dict[str, Any] | None = None
    disable: bool = False

    def __post_init__(self) -> None:
        check_bool("fullgraph", self.fullgraph)
        if self.dynamic is not None:
            check_bool("dynamic", self.dynamic)
        if not (isinstance(self.backend, str) and self.backend) and not callable(self.backend):
            raise ValueError(f"backend must be a backend name or a callable, got {self.backend!r}")
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise ValueError(f"mode must be None or one of {COMPILE_MODES}, got {self.mode!r}")
        if self.options is not None and not isinstance(self.options, dict):
            raise ValueError(f"options must be None or a dict, got {self.options!r}")
        if self.mode is not None and self.options is not None:
            raise ValueError(
                "mode and options cannot both be set (torch.compile takes one or the other)"
            )
        check_bool("disable", self.disable)

    def compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.compile``."""
        return dict(
            fullgraph=self.fullgraph,
            dynamic=self.dynamic,
            backend=self.backend,
            mode=self.mode,
            options=self.options,
            disable=self.disable,
        )


@dataclass(kw_only=True)
class ShampooRuntimeConfig:
    """Debugging switches of a step.

    Fields:
        eager_nan_check: check each parameter's gradient for NaN/Inf as it is read (one host
            sync per parameter) and raise :class:`NonFiniteGradientError` naming it, whatever
            ``nonfinite_grad_policy`` says, as the reference library's assertion does. Without
            it the step still checks every gradient, fused (one sync per step), and follows
            ``nonfinite_grad_policy``.
    """

    eager_nan_check: bool = False

    def __post_init__(self) -> None:
        check_bool("eager_nan_check", self.eager_nan_check)


DefaultShampooRuntimeConfig = ShampooRuntimeConfig()


@dataclass(kw_only=True)
class ConcurrencyConfig:
    """Concurrency of the param groups' steps.

    Fields:
        enable_cuda_stream_for_param_groups: in the reference library, each group's GPU work
            runs on its own CUDA stream, so that the groups' NCCL exchanges overlap (ignored
            on CPU). Accepted and validated here, with no effect: the groups step one after
            another on the current stream (a group's exchanges are already one ``all_to_all``
            per round over all of its blocks), on CPU and on CUDA alike.
    """

    enable_cuda_stream_for_param_groups: bool = True

    def __post_init__(self) -> None:
        check_bool("enable_cuda_stream_for_param_groups", self.enable_cuda_stream_for_param_groups)


DefaultConcurrencyConfig = ConcurrencyConfig()
