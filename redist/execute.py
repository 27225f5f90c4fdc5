"""Execution of a :class:`Plan` with ``jax.lax`` collectives inside one ``shard_map``.

| step       | jax.lax                                                    |
|------------|------------------------------------------------------------|
| dynslice   | ``dynamic_slice`` at offsets looked up by device index     |
| allgather  | ``all_gather(tiled=True)``                                  |
| alltoall   | ``all_to_all(tiled=True)`` on a leading axis of the chunks stacked |
| allpermute | ``ppermute`` over all mesh axes                            |
| reducescatter | ``psum_scatter(tiled=True)`` (a pending sum, onto ``dim``) |
| allreduce  | ``psum`` (a pending sum)                                   |
| reblock    | per round a ``dynamic_slice``, a ``ppermute``, a masked update |

Collectives use named mesh axes when their device groups are exactly the groups of some mesh axes
(in some order); otherwise all axes with ``axis_index_groups`` (groups relabelled by device maps).
Consecutive dynslices are fused into one ``dynamic_slice``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from redist.radix import move_blocks
from redist.steps import Group, Plan, Step


def _axis_groups(mesh_axes: Sequence[tuple[str, int]], names: Sequence[str]) -> frozenset:
    """Groups (member order row-major over ``names``, first major) of the mesh's devices."""
    sizes = [s for _, s in mesh_axes]
    pos = [n for n, _ in mesh_axes]
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    order = [pos.index(n) for n in names] + [k for k in range(len(pos)) if pos[k] not in names]
    moved = ids.transpose(order).reshape(math.prod(sizes[k] for k in order[: len(names)]), -1)
    return frozenset(tuple(int(v) for v in moved[:, c]) for c in range(moved.shape[1]))


@functools.lru_cache(maxsize=4096)
def _named_axes(mesh_axes: tuple[tuple[str, int], ...], groups: tuple[Group, ...]):
    """Mesh axis names (major first) whose groups are exactly ``groups``, or ``None``."""
    sizes = dict(mesh_axes)
    strides, s = {}, 1
    for name, size in reversed(mesh_axes):
        strides[name] = s
        s *= size
    first = groups[0]
    varying = [
        n for n, _ in mesh_axes
        if len({(d // strides[n]) % sizes[n] for d in first}) > 1
    ]  # fmt: skip
    if math.prod(sizes[n] for n in varying) != len(first) or len(varying) > 4:
        return None
    want = frozenset(groups)
    for names in itertools.permutations(varying):
        if _axis_groups(mesh_axes, names) == want:
            return names
    return None


def _device_index(mesh_axes: Sequence[tuple[str, int]]):
    idx = 0
    for name, size in mesh_axes:
        idx = idx * size + lax.axis_index(name)
    return idx


def per_device(table, idx) -> list:
    """Row ``idx`` of ``table`` (one row per device, one column per value), the device's own
    values: a column every device shares is a Python int, the varying ones are read from one
    flat constant with one slice. Compilers store a small table padded to their tile (the TPU:
    a 2-D ``s32[8, 5]`` takes 4 KiB, a 1-D ``s32[40]`` 512 B), so one flat table per lookup.

    Example:
        >>> per_device(np.array([[0, 4], [0, 8]]), lax.axis_index("a"))   # doctest: +SKIP
        [0, Array(4 or 8)]
    """
    t = np.asarray(table, dtype=np.int64).reshape(len(table), -1)
    varying = [c for c in range(t.shape[1]) if (t[:, c] != t[0, c]).any()]
    out: list = [int(v) for v in t[0]]
    if varying:
        flat = jnp.asarray(t[:, varying].reshape(-1), dtype=jnp.int32)
        row = lax.dynamic_slice(flat, [idx * len(varying)], [len(varying)])
        for k, c in enumerate(varying):
            out[c] = row[k]
    return out


def _collective_args(mesh_axes, step: Step):
    named = _named_axes(mesh_axes, step.groups)
    if named is not None:
        return {"axis_name": named if len(named) > 1 else named[0]}
    return {
        "axis_name": tuple(n for n, _ in mesh_axes),
        "axis_index_groups": [list(g) for g in step.groups],
    }


def _moves(step: Step) -> tuple[tuple[int, int, int], ...]:
    return step.moves or ((step.dim, step.to_dim, step.group_size),)


def _tiled_all_to_all(x, split_axis: int, concat_axis: int, **args):
    """``lax.all_to_all(tiled=True)`` on ``x`` with its other size-1 dimensions squeezed out.

    XLA:CPU rewrites an all-to-all into a tuple of slices and may then give those slices
    different layouts on size-1 dimensions, which its HLO verifier rejects ("all-to-all has
    operands with different shapes"); without such dimensions the layouts agree.
    """
    keep = [d for d, n in enumerate(x.shape) if n != 1 or d in (split_axis, concat_axis)]
    if len(keep) == x.ndim:
        return lax.all_to_all(x, split_axis=split_axis, concat_axis=concat_axis, tiled=True, **args)
    y = lax.all_to_all(x.reshape([x.shape[d] for d in keep]), split_axis=keep.index(split_axis),
                       concat_axis=keep.index(concat_axis), tiled=True, **args)  # fmt: skip
    shape = list(x.shape)
    for k, d in enumerate(keep):
        shape[d] = y.shape[k]
    return y.reshape(shape)


def _all_to_all(x, step: Step, args: dict):
    """An all-to-all of ``step.moves``: factors leave the gathered dimensions for the split ones.

    The chunks are stacked on a new leading axis (rank digits, first move fastest), exchanged
    with one all-to-all on that axis, and unstacked into the gathered dimensions: the received
    chunks then land in place. This is the form XLA's partitioner emits (the parts on an axis of
    their own): for it the TPU compiler picks layouts that pad less than for an all-to-all that
    splits and concatenates inner dimensions (v5p:2x2x2, float32: the paper's P3 needs 0.78 x
    the bound of temporaries instead of 0.89, XLA 0.77; a random problem 3.66 instead of 8.00);
    XLA:CPU compiles the same kernels either way, and stages half a tile less for one move.
    """
    moves = _moves(step)
    m, shape = len(moves), x.shape
    # Split every destination dim into (digit axes of its moves, last move major; rest).
    split_shape, digit_axis, rest_axis = [], {}, []
    for d, size in enumerate(shape):
        into = [k for k, mv in enumerate(moves) if mv[1] == d]
        for k in reversed(into):
            digit_axis[k] = len(split_shape)
            split_shape.append(moves[k][2])
            size //= moves[k][2]
        rest_axis.append(len(split_shape))
        split_shape.append(size)
    order = [digit_axis[k] for k in reversed(range(m))] + rest_axis
    y = jnp.transpose(x.reshape(split_shape), order)
    rest = [split_shape[a] for a in rest_axis]
    y = y.reshape((math.prod(mv[2] for mv in moves), *rest))
    y = _tiled_all_to_all(y, split_axis=0, concat_axis=0, **args)
    y = y.reshape(tuple(mv[2] for mv in reversed(moves)) + tuple(rest))
    # Digit axis of move k is m - 1 - k; put each before its gathered dim, last move major.
    order, out_shape = [], []
    for d, size in enumerate(rest):
        frm = [k for k, mv in enumerate(moves) if mv[0] == d]
        order += [m - 1 - k for k in reversed(frm)] + [m + d]
        out_shape.append(size * math.prod(moves[k][2] for k in frm))
    return jnp.transpose(y, order).reshape(out_shape)


def _all_to_all_permuted(x, step: Step, all_names, idx, num_devices: int):
    """An all-to-all whose results go to permuted devices, as rounds of ``ppermute``.

    In round ``k`` the member of rank ``r`` sends its chunk for rank ``t = (r + k) % n`` to the
    device that finally holds rank ``t``'s result; receivers place it by the sender's rank. Bytes
    moved are those of the all-to-all alone, and no staging copy of the whole tile is needed.
    With ``step.serial`` a round slices its pieces only once the round before has landed (an
    ``optimization_barrier`` on its offsets and the result), so one round's buffers are live.
    """
    moves = _moves(step)
    n = step.group_size
    dest = np.arange(num_devices)
    for s, d in step.perm:
        dest[s] = d
    out_shape = list(x.shape)
    for i, j, f in moves:
        out_shape[i] *= f
        out_shape[j] //= f

    def starts(rank: int, side: int, sizes) -> list[int]:
        start = [0] * x.ndim
        for dim, b in move_blocks(moves, rank, side).items():
            start[dim] = b * sizes[dim]
        return start

    piece_shape = list(out_shape)
    for i, _, _ in moves:
        piece_shape[i] = x.shape[i]
    # every round's offsets, the pieces taken then placed, read with one lookup
    tables = np.zeros((num_devices, n, 2, x.ndim), np.int64)
    rounds = []
    for k in range(n):
        pairs = []
        for group in step.groups:
            for r, d in enumerate(group):
                t = (r + k) % n
                e = int(dest[group[t]])
                tables[d, k, 0] = starts(t, 1, out_shape)
                tables[e, k, 1] = starts(r, 0, x.shape)
                pairs.append((d, e))
        rounds.append(pairs)
    offsets = per_device(tables.reshape(num_devices, -1), idx)
    out = jnp.zeros(out_shape, x.dtype)
    for k, pairs in enumerate(rounds):
        take = offsets[(2 * k) * x.ndim : (2 * k + 1) * x.ndim]
        put = offsets[(2 * k + 1) * x.ndim : (2 * k + 2) * x.ndim]
        if step.serial and k:  # round k slices once round k - 1 has landed
            take, out = _in_turn(take, out)
        piece = lax.dynamic_slice(x, take, piece_shape)
        if any(a != b for a, b in pairs):
            piece = lax.ppermute(piece, all_names, perm=pairs)
        out = lax.dynamic_update_slice(out, piece, put)
    return out


def _in_turn(offsets: list, out):
    """``offsets`` and ``out`` through an ``optimization_barrier``: what a round reads them for
    waits until the round before has written ``out``, so rounds run one after another."""
    return lax.optimization_barrier(([jnp.asarray(v, jnp.int32) for v in offsets], out))


def _all_gather_in_rounds(x, step: Step, all_names, idx, num_devices: int):
    """An all-gather as rounds of ``ppermute``, one after another (:attr:`Step.serial`): in round
    ``k`` the member of rank ``r`` sends its tile to rank ``(r + k) % n``, which writes it in
    place in the result. XLA:GPU gathers into a result dimension that is not the leading one
    through a staging buffer of the whole result, transposed into place; in rounds one tile is
    in flight (8 compiled H100s: the paper's r0016 needs 1.0x the bound of temporaries instead
    of 1.5x, P2 0.5 instead of 0.75)."""
    n, d = step.group_size, step.dim
    tables = np.zeros((num_devices, n), np.int64)
    rounds = []
    for k in range(n):
        pairs = []
        for group in step.groups:
            for r, dev in enumerate(group):
                q = (r + k) % n
                tables[group[q], k] = r * x.shape[d]
                pairs.append((dev, group[q]))
        rounds.append(pairs)
    offsets = per_device(tables, idx)
    shape = list(x.shape)
    shape[d] *= n
    out = jnp.zeros(shape, x.dtype)
    for k, pairs in enumerate(rounds):
        at = offsets[k : k + 1]
        if k:  # round k sends once round k - 1 has landed
            at, out = _in_turn(at, out)
        piece = lax.ppermute(x, all_names, perm=pairs) if k else x
        out = lax.dynamic_update_slice_in_dim(out, piece, at[0], axis=d)
    return out


def _reblock(x, step: Step, all_names, idx):
    """A reblock (:mod:`redist.uneven`) in about one pass over the tile. The rows a device keeps
    arrive with one shifted slice of its zero-bordered tile (XLA fuses the border into the slice;
    a static slice where every device shifts alike, as on a dimension split one way); then each
    round slices the rows a device sends, a ``ppermute`` hands them over, and the receiver writes
    them in place, masked to the piece, through a window that lies inside its tile. Rows past the
    array's extent are left as they fall: they are padding, never read as values."""
    i = step.dim
    size = step.after.local_shape[i]
    local, moving = [], []
    for pairs, table in step.rounds:
        t = np.asarray(table, dtype=np.int64)
        (local if all(a == b for a, b in pairs) else moving).append((pairs, t))
    num = len(step.rounds[0][1])
    shift = local[0][1][:, 0] - local[0][1][:, 2] if local else np.zeros(num, np.int64)
    config = [(0, 0, 0)] * x.ndim
    if not moving and (shift == shift[0]).all():  # one static shifted slice
        config[i] = (-int(shift[0]), int(shift[0]) + size - x.shape[i], 0)
        return lax.pad(x, jnp.zeros((), x.dtype), config)
    rounds = []  # per moving round: pairs, piece length, sender start, window start, mask
    for pairs, t in moving:
        n = int(t[:, 1].max())
        window = np.minimum(t[:, 2], size - n)  # the receiver's n rows, inside its tile
        send = t[:, 0].copy()
        for a, b in pairs:  # the sender starts as far before its rows as the window before the
            send[a] -= t[b, 2] - window[b]  # receiver's
        lo = t[:, 2] - window
        rounds.append((pairs, n, send, window, np.stack([lo, lo + t[:, 3]], axis=1)))
    starts = [shift] + [r[2] for r in rounds]
    ends = [shift + size] + [r[2] + r[1] for r in rounds]
    front = max(0, -min(int(v.min()) for v in starts))
    back = max(0, max(int(v.max()) for v in ends) - x.shape[i])
    config[i] = (front, back, 0)
    source = lax.pad(x, jnp.zeros((), x.dtype), config)
    out = lax.dynamic_slice_in_dim(source, jnp.asarray(front + shift, jnp.int32)[idx], size, i)
    for pairs, n, send, window, mask in rounds:
        piece = lax.dynamic_slice_in_dim(source, jnp.asarray(front + send, jnp.int32)[idx], n, i)
        piece = lax.ppermute(piece, all_names, perm=[(a, b) for a, b in pairs if a != b])
        at = jnp.asarray(window, jnp.int32)[idx]
        keep = jnp.asarray(mask, jnp.int32)[idx]
        pos = lax.broadcasted_iota(jnp.int32, piece.shape, i)
        held = lax.dynamic_slice_in_dim(out, at, n, axis=i)
        new = jnp.where((pos >= keep[0]) & (pos < keep[1]), piece, held)
        out = lax.dynamic_update_slice_in_dim(out, new, at, axis=i)
    return out


def tile_kernel(plan: Plan, mesh_axes: tuple[tuple[str, int], ...]):
    """The function of one device's tile that runs ``plan`` (call it inside a ``shard_map`` over
    a mesh of axes ``mesh_axes``, ``(name, size)`` major first, whose devices the plan numbers).

    Example:
        >>> jax.shard_map(tile_kernel(plan, (("a", 2), ("b", 4))), ...)  # doctest: +SKIP
    """
    all_names = tuple(n for n, _ in mesh_axes)
    num_devices = math.prod(s for _, s in mesh_axes)
    # Fold consecutive dynslices into one slice: offsets add, the last shape wins.
    ops: list[tuple[str, object]] = []
    for step in plan.steps:
        if step.kind == "dynslice" and ops and ops[-1][0] == "dynslice":
            offsets, _ = ops[-1][1]
            ops[-1] = ("dynslice", (offsets + np.asarray(step.offsets), step.after.local_shape))
        elif step.kind == "dynslice":
            ops.append(("dynslice", (np.asarray(step.offsets), step.after.local_shape)))
        else:
            ops.append((step.kind, step))

    def kernel(x):
        # the device's index, for steps whose tables are looked up per device
        indexed = any(
            k in ("dynslice", "reblock") or (k == "alltoall" and a.perm)
            or (k == "allgather" and a.serial)
            for k, a in ops
        )  # fmt: skip
        idx = _device_index(mesh_axes) if indexed else None
        for kind, arg in ops:
            if kind == "dynslice":
                offsets, shape = arg
                x = lax.dynamic_slice(x, per_device(offsets, idx), shape)
            elif kind == "allgather" and arg.serial:
                x = _all_gather_in_rounds(x, arg, all_names, idx, num_devices)
            elif kind == "allgather":
                x = lax.all_gather(x, axis=arg.dim, tiled=True, **_collective_args(mesh_axes, arg))
            elif kind == "reducescatter":
                x = lax.psum_scatter(x, scatter_dimension=arg.dim, tiled=True,
                                     **_collective_args(mesh_axes, arg))  # fmt: skip
            elif kind == "allreduce":
                x = lax.psum(x, **_collective_args(mesh_axes, arg))
            elif kind == "reblock":
                x = _reblock(x, arg, all_names, idx)
            elif kind == "alltoall" and arg.perm:
                x = _all_to_all_permuted(x, arg, all_names, idx, num_devices)
            elif kind == "alltoall":
                x = _all_to_all(x, arg, _collective_args(mesh_axes, arg))
            else:  # allpermute: a full permutation (staying tiles map to themselves), so
                # every device receives and no select keeps the old buffer alive.
                moving = dict(arg.perm)
                targets = set(moving.values())
                stay = [d for d in range(num_devices) if d not in moving and d not in targets]
                pairs = sorted(moving.items()) + [(d, d) for d in stay]
                x = lax.ppermute(x, all_names, perm=pairs)
        return x

    return kernel


def shard_mapped(plan: Plan, mesh, src: PartitionSpec, dst: PartitionSpec):
    """The ``shard_map`` running ``plan`` on ``mesh`` (a ``Mesh`` or ``AbstractMesh``).

    Its input must be sharded as ``src`` and its output is sharded as ``dst``.
    """
    mesh_axes = tuple((n, int(s)) for n, s in mesh.shape.items())
    return jax.shard_map(
        tile_kernel(plan, mesh_axes), mesh=mesh, in_specs=src, out_specs=dst, check_vma=False
    )
