"""The parameter exchange on CUDA tensors: locally on one GPU, and over NCCL on two GPUs."""

import pytest
import torch
import torch.distributed as dist

from nanoshampoo.optim.shampoo.utils.param_redistribution import (
    prepare_update_param_buffers,
    redistribute_and_update_params,
)
from nanoshampoo.optim.shampoo.utils.shampoo_utils import (
    distribute_buffer_sizes,
    multi_dim_split,
)
from nanoshampoo.testing.distributed import run_on_gloo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_SHAPES = ((5, 3), (7,), (4, 4), (1,), (6, 2))


def _params(device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(device) for shape in _SHAPES]


def _new_value(block: torch.Tensor, index: int) -> torch.Tensor:
    return block * 0.5 + 0.25 * (index + 1)


def _expected(device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    params = _params(device)
    for i, block in enumerate(b for p in params for b in multi_dim_split(p, 2)):
        block.copy_(_new_value(block, i).to(dtype))
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_exchange_on_cuda(dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    params = _params(device)
    blocks = [b for p in params for b in multi_dim_split(p, 2)]
    buffers = prepare_update_param_buffers(
        blocks,
        distribute_buffer_sizes(blocks, 1),
        communication_dtype=dtype,
    )
    assert buffers.send_buffer.is_cuda and buffers.send_buffer.dtype == dtype
    redistribute_and_update_params(
        buffers, [_new_value(blocks[i], i) for i in buffers.owned_block_indices]
    )
    for got, want in zip(params, _expected(device, dtype), strict=True):
        assert torch.equal(got, want)


def _nccl_body(rank: int, world_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")
    device = torch.device("cuda", rank)
    params = _params(device)
    blocks = [b for p in params for b in multi_dim_split(p, 2)]
    assignment = distribute_buffer_sizes(blocks, world_size)
    buffers = prepare_update_param_buffers(
        blocks, assignment, group=group, communication_dtype=dtype
    )
    redistribute_and_update_params(
        buffers, [_new_value(blocks[i], i) for i in buffers.owned_block_indices]
    )
    torch.cuda.synchronize()
    return [p.cpu() for p in params]


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for an NCCL group")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nccl_exchange_on_two_gpus(dtype: torch.dtype) -> None:
    results = run_on_gloo(_nccl_body, 2, dtype)
    expected = [p.cpu() for p in _expected(torch.device("cuda"), dtype)]
    for rank_params in results:
        for got, want in zip(rank_params, expected, strict=True):
            assert torch.equal(got, want)
