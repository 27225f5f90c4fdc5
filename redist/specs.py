"""User-facing specs, meshes and dtypes to types, and ``plan()`` from them (no devices, no JAX).

Accepts JAX objects by duck typing (a ``PartitionSpec`` is a tuple; a ``NamedSharding`` has
``.spec`` and ``.mesh``; a ``Mesh`` / ``AbstractMesh`` has ``.shape``), so that a 4096-device mesh
can be planned in a plain Python process.

Example:
    >>> p = plan((16, 16, 8), ("a", "c"), (None, "a", ("c", "b")), {"a": 2, "b": 2, "c": 2})
    >>> p.kinds
    ('dynslice', 'alltoall', 'allpermute')
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes  # registers bfloat16 and friends with numpy
import numpy as np

from redist.cost import AUTO, COST_MODELS, cost_model_ok
from redist.steps import Plan
from redist.synthesis import FOLD_MIN_BYTES, synthesize_uneven
from redist.types import DistType, MeshShape, SpecEntry, check_shape, check_size

MeshLike = Any  # jax.sharding.Mesh | jax.sharding.AbstractMesh | Mapping[str, int] | MeshShape
SpecLike = Any  # jax.sharding.PartitionSpec | jax.sharding.NamedSharding | tuple of entries


def mesh_shape(mesh: MeshLike, *, argname: str = "mesh") -> MeshShape:
    """The pure :class:`MeshShape` of a JAX ``Mesh`` / ``AbstractMesh``, a mapping, or a MeshShape.

    Raises:
        TypeError: for anything else, a non-string axis name or a non-integer size.
        ValueError: for a size below 1, or more than :data:`~redist.types.MAX_DEVICES` devices.

    Example:
        >>> mesh_shape({"a": 2, "b": 4})
        MeshShape(axes=(('a', 2), ('b', 4)))
        >>> mesh_shape({"a": "2"})
        Traceback (most recent call last):
        TypeError: mesh: mesh axis 'a' must have a positive integer size, got '2' of type str
    """
    if isinstance(mesh, MeshShape):
        return mesh
    axes = mesh if isinstance(mesh, Mapping) else getattr(mesh, "shape", None)
    if not isinstance(axes, Mapping):
        raise TypeError(
            f"{argname} must be a jax.sharding.Mesh, an AbstractMesh, or a {{axis name: size}} "
            f"mapping; got {mesh!r} of type {type(mesh).__name__}"
        )
    try:
        return MeshShape.of(axes)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{argname}: {e}") from None


def _is_partition_spec(spec: Any) -> bool:
    """A ``jax.sharding.PartitionSpec``, recognised without importing JAX."""
    return hasattr(spec, "partitions") and hasattr(spec, "unreduced")


def spec_entries(spec: SpecLike, *, argname: str) -> tuple[SpecEntry, ...]:
    """The entries of a ``PartitionSpec``, a ``NamedSharding``'s spec, or a tuple/list of entries
    (``None`` is a replicated spec). An entry is ``None``, an axis name, or a tuple/list of names.

    Raises:
        TypeError: for anything else: a dict, a set (no order), a string, an iterator, or an entry
            that is none of the above (``P.UNCONSTRAINED`` included).

    Example:
        >>> spec_entries(("a", ["b", "c"], None), argname="src")
        ('a', ('b', 'c'), None)
        >>> spec_entries({"a": 1}, argname="src")
        Traceback (most recent call last):
        TypeError: src must be a PartitionSpec, a NamedSharding, or a tuple of entries (None, an axis name, or a tuple of names); got {'a': 1} of type dict
    """
    if hasattr(spec, "spec") and hasattr(spec, "mesh"):
        spec = spec.spec
    if spec is None:
        return ()
    if _is_partition_spec(spec):  # not a tuple in recent JAX; refuses iteration when unreduced
        spec = tuple(spec.partitions)
    if not isinstance(spec, (tuple, list)):
        raise TypeError(
            f"{argname} must be a PartitionSpec, a NamedSharding, or a tuple of entries (None, an "
            f"axis name, or a tuple of names); got {spec!r} of type {type(spec).__name__}"
        )
    out = []
    for k, entry in enumerate(spec):
        if isinstance(entry, list):
            entry = tuple(entry)
        if isinstance(entry, tuple):
            bad = [n for n in entry if not isinstance(n, str)]
            if bad:
                raise TypeError(
                    f"{argname} entry {k} is {entry!r}, which holds {bad[0]!r}; a tuple entry "
                    "holds mesh axis names (strings) only"
                )
        elif entry is not None and not isinstance(entry, str):
            raise TypeError(
                f"{argname} entry {k} is {entry!r}; expected None, an axis name, or a tuple of names "
                "(unconstrained dimensions are not supported)"
            )
        out.append(entry)
    return tuple(out)


def padded_entries(spec: SpecLike, ndim: int) -> tuple:
    """``spec``'s dimension entries as given (not validated), padded with ``None`` to ``ndim``.

    Example:
        >>> padded_entries(("a", ("b", "c")), 3)
        ('a', ('b', 'c'), None)
    """
    parts = tuple(getattr(spec, "partitions", spec))
    return parts + (None,) * (ndim - len(parts))


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one dimension entry, major first.

    Example:
        >>> entry_axes(None), entry_axes("a"), entry_axes(("a", "b"))
        ((), ('a',), ('a', 'b'))
    """
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def unreduced_axes(spec: SpecLike, *, argname: str) -> tuple[str, ...]:
    """The mesh axes of a pending sum in a ``PartitionSpec`` (``P('a', unreduced={'c'})``)."""
    if hasattr(spec, "spec") and hasattr(spec, "mesh"):
        spec = spec.spec
    if not _is_partition_spec(spec):
        return ()
    if getattr(spec, "reduced", None):
        raise NotImplementedError(
            f"{argname} has reduced axes {set(spec.reduced)}; only unreduced axes are supported"
        )
    axes = spec.unreduced or ()
    bad = [n for n in axes if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{argname} has unreduced axes {set(axes)}; axis names must be strings")
    return tuple(axes)


def dist_type(
    spec: SpecLike, shape: Sequence[int], mesh: MeshShape, *, argname: str, padded: bool = False
) -> DistType:
    """A :class:`DistType` from a spec, with errors that name the argument (``padded``: uneven
    dimensions typed at their padded size, see :meth:`DistType.from_spec`)."""
    try:
        entries = spec_entries(spec, argname=argname)
        unreduced = unreduced_axes(spec, argname=argname)
        return DistType.from_spec(entries, shape, mesh, unreduced, padded=padded)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{argname}: {e}") from None


def _dtype(dtype: Any, argname: str) -> np.dtype:
    """``dtype`` as a numpy dtype of a kind JAX arrays have: bool, integers, floats, complex and
    ml_dtypes' bfloat16 / float8 / int4 ... types, as JAX itself answers (:func:`_jax_refuses`)."""
    if dtype is None:
        raise TypeError(
            f"{argname}: expected a dtype such as 'float32' or jnp.bfloat16, got None (numpy would "
            "read None as float64; pass the dtype explicitly)"
        )
    try:
        # An array or ShapeDtypeStruct stands for its dtype; a scalar type (np.int16) is one.
        has_dtype = not isinstance(dtype, type) and hasattr(dtype, "dtype")
        dt = np.dtype(dtype.dtype if has_dtype else dtype)
    except TypeError:
        raise TypeError(
            f"{argname}: {dtype!r} is not a valid numpy/JAX dtype; expected a dtype such as "
            "'float32' or jnp.bfloat16"
        ) from None
    numeric = dt.kind in "biufc" or dt.type.__module__ == "ml_dtypes"
    if numeric and _jax_refuses(dt) is None:
        return dt
    kind = _jax_refuses(dt) if numeric else _KIND_NAMES.get(dt.kind, "an unsupported kind")
    raise TypeError(
        f"{argname}: dtype {dt} ({kind}) is not an element type of JAX arrays; expected bool, an "
        "integer, a float (bfloat16 and float8 included) or a complex type"
    )


@functools.cache
def _jax_refuses(dt: np.dtype) -> str | None:
    """Why JAX refuses ``dt`` as an array's element type, or ``None`` where it takes it: JAX's own
    answer (``jax.dtypes.result_type``), so that a type numpy or ml_dtypes registers and JAX does
    not (ml_dtypes' ``complex32``, numpy's ``float128``) is refused as JAX refuses it. Imports
    JAX, which starts no backend.

    Example:
        >>> _jax_refuses(np.dtype("bfloat16")) is None
        True
    """
    import jax  # JAX decides what its arrays hold; no devices are touched

    try:
        with warnings.catch_warnings():  # 64-bit types without jax_enable_x64: JAX takes them
            warnings.simplefilter("ignore")
            jax.dtypes.result_type(dt)
    except TypeError:
        return "a type numpy knows and JAX refuses"
    return None


_KIND_NAMES = {"O": "Python objects", "S": "byte strings", "U": "unicode strings",
               "V": "raw or structured records", "M": "datetimes", "m": "timedeltas"}  # fmt: skip


def _ml_bits(dt: np.dtype) -> int | None:
    """The bit width of an ml_dtypes type (``int4`` -> 4, ``bfloat16`` -> 16), else ``None``."""
    if dt.type.__module__ != "ml_dtypes":
        return None
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo):
        try:
            return int(info(dt).bits)
        except (TypeError, ValueError):
            pass
    return None


def dtype_info(dtype: Any, *, argname: str = "dtype") -> tuple[str, int]:
    """Name and item size of a dtype-like (``"bfloat16"``, ``np.float32``, ``jnp.int32``, an
    array...): any element type of JAX arrays, sub-byte types included (see :func:`movable_dtype`).

    Raises:
        TypeError: naming ``argname`` for ``None`` (numpy reads it as float64), ``object``,
            strings, records, datetimes, and what is no dtype at all.

    Example:
        >>> dtype_info("bfloat16")
        ('bfloat16', 2)
        >>> dtype_info(None)
        Traceback (most recent call last):
        TypeError: dtype: expected a dtype such as 'float32' or jnp.bfloat16, got None (numpy would read None as float64; pass the dtype explicitly)
    """
    dt = _dtype(dtype, argname)
    return dt.name, dt.itemsize


def movable_dtype(dtype: Any, *, argname: str = "x") -> tuple[str, int]:
    """Name and item size of a dtype that collectives can move: :func:`dtype_info`, refusing
    sub-byte types (``int2``, ``uint2``, ``int4``, ``uint4``, ``float4_e2m1fn``, ``float6_*``...),
    which XLA packs below a byte (an ``int2`` array through a collective aborts XLA:CPU).

    Raises:
        TypeError: naming ``argname`` and the dtype, for sub-byte types and as :func:`dtype_info`.

    Example:
        >>> movable_dtype("float8_e4m3fn")
        ('float8_e4m3fn', 1)
        >>> movable_dtype("int4", argname="x")
        Traceback (most recent call last):
        TypeError: x: dtype int4 is a sub-byte type (4 bits), which collectives cannot move; use a type of at least 8 bits (e.g. int8)
    """
    dt = _dtype(dtype, argname)
    bits = _ml_bits(dt) if dt.type.__module__ == "ml_dtypes" else 8 * dt.itemsize
    if bits is None or bits < 8:
        raise TypeError(
            f"{argname}: dtype {dt.name} is a sub-byte type ({bits} bits), which collectives cannot "
            f"move; use a type of at least 8 bits (e.g. {_WIDER.get(dt.name[:3], 'bfloat16')})"
        )
    return dt.name, dt.itemsize


_WIDER = {"int": "int8", "uin": "uint8"}


def check_options(
    cost_model: Any, fold_min_bytes: Any, allow_auto: bool = False
) -> tuple[str, int]:
    """The search options of :func:`plan` and ``redistribute``, checked and normalised:
    ``cost_model`` one of :data:`~redist.cost.COST_MODELS` or ``"calibrated:<name>"`` of a
    shipped calibration (and ``"auto"`` where ``allow_auto``: ``redistribute`` resolves it on the
    mesh's devices), ``fold_min_bytes`` a non-negative integer (numpy integers included; not
    floats, strings or bools).

    Raises:
        TypeError: for a cost model that is no string or a byte count that is no integer.
        ValueError: for an unknown cost model or a negative byte count.

    Example:
        >>> check_options("bytes", np.int64(0))
        ('bytes', 0)
        >>> check_options("foo", 0)
        Traceback (most recent call last):
        ValueError: cost_model must be one of ('bytes', 'bytes+copies', 'calibrated'), got 'foo'
    """
    if not isinstance(cost_model, str):
        raise TypeError(
            f"cost_model must be one of {COST_MODELS} (a string), got {cost_model!r} of type "
            f"{type(cost_model).__name__}"
        )
    if not (cost_model_ok(cost_model) or (allow_auto and cost_model == AUTO)):
        also = " or 'auto' (the calibration of the mesh's devices)" if allow_auto else ""
        raise ValueError(
            f"cost_model must be one of {COST_MODELS}, got {cost_model!r}; or 'calibrated:<name>' "
            f"of a shipped calibration (redist/calibrations: 'calibrated:tpu_v5p', ...){also}"
        )
    try:
        fold = check_size(fold_min_bytes, "fold_min_bytes")
    except TypeError as e:
        raise TypeError(f"{e}; expected a non-negative number of bytes (0 always folds)") from None
    if fold < 0:
        raise ValueError(
            f"fold_min_bytes must be a non-negative number of bytes (0 always folds), got {fold}"
        )
    return cost_model, fold


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
            ``"calibrated"`` (time on the shipped CPU calibration: a latency per collective plus
            bytes over bandwidth, plus local copies; ``"calibrated:tpu_v5p"`` on that shipped
            calibration) or
            ``"bytes+copies"`` (also the local copies that interleaving costs, which matter on
            CPU where a copy is as dear as a transfer).
        fold_min_bytes: a final permutation right after an alltoall is folded into it (chunks
            go straight to their final devices, in rounds of ``ppermute``) when every chunk has at
            least this many bytes; smaller chunks keep one all-to-all and one permute, as rounds
            of tiny messages are latency-bound. 0 always folds.

    Returns:
        An immutable :class:`Plan`; ``print`` it to read the steps in the paper's notation.

    Raises:
        TypeError: for a shape, spec, mesh, dtype or option of the wrong type (a float or string
            size, a dict or set as a spec, ``dtype=None``, a sub-byte dtype...), naming it.
        ValueError: for values out of range: negative sizes, unknown or repeated axes, a spec
            longer than the rank, a mesh of more than
            :data:`~redist.types.MAX_DEVICES` devices, an unknown ``cost_model``...
        NotImplementedError: for a ``dst`` with unreduced axes, or reduced axes anywhere.
    """
    shape = check_shape(shape)
    m = mesh_shape(mesh)
    name, itemsize = movable_dtype(dtype, argname="dtype")
    options = check_options(cost_model, fold_min_bytes)
    s = dist_type(src, shape, m, argname="src", padded=True)
    d = dist_type(dst, shape, m, argname="dst", padded=True)
    if d.pending:
        raise NotImplementedError(
            f"dst {dst} has unreduced axes: a redistribution reduces pending sums, it does not "
            "create them"
        )
    return synthesize_uneven(m, s, d, shape, name, itemsize, *options)
