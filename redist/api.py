"""``redistribute``: move a sharded JAX array (or a pytree of them) to a new layout.

Example:
    >>> mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    >>> x = jax.device_put(arr, NamedSharding(mesh, P(("a", "b"), "c", None)))
    >>> y = redist.redistribute(x, P(None, "a", ("c", "b")))      # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from redist.execute import shard_mapped
from redist.meshes import factor_spec, translate
from redist.specs import SpecLike, dist_type, dtype_info, mesh_shape
from redist.synthesis import FOLD_MIN_BYTES, synthesize
from redist.transfer import transfer

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
    """The source mesh, from ``src``, ``mesh=``, ``x``'s sharding, else ``dst``'s or the ambient
    mesh."""
    candidates = []
    if isinstance(src, NamedSharding):
        candidates.append(("src", src.mesh))
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
    if not candidates and isinstance(dst, NamedSharding):
        candidates.append(("dst", dst.mesh))
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
        if not _same_mesh(chosen, m):
            what = (
                f"devices of {name}'s mesh {_device_ids(chosen)} and {other}'s {_device_ids(m)}"
                if dict(chosen.shape) == dict(m.shape)
                else f"meshes of {name} {dict(chosen.shape)} and {other} {dict(m.shape)}"
            )
            raise ValueError(
                f"the {what} differ; x lives on one mesh (give dst as a NamedSharding on "
                "another mesh to move it there)"
            )
    return chosen


def _same_mesh(a, b) -> bool:
    """Same axes and sizes, and the same devices in the same order where both are known."""
    if dict(a.shape) != dict(b.shape) or tuple(a.axis_names) != tuple(b.axis_names):
        return False
    ia, ib = _device_ids(a), _device_ids(b)
    return ia is None or ib is None or ia == ib


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


def _redistribute_array(x, src, dst, mesh, options, donate: bool):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"x must be a JAX array (or a pytree of them), got {type(x).__name__}")
    mesh = _resolve_mesh(x, src, dst, mesh)
    src_spec = _source_spec(x) if src is _MISSING else _pspec(src)
    dst_spec = _pspec(dst)
    m = mesh_shape(mesh)
    shape = tuple(x.shape)
    name, itemsize = dtype_info(x.dtype)
    s = dist_type(src_spec, shape, m, argname="src")
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
    if isinstance(dst, NamedSharding) and not _same_mesh(mesh, dst.mesh):
        return _to_other_mesh(x, mesh, s, dst, (name, itemsize, *options), donate)
    d = dist_type(dst_spec, shape, m, argname="dst")
    if d.pending:
        raise NotImplementedError(
            f"dst {dst_spec} has unreduced axes: a redistribution reduces pending sums, it does "
            "not create them"
        )
    plan = synthesize(m, s, d, name, itemsize, *options)
    target = dst if isinstance(dst, NamedSharding) else NamedSharding(mesh, dst_spec)
    if s.global_size == 0:  # a zero-size array: only its sharding changes
        return _place(x, target)
    if not plan.steps and not isinstance(dst, NamedSharding):
        return x
    if isinstance(x, jax.core.Tracer):
        return _across(plan, mesh, target, _explicit(mesh))(x)
    return _across_jitted(plan, mesh, target, donate, _explicit(mesh))(x)


def _place(x, target: NamedSharding):
    """``x`` with sharding ``target``: eagerly ``device_put``; traced, ``reshard`` on Explicit axes
    and a sharding constraint on Auto ones (free when the placement is the same)."""
    if not isinstance(x, jax.core.Tracer):
        return jax.device_put(x, target)
    if any(str(t).endswith("Explicit") for t in target.mesh.axis_types):
        return jax.sharding.reshard(x, target)
    return jax.lax.with_sharding_constraint(x, target)


def _explicit(mesh) -> bool:
    return any(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ()))


def _factored(mesh, explicit: bool):
    """``mesh`` with every axis split into its prime factors (same devices, same order), all of
    them Explicit or all Auto (as the axes of the value moved)."""
    ms = mesh_shape(mesh)
    names = ms.factor_names
    sizes = tuple(f.size for f in ms.factors)
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    kinds = (kind,) * len(sizes)
    if _device_ids(mesh) is None:
        return jax.sharding.AbstractMesh(sizes, names, axis_types=kinds)
    return jax.sharding.Mesh(mesh.devices.reshape(sizes), names, axis_types=kinds)


def _to_other_mesh(x, mesh, s, dst: NamedSharding, options, donate: bool):
    """Redistribute onto ``dst.mesh``: over the same devices in the same order, a planned move on
    the prime factors of whichever mesh writes both layouts; otherwise a direct transfer."""
    other = mesh_shape(dst.mesh, argname="dst.mesh")
    shape = tuple(x.shape)
    d = dist_type(dst.spec, shape, other, argname="dst")
    a, b = _device_ids(mesh), _device_ids(dst.mesh)
    if a is not None and b is not None and a != b:
        if isinstance(x, jax.core.Tracer):
            raise ValueError(
                f"inside jax.jit, dst's mesh must list the devices of x's mesh in the same order "
                f"(JAX runs one jit on one device order); x's mesh has devices {a}, dst's {b}. "
                "Call redistribute outside jit for a transfer between such meshes"
            )
        return transfer(x, dst, donate=donate)
    if mesh_shape(mesh).num_devices != other.num_devices:
        raise ValueError(f"dst's mesh {other} and x's mesh {mesh_shape(mesh)} differ in size")
    m = mesh_shape(mesh)
    on_src = translate(d, other, m)
    if on_src is not None:
        run_mesh, s_run, d_run = mesh, s, on_src
    else:
        on_dst = translate(s, m, other)
        if on_dst is None:
            raise NotImplementedError(
                f"moving between meshes {m} and {other}: their prime factors lie in different "
                "orders in the device list, so neither mesh writes both layouts; reorder the "
                "axes of one mesh so that the prime factors of equal size line up"
            )
        run_mesh, s_run, d_run = dst.mesh, on_dst, d
    plan = synthesize(mesh_shape(run_mesh), s_run, d_run, *options)
    if isinstance(x, jax.core.Tracer):
        return _across(plan, run_mesh, dst, _explicit(mesh))(x)
    return _across_jitted(plan, run_mesh, dst, donate, _explicit(mesh))(x)


@functools.lru_cache(maxsize=1024)
def _across_jitted(plan, run_mesh, dst: NamedSharding, donate: bool, explicit: bool):
    run = _across(plan, run_mesh, dst, explicit, hand_over=False)  # out_shardings hands over
    return jax.jit(run, out_shardings=dst, donate_argnums=(0,) if donate else ())


def _factor_pspec(t) -> PartitionSpec:
    """``t`` as a ``PartitionSpec`` over the factored mesh (pending factors unreduced)."""
    return PartitionSpec(*factor_spec(t), unreduced=frozenset(t.pending))


@functools.lru_cache(maxsize=1024)
def _across(plan, run_mesh, dst: NamedSharding, explicit: bool, hand_over: bool = True):
    """The function running ``plan`` on ``run_mesh``'s prime factors and handing the result over
    to ``dst`` (the same placement, so neither hand-over moves data). On the factored mesh a
    plan's device groups are named axes far more often than on the user's (measured: all of 300
    random plans on {a:4, b:2}, against 264), which ``vmap`` needs."""
    factored = _factored(run_mesh, explicit)
    s_spec, d_spec = _factor_pspec(plan.src), _factor_pspec(plan.dst)
    if hand_over and explicit != _explicit(dst.mesh):
        raise ValueError(
            "inside jax.jit, x's mesh and dst's mesh must both have Explicit axes or both Auto "
            f"ones (x's are {'Explicit' if explicit else 'Auto'}); call redistribute outside jit "
            "to move between them"
        )

    abstract = getattr(factored, "abstract_mesh", factored)

    def run(v):
        context = contextlib.nullcontext()
        if not jax.sharding.get_abstract_mesh().empty:  # jax.set_mesh: shard_map wants its mesh
            context = jax.sharding.use_abstract_mesh(abstract)
        with context:
            v = _place(v, NamedSharding(factored, s_spec))
            if plan.steps:
                v = shard_mapped(plan, factored, s_spec, d_spec)(v)
        return _place(v, dst) if hand_over else v

    return run


def redistribute(
    x,
    src_or_dst,
    dst=_MISSING,
    *,
    mesh=None,
    cost_model: str = "bytes",
    fold_min_bytes: int = FOLD_MIN_BYTES,
    donate: bool = False,
):
    """Move ``x`` from layout ``src`` to layout ``dst`` with a synthesized, memory-bounded plan.

    Call as ``redistribute(x, dst)`` (source read from ``x.sharding``) or ``redistribute(x, src,
    dst)``. Works eagerly, inside ``jax.jit`` and under ``jax.grad``. ``dst`` may be a
    ``NamedSharding`` on another mesh: over the same devices in the same order the move is
    planned on the prime factors of one of the meshes (inside ``jit`` too); over devices in
    another order, or other devices, it is a direct device-to-device transfer of the pieces each
    destination device lacks (eager only: JAX runs one jit on one device order).

    Memory. Every intermediate tile of the plan is at most ``max(src tile, dst tile)``. What a
    device holds during the call is more: without donation, the input tile and the output tile
    both live through the call, plus the collectives' staging (an all-to-all stages up to about
    1.5x its tile on CPU; a permutation needs a receive buffer). With ``donate=True`` XLA reuses
    the input's buffer, so the call holds one tile less (measured on 8 CPU devices, 1 MiB tiles:
    all-to-all then permutation 4.0 -> 2.75 MiB, one all-to-all 1.94 -> 1.5 MiB).

    Args:
        x: a JAX array, or a pytree of arrays.
        src_or_dst: the destination (two-argument form) or the source layout.
        dst: the destination layout (three-argument form).
        mesh: the mesh; optional when a spec is a ``NamedSharding``, ``x`` has a
            ``NamedSharding``, or a mesh is set with ``jax.set_mesh``.
        cost_model: what the plan search minimizes, ``"bytes"`` (the paper's model),
            ``"bytes+copies"`` or ``"calibrated"`` (see :func:`redist.plan`).
        fold_min_bytes: fold a final permutation into the alltoall before it when each chunk
            sent has at least this many bytes (see :func:`redist.plan`).
        donate: give ``x``'s buffers to the call (eager calls; ``x`` is deleted). Inside ``jit``
            donate through the enclosing ``jax.jit(..., donate_argnums=...)`` instead; there this
            flag has no effect.

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
        return _redistribute_array(x, src, dst, mesh, options, donate)
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
    out = [
        _redistribute_array(v, s, d, mesh, options, donate) for v, s, d in zip(leaves, srcs, dsts)
    ]
    return jax.tree.unflatten(treedef, out)
