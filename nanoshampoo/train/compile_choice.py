"""Whether the trainer runs the model through ``torch.compile`` (``TrainConfig.compile``).

``"true"`` / ``"false"`` decide. ``"auto"`` (the default) compiles only where compiling was
measured to pay for itself within the run, and says why in the run header:

* on CPU, in one process (the measurement's setting; compiled multi-process and sharded
  models, with the optimizers' gradient hooks, were not timed against eager);
* for runs of at least :data:`COMPILE_PAYS_AFTER_STEPS` steps;
* when inductor compiles and runs a probe here (on CPU it needs a C++ compiler).

Elsewhere ``"auto"`` stays eager: on CUDA nothing was measured here (the gpt2 CUDA presets
set ``compile = true`` themselves).

The measurement (``bench/train_compile_steps.py``, ``bench/train_compile.py``,
``docs/results/mfu.md`` "torch.compile"): on the project's 2-core Xeon (torch 2.13, bf16
autocast, 1 thread, cores shared with other jobs) the compiled tiny model's step took 0.55x
(tiny-adamw) and 0.54x (tiny-shampoo) of the eager one, the two alternating in one process.
The compilation, inside the first training step, cost 1-4 s more than an eager first step
from the inductor cache that later runs reuse (paid back after 10-34 steps), and 39-122 s with
an empty cache (a user's first compiled run; paid back after 89-291 steps). A 300-step
``make train`` trains faster compiled, on its first run too.

Example:
    >>> resolve_compile("false", torch.device("cpu"), world_size=1, num_iterations=300)
    CompileChoice(enabled=False, reason='compile=false')
    >>> resolve_compile("auto", torch.device("cpu"), world_size=1, num_iterations=40).reason
    'auto: off for a run of 40 steps (compiling pays after ~300 on CPU)'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoshampoo.train.probe_cache import ProbeCache

COMPILE_CHOICES = ("auto", "true", "false")
# The shortest run "auto" compiles on CPU: the worst payback measured, 291 steps with a cold
# inductor cache (see the module doc).
COMPILE_PAYS_AFTER_STEPS = 300


@dataclass(frozen=True)
class CompileChoice:
    """``enabled``: the model runs through ``torch.compile``; ``reason``: one line, for the
    run header and the log."""

    enabled: bool
    reason: str

    @property
    def name(self) -> str:
        return "on" if self.enabled else "off"


def _probe_function(x: torch.Tensor) -> torch.Tensor:
    return (x * 2.0 + 1.0).relu()


def probe_inductor(device: torch.device) -> str | None:
    """``None`` when inductor compiles and runs a one-line function on ``device`` with the
    eager result; otherwise why not, in one line (the exception's type and first line)."""
    x = torch.linspace(-2.0, 2.0, 8, device=device)
    try:
        compiled = torch.compile(_probe_function, backend="inductor", fullgraph=True)(x)
    except Exception as error:  # noqa: BLE001 - any failure means: do not compile here
        first = (str(error).strip().splitlines() or [""])[0]
        return f"{type(error).__name__}: {first}"[:200]
    if not torch.equal(compiled, _probe_function(x)):
        return "the probe's compiled result differs from the eager one"
    return None


def resolve_compile(
    choice: str,
    device: torch.device,
    world_size: int,
    num_iterations: int,
    cache: ProbeCache | None = None,
) -> CompileChoice:
    """Resolve ``TrainConfig.compile`` (``auto|true|false``) for this run; see the module doc.

    ``"auto"`` probes inductor (~1 s, a few more on a first run) only when the run is one it
    would compile; ``cache``: where that verdict may come from and goes (``probe_cache``).
    """
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"TrainConfig.compile must be one of {COMPILE_CHOICES}, got {choice!r}")
    if choice != "auto":
        return CompileChoice(choice == "true", f"compile={choice}")
    if device.type != "cpu":
        return CompileChoice(
            False, f"auto: off on {device.type} (not measured; --compile true compiles)"
        )
    if world_size > 1:
        return CompileChoice(False, f"auto: off for {world_size} processes (measured in one)")
    if num_iterations < COMPILE_PAYS_AFTER_STEPS:
        return CompileChoice(
            False,
            f"auto: off for a run of {num_iterations} steps (compiling "
            f"pays after ~{COMPILE_PAYS_AFTER_STEPS} on CPU)",
        )
    failure, note = (cache or ProbeCache(None)).answer(
        "inductor", {"device": device.type}, lambda: probe_inductor(device)
    )
    noted = f"; probe {note}" if note else ""
    if failure is not None:
        return CompileChoice(False, f"auto: off, inductor cannot compile here ({failure}{noted})")
    return CompileChoice(
        True,
        f"auto: a {num_iterations}-step run on CPU (compiling pays "
        f"after ~{COMPILE_PAYS_AFTER_STEPS} steps, ~15 from inductor's "
        f"cache{noted})",
    )
