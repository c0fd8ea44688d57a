"""Tensor operations on stacks of Kronecker factor matrices: pure maths, no state.

A stack is ``(B, n, n)`` (one factor per block of a bucket, or per row of a factor pool);
blocks are ``(B, *shape)``. Used by :mod:`kronecker_factors` (the statistics) and the
preconditioners built on them (the solves and the preconditioning).

Example:
    >>> grads = torch.ones(1, 3, 2)
    >>> factors = torch.zeros(1, 3, 3)
    >>> symmetric_rank_update_(factors, unfold(grads, 0), beta=1.0, alpha=1.0)[0, 0].tolist()
    [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import torch

from nanoshampoo.optim.shampoo.preconditioner.parallel_eigh import rows_over_threads


def solve_dtype(factor_dtype: torch.dtype) -> torch.dtype:
    """Amortized computations run in at least float32 (``eigh``/``qr`` have no half kernels)."""
    return torch.promote_types(factor_dtype, torch.float32)


def unfold(grad: torch.Tensor, dim: int) -> torch.Tensor:
    """``(B, n_dim, prod(other dims))`` from stacked blocks ``(B, *shape)``.

    A view (no copy) for the first and the last dim of the block.
    """
    count, size = grad.shape[0], grad.shape[dim + 1]
    if dim + 2 == grad.dim():
        return grad.reshape(count, -1, size).mT
    return grad.movedim(dim + 1, 1).reshape(count, size, -1)


def multiply_along_dim(matrices: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x x_dim M``: ``matrices`` ``(B, n, n)`` applied along dim ``dim`` of blocks ``x``.

    ``x`` is ``(B, *shape)`` with ``shape[dim] == n``; the result has the same shape (a new
    tensor). For matrix blocks, dim 0 is ``M @ X`` and dim 1 is ``X @ M^T``.
    """
    moved = x.movedim(dim + 1, 1)
    product = matrices @ moved.reshape(x.shape[0], moved.shape[1], -1)
    return product.view(moved.shape).movedim(1, dim + 1)


# Factors at least this large are updated by tiles (one triangle); smaller ones by one baddbmm,
# where the per-tile launches cost more than the halved flops save.
TILED_UPDATE_MIN_SIZE = 512
TILE_SIZE = 256


def tile_edges(size: int) -> list[int]:
    """Row (and column) edges of the tiles of :func:`symmetric_rank_update_` for a factor of
    ``size``: ``[0, size]`` (one tile) below ``TILED_UPDATE_MIN_SIZE``."""
    tiles = size // TILE_SIZE if size >= TILED_UPDATE_MIN_SIZE else 1
    return [size * i // max(tiles, 1) for i in range(max(tiles, 1) + 1)]


def symmetric_rank_update_(
    factors: torch.Tensor, unfolded: torch.Tensor, beta: float, alpha: float, mirror: bool = True
) -> torch.Tensor:
    """``F <- beta F + alpha U U^T`` in place, computing only the upper triangle of tiles.

    ``factors`` ``(B, n, n)`` symmetric, ``unfolded`` ``(B, n, m)``. torch has no ``syrk``,
    so for ``n >= TILED_UPDATE_MIN_SIZE`` the rows are cut into ``k = n // TILE_SIZE`` tiles;
    the tiles ``(i, j)`` with ``i <= j`` are computed, a row of them (a band) per ``baddbmm_``,
    and tile ``(j, i)`` is their transpose: ``(k + 1) / 2k`` of the flops. Tiles below the
    diagonal are exact copies of their mirrors; ``mirror=False`` leaves them stale (for
    :meth:`SymmetricPacking.pack_updated`, which reads the computed tiles only). What the tiles
    save: docs/results/shampoo-step.md "Kernel choices inside the step".
    """
    edges = tile_edges(factors.shape[-1])
    if len(edges) <= 2:
        return factors.baddbmm_(unfolded, unfolded.mT, beta=beta, alpha=alpha)
    # One product per row of tiles (its band: the diagonal tile and those right of it), the
    # same entries as one per tile, bit for bit, in fewer and larger GEMMs.
    for r0, r1 in zip(edges[:-1], edges[1:]):
        factors[:, r0:r1, r0:].baddbmm_(
            unfolded[:, r0:r1], unfolded[:, r0:].mT, beta=beta, alpha=alpha
        )
    if not mirror:
        return factors
    for r0, r1 in zip(edges[:-2], edges[1:-1]):
        factors[:, r1:, r0:r1].copy_(factors[:, r0:r1, r1:].mT)
    return factors


# symmetric_part reads one operand transposed: a row of the result reads a column of the input,
# one cache line per element. Up to 768 the lines of a column stay in the L1 cache across the
# rows that reuse them; from 1024 on they do not, and tiles of 256 x 256 keep them there
# (docs/results/shampoo-step.md "Kernel choices inside the step").
SYMMETRIC_PART_TILED_MIN_SIZE = 1024
SYMMETRIC_PART_TILE = 256


def symmetric_part(matrices: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = (X + X^T) / 2`` for a stack ``X`` ``(B, n, n)``; returns ``out`` (``(B, n, n)``,
    not overlapping ``matrices``). Elementwise the same sum and halving at any size, so the same
    bits tiled or not."""
    size = matrices.shape[-1]
    if size < SYMMETRIC_PART_TILED_MIN_SIZE:
        return torch.add(matrices, matrices.mT, out=out).mul_(0.5)
    tile = SYMMETRIC_PART_TILE
    for r in range(0, size, tile):
        for c in range(0, size, tile):
            block = out[:, r : r + tile, c : c + tile]
            torch.add(
                matrices[:, r : r + tile, c : c + tile],
                matrices.mT[:, r : r + tile, c : c + tile],
                out=block,
            ).mul_(0.5)  # while the tile is in the cache
    return out


def symmetric_product(
    left: torch.Tensor, right: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """An exactly symmetric ``(B, n, n)`` stack equal, up to rounding, to ``left @ right^T``,
    for ``(B, n, n)`` operands whose product is symmetric in exact arithmetic (a root
    ``Q diag(w) Q^T``: ``left = Q diag(w)``, ``right = Q``).

    Below ``TILED_UPDATE_MIN_SIZE``: the symmetric part ``(X + X^T) / 2`` of the full product.
    From it on, the tiles of :func:`tile_edges` on and above the diagonal only (a row of them
    per product), ``(k + 1) / 2k`` of the flops: a tile above the diagonal is its product and
    the one below it its transpose, a diagonal tile its own symmetric part. A new row-major
    tensor either way, or written into ``out`` (contiguous ``(B, n, n)``, the operands' dtype,
    overlapping neither) when given.
    """
    edges = tile_edges(left.shape[-1])
    if len(edges) <= 2:
        product = left @ right.mT
        return symmetric_part(product, out=torch.empty_like(product) if out is None else out)
    if out is None:
        out = left.new_empty(left.shape)
    for r0, r1 in zip(edges[:-1], edges[1:]):
        # One product per row of tiles (as symmetric_rank_update_); beta 0: the uninitialized
        # band is not read.
        out[:, r0:r1, r0:].baddbmm_(left[:, r0:r1], right[:, r0:].mT, beta=0.0)
        diagonal = out[:, r0:r1, r0:r1]
        product = diagonal.clone()
        torch.add(product, product.mT, out=diagonal).mul_(0.5)
        out[:, r1:, r0:r1].copy_(out[:, r0:r1, r1:].mT)
    return out


class SymmetricPacking:
    """Packed storage of stacked symmetric ``n x n`` matrices (one per ``(n, device)``), laid out
    as the reference library's upper triangle.

    ``pack(full)`` stores, at the position of entry ``(i, j)``, ``i <= j``, of
    ``torch.triu_indices(n, n)`` (row-major upper triangle), the value ``full[:, j, i]``: for a
    symmetric matrix that is ``A[i, j]``, the reference's layout, so packed state dicts move
    between the libraries as they are. The value is read from the lower triangle because that is
    the triangle ``eigh`` reads, and a float ``G G^T`` need not be symmetric to the last bit: so a
    packed factor evolves bit for bit like the lower triangle of a full one. ``unpack(packed)``
    returns new full ``(M, n, n)`` matrices, symmetric by construction; ``unpack(pack(A))``
    equals ``A`` wherever ``A``'s lower triangle is mirrored.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        rows, cols = torch.triu_indices(size, size, device=device)
        # The flat indices below are read in full by every pack and unpack (each step, each
        # packed factor): int32 where they fit is a third less memory traffic than int64
        # (docs/results/shampoo-step.md "Kernel choices inside the step").
        flat_dtype = torch.int32 if size * size <= torch.iinfo(torch.int32).max else torch.int64
        # Flat positions of the mirrored entries (j, i) in an n x n matrix: index_select on the
        # flattened matrices packs faster than advanced indexing on a CPU.
        self.flat_mirrored = (cols * size + rows).to(flat_dtype)
        index = torch.empty(size, size, dtype=torch.int64, device=device)
        index[rows, cols] = torch.arange(rows.numel(), device=device)
        index[cols, rows] = torch.arange(rows.numel(), device=device)
        self.index = index
        # The same, flat: index_select unpacks faster than packed[:, index] on a CPU (it runs
        # every step on every packed factor).
        self._flat_index = index.flatten().to(flat_dtype)
        self._size = size
        # Elements per packed matrix (as TiledPacking.storage_size).
        self.storage_size = self.packed_size(size)
        # The same values read where symmetric_rank_update_(mirror=False) computed them: the
        # lower triangle inside a diagonal tile, the upper one (whose mirror the lower would
        # be, bit for bit) between tiles.
        edges = torch.tensor(tile_edges(size)[1:-1], device=device)
        across = torch.bucketize(rows, edges, right=True) < torch.bucketize(cols, edges, right=True)
        self.flat_updated = torch.where(across, rows * size + cols, cols * size + rows).to(
            flat_dtype
        )

    @staticmethod
    def packed_size(size: int) -> int:
        return size * (size + 1) // 2

    def pack(self, full: torch.Tensor) -> torch.Tensor:
        return full.flatten(1).index_select(1, self.flat_mirrored)

    def pack_updated(self, full: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``pack(F)`` of a factor that ``symmetric_rank_update_(..., mirror=False)`` updated:
        the same values (bit for bit), without the mirror pass that ``pack`` needs; written
        into ``out`` ``(M, n (n + 1) / 2)`` when given (the packed factors themselves: no
        temporary and no copy)."""
        return _gather_columns(full.flatten(1), self.flat_updated, out)

    def unpack(self, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """New full ``(M, n, n)`` matrices from ``packed`` ``(M, n (n + 1) / 2)``, or written
        into ``out`` (contiguous ``(M, n, n)``) when given."""
        flat = None if out is None else out.view(packed.shape[0], -1)
        return _gather_columns(packed, self._flat_index, flat).view(
            packed.shape[0], self._size, self._size
        )

    def mirror_updated_(self, full: torch.Tensor, lower: bool = True) -> torch.Tensor:
        """``unpack(pack_updated(full))`` in place, returned: each entry off the tiles that
        ``symmetric_rank_update_(..., mirror=False)`` computed, or in the upper triangle of a
        diagonal tile, is overwritten by its mirror, which :meth:`pack_updated` keeps. Copies
        only, so the same bits. ``lower=False`` leaves the tiles below the diagonal as they
        are: the upper triangle alone then equals ``unpack``'s."""
        edges = tile_edges(self._size)
        spans = list(zip(edges[:-1], edges[1:]))
        for i, (r0, r1) in enumerate(spans):
            diagonal = full[:, r0:r1, r0:r1]
            upper = torch.ones(r1 - r0, r1 - r0, dtype=torch.bool, device=full.device).triu_(1)
            # torch.where writes a new tensor, so the copy does not read what it overwrites.
            diagonal.copy_(torch.where(upper, diagonal.mT, diagonal))
            for c0, c1 in spans[i + 1 :] if lower else ():
                full[:, c0:c1, r0:r1].copy_(full[:, r0:r1, c0:c1].mT)
        return full


class TiledPacking:
    """Packed storage of stacked symmetric ``n x n`` matrices, for ``n >= TILED_UPDATE_MIN_SIZE``,
    as the tiles that :func:`symmetric_rank_update_` computes: per row of tiles ``a`` of
    :func:`tile_edges`'s grid (rows ``r0:r1``), its *band*, the tiles on and right of the
    diagonal, rows ``r0:r1`` by columns ``r0:n``, whole and row-major, the bands one after the
    other in ``(M, storage_size)``.

    The rank update writes straight into the bands (:meth:`update_`), so a step neither unpacks
    nor packs its factors. The values are those of :class:`SymmetricPacking` as
    :meth:`SymmetricPacking.pack_updated` keeps them: entry ``(i, j)``, ``i <= j``, is the band
    entry ``(i, j)`` where ``i`` and ``j`` lie in different tiles, and the diagonal tile's entry
    ``(j, i)`` (its lower triangle, the triangle ``eigh`` reads) where they lie in one; a
    diagonal tile's upper triangle is computed but never read. So a tiled factor evolves bit for
    bit like a packed one, and :meth:`to_reference` / :meth:`from_reference` convert between the
    two (state dicts keep :class:`SymmetricPacking`'s layout, the reference library's).

    Size: ``n (n + 1) / 2`` plus the diagonal tiles' other halves, ``sum_a h_a (h_a - 1) / 2``
    (a third more than the triangle at ``n = 768``, a quarter at 1024; still well under
    ``n^2``).
    """

    def __init__(self, size: int, device: torch.device) -> None:
        if not tiles_pack(size):
            raise ValueError(f"TiledPacking: size {size} is below {TILED_UPDATE_MIN_SIZE}")
        # (r0, r1, offset) of each band.
        self.bands, self.storage_size = _bands(size)
        self.size = size
        # The storage position whose value entry (i, j) of the matrix takes (both triangles).
        where = torch.empty(size, size, dtype=torch.int64)
        for r0, r1, start in self.bands:
            band = torch.arange(start, start + (r1 - r0) * (size - r0)).view(r1 - r0, -1)
            diagonal = band[:, : r1 - r0]
            where[r0:r1, r0:r1] = torch.tril(diagonal) + torch.tril(diagonal, -1).mT
            where[r0:r1, r1:] = band[:, r1 - r0 :]
            where[r1:, r0:r1] = band[:, r1 - r0 :].mT
        rows, cols = torch.triu_indices(size, size)
        triangle = torch.empty(size, size, dtype=torch.int64)
        triangle[rows, cols] = torch.arange(rows.numel())
        triangle[cols, rows] = torch.arange(rows.numel())
        flat_dtype = torch.int32 if size * size <= torch.iinfo(torch.int32).max else torch.int64
        self._to_reference = where[rows, cols].to(device=device, dtype=flat_dtype)
        self._from_reference = torch.cat(
            [triangle[r0:r1, r0:].flatten() for r0, r1, _ in self.bands]
        ).to(device=device, dtype=flat_dtype)
        # Per diagonal tile size, the mask of its strict upper triangle (where its mirror is read).
        self._upper = {
            r1 - r0: torch.ones(r1 - r0, r1 - r0, dtype=torch.bool, device=device).triu_(1)
            for r0, r1, _ in self.bands
        }

    def band(self, storage: torch.Tensor, index: int) -> torch.Tensor:
        """Band ``index`` (of :attr:`bands`) of ``storage`` ``(M, storage_size)``: an
        ``(M, r1 - r0, n - r0)`` view."""
        r0, r1, start = self.bands[index]
        width = self.size - r0
        return storage[:, start : start + (r1 - r0) * width].view(-1, r1 - r0, width)

    def update_(
        self, storage: torch.Tensor, unfolded: torch.Tensor, beta: float, alpha: float
    ) -> torch.Tensor:
        """``F <- beta F + alpha U U^T`` in place on tiled ``storage`` ``(M, storage_size)``
        from ``unfolded`` ``(M, n, m)``: one ``baddbmm_`` per band, the very products of
        :func:`symmetric_rank_update_` (``mirror=False``), written where they are kept."""
        for index, (r0, r1, _) in enumerate(self.bands):
            self.band(storage, index).baddbmm_(
                unfolded[:, r0:r1], unfolded[:, r0:].mT, beta=beta, alpha=alpha
            )
        return storage

    def full(
        self,
        storage: torch.Tensor,
        dtype: torch.dtype | None = None,
        divisor: float = 1.0,
        upper_only: bool = False,
    ) -> torch.Tensor:
        """New full ``(M, n, n)`` matrices of tiled ``storage``, cast to ``dtype`` (None: the
        storage's) and divided by ``divisor``, both elementwise (the same numbers as unpacking
        first). With ``upper_only`` only the upper triangle is written (what ``eigh`` reads of
        the transposed view): the tiles below the diagonal are left uninitialized."""
        dtype = dtype or storage.dtype
        out = storage.new_empty(storage.shape[0], self.size, self.size, dtype=dtype)
        for index, (r0, r1, _) in enumerate(self.bands):
            # Cast first (no copy in the storage's dtype), then divide: as unpacking does.
            band = self.band(storage, index).to(dtype)
            tile, right = band[:, :, : r1 - r0], band[:, :, r1 - r0 :]
            target = out[:, r0:r1, r0:r1]
            # The diagonal tile's lower triangle is the kept one: mirrored over the upper.
            torch.where(self._upper[r1 - r0], tile.mT, tile, out=target)
            if divisor != 1.0:
                target.div_(divisor)
            if r1 == self.size:
                continue
            target = out[:, r0:r1, r1:]
            if divisor == 1.0:
                target.copy_(right)
            else:
                torch.div(right, divisor, out=target)
            if not upper_only:
                out[:, r1:, r0:r1].copy_(target.mT)
        return out

    def to_reference(self, storage: torch.Tensor) -> torch.Tensor:
        """:class:`SymmetricPacking`'s layout ``(M, n (n + 1) / 2)`` of tiled ``storage``
        ``(M, storage_size)``, a new tensor (the same values)."""
        return _gather_columns(storage, self._to_reference)

    def from_reference(self, packed: torch.Tensor) -> torch.Tensor:
        """Tiled storage ``(M, storage_size)`` of :class:`SymmetricPacking`'s ``packed``
        ``(M, n (n + 1) / 2)``, a new tensor; ``to_reference(from_reference(p))`` is ``p``."""
        return _gather_columns(packed, self._from_reference)


def tiles_pack(size: int) -> bool:
    """Whether packed factors of ``size`` are kept by tiles (:class:`TiledPacking`), not as one
    triangle (:class:`SymmetricPacking`): from ``TILED_UPDATE_MIN_SIZE`` on."""
    return len(tile_edges(size)) > 2


def _bands(size: int) -> tuple[list[tuple[int, int, int]], int]:
    """``([(r0, r1, offset) per band], elements in all)`` of :class:`TiledPacking` at
    ``size``: band ``r0:r1`` holds rows ``r0:r1`` by columns ``r0:size``."""
    bands, offset = [], 0
    edges = tile_edges(size)
    for r0, r1 in zip(edges[:-1], edges[1:]):
        bands.append((r0, r1, offset))
        offset += (r1 - r0) * (size - r0)
    return bands, offset


def tiled_storage_size(size: int) -> int:
    """Elements of one factor of ``size`` in :class:`TiledPacking` (``size`` tiled), without
    building its index tensors."""
    return _bands(size)[1]


_tiled_packings: dict[tuple[int, torch.device], TiledPacking] = {}


def tiled_packing(size: int, device: torch.device) -> TiledPacking:
    """The :class:`TiledPacking` of ``size`` on ``device``, built once (its index tensors are
    read-only)."""
    key = (size, torch.device(device))
    if key not in _tiled_packings:
        _tiled_packings[key] = TiledPacking(size, key[1])
    return _tiled_packings[key]


def _gather_columns(
    source: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``source.index_select(1, index)`` for ``(M, k)`` ``source``, into ``out`` when given.

    On a CPU, ``index_select`` along dim 1 runs on one thread whatever the intra-op count; the
    packed update and the roots gather every packed factor each step this way, so the rows are
    split over the threads (:func:`rows_over_threads`): the same gather, the same bits."""
    if out is None:
        out = source.new_empty(source.shape[0], index.numel())
    if source.device.type != "cpu":
        return torch.index_select(source, 1, index, out=out)

    def gather(rows: slice) -> None:
        torch.index_select(source[rows], 1, index, out=out[rows])

    rows_over_threads(gather, source.shape[0])
    return out


def keep_previous_where_failed(
    previous: torch.Tensor, computed: torch.Tensor, ok: torch.Tensor
) -> None:
    """``previous[i] = computed[i]`` where ``ok[i]``, in place; ``(N, n, n)`` and ``(N,)``.

    No ``(N, n, n)`` temporary: all ok (the common case) is one ``copy_`` (it casts the
    dtype), none ok leaves ``previous`` alone, and a mix copies the ok rows only.
    """
    if bool(ok.all()):
        previous.copy_(computed)
    elif bool(ok.any()):
        rows = ok.nonzero().squeeze(1)
        previous.index_copy_(0, rows, computed.index_select(0, rows).to(previous.dtype))
