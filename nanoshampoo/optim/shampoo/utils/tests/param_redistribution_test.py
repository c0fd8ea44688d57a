import math

import pytest
import torch
import torch.distributed as dist

from nanoshampoo.optim.shampoo.utils import shampoo_utils
from nanoshampoo.optim.shampoo.utils.param_redistribution import (
    prepare_update_param_buffers,
    redistribute_and_update_params,
)
from nanoshampoo.optim.shampoo.utils.shampoo_utils import (
    distribute_buffer_sizes,
    multi_dim_split,
)
from nanoshampoo.testing.distributed import run_on_gloo

_UNEVEN = ((5, 3), (7,), (4, 4), (1,), (0, 3), (6, 2))
# name -> (parameter shapes, split size, communication dtype, accumulate)
_CASES: dict[str, tuple[tuple[tuple[int, ...], ...], float, torch.dtype, bool]] = {
    "uneven_fp32": (_UNEVEN, 2, torch.float32, False),
    "fewer_blocks_than_ranks": (((3,), (2, 2)), math.inf, torch.float32, False),
    "uneven_bf16": (_UNEVEN, 2, torch.bfloat16, False),
    "accumulate_updates": (_UNEVEN, 3, torch.float32, True),
    "no_blocks": ((), 2, torch.float32, False),
}
_STEPS = 2


def _params(shapes: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _blocks(params: list[torch.Tensor], split_size: float) -> list[torch.Tensor]:
    return [block for param in params for block in multi_dim_split(param, split_size)]


def _owner_value(block: torch.Tensor, index: int, step: int) -> torch.Tensor:
    """What the owner of block ``index`` computes at ``step`` (a new value or an update)."""
    return block * 0.5 + 0.25 * (index + 1) + step


def _run_cases(group_size: int, group: dist.ProcessGroup | None) -> dict[str, dict]:
    results = {}
    for name, (shapes, split_size, dtype, accumulate) in _CASES.items():
        params = _params(shapes)
        blocks = _blocks(params, split_size)
        assignment = distribute_buffer_sizes(blocks, group_size)
        buffers = prepare_update_param_buffers(
            blocks, assignment, group=group, communication_dtype=dtype
        )
        pointers = (buffers.send_buffer.data_ptr(), buffers.recv_buffer.data_ptr())
        owned = buffers.owned_block_indices
        for step in range(_STEPS):
            values = [_owner_value(blocks[i], i, step) for i in owned]
            if step % 2 == 0:
                redistribute_and_update_params(buffers, values, accumulate=accumulate)
            else:  # the owner writes straight into the send buffer
                for view, value in zip(buffers.send_views, values, strict=True):
                    view.copy_(value)
                redistribute_and_update_params(buffers, accumulate=accumulate)
        results[name] = {
            "params": params,
            "owned": list(owned),
            "group_size": buffers.group_size,
            "send_numel": buffers.send_buffer.numel(),
            "recv_numel": buffers.recv_buffer.numel(),
            "persistent": pointers
            == (buffers.send_buffer.data_ptr(), buffers.recv_buffer.data_ptr()),
        }
    return results


def _exchange_body(rank: int, world_size: int) -> dict[str, dict]:
    """Group size ``world_size`` on the default group, then group size 2 on pairs of ranks."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world_size, 2)]
    outsider_error = ""
    if rank >= 2:
        try:
            prepare_update_param_buffers([torch.zeros(1)], [(64, 0)], group=pairs[0])
        except ValueError as error:
            outsider_error = str(error)
    return {
        world_size: _run_cases(world_size, None),
        2: _run_cases(2, pairs[rank // 2]),
        "outsider_error": outsider_error,
    }


def _expected_send_numel(name: str, group_size: int) -> int:
    """Sum over rounds of the largest block sent in the round (zero padding included)."""
    shapes, split_size, _, _ = _CASES[name]
    blocks = _blocks(_params(shapes), split_size)
    assignment = distribute_buffer_sizes(blocks, group_size)
    largest_first = sorted(range(len(blocks)), key=lambda i: (-blocks[i].numel(), i))
    owned = [[i for i in largest_first if assignment[i][1] == r] for r in range(group_size)]
    rounds = max((len(o) for o in owned), default=0)
    return sum(max(blocks[o[k]].numel() for o in owned if k < len(o)) for k in range(rounds))


def _reference(name: str, round_through: torch.dtype | None) -> list[torch.Tensor]:
    """Single process: apply every owner's computation to every block, the slow obvious way."""
    shapes, split_size, _, accumulate = _CASES[name]
    params = _params(shapes)
    blocks = _blocks(params, split_size)
    for step in range(_STEPS):
        values = [_owner_value(block, i, step) for i, block in enumerate(blocks)]
        if round_through is not None:
            values = [v.to(round_through).float() for v in values]
        for block, value in zip(blocks, values, strict=True):
            if accumulate:
                block.add_(value)
            else:
                block.copy_(value)
    return params


@pytest.mark.slow
@pytest.mark.distributed
def test_every_rank_ends_with_the_single_process_result() -> None:
    world_size = 4
    results = run_on_gloo(_exchange_body, world_size)
    for group_size in (4, 2):
        groups = [results[start : start + group_size] for start in range(0, world_size, group_size)]
        for name, (shapes, split_size, dtype, _) in _CASES.items():
            num_blocks = len(_blocks(_params(shapes), split_size))
            expected = _reference(name, round_through=dtype)
            unrounded = _reference(name, round_through=None)
            send_numel = _expected_send_numel(name, group_size)
            for group in groups:
                outcomes = [result[group_size][name] for result in group]
                owned = sorted(i for outcome in outcomes for i in outcome["owned"])
                assert owned == list(range(num_blocks)), (name, group_size)  # each owned once
                for outcome in outcomes:
                    assert outcome["group_size"] == group_size and outcome["persistent"]
                    assert outcome["send_numel"] == send_numel
                    assert outcome["recv_numel"] == group_size * send_numel
                    for got, want, exact in zip(
                        outcome["params"], expected, unrounded, strict=True
                    ):
                        assert torch.equal(got, want), (name, group_size)
                        if dtype == torch.bfloat16:  # within bf16 rounding of full precision
                            torch.testing.assert_close(got, exact, rtol=2.0**-7, atol=1e-6)
    fewer = [len(result[world_size]["fewer_blocks_than_ranks"]["owned"]) for result in results]
    assert sorted(fewer) == [0, 0, 1, 1]  # two idle ranks send zero padding
    assert [result["outsider_error"] for result in results] == ["", ""] + [
        "prepare_update_param_buffers: this process is not a member of group"
    ] * 2


def test_single_process_exchange_without_process_group() -> None:
    params = _params(_UNEVEN)
    blocks = _blocks(params, 2)
    assignment = distribute_buffer_sizes(blocks, 1)
    buffers = prepare_update_param_buffers(blocks, assignment)
    assert buffers.group_size == 1 and buffers.recv_buffer is buffers.send_buffer
    assert buffers.round_inputs == ()
    # Round order: largest block first, ties by block index.
    sizes = [b.numel() for b in blocks]
    assert buffers.owned_block_indices == tuple(
        sorted(range(len(blocks)), key=lambda i: (-sizes[i], i))
    )
    expected = [_owner_value(b, i, 0) for i, b in enumerate(blocks)]
    redistribute_and_update_params(buffers, [expected[i] for i in buffers.owned_block_indices])
    for block, value in zip(blocks, expected, strict=True):
        assert torch.equal(block, value)


def test_reexported_from_shampoo_utils() -> None:
    assert shampoo_utils.prepare_update_param_buffers is prepare_update_param_buffers
    assert shampoo_utils.redistribute_and_update_params is redistribute_and_update_params


@pytest.mark.parametrize(
    ("blocks", "assignment", "kwargs", "message"),
    [
        ([torch.zeros(2)], [], {}, r"len\(block_assignment\)=0 and len\(blocks\)=1"),
        ([torch.zeros(2)], [(64, 1)], {}, r"owner ranks must be in \[0, 1\), got \[1\]"),
        ([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], [(64, 0)] * 2, {},
         r"several dtypes \['torch.float32', 'torch.float64'\]; pass communication_dtype"),
        ([torch.zeros(2)], [(64, 0)], {"communication_dtype": torch.int32},
         r"communication_dtype must be a floating-point dtype, got torch.int32"),
        ([torch.zeros(2), torch.zeros(2, device="meta")], [(64, 0)] * 2, {},
         r"blocks must share one device, got \['cpu', 'meta'\]"),
        ([torch.zeros(2)], [(64, 0)], {"group": object()}, r"no process group is initialized"),
    ],
)  # fmt: skip
def test_prepare_rejects_bad_input(blocks, assignment, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prepare_update_param_buffers(blocks, assignment, **kwargs)


def test_redistribute_rejects_bad_owned_values() -> None:
    buffers = prepare_update_param_buffers([torch.zeros(2, 3), torch.zeros(4)], [(64, 0), (64, 0)])
    with pytest.raises(ValueError, match=r"one value per owned block \(2\), got 1"):
        redistribute_and_update_params(buffers, [torch.zeros(2, 3)])
    with pytest.raises(ValueError, match=r"block 1 has shape \(2, 2\), expected \(4,\)"):
        redistribute_and_update_params(buffers, [torch.zeros(2, 3), torch.zeros(2, 2)])
