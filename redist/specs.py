"""User-facing specs, meshes and dtypes to types, and ``plan()`` from them (no devices, no JAX).

Accepts JAX objects by duck typing (a ``PartitionSpec`` is a tuple; a ``NamedSharding`` has
``.spec`` and ``.mesh``; a ``Mesh`` / ``AbstractMesh`` has ``.shape``), so that a 4096-device mesh
can be planned in a plain Python process.

Example:
    >>> p = plan((16, 16, 8), ("a", "c"), (None, "a", ("c", "b")), {"a": 2, "b": 2, "c": 2})
    >>> p.kinds
    ('dynslice', 'alltoall')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
import numpy as np

from redist.steps import Plan
from redist.synthesis import FOLD_MIN_BYTES, synthesize
from redist.types import DistType, MeshShape, SpecEntry

MeshLike = Any  # jax.sharding.Mesh | jax.sharding.AbstractMesh | Mapping[str, int] | MeshShape
SpecLike = Any  # jax.sharding.PartitionSpec | jax.sharding.NamedSharding | tuple of entries


def mesh_shape(mesh: MeshLike, *, argname: str = "mesh") -> MeshShape:
    """The pure :class:`MeshShape` of a JAX ``Mesh`` / ``AbstractMesh``, a mapping, or a MeshShape."""
    if isinstance(mesh, MeshShape):
        return mesh
    if isinstance(mesh, Mapping):
        return MeshShape.of(mesh)
    shape = getattr(mesh, "shape", None)
    if isinstance(shape, Mapping):
        return MeshShape.of(shape)
    raise TypeError(
        f"{argname} must be a jax.sharding.Mesh, an AbstractMesh, or a {{axis name: size}} mapping; "
        f"got {type(mesh).__name__}"
    )


def spec_entries(spec: SpecLike, *, argname: str) -> tuple[SpecEntry, ...]:
    """The entries of a ``PartitionSpec``, a ``NamedSharding``'s spec, or a plain tuple."""
    if hasattr(spec, "spec") and hasattr(spec, "mesh"):
        spec = spec.spec
    if spec is None:
        return ()
    if hasattr(spec, "partitions"):  # a PartitionSpec (which refuses iteration when unreduced)
        spec = tuple(spec.partitions)
    elif not isinstance(spec, (tuple, list, str)) and hasattr(spec, "__iter__"):
        spec = tuple(spec)  # a PartitionSpec is not a tuple in recent JAX, but iterates as one
    if not isinstance(spec, (tuple, list)):
        raise TypeError(
            f"{argname} must be a PartitionSpec, a NamedSharding, or a tuple of axis names; "
            f"got {type(spec).__name__}"
        )
    out = []
    for k, entry in enumerate(spec):
        if isinstance(entry, list):
            entry = tuple(entry)
        if entry is not None and not isinstance(entry, (str, tuple)):
            raise TypeError(
                f"{argname} entry {k} is {entry!r}; expected None, an axis name, or a tuple of names "
                "(unconstrained dimensions are not supported)"
            )
        out.append(entry)
    return tuple(out)


def unreduced_axes(spec: SpecLike, *, argname: str) -> tuple[str, ...]:
    """The mesh axes of a pending sum in a ``PartitionSpec`` (``P('a', unreduced={'c'})``)."""
    if hasattr(spec, "spec") and hasattr(spec, "mesh"):
        spec = spec.spec
    if getattr(spec, "reduced", None):
        raise NotImplementedError(
            f"{argname} has reduced axes {set(spec.reduced)}; only unreduced axes are supported"
        )
    return tuple(getattr(spec, "unreduced", None) or ())


def dist_type(spec: SpecLike, shape: Sequence[int], mesh: MeshShape, *, argname: str) -> DistType:
    """A :class:`DistType` from a spec, with errors that name the argument."""
    try:
        entries = spec_entries(spec, argname=argname)
        return DistType.from_spec(entries, shape, mesh, unreduced_axes(spec, argname=argname))
    except (ValueError, TypeError) as e:
        raise type(e)(f"{argname}: {e}") from None


def dtype_info(dtype: Any) -> tuple[str, int]:
    """Name and item size of a dtype-like (``"bfloat16"``, ``np.float32``, ``jnp.int32``...)."""
    try:
        dt = np.dtype(getattr(dtype, "dtype", dtype))
    except TypeError:
        raise TypeError(f"dtype {dtype!r} is not a valid numpy/JAX dtype") from None
    return dt.name, dt.itemsize


def plan(
    shape: Sequence[int],
    src: SpecLike,
    dst: SpecLike,
    mesh: MeshLike,
    dtype: Any = "float32",
    *,
    cost_model: str = "bytes",
    fold_min_bytes: int = FOLD_MIN_BYTES,
) -> Plan:
    """Synthesize the redistribution of an array of ``shape`` from ``src`` to ``dst`` on ``mesh``.

    Pure: no devices, no tracing; cached on its inputs.

    Args:
        shape: the global shape of the array.
        src, dst: ``PartitionSpec`` (or ``NamedSharding``, or a tuple of entries).
        mesh: a ``Mesh``, an ``AbstractMesh``, or a ``{axis name: size}`` mapping.
        dtype: element type, for byte counts.
        cost_model: what the search minimizes: ``"bytes"`` (the paper's model, Fig. 11),
            ``"calibrated"`` (time on the shipped calibration: a latency per collective plus
            bytes over bandwidth, plus local copies) or
            ``"bytes+copies"`` (also the local copies that interleaving costs, which matter on
            CPU where a copy is as dear as a transfer).
        fold_min_bytes: a final permutation right after an alltoall is folded into it (chunks
            go straight to their final devices, in rounds of ``ppermute``) when every chunk has at
            least this many bytes; smaller chunks keep one all-to-all and one permute, as rounds
            of tiny messages are latency-bound. 0 always folds.

    Returns:
        An immutable :class:`Plan`; ``print`` it to read the steps in the paper's notation.
    """
    try:
        shape = tuple(int(n) for n in shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(n < 0 for n in shape):
        raise ValueError(f"shape must have non-negative sizes, got {shape}")
    m = mesh_shape(mesh)
    name, itemsize = dtype_info(dtype)
    s = dist_type(src, shape, m, argname="src")
    d = dist_type(dst, shape, m, argname="dst")
    if d.pending:
        raise NotImplementedError(
            f"dst {dst} has unreduced axes: a redistribution reduces pending sums, it does not "
            "create them"
        )
    return synthesize(m, s, d, name, itemsize, cost_model, int(fold_min_bytes))
