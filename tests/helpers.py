"""Shared test helpers: random problems and an exhaustive concrete search (the optimality oracle)."""

from __future__ import annotations

import collections
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


def paper_edge_optimum(global_shape, src, dst, primes, itemsize: int) -> int:
    """Cheapest weak cost over the paper's edge set (§7.1: dynslice, allgather and alltoall
    between one pair of dimensions, by any product of free / held factors), by plain Dijkstra
    over every memory-bounded local shape: no pruning, no heuristic."""
    pool = collections.Counter(primes)
    bound = max(math.prod(src), math.prod(dst))

    def products(ps):
        out = {1}
        for p in ps:
            out |= {q * p for q in out}
        return sorted(out - {1})

    def factors(n):
        out, p = [], 2
        while n > 1:
            while n % p == 0:
                out.append(p)
                n //= p
            p += 1
        return out

    best = {src: 0}
    heap = [(0, src)]
    while heap:
        cost, node = heapq.heappop(heap)
        if node == dst:
            return cost
        if cost > best[node]:
            continue
        counts = [g // u for g, u in zip(global_shape, node)]
        free = pool - collections.Counter(p for c in counts for p in factors(c))
        size = math.prod(node)
        for i in range(len(node)):
            nxt = []
            for n in products(sorted(free.elements())):
                if node[i] % n == 0:
                    nxt.append((0, node[:i] + (node[i] // n,) + node[i + 1 :]))
            for n in products(factors(counts[i])):
                if size * n <= bound:
                    nxt.append((size * n, node[:i] + (node[i] * n,) + node[i + 1 :]))
                for j in range(len(node)):
                    if j != i and node[j] % n == 0:
                        new = list(node)
                        new[i] *= n
                        new[j] //= n
                        nxt.append((size, tuple(new)))
            for w, new in nxt:
                if cost + w * itemsize < best.get(new, math.inf):
                    best[new] = cost + w * itemsize
                    heapq.heappush(heap, (best[new], new))
    raise AssertionError("no path")
