"""A ``shard_map`` result summed over mesh axes and then left whole over them is summed *and
split*: its ``psum`` becomes a ``psum_scatter`` and its ``out_specs`` split one dimension over
those axes.

The backward pass of a ``shard_map`` that reads a weight whole on every device (MaxText's mixture
of experts, over ``fsdp``) ends with a ``psum`` of the weight's gradient over the axes it was
whole on. Every device then holds the whole sum, which the optimizer, storing the weight split
over the same axes, only slices: an all-reduce where a reduce-scatter carries half the bytes.
Split, the result is the same array (``psum_scatter`` gives each device the block the new
``out_specs`` says it holds); the planner lays it out from there and prices any move back to
whole (an all-gather, which with the reduce-scatter is what the all-reduce was).

Only bodies without replication checks (``check_vma=False``, as MaxText writes them) are
rewritten, and only results nothing else in the body reads. The dimension split is the longest
one whole in ``out_specs`` that the axes' devices divide (the first of equals).

On a mesh of devices whose compiler builds a reduce-scatter over all of them as the all-reduce
and a slice (their calibration's ``whole_mesh_reduce_scatter``: TPU v5p and v4), a sum over
every device stays as written: splitting it saves nothing there, and split along a minor
dimension the compiler first copies the whole block to make it major (DeepSeek-V3's 7.5 GB
expert gradients over 512 v5p chips, three per layer: 1.1 s of its step). Over part of such a
mesh the compiler chooses per collective and mostly keeps the reduce-scatter (Qwen3-235B's plan
at tensor 4 on v5p: 658 of them); v5e, v6e and Ironwood keep it over a whole mesh too.

Example::

    # body: ..., g = psum[axes=('fsdp',)] t;  out_specs (P(None, None, 'tensor'),)
    # becomes
    # body: ..., g = reduce_scatter[axis_name=('fsdp',), scatter_dimension=1, tiled=True] t
    #       out_specs (P(None, 'fsdp', 'tensor'),)
"""

from __future__ import annotations

import collections
import functools
import math

import jax
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from planner.program.manual import mesh_sizes, spec_axes
from redist.calibration import Calibration
from redist.specs import padded_entries


def _scatter_dim(shape, spec, parts: int) -> int | None:
    """The longest dimension whole in ``spec`` that ``parts`` divides (first of equals)."""
    whole = [d for d, axes in enumerate(spec_axes(spec, len(shape)))
             if not axes and shape[d] % parts == 0 and shape[d] >= parts]  # fmt: skip
    return max(whole, key=lambda d: (shape[d], -d)) if whole else None


def _every_device(axes: tuple[str, ...], sizes: dict[str, int]) -> bool:
    """Whether a sum over ``axes`` spans every device of a mesh of ``sizes``.

    Example:
        >>> _every_device(("fsdp",), {"fsdp": 512, "tensor": 1}), _every_device(("x",), {"x": 4, "y": 2})
        (True, False)
    """
    return math.prod(sizes[a] for a in set(axes)) == math.prod(sizes.values())


def _summed_whole(mesh) -> bool:
    """Whether the compiler for ``mesh``'s devices builds a reduce-scatter over all of them as
    an all-reduce (the calibration of their kind says so; an abstract mesh names no devices)."""
    if not isinstance(mesh, jax.sharding.Mesh) or not mesh.devices.size:
        return False
    return _summed_whole_on(mesh.devices.flat[0].device_kind)


@functools.cache
def _summed_whole_on(kind: str) -> bool:
    """:func:`_summed_whole` for devices of ``kind`` (their calibration's file read once)."""
    cal = Calibration.for_device_kind(kind)
    return cal is not None and cal.whole_mesh_reduce_scatter == "all-reduce"


def _reduce_scatter(mesh, axes: tuple[str, ...], aval, dim: int):
    """A ``psum_scatter`` equation over ``axes`` (tiled along ``dim``) of a value of ``aval``,
    as JAX traces it in a ``shard_map`` on ``mesh`` (its operand is to be replaced), or None
    where JAX does not trace one."""
    out_spec = P(*([None] * dim), axes)
    body = jax.shard_map(
        lambda x: lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True),
        mesh=mesh, in_specs=P(), out_specs=out_spec, check_vma=False,
    )  # fmt: skip
    try:
        traced = jax.make_jaxpr(body)(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    except (TypeError, ValueError, NotImplementedError):
        return None
    inner = traced.jaxpr.eqns[0].params["jaxpr"]
    return next((e for e in inner.eqns if e.primitive.name == "reduce_scatter"), None)


def _scattered(eqn):
    """The ``shard_map`` equation ``eqn`` with its summed-then-whole results split (see the
    module), or ``eqn`` itself where none is."""
    params = eqn.params
    if params.get("check_vma", params.get("check_rep", True)):
        return eqn
    body, specs = params["jaxpr"], list(params["out_specs"])
    sizes = mesh_sizes(eqn)
    reads = collections.Counter(v for e in body.eqns for v in e.invars
                                if not isinstance(v, jcore.Literal))  # fmt: skip
    reads.update(v for v in body.outvars if not isinstance(v, jcore.Literal))
    producer = {v: e for e in body.eqns for v in e.outvars}
    swaps = {}  # the psum's result -> (its operand, the axes, the dimension, the result's k)
    for k, (v, outer) in enumerate(zip(body.outvars, eqn.outvars)):
        sum_ = producer.get(v) if not isinstance(v, jcore.Literal) else None
        if (sum_ is None or sum_.primitive.name != "psum" or reads[v] != 1
                or isinstance(outer, jcore.DropVar)
                or sum_.params.get("axis_index_groups") is not None):  # fmt: skip
            continue
        axes = tuple(sum_.params["axes"])
        mentioned = {a for entry in spec_axes(specs[k], len(v.aval.shape)) for a in entry}
        if getattr(specs[k], "unreduced", None) or getattr(specs[k], "reduced", None):
            continue
        if (not axes or not all(isinstance(a, str) and a in sizes for a in axes)
                or mentioned & set(axes)
                or _every_device(axes, sizes) and _summed_whole(params["mesh"])):  # fmt: skip
            continue
        dim = _scatter_dim(v.aval.shape, specs[k], math.prod(sizes[a] for a in axes))
        if dim is not None:
            swaps[v] = (sum_.invars[sum_.outvars.index(v)], axes, dim, k)
    if not swaps:
        return eqn
    eqns, outvars = [], list(body.outvars)
    for e in body.eqns:
        moved = [v for v in e.outvars if v in swaps]
        if moved:
            kept = [(x, v) for x, v in zip(e.invars, e.outvars) if v not in swaps]
            if kept:  # the psum's other operands are summed as before
                eqns.append(e.replace(invars=[x for x, _ in kept], outvars=[v for _, v in kept]))
            for v in moved:
                x, axes, dim, k = swaps[v]
                rs = _reduce_scatter(params["mesh"], axes, v.aval, dim)
                if rs is None:  # JAX would not trace it: the sum stays as written
                    eqns.append(e.replace(invars=[x], outvars=[v]))
                    continue
                eqns.append(rs.replace(invars=[x]))
                outvars[k] = rs.outvars[0]
                entries = list(padded_entries(specs[k], len(v.aval.shape)))
                entries[dim] = axes[0] if len(axes) == 1 else axes
                specs[k] = P(*entries)
            continue
        eqns.append(e)
    new_body = body.replace(eqns=eqns, outvars=outvars)
    return eqn.replace(params={**params, "jaxpr": new_body, "out_specs": tuple(specs)})


def scatter_sums(eqns) -> list:
    """``eqns`` with every ``shard_map`` among them rewritten as the module says.

    Example:
        >>> [e.primitive.name for e in scatter_sums(jaxpr.eqns)]      # doctest: +SKIP
    """
    return [_scattered(e) if e.primitive.name == "shard_map" else e for e in eqns]


__all__ = ["scatter_sums"]
