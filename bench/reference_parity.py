"""Parity checks against implementations outside the project (results: docs/results/soap-parity.md).

``example5``: the reference library's README Example 5 (eigenvalue-corrected Shampoo, import
line swapped) on a small model for ``--steps`` float32 steps, with the reference library
(facebookresearch/optimizers ``distributed_shampoo``; pass the directory holding it), ours and
``torch.optim.AdamW`` fed the same batches; prints the relative parameter differences.

``variants``: the classic Shampoo variants and statistics options (eigendecomposed, KL-Shampoo,
trace scaling, a dropped weighting factor, ``CoupledHigherOrderConfig``, SOAP with a dropped
weighting factor) side by side with the reference library, float64, ``--steps`` steps on a small
model (``--no-bias``: only matrices, whose factors are full rank from the first root).

``one-step``: one SOAP step from the same state against nikhilvyas/SOAP. Runs the SOAP
reference implementation (https://github.com/nikhilvyas/SOAP, ``soap.py``; not part of this
project: pass the directory holding it) for ``--warm`` steps on a 32x16 matrix,
copies its state into :class:`DistributedShampoo` (factors, eigenbases, second moment; its
first moment, kept in the eigenbasis, rotated back to ours in the parameter basis), takes one
more step with both from that state, and prints the relative difference of the two updates.

The two place epsilon differently: ours divides by ``sqrt(D / bc2) + eps``; nikhilvyas/SOAP
by ``sqrt(D) + eps`` and folds ``sqrt(bc2)`` into the step size, i.e. ``sqrt(D / bc2) +
eps / sqrt(bc2)``. The second row of each pair runs ours with ``epsilon = eps / sqrt(bc2)``
(for this one step), which is that placement.

Example:
    python bench/reference_parity.py example5 --reference-dir /path/to/optimizers --steps 5
    python bench/reference_parity.py variants --reference-dir /path/to/optimizers --steps 10
    python bench/reference_parity.py one-step --soap-dir /path/to/nikhilvyas-SOAP --grad-scale 1e-4
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from types import ModuleType
from typing import Any

import torch

import nanoshampoo.optim.shampoo as ours
from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    EigendecompositionConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    QREigendecompositionConfig,
)

SHAPE = (32, 16)


def example_5_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def example_5_optimizer(
    library: ModuleType, model: torch.nn.Module, qr: bool
) -> torch.optim.Optimizer:
    """Example 5's call, with ``library`` in place of the import line."""
    return library.DistributedShampoo(
        model.parameters(),
        lr=0.001,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        weight_decay=1e-05,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        weight_decay_type=library.WeightDecayType.DECOUPLED,
        preconditioner_config=library.DefaultSOAPConfig
        if qr
        else library.DefaultEigenvalueCorrectedShampooConfig,
    )


def train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, features: int = 12
) -> list[torch.Tensor]:
    """``steps`` MSE steps on seeded batches of 32 (default dtype); the final parameters."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        inputs, targets = (
            torch.randn(32, features, generator=gen),
            torch.randn(32, 3, generator=gen),
        )
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def max_relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        (torch.linalg.vector_norm(x - y) / torch.linalg.vector_norm(y)).item() for x, y in zip(a, b)
    )


def example5(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.reference_dir)
    reference = importlib.import_module("distributed_shampoo")
    for qr in (False, True):
        runs = {}
        for name, library in (("reference", reference), ("ours", ours)):
            model = example_5_model()
            runs[name] = train(model, example_5_optimizer(library, model, qr), args.steps)
        model = example_5_model()
        runs["adamw"] = train(
            model,
            torch.optim.AdamW(
                model.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-12, weight_decay=1e-05
            ),
            args.steps,
        )
        config = "DefaultSOAPConfig" if qr else "DefaultEigenvalueCorrectedShampooConfig"
        print(
            f"{config}, {args.steps} steps: ours vs reference "
            f"{max_relative(runs['ours'], runs['reference']):.2e}, "
            f"reference vs AdamW {max_relative(runs['reference'], runs['adamw']):.2e}, "
            f"ours vs AdamW {max_relative(runs['ours'], runs['adamw']):.2e}"
        )


def variant_configs(library: ModuleType) -> dict[str, Any]:
    """The same configs in either library, every state in float64."""
    f64 = dict(factor_matrix_dtype=torch.float64)
    # The reference stores roots in float32 unless told; ours in the block's dtype.
    roots = dict(inv_factor_matrix_dtype=torch.float64) if library is not ours else {}
    eig = dict(
        factor_matrix_eigenvectors_dtype=torch.float64,
        factor_matrix_eigenvalues_dtype=torch.float64,
    )
    soap = dict(
        factor_matrix_eigenvectors_dtype=torch.float64, corrected_eigenvalues_dtype=torch.float64
    )
    higher = library.CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=1e-6, tolerance=1e-14)
    return {
        "RootInvShampoo": library.RootInvShampooPreconditionerConfig(**f64, **roots),
        "EigendecomposedShampoo": library.EigendecomposedShampooPreconditionerConfig(**f64, **eig),
        "RootInvKLShampoo": library.RootInvKLShampooPreconditionerConfig(**f64, **roots),
        "EigendecomposedKLShampoo": library.EigendecomposedKLShampooPreconditionerConfig(
            **f64, **eig
        ),
        "use_trace_scaling": library.RootInvShampooPreconditionerConfig(
            use_trace_scaling=True, **f64, **roots
        ),
        "trace_scaling_exponent=1": library.RootInvShampooPreconditionerConfig(
            use_trace_scaling=True, trace_scaling_exponent=1.0, **f64, **roots
        ),
        "drop_weighting_factor_on_gsquare": library.RootInvShampooPreconditionerConfig(
            drop_weighting_factor_on_gsquare=True, **f64, **roots
        ),
        "CoupledHigherOrderConfig": library.RootInvShampooPreconditionerConfig(
            amortized_computation_config=higher, **f64, **roots
        ),
        "SOAP drop_weighting_factor_on_gsquare": (
            library.EigenvalueCorrectedShampooPreconditionerConfig(
                drop_weighting_factor_on_gsquare=True, **f64, **soap
            )
        ),
    }


def variants(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.reference_dir)
    reference = importlib.import_module("distributed_shampoo")
    torch.set_default_dtype(torch.float64)
    for name in variant_configs(ours):
        for grafting in (
            (None, "Adam drop_weighting_factor_on_gsquare") if name == "RootInvShampoo" else (None,)
        ):
            runs = []
            for library in (reference, ours):
                torch.manual_seed(0)
                model = torch.nn.Sequential(
                    torch.nn.Linear(12, 5, bias=not args.no_bias),
                    torch.nn.Tanh(),
                    torch.nn.Linear(5, 3, bias=not args.no_bias),
                )
                graft = (
                    None
                    if grafting is None
                    else library.AdamPreconditionerConfig(
                        beta2=0.99, epsilon=1e-8, drop_weighting_factor_on_gsquare=True
                    )
                )
                optimizer = library.DistributedShampoo(
                    model.parameters(),
                    lr=0.01,
                    betas=(0.9, 0.95),
                    epsilon=1e-6,
                    max_preconditioner_dim=8,
                    precondition_frequency=2,
                    start_preconditioning_step=2,
                    grafting_config=graft,
                    preconditioner_config=variant_configs(library)[name],
                )
                runs.append(train(model, optimizer, args.steps, features=12))
            label = name if grafting is None else f"{name}, grafting {grafting}"
            print(
                f"{label}: {args.steps} float64 steps, ours vs reference "
                f"{max_relative(runs[1], runs[0]):.2e}"
            )


def reference_state(
    soap_dir: str, args: argparse.Namespace
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor, torch.Tensor]:
    """``(weights before the measured step, state snapshot, gradient, reference update)``."""
    sys.path.insert(0, soap_dir)
    from soap import SOAP  # noqa: PLC0415 (the reference is not a dependency of the project)

    gen = torch.Generator().manual_seed(args.seed)
    param = torch.nn.Parameter(torch.randn(SHAPE, generator=gen))
    grads = [args.grad_scale * torch.randn(SHAPE, generator=gen) for _ in range(args.warm + 1)]
    reference = SOAP(
        [param],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
        weight_decay=0.0,
        precondition_frequency=args.frequency,
    )
    for grad in grads[: args.warm]:
        param.grad = grad.clone()
        reference.step()
    state = {
        key: [m.clone() for m in value]
        if isinstance(value, list)
        else value.clone()
        if torch.is_tensor(value)
        else value
        for key, value in reference.state[param].items()
    }
    before = param.detach().clone()
    param.grad = grads[args.warm].clone()
    reference.step()
    return before, state, grads[args.warm], param.detach() - before


def our_update(
    before: torch.Tensor,
    state: dict[str, Any],
    grad: torch.Tensor,
    epsilon: float,
    solver: EigendecompositionConfig,
    args: argparse.Namespace,
) -> torch.Tensor:
    """Our update of the same step from the reference's state (no eigenbasis computed in it)."""
    param = torch.nn.Parameter(before.clone())
    opt = DistributedShampoo(
        [param],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        epsilon=epsilon,
        max_preconditioner_dim=max(SHAPE),
        precondition_frequency=1000,
        grafting_config=None,
        preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(
            amortized_computation_config=solver, use_symmetric_packing=False
        ),
    )
    param.grad = torch.zeros(SHAPE)
    opt.step()  # a zero step allocates the state; it is replaced below
    saved = copy.deepcopy(opt.state_dict())
    block = saved["state"][0]["block_0"]
    left, right = state["Q"]
    # A state dict holds the bases ascending, D indexed by them (the reference library's order);
    # the optimizer keeps them as the reference SOAP's descending Q: reversed here, back on load.
    for dim, (factor, basis) in enumerate(zip(state["GG"], (left, right))):
        block["shampoo"]["factor_matrices"][dim] = factor.clone()
        block["shampoo"]["factor_matrices_eigenvectors"][dim] = basis.flip(-1)
        block["shampoo"]["eigenvectors_computed"][dim] = torch.tensor(True)
    block["shampoo"]["corrected_eigenvalues"] = state["exp_avg_sq"].flip(0).flip(1)
    block["filtered_grad"] = left @ state["exp_avg"] @ right.T
    saved["state"][0]["step"] = torch.tensor(int(state["step"]))
    opt.load_state_dict(saved)
    param.grad = grad.clone()
    opt.step()
    return param.detach() - before


def one_step(args: argparse.Namespace) -> None:
    before, state, grad, reference = reference_state(args.soap_dir, args)
    step = state["step"] + 1
    bias_correction2 = 1.0 - args.beta2**step
    for name, solver in (
        ("eigh", EighEigendecompositionConfig()),
        ("qr", QREigendecompositionConfig()),
    ):
        for placement, epsilon in (
            ("after bias correction (ours)", args.eps),
            ("before bias correction (nikhilvyas/SOAP)", args.eps / bias_correction2**0.5),
        ):
            update = our_update(before, state, grad, epsilon, solver, args)
            relative = (
                torch.linalg.vector_norm(update - reference) / torch.linalg.vector_norm(reference)
            ).item()
            print(
                f"grad scale {args.grad_scale:g}, {name}, epsilon {placement}: step {step}, "
                f"relative update difference {relative:.2e}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    side_by_side = commands.add_parser("example5", help="README Example 5 vs the reference library")
    side_by_side.add_argument(
        "--reference-dir", required=True, help="directory holding distributed_shampoo/"
    )
    side_by_side.add_argument("--steps", type=int, default=5)
    variant = commands.add_parser(
        "variants", help="Shampoo variants vs the reference library (float64)"
    )
    variant.add_argument(
        "--reference-dir", required=True, help="directory holding distributed_shampoo/"
    )
    variant.add_argument("--steps", type=int, default=10)
    variant.add_argument("--no-bias", action="store_true", help="matrices only (full-rank factors)")
    single = commands.add_parser("one-step", help="one step from the same state vs nikhilvyas/SOAP")
    single.add_argument(
        "--soap-dir", required=True, help="directory holding nikhilvyas/SOAP's soap.py"
    )
    single.add_argument(
        "--grad-scale", type=float, default=1.0, help="gradient entries ~ N(0, scale^2)"
    )
    single.add_argument(
        "--warm", type=int, default=6, help="reference steps before the measured one"
    )
    single.add_argument("--frequency", type=int, default=3, help="reference eigenbasis frequency")
    single.add_argument("--lr", type=float, default=3e-3)
    single.add_argument("--beta1", type=float, default=0.95)
    single.add_argument("--beta2", type=float, default=0.95)
    single.add_argument("--eps", type=float, default=1e-8)
    single.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"example5": example5, "variants": variants, "one-step": one_step}[args.command](args)


if __name__ == "__main__":
    main()
