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

from redist.cost import calibrated_floor_ns, is_calibrated, search_weight
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


def _divides(a: Shape, b: Shape) -> bool:
    """``a[i] | b[i]`` for every dimension."""
    return all(y % x == 0 for x, y in zip(a, b))


def apply_moves(node: Shape, moves) -> Shape:
    new = list(node)
    for i, j, n in moves:
        new[i] *= n
        new[j] //= n
    return tuple(new)


def _goal_targets(node: Shape, dst: Shape, global_shape: Shape) -> list[Shape]:
    """Local shapes one all-to-all can reach from ``node`` that divide ``dst`` and differ from it
    in at most one dimension (so that at most one allgather remains): each dimension grows or
    shrinks by a whole factor, the size is kept."""
    size = math.prod(node)
    options = []
    for u, d, g in zip(node, dst, global_shape):
        opts = [v for v in (1, *_products(prime_factors(d))) if d % v == 0 and g % v == 0]
        options.append([v for v in opts if v % u == 0 or u % v == 0])
    suffix = [1] * (len(node) + 1)  # the largest size the remaining dimensions can reach
    for k in range(len(node) - 1, -1, -1):
        suffix[k] = suffix[k + 1] * max(options[k])
    out: list[Shape] = []

    def grow(k: int, prefix: tuple[int, ...], prod: int, short: int) -> None:
        if k == len(node):
            if prod == size and prefix != node:
                out.append(prefix)
            return
        for v in options[k]:
            p = prod * v
            left = short + (v != dst[k])
            if size % p == 0 and p * suffix[k + 1] >= size and left <= 1:
                grow(k + 1, prefix + (v,), p, left)

    grow(0, (), 1, 0)
    return out


def _moves_to(node: Shape, target: Shape) -> tuple[tuple[int, int, int], ...]:
    """Pair the factors gathered in some dimensions with those split in others: one move per
    (from, to) pair, each prime unit going to the first dimension that still needs it."""
    gather = [(i, t // u) for i, (u, t) in enumerate(zip(node, target)) if t > u]
    split = [(j, u // t) for j, (u, t) in enumerate(zip(node, target)) if t < u]
    need = {j: Counter(prime_factors(n)) for j, n in split}
    moves: dict[tuple[int, int], int] = {}
    for i, n in gather:
        for p in prime_factors(n):
            j = next(j for j, _ in split if need[j][p])
            need[j][p] -= 1
            moves[(i, j)] = moves.get((i, j), 1) * p
    return tuple((i, j, n) for (i, j), n in moves.items())


@functools.lru_cache(maxsize=1 << 16)
def _edges(node: Shape, global_shape: Shape, primes: tuple[int, ...], bound: int, dst: Shape):
    """Edges of the weak graph pruned to normal forms (Theorem 4.8, Lemma 6.5): some cheapest
    path is ``dynslice* alltoall* allgather*``, so its all-to-alls run at a size no larger than
    ``dst``'s and each allgather lands on a shape dividing ``dst``. Every single-pair collective
    of the paper's edge set (§7.1) that such a path can use is generated; all-to-alls moving
    factors between several pairs of dimensions at once are generated only when they land where
    allgathers alone finish the job."""
    counts = tuple(g // loc for g, loc in zip(global_shape, node))
    used = Counter(p for c in counts for p in prime_factors(c))
    free = Counter(primes) - used
    size = math.prod(node)
    rank = len(node)
    exchange = size <= math.prod(dst)
    out = []
    for i in range(rank):
        for n in _products(tuple(sorted(free.elements()))):
            if node[i] % n == 0:
                out.append(("dynslice", i, None, n, node[:i] + (node[i] // n,) + node[i + 1 :], ()))
        for n in _divisors(counts[i]):
            if size * n <= bound and dst[i] % (node[i] * n) == 0 and _divides(node, dst):
                out.append(("allgather", i, None, n, node[:i] + (node[i] * n,) + node[i + 1 :], ()))
            if not exchange:
                continue
            for j in range(rank):
                if j != i and node[j] % n == 0:
                    out.append(("alltoall", i, j, n, apply_moves(node, [(i, j, n)]), ((i, j, n),)))
    if exchange:
        for target in _goal_targets(node, dst, global_shape):
            if sum(u != v for u, v in zip(node, target)) > 2:  # two: a single pair, listed above
                moves = _moves_to(node, target)
                i, j, n = moves[0]
                out.append(("alltoall", i, j, n, target, moves))
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)
def _weighted_edges(node, global_shape, primes, bound, dst, itemsize, cost_model):
    """:func:`_edges` as weak steps weighted under ``cost_model`` (cached: the planner asks for
    many redistributions of one array, whose searches share nodes)."""
    out = []
    for kind, i, j, n, new, moves in _edges(node, global_shape, primes, bound, dst):
        dim = max(m[0] for m in moves) if moves else i
        group = math.prod(m[2] for m in moves) if moves else n
        w = search_weight(kind, node, new, dim, itemsize, cost_model, group)
        out.append(WeakStep(kind, i, j, n, node, new, w, moves))
    return tuple(out)


def _key_add(key: tuple[int, int], kind: str, w: int) -> tuple[int, int]:
    return (key[0] + w, key[1] + (kind != "dynslice"))


def _remaining(node: Shape, dst: Shape, global_shape: Shape, primes: Counter, itemsize: int) -> int:
    """A lower bound on the bytes still to move from ``node`` to ``dst`` (A*'s heuristic).

    Dynslices alone suffice when ``dst`` divides ``node``. Otherwise the last communicating step
    lands on a tile at least ``dst``'s and costs that much. When neither allgathers alone nor
    dynslices then allgathers can finish, an all-to-all comes first, at a size no smaller than
    what dynslices can reach from ``node``.
    """
    if _divides(dst, node):
        return 0
    last = math.prod(dst)
    size = math.prod(node)
    if size >= last:
        return last * itemsize
    common = tuple(math.gcd(u, d) for u, d in zip(node, dst))
    if _fits(tuple(g // c for g, c in zip(global_shape, common)), primes):
        return last * itemsize
    counts = tuple(g // u for g, u in zip(global_shape, node))
    free = primes - Counter(p for c in counts for p in prime_factors(c))
    return (last + size // math.prod(free.elements())) * itemsize


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
        cost_model: ``"bytes"`` (the paper's Fig. 11), ``"bytes+copies"`` (also local copies,
            see :func:`redist.cost.local_copy_elems`) or ``"calibrated"`` / ``"calibrated:<name>"``
            (nanoseconds on the CPU or the named calibration, see
            :func:`redist.cost.search_weight`).
        limit: at most this many paths are returned.
    """
    pool = Counter(primes)
    primes_key = tuple(sorted(primes))
    for shape in (src, dst):
        counts = tuple(g // loc for g, loc in zip(global_shape, shape))
        if not _fits(counts, pool):
            raise ValueError(
                f"local shape {shape} of global {global_shape} does not fit mesh {primes}"
            )
    bound = max(math.prod(src), math.prod(dst))
    best: dict[Shape, tuple[int, int]] = {src: (0, 0)}
    edges: dict[Shape, list[tuple[WeakStep, tuple[int, int]]]] = {}

    @functools.cache
    def h(node: Shape) -> int:
        floor = _remaining(node, dst, global_shape, pool, itemsize)
        return calibrated_floor_ns(floor, cost_model) if is_calibrated(cost_model) else floor

    heap = [(h(src), 0, 0, src)]  # (estimate, collectives, cost, node)
    while heap:  # A* with an admissible heuristic; a node is expanded again if reached cheaper
        _, ncoll, cost, node = heapq.heappop(heap)
        if (cost, ncoll) != best[node]:
            continue
        if dst in best and (cost + h(node), ncoll) > best[dst]:
            break
        out = edges[node] = []
        for step in _weighted_edges(
            node, global_shape, primes_key, bound, dst, itemsize, cost_model
        ):
            new = step.after
            key = _key_add((cost, ncoll), step.kind, step.cost)
            out.append((step, key))
            if key < best.get(new, (math.inf, 0)):
                best[new] = key
                heapq.heappush(heap, (key[0] + h(new), key[1], key[0], new))
    if dst not in best:  # pragma: no cover - a normal form always exists (Theorem 4.8)
        raise RuntimeError(f"no memory-bounded path from {src} to {dst}")
    done = set(edges) | {dst}
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
