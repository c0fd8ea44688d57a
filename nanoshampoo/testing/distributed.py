"""Run a function on a spawned gloo process group and collect each rank's result.

Used by every multi-process test, so that distributed code is tested distributed.

Example:
    >>> def body(rank: int, world_size: int) -> int:
    ...     t = torch.tensor([rank + 1.0])
    ...     torch.distributed.all_reduce(t)
    ...     return int(t.item())
    >>> run_on_gloo(body, world_size=2)  # doctest: +SKIP
    [3, 3]
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The ranks are forked from a fork server that has imported these once (``forkserver`` start
# method): a rank then starts without importing torch again, which was most of a spawned rank's
# start-up. Each call still gets fresh processes and a fresh process group, as with ``spawn``.
_PRELOAD = ["torch", "torch.distributed", "numpy"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    result_dir: str,
    environ: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    # A forked rank has the fork server's environment: take the caller's, as a spawned one would.
    os.environ.clear()
    os.environ.update(environ)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # One intra-op thread per rank: the ranks share two cores and would otherwise oversubscribe.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - the traceback is shipped to the parent and re-raised
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        dist.destroy_process_group()
    # The result is saved and the group destroyed: leave without the interpreter's teardown.
    # Rarely, a gloo worker thread still joinable at static destruction aborted a rank here
    # ("terminate called without an active exception", SIGABRT) after a successful body, which
    # failed the test; nothing is left to clean up that the OS does not.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_gloo(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Start ``world_size`` processes in a gloo group, run ``fn(rank, world_size, *args)`` on each.

    ``fn`` must be a module-level function (it is pickled) and its return value must be
    saveable with ``torch.save`` using only tensors and plain containers (loaded back with
    ``weights_only=True``). Returns the results ordered by rank. A failure on any rank raises
    ``RuntimeError`` carrying that rank's traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    mp.set_forkserver_preload(_PRELOAD)  # takes effect when the fork server starts (once)
    with tempfile.TemporaryDirectory() as result_dir:
        port = _free_port()
        try:
            mp.start_processes(
                _worker,
                args=(world_size, port, result_dir, dict(os.environ), fn, args),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
        except mp.ProcessRaisedException as exc:
            errors = []
            for rank in range(world_size):
                path = os.path.join(result_dir, f"rank{rank}.pt")
                if os.path.exists(path):
                    record = torch.load(path, weights_only=True)
                    if not record["ok"]:
                        errors.append(f"rank {rank}:\n{record['error']}")
            raise RuntimeError("distributed test body failed\n" + "\n".join(errors)) from exc
        results = []
        for rank in range(world_size):
            record = torch.load(os.path.join(result_dir, f"rank{rank}.pt"), weights_only=True)
            results.append(record["result"])
        return results
