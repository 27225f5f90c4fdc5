"""Shortest-path search over weak types (paper §5, §7.2).

A weak type (a distributed type up to a permutation of devices) is identified by its local shape
once the global shape is fixed. Nodes are local shapes whose size stays within
``max(localsize(src), localsize(dst))``, and whose partition counts can be made from the mesh's
prime factors. Edges are the multi-axis collectives of §7.1, one per (dimension[s], factor):

| edge                 | local shape change             | condition                               |
|----------------------|--------------------------------|-----------------------------------------|
| dynslice(i, n)       | l_i -> l_i / n                 | n | l_i, primes of n free on the mesh    |
| allgather(i, n)      | l_i -> l_i * n                 | n | (g_i / l_i)                          |
| alltoall(i -> j, n)  | l_i -> l_i * n, l_j -> l_j / n | n | (g_i / l_i), n | l_j                  |

Weights come from :mod:`redist.cost`. Ties are broken deterministically: lower cost, then fewer
communicating collectives, then fewer steps, then the lexicographically smaller local shape.

Example:
    >>> path = weak_path((8, 8), (1, 8), (8, 1), (2, 2, 2), 4)
    >>> [(s.kind, s.factor) for s in path]
    [('alltoall', 8)]
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import Counter
from typing import NamedTuple

from redist.cost import search_weight
from redist.types import Shape, prime_factors


class WeakStep(NamedTuple):
    """One weak collective: ``kind`` on ``dim`` (``to_dim`` for alltoall) by ``factor``.

    An alltoall lists its ``moves``: ``(from_dim, to_dim, factor)`` triples, several when one
    all-to-all moves factors between several pairs of dimensions at once (``dim``, ``to_dim`` and
    ``factor`` are then those of the first move).
    """

    kind: str
    dim: int
    to_dim: int | None
    factor: int
    before: Shape
    after: Shape
    cost: int
    moves: tuple[tuple[int, int, int], ...] = ()


@functools.lru_cache(maxsize=65536)
def _products(primes: tuple[int, ...]) -> tuple[int, ...]:
    """Products > 1 of the sub-multisets of ``primes`` (sorted), e.g. ``(2, 2, 3) -> 2, 3, 4, 6, 12``."""
    out = {1}
    for p in primes:
        out |= {q * p for q in out}
    return tuple(sorted(out - {1}))


def _divisors(n: int) -> tuple[int, ...]:
    return _products(prime_factors(n))


def _fits(counts: Shape, primes: Counter) -> bool:
    need = Counter(p for c in counts for p in prime_factors(c))
    return all(primes[p] >= k for p, k in need.items())


MAX_MOVES = 3  # factor moves merged into one all-to-all
MAX_MULTI_EDGES = 2048  # per node, to keep huge meshes fast


def apply_moves(node: Shape, moves) -> Shape:
    new = list(node)
    for i, j, n in moves:
        new[i] *= n
        new[j] //= n
    return tuple(new)


def _multi_moves(singles, counts: Shape, node: Shape):
    """Sets of 2..MAX_MOVES single moves that one all-to-all can do at once: distinct
    (from, to) pairs, no dimension both gathered and split, divisibility per dimension."""
    out = []

    def grow(start, chosen, gathered, split):
        if len(out) >= MAX_MULTI_EDGES:
            return
        if len(chosen) >= 2:
            out.append(tuple(chosen))
        if len(chosen) == MAX_MOVES:
            return
        for k in range(start, len(singles)):
            i, j, n = singles[k]
            if i in split or j in gathered or any(m[0] == i and m[1] == j for m in chosen):
                continue
            g, s = dict(gathered), dict(split)
            g[i] = g.get(i, 1) * n
            s[j] = s.get(j, 1) * n
            if counts[i] % g[i] or node[j] % s[j]:
                continue
            grow(k + 1, chosen + [singles[k]], g, s)

    grow(0, [], {}, {})
    return out


def _edges(node: Shape, global_shape: Shape, primes: Counter, bound: int):
    counts = tuple(g // loc for g, loc in zip(global_shape, node))
    used = Counter(p for c in counts for p in prime_factors(c))
    free = primes - used
    size = math.prod(node)
    rank = len(node)
    singles = []
    for i in range(rank):
        # dynslice: split dim i further by free factors.
        for n in _products(tuple(sorted(free.elements()))):
            if node[i] % n == 0:
                yield "dynslice", i, None, n, node[:i] + (node[i] // n,) + node[i + 1 :], ()
        for n in _divisors(counts[i]):
            if size * n <= bound:
                yield "allgather", i, None, n, node[:i] + (node[i] * n,) + node[i + 1 :], ()
            for j in range(rank):
                if j != i and node[j] % n == 0:
                    singles.append((i, j, n))
                    yield "alltoall", i, j, n, apply_moves(node, [(i, j, n)]), ((i, j, n),)
    for moves in _multi_moves(singles, counts, node):
        i, j, n = moves[0]
        yield "alltoall", i, j, n, apply_moves(node, moves), moves


def _key_add(key: tuple[int, int], kind: str, w: int) -> tuple[int, int]:
    return (key[0] + w, key[1] + (kind != "dynslice"))


@functools.lru_cache(maxsize=4096)
def weak_paths(
    global_shape: Shape,
    src: Shape,
    dst: Shape,
    primes: tuple[int, ...],
    itemsize: int,
    cost_model: str = "bytes",
    limit: int = 32,
) -> tuple[tuple[WeakStep, ...], ...]:
    """All cheapest memory-bounded weak paths from local shape ``src`` to ``dst`` (up to ``limit``).

    Cheapest means lowest cost, then fewest communicating collectives. Paths come shortest first,
    in a deterministic order; the first is the one Dijkstra's tie-break (fewer steps) prefers.

    Args:
        global_shape: the array's global shape.
        src, dst: local (per-device) shapes of the source and destination types.
        primes: the mesh's prime factor sizes (a multiset, any order).
        itemsize: bytes per element, for the cost in bytes.
        cost_model: ``"bytes"`` (the paper's Fig. 11) or ``"bytes+copies"`` (also local copies,
            see :func:`redist.cost.local_copy_elems`).
        limit: at most this many paths are returned.
    """
    pool = Counter(primes)
    for shape in (src, dst):
        counts = tuple(g // loc for g, loc in zip(global_shape, shape))
        if not _fits(counts, pool):
            raise ValueError(
                f"local shape {shape} of global {global_shape} does not fit mesh {primes}"
            )
    bound = max(math.prod(src), math.prod(dst))
    best: dict[Shape, tuple[int, int]] = {src: (0, 0)}
    edges: dict[Shape, list[tuple[WeakStep, tuple[int, int]]]] = {}
    heap = [(0, 0, src)]
    done: set[Shape] = set()
    while heap:
        cost, ncoll, node = heapq.heappop(heap)
        if node in done:
            continue
        if dst in best and (cost, ncoll) > best[dst]:
            break
        done.add(node)
        out = edges.setdefault(node, [])
        for kind, i, j, n, new, moves in _edges(node, global_shape, pool, bound):
            dim = max(m[0] for m in moves) if moves else i
            w = search_weight(kind, node, new, dim, itemsize, cost_model)
            key = _key_add((cost, ncoll), kind, w)
            out.append((WeakStep(kind, i, j, n, node, new, w, moves), key))
            if key < best.get(new, (math.inf, 0)):
                best[new] = key
                heapq.heappush(heap, (*key, new))
    if dst not in best:  # pragma: no cover - a normal form always exists (Theorem 4.8)
        raise RuntimeError(f"no memory-bounded path from {src} to {dst}")
    # Tight edges form a DAG (dynslice shrinks tiles; every other edge costs bytes).
    tight = {
        u: [s for s, key in out if s.after in done and key == best[s.after]]
        for u, out in edges.items()
    }
    hops: dict[Shape, int] = {dst: 0}
    changed = True
    while changed:  # hops to dst along tight edges (small graphs: fixed point is quick)
        changed = False
        for u, out in tight.items():
            h = min((hops[s.after] + 1 for s in out if s.after in hops), default=None)
            if h is not None and h < hops.get(u, math.inf):
                hops[u] = h
                changed = True
    paths: list[tuple[WeakStep, ...]] = []
    max_len = hops[src] + 2

    def walk(node: Shape, prefix: tuple[WeakStep, ...]) -> None:
        if len(paths) >= limit:
            return
        if node == dst:
            paths.append(prefix)
            return
        nxt = [s for s in tight.get(node, []) if s.after in hops]
        for s in sorted(
            nxt, key=lambda s: (hops[s.after], s.kind, s.dim, s.to_dim or 0, s.factor, s.moves)
        ):
            if len(prefix) + 1 + hops[s.after] <= max_len:
                walk(s.after, prefix + (s,))

    walk(src, ())
    return tuple(sorted(paths, key=len))


def weak_path(
    global_shape: Shape,
    src: Shape,
    dst: Shape,
    primes: tuple[int, ...],
    itemsize: int,
    cost_model: str = "bytes",
) -> tuple[WeakStep, ...]:
    """The cheapest memory-bounded weak path (fewest collectives, then fewest steps)."""
    return weak_paths(global_shape, src, dst, primes, itemsize, cost_model)[0]
