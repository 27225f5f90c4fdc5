"""Shared test helpers: random problems and an exhaustive concrete search (the optimality oracle)."""

from __future__ import annotations

import heapq
import itertools
import math
import random

from redist import problems
from redist.cost import step_cost
from redist.types import DistDim, DistType, MeshShape

MESHES = ({"a": 2, "b": 2, "c": 2}, {"a": 4, "b": 2}, {"a": 8}, {"a": 2, "b": 3})


def random_problem(rng: random.Random, mesh: dict[str, int], max_rank: int = 6, max_elems=4096):
    """``(shape, src, dst)`` of a random problem of at most ``max_elems`` elements."""
    p = problems.random_problem(rng, mesh, max_rank=max_rank, max_elems=max_elems)
    return p.shape, p.src, p.dst


def concrete_optimum(mesh: MeshShape, src: DistType, dst: DistType, itemsize: int) -> int:
    """Cheapest memory-bounded sequence of Fig. 8's collectives (multi-axis, plus allpermute)."""
    bound = max(src.local_size, dst.local_size)
    factors = mesh.factor_names
    size = mesh.factor_size

    def neighbours(t: DistType):
        used = t.axes
        free = [a for a in factors if a not in used]
        for i, d in enumerate(t.dims):
            for k in range(1, len(free) + 1):
                for xs in itertools.permutations(free, k):
                    n = math.prod(size[a] for a in xs)
                    if d.local % n == 0:
                        yield "dynslice", _set(t, i, DistDim(d.local // n, xs + d.axes, d.size))
            for k in range(1, len(d.axes) + 1):
                xs, rest = d.axes[:k], d.axes[k:]
                n = math.prod(size[a] for a in xs)
                gathered = DistDim(d.local * n, rest, d.size)
                yield "allgather", _set(t, i, gathered)
                for j, e in enumerate(t.dims):
                    if j != i and e.local % n == 0:
                        yield (
                            "alltoall",
                            _set(
                                _set(t, i, gathered), j, DistDim(e.local // n, xs + e.axes, e.size)
                            ),
                        )

    by_local: dict[tuple[int, ...], list[DistType]] = {}
    for t in _all_types(mesh, src.global_shape):
        if t.local_size <= bound:
            by_local.setdefault(t.local_shape, []).append(t)
    best = {src: 0}
    heap = [(0, 0, src)]
    counter = itertools.count()
    seen: set[DistType] = set()
    while heap:
        cost, _, t = heapq.heappop(heap)
        if t in seen:
            continue
        seen.add(t)
        if t == dst:
            return cost
        moves = list(neighbours(t))
        moves += [("allpermute", u) for u in by_local.get(t.local_shape, []) if u != t]
        for kind, u in moves:
            if u.local_size > bound:
                continue
            w = step_cost(kind, before=t.local_size, after=u.local_size, itemsize=itemsize)
            if cost + w < best.get(u, math.inf):
                best[u] = cost + w
                heapq.heappush(heap, (cost + w, next(counter), u))
    raise AssertionError("destination unreachable")


def _all_types(mesh: MeshShape, shape: tuple[int, ...]):
    """Every well-formed type of ``shape`` on ``mesh`` (small meshes only)."""
    names = mesh.factor_names
    for where in itertools.product(range(-1, len(shape)), repeat=len(names)):
        per_dim = [[a for a, w in zip(names, where) if w == i] for i in range(len(shape))]
        for orders in itertools.product(*(itertools.permutations(d) for d in per_dim)):
            try:
                yield DistType.from_axes(shape, orders, mesh)
            except ValueError:
                continue


def _set(t: DistType, i: int, d: DistDim) -> DistType:
    dims = list(t.dims)
    dims[i] = d
    return DistType(tuple(dims))
