"""One op's kernel on its tiles: the primitive bound with local shapes, its window's halos
exchanged with its neighbours (``ppermute``), its partial results combined by their own
collective (``psum``, ``psum_scatter``, ``pmax``...). Every backend of :mod:`planner.lowering`
runs ops through :func:`bind`.

Example:
    >>> outs = bind(op, *tiles, local_out=[(4, 8)], step=step)   # doctest: +SKIP
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from planner.layout.dataflow import OpStep
from planner.layout.explanation import COLLECTIVE, entries
from planner.program.constraints import SHARDING_PARAM
from planner.program.halo import split
from planner.program.ops import Op
from planner.program.rules import OPERAND_SIZE_PARAMS, POOLS, SCATTER_ADD
from planner.program.schedule import Spec

SHAPE_PARAMS = ("shape", "new_sizes")
SHARDING_PARAMS = ("sharding", "out_sharding")


def pspec(spec: Spec) -> PartitionSpec:
    """A schedule's layout as a ``PartitionSpec``."""
    return PartitionSpec(*entries(spec))


def _combine(x, kind: str, axes):
    """Combine partial results over ``axes`` by the reduction's own operation."""
    if kind == "sum":
        return lax.psum(x, axes)
    if kind in ("and", "or"):  # booleans: and = min, or = max
        return getattr(lax, COLLECTIVE[kind])(x.astype(jnp.int32), axes).astype(x.dtype)
    return getattr(lax, COLLECTIVE[kind])(x, axes)


def _first_device(axes):
    """True on the devices at index 0 along every one of ``axes`` (inside ``shard_map``)."""
    return functools.reduce(jnp.logical_and, [lax.axis_index(a) == 0 for a in axes])


def with_literals(eqn, args) -> list:
    """``eqn``'s operands: ``args`` with its literals put back in their places."""
    it = iter(args)
    return [v.val if isinstance(v, jcore.Literal) else next(it) for v in eqn.invars]


def bind(op: Op, *args, local_out=None, step: OpStep | None = None):
    """Run ``op``'s primitive on ``args`` (local blocks when ``local_out`` is given)."""
    eqn = op.eqn
    if op.how == "manual":  # the user's shard_map, bound with its own body and layouts
        return tuple(eqn.primitive.bind(*with_literals(eqn, args),
                                         **eqn.primitive.get_bind_params(eqn.params)))  # fmt: skip
    if eqn.primitive.name in SHARDING_PARAM:  # the plan lays the result out (program.constraints)
        it = iter(args)
        return tuple(jnp.asarray(v.val, v.aval.dtype) if isinstance(v, jcore.Literal) else next(it)
                     for v in eqn.invars)  # fmt: skip
    params = dict(eqn.params)
    pending = step.pending if step is not None else ()
    if local_out is not None:
        for key in SHAPE_PARAMS:
            if key in params and len(op.results) == 1:
                params[key] = tuple(local_out[0])
        if op.primitive == "tile":  # a broadcast dimension's copies: the local result's size
            params["reps"] = tuple(n // k for n, k in zip(local_out[0], args[0].shape))
        key = OPERAND_SIZE_PARAMS.get(op.primitive)
        if key:
            whole, local = op.operands[0].value.shape, args[0].shape
            params[key] = tuple(m if k == n else k
                                for k, n, m in zip(params[key], whole, local))  # fmt: skip
    for key in SHARDING_PARAMS:
        if key in params:
            params[key] = None
    args = list(args)
    crops = []
    if local_out is not None and op.windows and step is not None:
        crops = _with_halos(op, args, params, step)
    if local_out is not None and op.primitive == "conv_general_dilated":
        _local_groups(params, args, local_out)
    if pending and op.primitive in SCATTER_ADD:  # the operand is added once, not once per part
        args[0] = jnp.where(_first_device(pending), args[0], jnp.zeros_like(args[0]))
    out = eqn.primitive.bind(*with_literals(eqn, args), **params)
    outs = list(out) if eqn.primitive.multiple_results else [out]
    for dim, start, size in crops:  # a max-pool gradient's rows that are this device's
        outs[0] = lax.slice_in_dim(outs[0], start, start + size, axis=dim)
    if pending:
        for k, x in enumerate(outs):
            if step.scatter[k] is not None:
                outs[k] = lax.psum_scatter(
                    x, pending, scatter_dimension=step.scatter[k], tiled=True
                )
            else:
                outs[k] = _combine(x, step.combine, pending)
    return tuple(outs)


def spatially_split(step: OpStep) -> bool:
    """Whether ``step`` splits a window of its op: such an op runs on local tiles with the halo
    exchange of :func:`_with_halos` under every backend (XLA's SPMD partitioner, as of jaxlib
    0.10, computes a kernel's gradient wrongly when its input and the output gradient are both
    split along a spatial dimension)."""
    return any(step.in_specs[w.input][w.dim] for w in step.op.windows)


def _to_neighbour(
    axes: tuple[str, ...], shift: int
) -> tuple[tuple[str, ...], list[tuple[int, int]]]:
    """``(axis names, pairs)`` for a ``ppermute`` sending each tile of a dimension split over
    ``axes`` (major first) to the tile ``shift`` further on. ``ppermute`` numbers the devices of
    several axes in the mesh's axis order (JAX 0.12 requires the names in that order too), so
    the names and pairs are written in that one."""
    mesh = jax.sharding.get_abstract_mesh()
    size = dict(zip(mesh.axis_names, mesh.axis_sizes))
    in_mesh_order = [a for a in mesh.axis_names if a in axes]
    coords = list(itertools.product(*(range(size[a]) for a in axes)))  # in tile order

    def device(c: tuple[int, ...]) -> int:
        at = dict(zip(axes, c))
        index = 0
        for a in in_mesh_order:
            index = index * size[a] + at[a]
        return index

    return tuple(in_mesh_order), [(device(coords[t]), device(coords[t + shift]))
                                  for t in range(len(coords)) if 0 <= t + shift < len(coords)]  # fmt: skip


def _with_halos(op: Op, args: list, params: dict, step: OpStep) -> list[tuple[int, int, int]]:
    """A convolution or pooling on local tiles: each split spatial dimension of its input
    extended by the halo its neighbours send (``ppermute``; at the ends, the padding value: 0,
    or a max-pool's -inf) and padded as :func:`planner.program.halo.split` says. A max-pool's
    gradient (``select_and_scatter_add``) gets its source's windows too; returns the ``(dimension,
    start, size)`` crops of its result to the device's own rows."""
    padding = list(params["padding"])
    fill = POOLS.get(op.primitive, 0.0)
    if op.primitive == "select_and_scatter_add":
        fill = float("-inf") if params["select_prim"] is lax.ge_p else float("inf")
    crops = []
    for k, w in enumerate(op.windows):
        tile = args[w.input].shape[w.dim]
        parts = w.size // tile
        if parts == 1:
            continue
        cut = split(w, parts)
        axes = step.in_specs[w.input][w.dim]
        args[w.input] = _extend(args[w.input], w.dim, cut.left, cut.right, axes, parts, fill)
        if w.scatters:
            args[0] = _extend(args[0], w.dim, *cut.source, axes, parts, 0.0)
            crops.append((w.dim, cut.left, tile))
        padding[w.dim if op.primitive in POOLS or w.scatters else k] = cut.pad
    params["padding"] = tuple(padding)
    return crops


def _local_groups(params: dict, args: list, local_out) -> None:
    """A grouped convolution's group count on local tiles: its input's local features over the
    kernel's features per group (``feature_group_count``), or its input's local batch over the
    output's (``batch_group_count``, a grouped convolution's kernel gradient)."""
    dn = params["dimension_numbers"]
    if params.get("feature_group_count", 1) > 1:
        per_group = args[1].shape[dn.rhs_spec[1]]
        params["feature_group_count"] = args[0].shape[dn.lhs_spec[1]] // per_group
    if params.get("batch_group_count", 1) > 1:
        per_group = local_out[0][dn.out_spec[0]]
        params["batch_group_count"] = args[0].shape[dn.lhs_spec[0]] // per_group


def _extend(x, dim: int, left: int, right: int, axes, parts: int, fill: float):
    """``x`` (a tile along ``dim``, split over ``axes`` in ``parts``) with the last ``left``
    elements of its left neighbour's tile before it and the first ``right`` of its right
    neighbour's after it (``fill`` at the ends)."""
    tile = x.shape[dim]
    pieces = [x]
    if left:
        border = lax.slice_in_dim(x, tile - left, tile, axis=dim)
        border = lax.ppermute(border, *_to_neighbour(axes, +1))
        pieces.insert(0, _at_the_end(border, axes, 0, fill))
    if right:
        border = lax.slice_in_dim(x, 0, right, axis=dim)
        border = lax.ppermute(border, *_to_neighbour(axes, -1))
        pieces.append(_at_the_end(border, axes, parts - 1, fill))
    return jnp.concatenate(pieces, axis=dim) if len(pieces) > 1 else x


def _at_the_end(border, axes: tuple[str, ...], end: int, fill: float):
    """``border`` as received, or ``fill`` on the tile at index ``end`` (which no one sends to)."""
    if fill == 0:
        return border  # what ppermute leaves there
    return jnp.where(lax.axis_index(axes) == end, jnp.full_like(border, fill), border)
