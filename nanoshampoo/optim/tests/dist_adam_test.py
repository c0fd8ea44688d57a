"""DistAdam against torch.optim.AdamW fed the rank-mean gradient, on gloo and on one process.

The toy problem has one parameter of each kind DistAdam distinguishes: sharded (two of the same
shape, so one shape group holds both), dim 0 divisible by neither 2 nor 4 (replicated), small
(replicated), 0-D (replicated) and one that never receives a gradient (skipped).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import Tensor

import nanoshampoo.optim.dist_adam as dist_adam_module
from nanoshampoo.optim.dist_adam import DistAdam, adamw_update_
from nanoshampoo.optim.shampoo.shampoo_types import NonFiniteGradientError
from nanoshampoo.testing.distributed import run_on_gloo

SHAPES: dict[str, tuple[int, ...]] = {
    "w1": (16, 80),  # 1280 elements, dim 0 divisible by 2 and 4: sharded
    "w2": (16, 80),  # same shape group as w1
    "odd": (5, 256),  # 1280 elements, dim 0 divisible by neither 2 nor 4: replicated
    "bias": (16,),  # below shard_min_numel: replicated
    "gain": (),  # 0-D: replicated
    "unused": (8, 160),  # never in the loss: grad stays None
}
LR_MUL = {"w2": 0.5, "odd": 2.0}
WD_MUL = {"bias": 0.0, "odd": 0.3}
LR = 1e-2
BETAS = (0.9, 0.99)
# DistAdam adds eps before the bias correction, AdamW after; with eps far below sqrt(v) in
# fp32 both are exact, so the comparison tests everything else at 1e-6.
EPS = 1e-12
WD = 0.1
# Comparable to sqrt(v) of this problem's gradients, so the gradient scale shows in the update.
LARGE_EPS = 1e-2
BATCH = 4
STEPS = 4
SPLIT = 2  # the state-dict round trip saves after this many steps


def make_params() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = {name: torch.randn(shape, generator=gen) * 0.3 for name, shape in SHAPES.items()}
    params["gain"] = params["gain"] + 1.0
    return {name: p.requires_grad_() for name, p in params.items()}


def make_batch(rank: int, step: int, micro: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    return torch.randn(BATCH, 80, generator=gen), torch.randn(BATCH, 256, generator=gen)


def loss_fn(params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    h = torch.tanh(x @ params["w1"].T + params["bias"])  # (B, 16)
    h = h * (x @ params["w2"].T)  # (B, 16)
    z = h[:, :5] + 0.1 * (y @ params["odd"].T)  # (B, 5)
    return params["gain"] * (z**2).mean()


def make_optimizer(
    params: dict[str, Tensor], launch: str = "hook", eps: float = EPS, policy: str = "raise"
) -> DistAdam:
    for name, p in params.items():
        if name in LR_MUL:
            p.lr_mul = LR_MUL[name]
        if name in WD_MUL:
            p.wd_mul = WD_MUL[name]
    return DistAdam(
        list(params.values()),
        lr=LR,
        betas=BETAS,
        eps=eps,
        weight_decay=WD,
        launch=launch,
        nonfinite_grad_policy=policy,
    )


def train(
    rank: int,
    params: dict[str, Tensor],
    opt: DistAdam,
    steps: range,
    micro_batches: int = 1,
    sync_in_hooks: bool = True,
) -> None:
    for step in steps:
        for micro in range(micro_batches):
            opt.should_sync = sync_in_hooks and micro == micro_batches - 1
            x, y = make_batch(rank, step, micro)
            (loss_fn(params, x, y) / micro_batches).backward()
        opt.step()
        opt.zero_grad()


def mean_gradients(
    params: dict[str, Tensor], world_size: int, step: int, micro_batches: int
) -> dict[str, Tensor]:
    """Each rank's gradient on its whole (all micro-batches) batch, averaged over ranks."""
    trained = [name for name in params if name != "unused"]
    total = {name: torch.zeros_like(params[name]) for name in trained}
    for rank in range(world_size):
        batches = [make_batch(rank, step, micro) for micro in range(micro_batches)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        grads = torch.autograd.grad(loss_fn(params, x, y), [params[n] for n in trained])
        for name, grad in zip(trained, grads):
            total[name] += grad
    return {name: grad / world_size for name, grad in total.items()}


def reference_adamw(world_size: int, steps: int, micro_batches: int = 1) -> dict[str, Tensor]:
    """torch.optim.AdamW on one process, fed each step the rank-mean gradient."""
    params = make_params()
    groups = [
        {
            "params": [p],
            "lr": LR * LR_MUL.get(name, 1.0),
            "weight_decay": WD * WD_MUL.get(name, 1.0),
        }
        for name, p in params.items()
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(steps):
        for name, grad in mean_gradients(params, world_size, step, micro_batches).items():
            params[name].grad = grad
        opt.step()
    return {name: p.detach() for name, p in params.items()}


def reference_spec_adam(world_size: int, steps: int, eps: float) -> dict[str, Tensor]:
    """The spec's update (eps added to sqrt(v) before bias correction) written out by hand.

    With a large ``eps`` the update depends on the gradient's scale, so this also checks that
    gradients are averaged over ranks rather than summed.
    """
    params = make_params()
    beta1, beta2 = BETAS
    moments = {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in params.items()}
    for step in range(1, steps + 1):
        grads = mean_gradients(params, world_size, step - 1, 1)
        with torch.no_grad():
            for name, grad in grads.items():
                lr = LR * LR_MUL.get(name, 1.0)
                wd = WD * WD_MUL.get(name, 1.0)
                m = beta1 * moments[name][0] + (1 - beta1) * grad
                v = beta2 * moments[name][1] + (1 - beta2) * grad * grad
                moments[name] = (m, v)
                step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
                new = params[name] * (1 - lr * wd) - step_size * m / (v.sqrt() + eps)
                params[name].copy_(new)
    return {name: p.detach() for name, p in params.items()}


def detached(params: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in params.items()}


def roundtrip(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _gloo_body(rank: int, world_size: int) -> dict[str, object]:
    results: dict[str, object] = {}

    # Hook launch, saving a checkpoint half way; the uninterrupted run is the main result.
    params = make_params()
    opt = make_optimizer(params)
    train(rank, params, opt, range(SPLIT))
    saved_state = roundtrip(opt.state_dict())
    saved_params = detached(params)
    train(rank, params, opt, range(SPLIT, STEPS))
    results["hook"] = detached(params)
    results["state_shapes"] = {
        name: list(opt.state[p]["exp_avg"].shape) for name, p in params.items() if p in opt.state
    }

    resumed = {name: p.clone().requires_grad_() for name, p in saved_params.items()}
    resumed_opt = make_optimizer(resumed)
    resumed_opt.load_state_dict(saved_state)
    train(rank, resumed, resumed_opt, range(SPLIT, STEPS))
    results["resumed"] = detached(resumed)

    params = make_params()
    train(rank, params, make_optimizer(params, launch="step"), range(STEPS))
    results["step"] = detached(params)

    # Hook mode with should_sync never set: step() must still launch every reduce-scatter.
    params = make_params()
    train(rank, params, make_optimizer(params), range(STEPS), sync_in_hooks=False)
    results["unsynced_hooks"] = detached(params)

    params = make_params()
    train(rank, params, make_optimizer(params), range(STEPS), micro_batches=2)
    results["accumulated"] = detached(params)

    params = make_params()
    train(rank, params, make_optimizer(params, eps=LARGE_EPS), range(STEPS))
    results["large_eps"] = detached(params)

    # A synced backward not followed by step(): zero_grad and the next synced backward refuse.
    params = make_params()
    opt = make_optimizer(params)
    x, y = make_batch(rank, 0, 0)
    loss_fn(params, x, y).backward()
    errors = []
    try:
        opt.zero_grad()
    except RuntimeError as exc:
        errors.append(str(exc))
    try:
        loss_fn(params, x, y).backward()
    except RuntimeError as exc:
        errors.append(str(exc))
    opt.step()  # consumes the launched collectives so the group shuts down cleanly
    results["errors"] = errors
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def gloo_run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, object]]]:
    world_size = request.param
    return world_size, run_on_gloo(_gloo_body, world_size)


def assert_params_close(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    for name in SHAPES:
        torch.testing.assert_close(actual[name], expected[name], atol=1e-6, rtol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_matches_adamw_on_the_mean_gradient(gloo_run: tuple[int, list[dict]]) -> None:
    world_size, results = gloo_run
    expected = reference_adamw(world_size, STEPS)
    for result in results:
        assert_params_close(result["hook"], expected)
    assert not torch.equal(expected["w1"], make_params()["w1"])


@pytest.mark.distributed
@pytest.mark.slow
def test_gradients_are_averaged_over_ranks(gloo_run: tuple[int, list[dict]]) -> None:
    world_size, results = gloo_run
    expected = reference_spec_adam(world_size, STEPS, LARGE_EPS)
    for result in results:
        assert_params_close(result["large_eps"], expected)


@pytest.mark.distributed
@pytest.mark.slow
def test_every_rank_holds_identical_parameters(gloo_run: tuple[int, list[dict]]) -> None:
    _, results = gloo_run
    for result in results[1:]:
        for name in SHAPES:
            assert torch.equal(result["hook"][name], results[0]["hook"][name])


@pytest.mark.distributed
@pytest.mark.slow
def test_step_launch_gives_the_same_numbers_as_hook_launch(gloo_run: tuple[int, list]) -> None:
    _, results = gloo_run
    for result in results:
        for name in SHAPES:
            assert torch.equal(result["step"][name], result["hook"][name])
            assert torch.equal(result["unsynced_hooks"][name], result["hook"][name])


@pytest.mark.distributed
@pytest.mark.slow
def test_gradient_accumulation_equals_one_large_batch(gloo_run: tuple[int, list]) -> None:
    world_size, results = gloo_run
    expected = reference_adamw(world_size, STEPS, micro_batches=2)
    for result in results:
        assert_params_close(result["accumulated"], expected)


@pytest.mark.distributed
@pytest.mark.slow
def test_state_dict_round_trip_continues_identically(gloo_run: tuple[int, list]) -> None:
    _, results = gloo_run
    for result in results:
        for name in SHAPES:
            assert torch.equal(result["resumed"][name], result["hook"][name])


@pytest.mark.distributed
@pytest.mark.slow
def test_state_is_sharded_only_where_dim0_divides(gloo_run: tuple[int, list]) -> None:
    world_size, results = gloo_run
    expected = {
        "w1": [16 // world_size, 80],
        "w2": [16 // world_size, 80],
        "odd": [5, 256],
        "bias": [16],
        "gain": [],
    }
    for result in results:
        assert result["state_shapes"] == expected


@pytest.mark.distributed
@pytest.mark.slow
def test_parameter_without_gradient_is_unchanged(gloo_run: tuple[int, list]) -> None:
    _, results = gloo_run
    for result in results:
        assert torch.equal(result["hook"]["unused"], make_params()["unused"])


@pytest.mark.distributed
@pytest.mark.slow
def test_unconsumed_reduce_scatter_is_an_error(gloo_run: tuple[int, list]) -> None:
    _, results = gloo_run
    for result in results:
        assert len(result["errors"]) == 2
        for message in result["errors"]:
            assert "never consumed by step()" in message


def test_world_size_one_matches_adamw_without_a_process_group() -> None:
    params = make_params()
    opt = make_optimizer(params)
    assert (opt.world_size, opt.rank) == (1, 0)
    train(0, params, opt, range(STEPS))
    assert_params_close(detached(params), reference_adamw(1, STEPS))


def test_world_size_one_gradient_accumulation() -> None:
    params = make_params()
    train(0, params, make_optimizer(params), range(STEPS), micro_batches=3)
    assert_params_close(detached(params), reference_adamw(1, STEPS, micro_batches=3))


def test_update_follows_the_bias_corrected_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    param, grad = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    exp_avg, exp_avg_sq = torch.randn(7, generator=gen), torch.rand(7, generator=gen)
    lr, beta1, beta2, eps, wd, step = 0.1, 0.8, 0.9, 0.05, 0.2, 3
    expected = []
    for i in range(7):
        p = param[i].item() * (1 - lr * wd)
        m = beta1 * exp_avg[i].item() + (1 - beta1) * grad[i].item()
        v = beta2 * exp_avg_sq[i].item() + (1 - beta2) * grad[i].item() ** 2
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        expected.append(p - step_size * m / (math.sqrt(v) + eps))
    adamw_update_(
        param, grad, exp_avg, exp_avg_sq,
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
    )  # fmt: skip
    torch.testing.assert_close(param, torch.tensor(expected), atol=1e-6, rtol=1e-6)


def test_groups_by_shape_in_first_seen_order_keeping_group_options() -> None:
    a, b, c, d = (torch.zeros(s, requires_grad=True) for s in [(2, 3), (4,), (2, 3), (4,)])
    e = torch.zeros(5, requires_grad=True)
    opt = DistAdam([{"params": [a, b, c, d]}, {"params": [e], "lr": 0.5}], lr=0.1)
    assert [g["params"] for g in opt.param_groups] == [[a, c], [b, d], [e]]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.1, 0.5]


INVALID_OPTIONS = [
    ({"lr": -1.0}, "lr"),
    ({"lr": math.inf}, "lr"),
    ({"lr": math.nan}, "lr"),
    ({"betas": (0.9, 1.0)}, "betas"),
    ({"betas": 0.9}, "betas"),
    ({"betas": (0.9,)}, "betas"),
    ({"betas": (math.nan, 0.99)}, "betas"),
    ({"eps": -1e-8}, "eps"),
    ({"eps": 0.0}, "eps"),
    ({"eps": math.inf}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"weight_decay": math.inf}, "weight_decay"),
    ({"weight_decay": math.nan}, "weight_decay"),
]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    INVALID_OPTIONS
    + [
        ({"launch": "backward"}, "launch"),
        ({"shard_min_numel": -1}, "shard_min_numel"),
        ({"nonfinite_grad_policy": "ignore"}, "nonfinite_grad_policy"),
    ],
    ids=str,
)
def test_invalid_options_raise_value_error_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DistAdam([torch.zeros(3, requires_grad=True)], **kwargs)


def test_invalid_group_option_names_the_group() -> None:
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="param group 0: lr"):
        DistAdam([{"params": [p], "lr": -1.0}])


@pytest.mark.parametrize("name", ["lr_mul", "wd_mul"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_invalid_parameter_multiplier_names_it(name: str, value: float) -> None:
    p = torch.zeros(3, requires_grad=True)
    setattr(p, name, value)
    with pytest.raises(ValueError, match=f"param group 0: {name}"):
        DistAdam([p])


def assert_one_group_holding(opt: DistAdam, param: Tensor) -> None:
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == [param]


@pytest.mark.parametrize(("kwargs", "field"), INVALID_OPTIONS, ids=str)
def test_add_param_group_that_fails_validation_is_not_added(kwargs: dict, field: str) -> None:
    kept = torch.zeros(3, requires_grad=True)
    rejected = torch.ones(2, 3, requires_grad=True)
    opt = DistAdam([kept], lr=0.1)
    with pytest.raises(ValueError, match=f"param group 1: {field}"):
        opt.add_param_group({"params": [rejected], **kwargs})
    assert_one_group_holding(opt, kept)
    assert not rejected._post_accumulate_grad_hooks  # no backward hook was registered
    rejected.sum().backward()
    opt.step()
    assert torch.equal(rejected, torch.ones(2, 3))
    assert opt.state_dict()["state"] == {}


def test_add_param_group_rolls_back_every_shape_group_when_torch_refuses_one() -> None:
    kept = torch.zeros(3, requires_grad=True)
    new = torch.zeros(2, 3, requires_grad=True)
    opt = DistAdam([kept])
    # Split by shape into [new] (accepted by torch) then [kept] (already in group 0: refused).
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [new, kept]})
    assert_one_group_holding(opt, kept)
    assert not new._post_accumulate_grad_hooks


def test_step_revalidates_options_before_changing_anything() -> None:
    params = make_params()
    opt = make_optimizer(params)
    train(0, params, opt, range(1))
    before = detached(params)
    state_before = roundtrip(opt.state_dict())
    x, y = make_batch(0, 1, 0)
    loss_fn(params, x, y).backward()  # the hooks launch (world size 1: trivial) syncs
    for field, value in [("lr", math.inf), ("eps", 0.0), ("betas", 0.9)]:
        good = opt.param_groups[1][field]
        opt.param_groups[1][field] = value  # what a buggy scheduler would do
        with pytest.raises(ValueError, match=f"param group 1: {field}"):
            opt.step()
        opt.param_groups[1][field] = good
        assert all(torch.equal(params[n], before[n]) for n in SHAPES)
        assert_state_equal(opt.state_dict(), state_before)
    opt.step()  # the launched syncs are still there to consume once the options are fixed
    opt.zero_grad()
    train(0, params, opt, range(2, STEPS))
    reference = make_params()
    reference_opt = make_optimizer(reference)
    train(0, reference, reference_opt, range(STEPS))
    for name in SHAPES:
        assert torch.equal(params[name], reference[name])


def assert_state_equal(actual: dict, expected: dict) -> None:
    assert actual["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert actual["state"][index]["step"] == entry["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(actual["state"][index][key], entry[key])


def nan_batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    """``make_batch`` with one NaN input: every parameter but ``unused`` gets a NaN gradient."""
    x, y = make_batch(rank, step, 0)
    x[0, 0] = math.nan
    return x, y


def test_nonfinite_gradient_raises_naming_the_parameter_and_changes_nothing() -> None:
    params = make_params()
    opt = make_optimizer(params)
    train(0, params, opt, range(1))
    before, state_before = detached(params), roundtrip(opt.state_dict())
    x, y = make_batch(0, 1, 0)
    loss_fn(params, x, y).backward()
    params["odd"].grad[2, 7] = math.inf  # only this gradient is bad
    with pytest.raises(NonFiniteGradientError, match=r"param 0 of group 1 \(shape \(5, 256\)\)"):
        opt.step()
    assert all(torch.equal(params[n], before[n]) for n in SHAPES)
    assert_state_equal(opt.state_dict(), state_before)
    opt.zero_grad()  # nothing launched is left waiting for step()
    train(0, params, opt, range(1, STEPS))
    assert all(torch.isfinite(p).all() for p in params.values())


def test_nonfinite_gradient_skip_policy_skips_the_step(caplog: pytest.LogCaptureFixture) -> None:
    params = make_params()
    opt = DistAdam(list(params.values()), lr=LR, nonfinite_grad_policy="skip")
    before = detached(params)
    x, y = nan_batch(0, 0)
    loss_fn(params, x, y).backward()
    opt.step()
    assert "skipping this step" in caplog.text and "group 0" in caplog.text
    assert all(torch.equal(params[n], before[n]) for n in SHAPES)
    assert opt.state_dict()["state"] == {}
    opt.zero_grad()
    train(0, params, opt, range(1))
    assert not torch.equal(params["w1"], before["w1"])


COMPLEX_SHAPES: dict[str, tuple[int, ...]] = {
    "c_sharded": (16, 80),  # sharded at world size 2
    "c_replicated": (5, 3),  # small: replicated
    "c_scalar": (),
}


def make_complex_params() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        name: (torch.randn(shape, dtype=torch.complex64, generator=gen) * 0.3).requires_grad_()
        for name, shape in COMPLEX_SHAPES.items()
    }


def complex_loss(params: dict[str, Tensor], rank: int, step: int) -> Tensor:
    """A real loss whose gradients have real and imaginary parts of very different scales."""
    gen = torch.Generator().manual_seed(777 + 100 * rank + step)
    x = torch.randn(4, 80, dtype=torch.complex64, generator=gen)
    z = torch.randn(4, 3, dtype=torch.complex64, generator=gen)
    h = x @ params["c_sharded"].T  # (4, 16)
    out = h[:, :5] @ params["c_replicated"] + z * params["c_scalar"]  # (4, 3)
    return out.real.square().mean() + 0.01 * out.imag.abs().mean()


def train_complex(rank: int, params: dict[str, Tensor], opt: torch.optim.Optimizer) -> None:
    for step in range(STEPS):
        complex_loss(params, rank, step).backward()
        opt.step()
        opt.zero_grad()


def reference_complex_adamw(world_size: int) -> dict[str, Tensor]:
    """torch.optim.AdamW on the rank-mean gradient of ``complex_loss``."""
    params = make_complex_params()
    opt = torch.optim.AdamW(list(params.values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(STEPS):
        grads = [
            torch.autograd.grad(complex_loss(params, rank, step), list(params.values()))
            for rank in range(world_size)
        ]
        for index, p in enumerate(params.values()):
            p.grad = sum(g[index] for g in grads) / world_size
        opt.step()
    return detached(params)


def test_complex_parameters_match_adamw() -> None:
    params = make_complex_params()
    opt = DistAdam(list(params.values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    train_complex(0, params, opt)
    expected = reference_complex_adamw(1)
    for name in COMPLEX_SHAPES:
        assert params[name].dtype == torch.complex64
        torch.testing.assert_close(params[name], expected[name], atol=1e-6, rtol=1e-6)
        assert not torch.equal(expected[name], make_complex_params()[name])


def test_synced_backward_without_step_raises_only_in_hook_mode() -> None:
    for launch, raises in [("hook", True), ("step", False)]:
        params = make_params()
        opt = make_optimizer(params, launch=launch)
        x, y = make_batch(0, 0, 0)
        loss_fn(params, x, y).backward()
        if raises:
            with pytest.raises(RuntimeError, match="never consumed by step"):
                loss_fn(params, x, y).backward()
        else:
            loss_fn(params, x, y).backward()
            opt.zero_grad()


def test_removed_hooks_launch_nothing() -> None:
    params = make_params()
    opt = make_optimizer(params)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in params.values())
    opt.remove_hooks()
    assert all(not p._post_accumulate_grad_hooks for p in params.values())
    x, y = make_batch(0, 0, 0)
    loss_fn(params, x, y).backward()
    opt.zero_grad()  # with a hook, this synced backward would have left a launched sync: raise
    train(0, params, opt, range(STEPS))  # step() still syncs every gradient itself
    assert_params_close(detached(params), reference_adamw(1, STEPS))


def test_load_state_dict_validates_everything_before_writing() -> None:
    params = make_params()
    opt = make_optimizer(params)
    train(0, params, opt, range(1))
    saved = roundtrip(opt.state_dict())
    train(0, params, opt, range(1, 2))
    current = roundtrip(opt.state_dict())
    bad_lr = roundtrip(saved)
    bad_lr["param_groups"][3]["lr"] = math.nan
    missing_key = roundtrip(saved)
    del missing_key["state"][4]["exp_avg_sq"]
    for bad, message in [
        (bad_lr, "state_dict param group 3: lr"),
        (missing_key, r"state\[4\] lacks \['exp_avg_sq'\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(bad)
        assert_state_equal(opt.state_dict(), current)
        assert opt.param_groups[3]["lr"] == LR


def test_load_state_dict_rejects_state_from_another_layout() -> None:
    params = make_params()
    opt = make_optimizer(params)
    train(0, params, opt, range(1))
    state = opt.state_dict()
    with pytest.raises(ValueError, match="rank 1 of world size 2"):
        opt.load_state_dict({**state, "dist_adam": {"world_size": 2, "rank": 1}})
    with pytest.raises(ValueError, match="no 'dist_adam' entry"):
        opt.load_state_dict({k: v for k, v in state.items() if k != "dist_adam"})
    bad = roundtrip(state)
    bad["state"][0]["exp_avg"] = torch.zeros(8, 80)
    with pytest.raises(ValueError, match=r"expected the local shard shape \(16, 80\)"):
        opt.load_state_dict(bad)


def _robustness_body(rank: int, world_size: int) -> dict[str, object]:
    """Non-finite gradients on one rank, complex parameters and removed hooks, on gloo."""
    results: dict[str, object] = {}

    # Hook launch, "raise": rank 1 alone sees a NaN batch at step 1; then step 1 is redone.
    params = make_params()
    opt = make_optimizer(params)
    train(rank, params, opt, range(1))
    before = detached(params)
    x, y = nan_batch(rank, 1) if rank == 1 else make_batch(rank, 1, 0)
    loss_fn(params, x, y).backward()
    try:
        opt.step()
        results["raised"] = ""
    except NonFiniteGradientError as exc:
        results["raised"] = str(exc)
    results["unchanged"] = all(torch.equal(params[n], before[n]) for n in SHAPES)
    results["state_steps"] = sorted({opt.state[p]["step"] for p in params.values() if opt.state[p]})
    opt.zero_grad()
    train(rank, params, opt, range(1, STEPS))
    results["after_raise"] = detached(params)

    # Step launch, "skip": rank 0 alone sees a NaN batch before the first step.
    params = make_params()
    opt = make_optimizer(params, launch="step", policy="skip")
    x, y = nan_batch(rank, 0) if rank == 0 else make_batch(rank, 0, 0)
    loss_fn(params, x, y).backward()
    opt.step()
    results["skip_left_state_empty"] = not any(opt.state[p] for p in params.values())
    opt.zero_grad()
    train(rank, params, opt, range(STEPS))
    results["after_skip"] = detached(params)

    complex_params = make_complex_params()
    complex_opt = DistAdam(
        list(complex_params.values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD
    )
    train_complex(rank, complex_params, complex_opt)
    results["complex"] = detached(complex_params)
    results["complex_state_shape"] = list(
        complex_opt.state[complex_params["c_sharded"]]["exp_avg"].shape
    )

    # Count the reduce-scatters DistAdam launches, with and without its backward hooks.
    launched: list[int] = []
    original = dist_adam_module.reduce_scatter_tensor

    def counting_reduce_scatter(*args: object, **kwargs: object) -> object:
        launched.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    dist_adam_module.reduce_scatter_tensor = counting_reduce_scatter  # type: ignore[assignment]
    try:
        params = make_params()
        opt = make_optimizer(params)
        x, y = make_batch(rank, 0, 0)
        loss_fn(params, x, y).backward()
        results["launched_by_backward_with_hooks"] = len(launched)
        opt.step()
        opt.zero_grad()
        opt.remove_hooks()
        launched.clear()
        loss_fn(params, x, y).backward()
        results["launched_by_backward_without_hooks"] = len(launched)
        opt.step()
        results["launched_by_step_without_hooks"] = len(launched)
    finally:
        dist_adam_module.reduce_scatter_tensor = original  # type: ignore[assignment]
    return results


@pytest.fixture(scope="module")
def robustness_run() -> list[dict[str, object]]:
    return run_on_gloo(_robustness_body, 2)


@pytest.mark.distributed
@pytest.mark.slow
def test_nonfinite_gradient_on_one_rank_raises_on_every_rank(robustness_run: list) -> None:
    for result in robustness_run:
        assert "non-finite gradient" in result["raised"]
        assert "param 0 of group 0 (shape (16, 80))" in result["raised"]
        assert "on at least one of 2 ranks" in result["raised"]
        assert result["unchanged"] and result["state_steps"] == [1]
        assert_params_close(result["after_raise"], reference_adamw(2, STEPS))


@pytest.mark.distributed
@pytest.mark.slow
def test_nonfinite_gradient_on_one_rank_is_skipped_on_every_rank(robustness_run: list) -> None:
    for result in robustness_run:
        assert result["skip_left_state_empty"]
        assert_params_close(result["after_skip"], reference_adamw(2, STEPS))


@pytest.mark.distributed
@pytest.mark.slow
def test_complex_parameters_match_adamw_on_two_ranks(robustness_run: list) -> None:
    expected = reference_complex_adamw(2)
    for result in robustness_run:
        assert result["complex_state_shape"] == [8, 80]  # sharded
        for name in COMPLEX_SHAPES:
            actual = result["complex"][name]
            torch.testing.assert_close(actual, expected[name], atol=1e-6, rtol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_removed_hooks_leave_the_reduce_scatters_to_step(robustness_run: list) -> None:
    for result in robustness_run:
        assert result["launched_by_backward_with_hooks"] == 2  # w1 and w2 are sharded
        assert result["launched_by_backward_without_hooks"] == 0
        assert result["launched_by_step_without_hooks"] == 2
