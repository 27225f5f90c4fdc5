"""``redistribute``: move a sharded JAX array (or a pytree of them) to a new layout.

Example:
    >>> mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    >>> x = jax.device_put(arr, NamedSharding(mesh, P(("a", "b"), "c", None)))
    >>> y = redist.redistribute(x, P(None, "a", ("c", "b")))      # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from redist.execute import shard_mapped
from redist.planning import SpecLike, dist_type, dtype_info, mesh_shape
from redist.synthesize import FOLD_MIN_BYTES, synthesize

_MISSING = object()


def _is_spec(s: Any) -> bool:
    return s is None or isinstance(s, (PartitionSpec, NamedSharding))


def _pspec(s: SpecLike) -> PartitionSpec:
    if isinstance(s, NamedSharding):
        return s.spec
    if s is None:
        return PartitionSpec()
    if isinstance(s, PartitionSpec):
        return s
    raise TypeError(f"expected a PartitionSpec or NamedSharding, got {type(s).__name__}")


def _device_ids(mesh) -> tuple[int, ...] | None:
    try:
        devices = getattr(mesh, "devices", None)
    except (NotImplementedError, ValueError):  # an AbstractMesh has no devices
        return None
    if devices is None:
        return None
    return tuple(int(d.id) for d in devices.flat)


def _resolve_mesh(x, src, dst, mesh):
    """The mesh to run on, from the specs, ``mesh=``, ``x``'s sharding, or the ambient mesh."""
    candidates = []
    for what, s in (("src", src), ("dst", dst)):
        if isinstance(s, NamedSharding):
            candidates.append((what, s.mesh))
    if mesh is not None:
        if not hasattr(mesh, "axis_names") or not hasattr(mesh, "shape"):
            raise TypeError(
                f"mesh must be a jax.sharding.Mesh or AbstractMesh, got {type(mesh).__name__}"
            )
        candidates.append(("mesh", mesh))
    if isinstance(x, jax.core.Tracer):  # inside jit: the mesh of the value's type, if it has one
        traced = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if traced is not None and not traced.empty:
            candidates.append(("x's type", traced))
    else:
        xs = getattr(x, "sharding", None)
        if isinstance(xs, NamedSharding):
            candidates.append(("x.sharding", xs.mesh))
    if not candidates:
        ambient = jax.sharding.get_abstract_mesh()
        if ambient.empty:
            concrete = getattr(jax.sharding, "get_mesh", lambda: None)()
            if concrete is None or getattr(concrete, "empty", True):
                raise ValueError(
                    "no mesh: pass NamedShardings, mesh=..., an array with a NamedSharding, or "
                    "set one with jax.set_mesh(mesh)"
                )
            ambient = concrete
        candidates.append(("ambient mesh", ambient))
    name, chosen = candidates[0]
    for other, m in candidates[1:]:
        if dict(m.shape) != dict(chosen.shape):
            raise ValueError(
                f"the meshes of {name} {dict(chosen.shape)} and {other} {dict(m.shape)} differ; "
                "use one mesh"
            )
        a, b = _device_ids(chosen), _device_ids(m)
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"the devices of {name}'s mesh {a} differ from those of {other}'s mesh {b}; "
                "redistribute moves data within one mesh: device_put x onto it first"
            )
    return chosen


def _source_spec(x) -> PartitionSpec:
    if isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        explicit = mesh is not None and not mesh.empty and any(
            str(t).endswith("Explicit") for t in mesh.axis_types
        )  # fmt: skip
        if not explicit:
            raise ValueError(
                "src cannot be read from a value traced inside jax.jit on a mesh without Explicit "
                "axes; call redistribute(x, src, dst)"
            )
        return sharding.spec
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise ValueError(
            f"src was not given and x's sharding is {type(sharding).__name__}, not a NamedSharding; "
            "call redistribute(x, src, dst) or device_put x with a NamedSharding"
        )
    return sharding.spec


@functools.lru_cache(maxsize=1024)
def _jitted(plan, mesh, src: PartitionSpec, dst: PartitionSpec):
    return jax.jit(shard_mapped(plan, mesh, src, dst))


def _redistribute_array(x, src, dst, mesh, options):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"x must be a JAX array (or a pytree of them), got {type(x).__name__}")
    mesh = _resolve_mesh(x, src, dst, mesh)
    src_spec = _source_spec(x) if src is _MISSING else _pspec(src)
    dst_spec = _pspec(dst)
    m = mesh_shape(mesh)
    shape = tuple(x.shape)
    name, itemsize = dtype_info(x.dtype)
    s = dist_type(src_spec, shape, m, argname="src")
    d = dist_type(dst_spec, shape, m, argname="dst")
    if src is not _MISSING and not isinstance(x, jax.core.Tracer):
        xs = getattr(x, "sharding", None)
        if isinstance(xs, NamedSharding):
            actual = dist_type(xs.spec, shape, m, argname="x.sharding")
            if actual != s:
                raise ValueError(
                    f"src {src_spec} (type {s}) disagrees with x.sharding {xs.spec} (type {actual}); "
                    "pass the array's own sharding as src, or omit src"
                )
            src_spec = xs.spec
    plan = synthesize(m, s, d, name, itemsize, *options)
    if s.global_size == 0:  # a zero-size array: only its sharding changes
        target = NamedSharding(mesh, dst_spec)
        if not isinstance(x, jax.core.Tracer):
            return jax.device_put(x, target)
        if any(str(t).endswith("Explicit") for t in mesh.axis_types):
            return jax.sharding.reshard(x, target)
        return jax.lax.with_sharding_constraint(x, target)
    if not plan.steps:
        return x
    if isinstance(x, jax.core.Tracer):
        return shard_mapped(plan, mesh, src_spec, dst_spec)(x)
    return _jitted(plan, mesh, src_spec, dst_spec)(x)


def redistribute(
    x,
    src_or_dst,
    dst=_MISSING,
    *,
    mesh=None,
    cost_model: str = "bytes",
    fold_min_bytes: int = FOLD_MIN_BYTES,
):
    """Move ``x`` from layout ``src`` to layout ``dst`` with a synthesized, memory-bounded plan.

    Call as ``redistribute(x, dst)`` (source read from ``x.sharding``) or ``redistribute(x, src,
    dst)``. Works eagerly, inside ``jax.jit`` and under ``jax.grad``. No device ever holds more
    than ``max(src tile, dst tile)`` of the array in the plan.

    Args:
        x: a JAX array, or a pytree of arrays.
        src_or_dst: the destination (two-argument form) or the source layout.
        dst: the destination layout (three-argument form).
        mesh: the mesh; optional when a spec is a ``NamedSharding``, ``x`` has a
            ``NamedSharding``, or a mesh is set with ``jax.set_mesh``.
        cost_model: what the plan search minimizes, ``"bytes"`` (the paper's model) or
            ``"bytes+copies"`` (see :func:`redist.plan`).
        fold_min_bytes: fold a final permutation into the alltoall before it when each chunk
            sent has at least this many bytes (see :func:`redist.plan`).

    Layouts are ``PartitionSpec`` or ``NamedSharding``; for a pytree ``x`` a single layout applies
    to every leaf, or give a pytree of layouts with the structure of ``x``.

    Returns:
        ``x`` in the destination layout, values unchanged.

    Raises:
        ValueError / TypeError: naming the argument, dimension and axis for invalid layouts.
    """
    options = (cost_model, int(fold_min_bytes))
    src = _MISSING if dst is _MISSING else src_or_dst
    dst = src_or_dst if dst is _MISSING else dst
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return _redistribute_array(x, src, dst, mesh, options)
    leaves, treedef = jax.tree.flatten(x)

    def per_leaf(spec, argname):
        if spec is _MISSING or _is_spec(spec):
            return [spec] * len(leaves)
        try:
            specs = treedef.flatten_up_to(spec)
        except (ValueError, TypeError):
            raise ValueError(
                f"{argname} must be one layout or a pytree of layouts with the structure of x "
                f"({treedef}); got {spec!r}"
            ) from None
        for s in specs:
            if not _is_spec(s):
                raise TypeError(
                    f"{argname} leaves must be PartitionSpec or NamedSharding, got {s!r}"
                )
        return specs

    srcs, dsts = per_leaf(src, "src"), per_leaf(dst, "dst")
    out = [_redistribute_array(v, s, d, mesh, options) for v, s, d in zip(leaves, srcs, dsts)]
    return jax.tree.unflatten(treedef, out)
