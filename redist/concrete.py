"""Lowering weak paths to concrete steps with device maps (paper §6, Fig. 10, §7.3).

A concrete state is a type ``t`` over the mesh's prime factors together with a device map
``phi`` (``phi[h]`` is the physical device at logical point ``h``): physical device ``phi[h]`` holds
the tile at ``base_offsets(t)[h]``. A collective on axes that are not minor-most in their dimension
first relabels devices (a new ``phi``, no data moves) so that they are; so no intermediate permutation
is ever needed. At the end the physical placement is compared with the destination's; only if they
differ is one ``allpermute`` added, placed before any trailing ``allgather``s where its tiles are
smaller. Concrete axes are chosen with a bias to the destination type.

Among weak paths of equal cost, the first whose lowering needs no permutation is taken.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from redist import radix
from redist.cost import search_weight, step_cost
from redist.search import WeakStep
from redist.steps import Group, Plan, Step
from redist.types import DistDim, DistType, MeshShape, prime_factors


class _State:
    """A concrete type with its device map; mutable scratch used only while lowering."""

    def __init__(self, mesh: MeshShape, t: DistType, phi: np.ndarray):
        self.mesh, self.t, self.phi = mesh, t, phi

    def physical_offsets(self) -> np.ndarray:
        out = np.empty((self.mesh.num_devices, self.t.rank), dtype=np.int64)
        out[self.phi] = self.t.base_offsets(self.mesh)
        return out


def _with_dim(t: DistType, i: int, local: int, axes: tuple[str, ...]) -> DistType:
    dims = list(t.dims)
    dims[i] = DistDim(local, axes, dims[i].size)
    return DistType(tuple(dims))


def _nested(a: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """A 2-d integer array as a tuple of tuples of Python ints (hashable, printable)."""
    return tuple(map(tuple, a.tolist()))


def _finished(step: Step) -> Step:
    """``step`` with its numpy tables (kept while candidate plans are compared) as tuples."""
    return dataclasses.replace(
        step,
        groups=_nested(step.groups) if len(step.groups) else (),
        offsets=_nested(step.offsets) if len(step.offsets) else (),
        device_map=tuple(np.asarray(step.device_map).tolist()),
    )


def _radix_index(mesh: MeshShape, axes: Sequence[str]) -> np.ndarray:
    """Per logical point, the mixed-radix number of its coordinates on ``axes`` (first = fastest)."""
    coords = mesh.factor_coords
    value = radix.number([coords[:, mesh.factor_index[a]] for a in axes],
                         [mesh.factor_size[a] for a in axes])  # fmt: skip
    return np.zeros(mesh.num_devices, dtype=np.int64) + value


def _relabel(state: _State, i: int, new_order: tuple[str, ...]) -> None:
    """Reorder dim ``i``'s axes to ``new_order`` keeping every device's tile (rule ALLGATHER/ALLTOALL).

    Finds ``sigma`` with ``beta' = beta o sigma`` and sets ``phi' = phi o sigma``.
    """
    mesh, old = state.mesh, state.t.dims[i].axes
    if new_order == old:
        return
    block = _radix_index(mesh, new_order)
    coords = mesh.factor_coords.copy()
    for a, digit in zip(old, radix.digits(block, [mesh.factor_size[a] for a in old])):
        coords[:, mesh.factor_index[a]] = digit
    sizes = [f.size for f in mesh.factors]
    sigma = np.ravel_multi_index(tuple(coords.T), sizes)
    state.phi = state.phi[sigma]
    state.t = _with_dim(state.t, i, state.t.dims[i].local, new_order)


def _groups(state: _State, axes: tuple[str, ...]) -> tuple[Group, ...]:
    """Device groups varying ``axes`` (the rest fixed), members ordered by ``axes`` (first fastest)."""
    mesh = state.mesh
    rank = _radix_index(mesh, axes)
    others = [f.name for f in mesh.factors if f.name not in axes]
    key = _radix_index(mesh, others)
    n = math.prod(mesh.factor_size[a] for a in axes)
    table = np.empty((mesh.num_devices // n, n), dtype=np.int64)
    table[key, rank] = state.phi
    return table


def _pick(candidates: Sequence[str], n: int, score, mesh: MeshShape) -> tuple[str, ...]:
    """Choose factors from ``candidates`` whose sizes multiply to ``n``, lowest ``score`` first."""
    ranked = sorted(range(len(candidates)), key=lambda k: (score(candidates[k]), k))
    chosen = []
    for p in prime_factors(n):
        for k in ranked:
            a = candidates[k]
            if a not in chosen and mesh.factor_size[a] == p:
                chosen.append(a)
                break
        else:  # pragma: no cover - guaranteed by the weak path's validity
            raise RuntimeError(f"cannot find factors of {n} among {candidates}")
    return tuple(a for a in candidates if a in chosen)


def _order_like(axes: tuple[str, ...], reference: tuple[str, ...]) -> tuple[str, ...]:
    """Sort ``axes`` by their position in ``reference``; those absent go last, in given order."""
    pos = {a: k for k, a in enumerate(reference)}
    return tuple(sorted(axes, key=lambda a: (pos.get(a, len(reference)), axes.index(a))))


def _lower_step(state: _State, w: WeakStep, dst: DistType, itemsize: int) -> Step:
    mesh, t = state.mesh, state.t
    i = w.dim
    before = t
    if w.kind == "dynslice":
        free = [f.name for f in mesh.factors if f.name not in t.axes]

        def score(a: str) -> int:
            d = dst.dim_of(a)
            return 0 if d == i else 1 if d is None else 2

        x = _order_like(_pick(free, w.factor, score, mesh), dst.dims[i].axes)
        local = t.dims[i].local // w.factor
        state.t = _with_dim(t, i, local, x + t.dims[i].axes)
        start = np.zeros((mesh.num_devices, t.rank), dtype=np.int64)
        start[state.phi, i] = local * _radix_index(mesh, x)
        return Step(
            "dynslice", i, None, x, before, state.t, 0,
            offsets=start,
            device_map=state.phi.copy(),
        )  # fmt: skip
    if w.kind == "allgather":
        axes_i = t.dims[i].axes

        def score(a: str) -> int:
            d = dst.dim_of(a)
            return 0 if d is None else 1 if d != i else 2

        x = _pick(axes_i, w.factor, score, mesh)
        _relabel(state, i, x + tuple(a for a in axes_i if a not in x))
        groups = _groups(state, x)
        new_t = _with_dim(state.t, i, t.dims[i].local * w.factor, state.t.dims[i].axes[len(x) :])
        moves: tuple[tuple[int, int, int], ...] = ()
        xs: list[tuple[str, ...]] = []
    else:
        moves, xs = _alltoall_moves(t, w.after, dst, mesh)
        # Moves into one dimension land in move order (first minor-most): follow dst's order.
        rank_in_dst = [
            min(
                (dst.dims[j].axes.index(a) for a in x if a in dst.dims[j].axes), default=len(x) + 99
            )
            for (_, j, _), x in zip(moves, xs)
        ]
        order = sorted(range(len(moves)), key=lambda k: (rank_in_dst[k], k))
        moves, xs = tuple(moves[k] for k in order), [xs[k] for k in order]
        for d in dict.fromkeys(m[0] for m in moves):  # moved axes minor-most, in move order
            front = tuple(a for k, m in enumerate(moves) if m[0] == d for a in xs[k])
            _relabel(state, d, front + tuple(a for a in state.t.dims[d].axes if a not in front))
        x = tuple(a for xk in xs for a in xk)
        groups = _groups(state, x)
        new_t = state.t
        for d in dict.fromkeys(m[0] for m in moves):
            n = math.prod(m[2] for m in moves if m[0] == d)
            gone = {a for k, m in enumerate(moves) if m[0] == d for a in xs[k]}
            rest = tuple(a for a in new_t.dims[d].axes if a not in gone)
            new_t = _with_dim(new_t, d, new_t.dims[d].local * n, rest)
        for d in dict.fromkeys(m[1] for m in moves):
            n = math.prod(m[2] for m in moves if m[1] == d)
            come = tuple(a for k, m in enumerate(moves) if m[1] == d for a in xs[k])
            new_t = _with_dim(new_t, d, new_t.dims[d].local // n, come + new_t.dims[d].axes)
    state.t = new_t
    cost = step_cost(w.kind, before=before.local_size, after=new_t.local_size, itemsize=itemsize)
    return Step(
        w.kind, i, w.to_dim, x, before, new_t, cost, groups=groups,
        device_map=state.phi.copy(), moves=moves,
        move_axes=tuple(xs) if moves else (),
    )  # fmt: skip


def _alltoall_moves(
    t: DistType, after: Sequence[int], dst: DistType, mesh: MeshShape
) -> tuple[tuple[tuple[int, int, int], ...], list[tuple[str, ...]]]:
    """The ``(from, to, n)`` moves of one all-to-all from ``t`` to local shape ``after``, and the
    factors each moves: every dimension that grows gives up factors, preferring those ``dst``
    places in a dimension that shrinks; each goes where ``dst`` wants it if that dimension still
    needs its prime, else to the first that does."""
    before = t.local_shape
    need = {j: list(prime_factors(u // a)) for j, (u, a) in enumerate(zip(before, after)) if a < u}
    assigned: dict[tuple[int, int], list[str]] = {}
    for i, (u, a) in enumerate(zip(before, after)):
        if a <= u:
            continue

        def score(x: str, i=i) -> int:
            d = dst.dim_of(x)
            return 0 if d in need else 2 if d == i else 1

        for x in _pick(t.dims[i].axes, a // u, score, mesh):
            p, d = mesh.factor_size[x], dst.dim_of(x)
            j = d if p in need.get(d, ()) else next(j for j, ps in need.items() if p in ps)
            need[j].remove(p)
            assigned.setdefault((i, j), []).append(x)
    moves = tuple(
        (i, j, math.prod(mesh.factor_size[x] for x in xs)) for (i, j), xs in assigned.items()
    )
    axes = [_order_like(tuple(xs), dst.dims[j].axes) for (_, j), xs in assigned.items()]
    return moves, axes


def _permute(state: _State, target: DistType, itemsize: int) -> Step | None:
    """One allpermute from ``state`` to ``target`` under the identity device map, if needed."""
    have = state.physical_offsets()
    want = target.base_offsets(state.mesh)
    if np.array_equal(have, want):
        return None
    # Tile ids; a device holding the tile it needs stays; the others pair up per tile, in order.
    shape = target.global_shape
    held = np.ravel_multi_index(tuple(have.T), shape) if shape else np.zeros(len(have), int)
    needed = np.ravel_multi_index(tuple(want.T), shape) if shape else np.zeros(len(want), int)
    moving = np.flatnonzero(held != needed)
    senders = moving[np.lexsort((moving, held[moving]))]
    receivers = moving[np.lexsort((moving, needed[moving]))]
    if not np.array_equal(held[senders], needed[receivers]):  # pragma: no cover
        raise RuntimeError("the tiles held and the tiles needed differ")
    pairs = list(zip(senders.tolist(), receivers.tolist()))
    identity = np.arange(state.mesh.num_devices)
    step = Step(
        "allpermute", None, None, (), state.t, target, target.local_size * itemsize,
        perm=tuple(sorted(pairs)), device_map=identity,
    )  # fmt: skip
    state.t, state.phi = target, identity
    return step


def _pregather_target(state: _State, gathers: Sequence[WeakStep], dst: DistType) -> DistType:
    """The type just before the trailing allgathers: ``dst`` plus the gathered axes, minor-most."""
    mesh, t = state.mesh, state.t
    taken: set[str] = set()
    dims = list(dst.dims)
    for i in dict.fromkeys(g.dim for g in gathers):
        n = math.prod(g.factor for g in gathers if g.dim == i)
        pool = list(t.dims[i].axes) + [f.name for f in mesh.factors]
        pool = [a for a in dict.fromkeys(pool) if a not in dst.axes and a not in taken]
        held = t.dims[i].axes
        x = _order_like(_pick(pool, n, lambda a, held=held: 0 if a in held else 1, mesh), held)
        taken.update(x)
        dims[i] = DistDim(dst.dims[i].local // n, x + dst.dims[i].axes, dst.dims[i].size)
    return DistType(tuple(dims))


def concretize(
    mesh: MeshShape,
    src: DistType,
    dst: DistType,
    path: Sequence[WeakStep],
    itemsize: int,
    fold_min_bytes: int = 0,
    fold_max_bytes: int | None = None,
) -> tuple[Step, ...]:
    """Concrete steps for ``path``: no intermediate permutation, at most one final one (folded
    into the alltoall before it where each chunk has ``fold_min_bytes`` to ``fold_max_bytes``)."""
    fold = (fold_min_bytes, fold_max_bytes)
    identity = np.arange(mesh.num_devices)
    state = _State(mesh, src, identity)
    steps = [_lower_step(state, w, dst, itemsize) for w in path]
    last = _permute(state, dst, itemsize)
    if last is None:
        return tuple(steps)
    k = len(path)
    while k > 0 and path[k - 1].kind == "allgather":
        k -= 1
    if k == len(path):
        return _fuse_permutation((*steps, last), itemsize, *fold)
    # Move the permutation before the trailing allgathers, where tiles are smaller.
    state = _State(mesh, src, identity)
    steps = [_lower_step(state, w, dst, itemsize) for w in path[:k]]
    target = _pregather_target(state, path[k:], dst)
    perm = _permute(state, target, itemsize)
    if perm is not None:
        steps.append(perm)
    for i in dict.fromkeys(g.dim for g in path[k:]):
        n = math.prod(g.factor for g in path[k:] if g.dim == i)
        w = WeakStep("allgather", i, None, n, state.t.local_shape, (), 0)
        steps.append(_lower_step(state, w, dst, itemsize))
    end = _permute(state, dst, itemsize)
    if end is not None:  # pragma: no cover - the pre-gather target gathers exactly into dst
        raise RuntimeError("lowering did not reach the destination placement")
    return _fuse_permutation(steps, itemsize, *fold)


def _fuse_permutation(
    steps: Sequence[Step], itemsize: int, min_bytes: int, max_bytes: int | None = None
) -> tuple[Step, ...]:
    """Fold an allpermute into the alltoall just before it: each chunk goes straight to the
    device that finally needs it, so the permutation costs no extra transfer."""
    out = list(steps)
    for k in range(1, len(out)):
        a2a = out[k - 1]
        chunk = a2a.after.local_size * itemsize // a2a.group_size
        sized = min_bytes <= chunk and (max_bytes is None or chunk <= max_bytes)
        if out[k].kind == "allpermute" and a2a.kind == "alltoall" and sized:
            fused = dataclasses.replace(
                out[k - 1], after=out[k].after, perm=out[k].perm, device_map=out[k].device_map
            )
            return (*out[: k - 1], fused, *out[k + 1 :])
    return tuple(out)


def make_plan(
    mesh: MeshShape,
    src: DistType,
    dst: DistType,
    paths: Sequence[Sequence[WeakStep]],
    dtype: str,
    itemsize: int,
    fold_min_bytes: int = 0,
    cost_model: str = "bytes",
    fold_max_bytes: int | None = None,
) -> Plan:
    """Lower each candidate path (all of equal weak cost) and keep the best concrete plan."""
    best = None
    for path in paths:
        steps = concretize(mesh, src, dst, path, itemsize, fold_min_bytes, fold_max_bytes)
        plan = Plan(mesh, src, dst, dtype, itemsize, steps)
        permute = sum(
            search_weight("allpermute", s.before.local_shape, s.after.local_shape, 0, itemsize,
                          cost_model, mesh.num_devices)
            for s in plan.steps if s.kind == "allpermute"
        )  # fmt: skip
        key = (sum(w.cost for w in path) + permute, plan.num_collectives, len(plan.steps))
        if best is None or key < best[0]:
            best = (key, plan)
        if "allpermute" not in plan.kinds:
            break
    plan = best[1]
    return dataclasses.replace(plan, steps=tuple(_finished(s) for s in plan.steps))


def reduce_pending(mesh: MeshShape, src: DistType, dim: int | None, itemsize: int) -> Step:
    """The step reducing ``src``'s pending sum: a reduce-scatter onto ``dim`` (whose tile gains
    the pending factors, minor-most) or, for ``dim=None``, an all-reduce."""
    x = tuple(reversed(src.pending))  # minor-to-major
    state = _State(mesh, src, np.arange(mesh.num_devices))
    groups = _groups(state, x)
    if dim is None:
        after = DistType(src.dims)
        kind = "allreduce"
    else:
        n = math.prod(mesh.factor_size[a] for a in x)
        old = src.dims[dim]
        after = _with_dim(DistType(src.dims), dim, old.local // n, x + old.axes)
        kind = "reducescatter"
    cost = step_cost(kind, before=src.local_size, after=after.local_size, itemsize=itemsize)
    return _finished(Step(kind, dim, None, x, src, after, cost, groups=groups,
                          device_map=np.arange(mesh.num_devices)))  # fmt: skip
