"""``torch.linalg.eigh`` and QR of a stack, split over the CPU's intra-op threads.

(The module keeps its name from when it held ``eigh`` alone: :func:`stacked_eigh`, and
:func:`stacked_qr` for the warm-started QR refresh of the eigenbases, share one splitting
helper; :func:`rows_over_threads` lends it to other single-threaded kernels over a stack, the
packed factors' gathers.)

LAPACK's symmetric eigensolver (``syevd``) spends most of its time in the Householder
tridiagonalisation, a chain of memory-bound matrix-vector products with a synchronisation per
column, so it parallelises unevenly at the sizes Shampoo uses. A batched ``eigh`` on CPU
decomposes its matrices one after the other, each with every intra-op thread. Here each thread
takes whole matrices instead (one single-threaded LAPACK call per chunk of the stack): the same
arithmetic with no synchronisation between threads, so one slow or busy core delays only its own
chunk. On idle cores the split is as fast as the batched call; with a core partly busy it is
faster: docs/results/shampoo-step.md "The eigendecompositions split over the threads".
A single matrix keeps every thread.

Each chunk's decomposition is the single-threaded ``torch.linalg.eigh`` of that chunk whichever
worker runs it, so the output is repeatable and does not depend on the scheduling. It can differ
in the last bits from one batched call (MKL's kernels depend on the thread count and on each
matrix's position in the batched workspace), as two thread counts already do.

:func:`stacked_qr` splits the same way. A batched QR on CPU also factors its matrices one
after the other with every thread, and it parallelises poorly as well; the split's gain:
docs/results/peers.md "What SOAP's step does to meet its goals". It calls ``torch.geqrf`` and
``torch.linalg.householder_product``, the two LAPACK steps of ``torch.linalg.qr`` without
building ``R`` (only its diagonal is needed): the same ``Q``, same signs, up to rounding.

CUDA stacks, stacks of one matrix, small matrices (below :data:`MIN_PARALLEL_SIZE`, where
the thread hand-off costs more than it saves) and a single intra-op thread go straight to
the unsplit call.

Example:
    >>> a = torch.eye(3).expand(4, 3, 3) * 2.0
    >>> evals, evecs = stacked_eigh(a)
    >>> evals.shape, evecs.shape
    (torch.Size([4, 3]), torch.Size([4, 3, 3]))
    >>> q, r_diagonal = stacked_qr(a)
    >>> q.shape, r_diagonal.shape
    (torch.Size([4, 3, 3]), torch.Size([4, 3]))
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

_Chunk = TypeVar("_Chunk")
_Result = TypeVar("_Result")

# Matrices smaller than this are decomposed by one batched call: below it the thread hand-off
# cost more than the split saved (docs/results/shampoo-step.md "Kernel choices inside the step").
MIN_PARALLEL_SIZE = 256

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
# The alignment of torch's CPU allocations, so of an unsplit eigh's outputs.
_ALIGNMENT = 64


def _pool(width: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if width not in _pools:
            # Each worker's own OpenMP thread count is 1 (it is per thread: the caller's
            # set_num_threads(1) alone leaves the workers' LAPACK at every core, oversubscribed).
            _pools[width] = ThreadPoolExecutor(
                max_workers=width,
                thread_name_prefix="eigh",
                initializer=torch.set_num_threads,
                initargs=(1,),
            )
        return _pools[width]


def parallel_width(matrices: torch.Tensor) -> int:
    """How many threads :func:`stacked_eigh` splits ``matrices`` over (1: one batched call).

    ``min(torch.get_num_threads(), N)`` for a CPU stack ``(N, n, n)`` with
    ``n >= MIN_PARALLEL_SIZE``; 1 otherwise.
    """
    if matrices.device.type != "cpu" or matrices.dim() != 3:
        return 1
    if matrices.shape[-1] < MIN_PARALLEL_SIZE:
        return 1
    return max(1, min(torch.get_num_threads(), matrices.shape[0]))


def _split_over_threads(
    solve: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    matrices: torch.Tensor,
    width: int | None,
) -> tuple[torch.Tensor, ...]:
    """``solve(matrices)``, on CPU with ``width`` (default :func:`parallel_width`) >= 2 as
    ``width`` contiguous chunks solved concurrently, each single-threaded, and concatenated
    along dim 0 (``solve`` returns a tuple of tensors whose dim 0 indexes the matrices). The
    intra-op thread count is 1 during the calls and restored afterwards, also when one raises;
    ``solve``'s exceptions propagate."""
    width = _split_width(matrices, width)
    if width < 2:
        return tuple(solve(matrices))
    chunks = [matrices[rows] for rows in _chunk_rows(matrices.shape[0], width)]
    results = _run_split(solve, chunks)
    return tuple(torch.cat(parts) for parts in zip(*results, strict=True))


def _split_width(matrices: torch.Tensor, width: int | None) -> int:
    """The chunks a stack is split into: ``width`` (default :func:`parallel_width`), or 1 for
    anything but a CPU ``(N, n, n)`` stack."""
    if matrices.dim() != 3 or matrices.device.type != "cpu":
        return 1
    return parallel_width(matrices) if width is None else width


def _run_split(work: Callable[[_Chunk], _Result], chunks: Sequence[_Chunk]) -> list[_Result]:
    """``[work(chunk) for chunk in chunks]``, one chunk per worker thread, each worker with one
    intra-op thread; the caller's thread count is 1 during the calls and restored afterwards,
    also when one raises (``work``'s exceptions propagate)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return list(_pool(len(chunks)).map(work, chunks))
    finally:
        torch.set_num_threads(threads)


def stacked_eigh(
    matrices: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh(matrices)``: ``(eigenvalues (N, n) ascending, eigenvectors (N, n, n))``.

    ``matrices`` ``(N, n, n)`` (or any shape ``torch.linalg.eigh`` takes), symmetric, float32 or
    float64. On CPU with ``T = parallel_width(matrices) >= 2``, the stack is cut into ``T``
    contiguous chunks decomposed concurrently, each by a single-threaded ``eigh``; the intra-op
    thread count is 1 during the calls and restored afterwards, also when one raises. Raises
    what ``torch.linalg.eigh`` raises (``torch.linalg.LinAlgError`` when a decomposition fails).
    ``width`` overrides the number of chunks (a CPU ``(N, n, n)`` stack; for benchmarks).
    """
    width = _split_width(matrices, width)
    # Looked up at each call (not bound at import) so that tests can patch torch.linalg.eigh.
    if width < 2:
        return torch.linalg.eigh(matrices)
    # Each chunk writes into its rows of the results (no concatenation copy). The eigenvectors
    # are column-major per matrix, as LAPACK computes them and an unsplit call returns them, so
    # the out= rows are used as they are.
    evals = matrices.new_empty(matrices.shape[:-1])
    evecs = matrices.new_empty(matrices.shape).mT

    def solve(rows: slice) -> None:
        values, vectors = evals[rows], evecs[rows]
        if values.data_ptr() % _ALIGNMENT == 0 and vectors.data_ptr() % _ALIGNMENT == 0:
            torch.linalg.eigh(matrices[rows], out=(values, vectors))
            return
        # MKL's result depends on where its output lies (on an AVX2-only AMD EPYC an eigh into
        # rows 64-byte misaligned differs in the last bits from one into fresh memory): such
        # rows are decomposed into fresh, aligned memory, as an unsplit call's are, and copied.
        fresh = torch.linalg.eigh(matrices[rows])
        values.copy_(fresh[0])
        vectors.copy_(fresh[1])

    _run_split(solve, _chunk_rows(matrices.shape[0], width))
    return evals, evecs


def rows_over_threads(work: Callable[[slice], object], count: int) -> None:
    """``work(rows)`` for contiguous slices of ``range(count)`` covering it, one slice per
    intra-op thread, concurrently, each worker with one intra-op thread: for a single-threaded
    CPU kernel over a stack (``index_select`` along dim 1 runs on one thread). With one thread
    or fewer than two rows, ``work(slice(0, count))`` here."""
    width = min(torch.get_num_threads(), count)
    if width < 2:
        work(slice(0, count))
        return
    _run_split(work, _chunk_rows(count, width))


def _chunk_rows(count: int, width: int) -> list[slice]:
    """``count`` rows in ``width`` contiguous chunks, the first ``count % width`` one row longer
    (as ``torch.tensor_split`` cuts them), empty ones left out."""
    size, extra = divmod(count, width)
    edges = [i * size + min(i, extra) for i in range(width + 1)]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _qr_with_r_diagonal(matrices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, diag(R))`` of ``matrices = Q R`` from LAPACK's ``geqrf`` + ``orgqr``."""
    reflectors, tau = torch.geqrf(matrices)
    # geqrf keeps R in the upper triangle of its output: the diagonal is R's.
    r_diagonal = reflectors.diagonal(dim1=-2, dim2=-1).clone()
    return torch.linalg.householder_product(reflectors, tau), r_diagonal


def stacked_qr(
    matrices: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced QR of each matrix: ``(Q (N, n, n), diag(R) (N, n))`` with ``matrices = Q R``.

    ``matrices`` ``(N, n, n)`` (square, or any shape ``torch.geqrf`` takes), float32 or float64.
    ``Q`` is ``torch.linalg.qr(matrices).Q`` up to rounding (the same LAPACK reflectors, so the
    same signs: ``diag(R)`` may be negative); ``R`` itself is not formed. Split over the threads
    as :func:`stacked_eigh` is (same rule, same ``width`` override). Raises what ``torch.geqrf``
    raises (``RuntimeError``, e.g. ``LinAlgError``, on non-finite input in some builds); a
    non-finite input may also just give a non-finite result.
    """
    q, r_diagonal = _split_over_threads(_qr_with_r_diagonal, matrices, width)
    return q, r_diagonal
