import pickle

import torch

from nanoshampoo.optim.shampoo.utils.shampoo_block_info import BlockInfo


def test_block_info_defaults_allocate_zeros_and_return_tensor_unchanged() -> None:
    param = torch.nn.Parameter(torch.ones(4, 3))
    info = BlockInfo(param=param, composable_block_ids=(2, "block_1"))
    state = info.allocate_zeros_tensor((3, 3), torch.float64, param.device)
    assert state.dtype == torch.float64 and torch.equal(
        state, torch.zeros(3, 3, dtype=torch.float64)
    )
    assert info.get_tensor(state) is state
    assert info.composable_block_ids == (2, "block_1")


def test_block_info_accepts_custom_callables_and_pickles() -> None:
    info = BlockInfo(
        param=torch.zeros(2),
        composable_block_ids=(0, "block_0"),
        allocate_zeros_tensor=lambda size, dtype, device: torch.full(size, 0.0, dtype=dtype),
        get_tensor=lambda t: t * 2,
    )
    assert torch.equal(info.get_tensor(torch.ones(2)), torch.full((2,), 2.0))
    default = BlockInfo(param=torch.zeros(2), composable_block_ids=(1, "block_0"))
    assert pickle.loads(pickle.dumps(default)).composable_block_ids == (1, "block_0")
