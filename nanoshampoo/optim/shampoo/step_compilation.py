"""``torch.compile`` of a param group's step, after probing that the backend works here.

Inductor on CPU needs a C++ compiler and on CUDA Triton; a machine without them fails only at
the first compiled call, deep inside a step. So the optimizer first compiles and runs a
one-line function with the same settings on the parameters' device (:func:`probe_compile`,
cached per setting and device type) and, when that fails, logs the reason and keeps the eager
step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from nanoshampoo.optim.shampoo.runtime_types import ShampooPT2CompileConfig

logger = logging.getLogger(__name__)

_probe_results: dict[tuple[str, str], str | None] = {}


def _probe_function(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 + 1.0


def _one_line(error: BaseException) -> str:
    """``Type: first line`` of the innermost cause (dynamo wraps a backend's error in
    ``BackendCompilerFailed``, whose own message names only the backend)."""
    root = error
    while (
        inner := getattr(root, "inner_exception", None) or root.__cause__
    ) is not None and inner is not root:
        root = inner
    first_line = (str(root).strip().splitlines() or [""])[0]
    return f"{type(root).__name__}: {first_line[:200]}"


def probe_compile(config: ShampooPT2CompileConfig, device: torch.device) -> str | None:
    """``None`` when ``config`` compiles and runs a one-line function on ``device`` with the
    right result; otherwise the reason, one line (the exception's type and first line)."""
    key = (repr(sorted(config.compile_kwargs().items(), key=lambda item: item[0])), device.type)
    if key not in _probe_results:
        reason: str | None = None
        try:
            x = torch.arange(4.0, device=device)
            if not torch.equal(
                torch.compile(_probe_function, **config.compile_kwargs())(x), _probe_function(x)
            ):
                reason = "the probe's compiled result differs from the eager one"
        except Exception as error:  # noqa: BLE001 - any failure means: do not compile here
            reason = _one_line(error)
        _probe_results[key] = reason
    return _probe_results[key]


def compile_step(
    step: Callable[..., Any], config: ShampooPT2CompileConfig | None, device: torch.device
) -> tuple[Callable[..., Any], bool]:
    """``(torch.compile(step, ...), True)`` when ``config`` asks for it and the probe passes;
    ``(step, False)`` otherwise (no config, ``disable``, or a failed probe, whose reason is
    logged as a warning)."""
    if config is None or config.disable:
        return step, False
    reason = probe_compile(config, device)
    if reason is not None:
        logger.warning(
            f"shampoo_pt2_compile_config: backend {config.backend!r} cannot compile on "
            f"{device.type} ({reason}); the step runs eagerly"
        )
        return step, False
    return torch.compile(step, **config.compile_kwargs()), True
