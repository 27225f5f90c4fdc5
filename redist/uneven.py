"""Uneven layouts: moving arrays whose dimensions their mesh axes do not divide (pure, no JAX).

XLA lays out a dimension of extent ``n`` split ``k`` ways as ``k`` tiles of ``c = ceil(n / k)`` rows:
device ``j`` holds rows ``[j c, (j + 1) c)``, the rows past ``n`` padding. Such a layout is typed at its
*padded extent* ``k c`` (:func:`redist.types.padded_size`), where it is an ordinary even type.

A move from ``src`` (``k_s`` parts) to ``dst`` (``k_d`` parts) runs on one *working extent* ``N`` per
dimension, which both divide: the plan is synthesized there as for any even move. Where ``N`` is not
``src``'s padded extent, a device's block of rows differs between the two extents, and a *reblock* step
first hands every row whose device changes to its new device (rounds of collective permutes of a few
rows each, :func:`reblock`); likewise at the end for ``dst``. ``N`` is taken from ``src``'s or ``dst``'s
padded extent where it can be, so at most one end moves rows, and none when both padded extents agree.
Padding rows are zeros throughout, so pending sums and the simulator see exact values.

Example (12 rows, 8 parts to 4 parts: working extent 16, each of 4 devices then holds 4 rows but
must hold 3, and rows 3, 6-7 and 9-11 change hands):
    >>> p = redist.plan((12,), P(("a", "b")), P("a"), {"a": 4, "b": 2})   # doctest: +SKIP
    >>> p.kinds
    ('allgather', 'reblock')
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from redist.steps import Step
from redist.types import DistDim, DistType, MeshShape, padded_size

Piece = tuple[int, int, int, int]  # (sender rank, receiver rank, first row, end row), global rows


def parts(dim: DistDim) -> int:
    """How many tiles a (padded, even) dimension is split into."""
    return dim.size // dim.local if dim.local else 1


def pieces(n: int, k: int, before: int, after: int) -> list[Piece]:
    """The rows of an extent-``n`` dimension that rank ``r`` of ``k`` needs when its tile of
    ``before`` rows (rows ``[r before, (r + 1) before)``) becomes one of ``after`` rows, by the rank
    holding them; padding rows (``>= n``) are not moved.

    Example:
        >>> pieces(12, 4, 4, 3)[:3]
        [(0, 0, 0, 3), (0, 1, 3, 4), (1, 1, 4, 6)]
    """
    out = []
    for r in range(k):
        lo, hi = r * after, min((r + 1) * after, n)
        if lo >= hi:
            continue
        for s in range(lo // before, (hi - 1) // before + 1):
            out.append((s, r, max(lo, s * before), min(hi, (s + 1) * before)))
    return out


def moved_rows(n: int, k: int, before: int, after: int) -> int:
    """The most rows any rank receives from another rank in that reblock (0: all stay put)."""
    got = [0] * k
    for s, r, lo, hi in pieces(n, k, before, after):
        if s != r:
            got[r] += hi - lo
    return max(got, default=0)


def working_extent(n: int, p_src: int, k_src: int, p_dst: int, k_dst: int) -> int:
    """The extent a move of an extent-``n`` dimension from ``k_src`` parts of extent ``p_src`` to
    ``k_dst`` parts of extent ``p_dst`` runs on: ``p_src`` or ``p_dst`` if both part counts divide
    it, else the least multiple of their lcm from ``n`` on; fewest rows moved by the reblocks
    first, then fewest reblocks, then the smallest.

    Example:
        >>> working_extent(12, 16, 8, 12, 4)   # src's padded extent; dst's is no multiple of 8
        16
    """
    lcm = math.lcm(k_src, k_dst)
    candidates = {c for c in (p_src, p_dst, padded_size(n, lcm)) if c % lcm == 0}

    def rows(extent: int) -> tuple[int, int, int]:
        moved = reblocks = 0
        for k, p in ((k_src, p_src), (k_dst, p_dst)):
            if extent != p:
                moved += moved_rows(n, k, p // k, extent // k)
                reblocks += 1
        return moved, reblocks, extent

    return min(candidates, key=rows)


def with_sizes(t: DistType, sizes: tuple[int, ...]) -> DistType:
    """``t`` with its dimensions' extents set to ``sizes`` (same axes; tiles scale with them)."""
    dims = tuple(
        DistDim(size // parts(d), d.axes, size) for d, size in zip(t.dims, sizes, strict=True)
    )
    return dataclasses.replace(t, dims=dims)


def reblock(
    mesh: MeshShape, before: DistType, after: DistType, dim: int, n: int, itemsize: int
) -> Step:
    """The step changing dimension ``dim`` (true extent ``n``) from ``before``'s padded extent to
    ``after``'s, on the same mesh factors: each device ends with rows ``[r c, (r + 1) c)`` of
    ``after``'s tile ``c``. Rows that change device move in rounds, one per rank distance, in which
    every device sends and receives at most one piece (a ``ppermute``); rows that stay are copied.

    Raises:
        ValueError: if the types differ elsewhere than in ``dim``'s extent.
    """
    b, a = before.dims[dim], after.dims[dim]
    rest = [i for i in range(before.rank) if i != dim]
    same_elsewhere = all(before.dims[i] == after.dims[i] for i in rest)
    if b.axes != a.axes or not same_elsewhere or before.pending != after.pending:
        raise ValueError(f"a reblock changes one dimension's extent only, not {before} -> {after}")
    k = parts(b)
    devices = np.arange(mesh.num_devices)
    rank = before.base_offsets(mesh)[:, dim] // max(b.local, 1)
    others = np.delete(mesh.factor_coords, [mesh.factor_index[f] for f in b.axes], axis=1)
    _, group = np.unique(others, axis=0, return_inverse=True)
    group = np.asarray(group).reshape(-1)
    device = np.empty((int(group.max()) + 1, k), dtype=np.int64)
    device[group, rank] = devices
    row_elems = after.local_size // max(a.local, 1)
    by_shift: dict[int, list[Piece]] = {}
    for p in pieces(n, k, b.local, a.local):
        by_shift.setdefault(p[1] - p[0], []).append(p)
    rounds, received = [], np.zeros(mesh.num_devices, dtype=np.int64)
    for shift in sorted(by_shift, key=abs):
        table = np.zeros((mesh.num_devices, 4), dtype=np.int64)
        pairs = []
        for s, r, lo, hi in by_shift[shift]:
            senders, receivers = device[:, s], device[:, r]
            table[senders, 0], table[senders, 1] = lo - s * b.local, hi - lo
            table[receivers, 2], table[receivers, 3] = lo - r * a.local, hi - lo
            pairs += zip(senders.tolist(), receivers.tolist())
            if shift:
                received[receivers] += (hi - lo) * row_elems
        rounds.append((tuple(sorted(pairs)), tuple(map(tuple, table.tolist()))))
    groups = tuple(tuple(int(d) for d in row) for row in device)
    cost = int(received.max(initial=0)) * itemsize
    return Step("reblock", dim, None, b.axes, before, after, cost, groups=groups,
                device_map=tuple(range(mesh.num_devices)), rounds=tuple(rounds))  # fmt: skip


def reblocks(
    mesh: MeshShape, before: DistType, after: DistType, extent: tuple[int, ...], itemsize: int
) -> list[Step]:
    """The reblock steps taking ``before`` to ``after`` (types that differ in extents only), one
    per dimension whose tile changes."""
    steps, t = [], before
    for i, (x, y) in enumerate(zip(before.dims, after.dims)):
        if x.local == y.local:
            continue
        sizes = tuple(y.size if j == i else d.size for j, d in enumerate(t.dims))
        nxt = with_sizes(t, sizes)
        steps.append(reblock(mesh, t, nxt, i, extent[i], itemsize))
        t = nxt
    return steps
