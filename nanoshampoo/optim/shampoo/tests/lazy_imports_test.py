"""A Shampoo run imports only the distributor and preconditioner modules its config needs.

The run log stores the source of every imported ``nanoshampoo`` module, so eager imports of
every distributor made a tiny run's log ~1.5k lines longer (measured: 10362 -> 8877 lines).
Checked in a fresh interpreter, since this test process has imported everything already. The
config modules (``*_types``) are always imported: ``shampoo_types`` re-exports every config.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys, torch
from nanoshampoo.optim.shampoo import AdamPreconditionerConfig, DistributedShampoo, {config}
# 40 x 30 stays a matrix (1200 > max_preconditioner_dim): spectral descent needs one.
param = torch.nn.Parameter(torch.randn(40, 30))
opt = DistributedShampoo([param], grafting_config=AdamPreconditionerConfig(),
                         preconditioner_config={config}())
param.grad = torch.randn(40, 30)
opt.step()
print(" ".join(sorted(m.rsplit(".", 1)[1] for m in sys.modules
                      if m.startswith("nanoshampoo.optim.shampoo.distributor.")
                      or m.startswith("nanoshampoo.optim.shampoo.preconditioner."))))
"""


@pytest.mark.slow  # a fresh interpreter imports torch
@pytest.mark.parametrize(
    "config, expected",
    [
        (
            "RootInvShampooPreconditionerConfig",
            "adagrad_preconditioner descent_types distributor distributor_types factor_matrix_ops "
            "kronecker_factored_preconditioner kronecker_factors matrix_functions_types "
            "matrix_roots "
            "parallel_eigh preconditioner preconditioner_types shampoo_preconditioner "
            "shampoo_variant_types single_device_distributor",
        ),
        (
            "SpectralDescentPreconditionerConfig",
            "adagrad_preconditioner descent_types distributor distributor_types "
            "matrix_functions_types preconditioner preconditioner_types shampoo_variant_types "
            "single_device_distributor "
            "spectral_descent_preconditioner",
        ),
    ],
)
def test_a_single_device_run_imports_only_what_its_config_needs(config: str, expected: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(config=config)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.split() == expected.split()
