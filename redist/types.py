"""Distributed array types of the paper (Fig. 6-7), over meshes split into prime factors.

Notation. The paper writes a distributed dimension as ``c{x, y}n``: local size ``c``, global size
``n``, partitioned by mesh axes listed **minor-to-major** (``x`` varies fastest). JAX's
``PartitionSpec`` lists the axes of a dimension **major-to-minor**. Conversion happens once, here.

Every mesh axis of non-prime size is split into prime factors, major first, ascending primes:
``a:4 -> a#0:2, a#1:2`` and ``a:6 -> a#0:2, a#1:3``. Devices keep their row-major order, so a
factor-level type describes exactly the same placement as the axis-level spec.

Example:
    >>> mesh = MeshShape.of({"a": 4, "b": 2})
    >>> t = DistType.from_spec(("a", None), (16, 8), mesh)
    >>> str(t)
    '[4{a#1,a#0}16, 8]'
    >>> t.to_spec(mesh)
    ('a',)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from redist.radix import number

AxisName = str
Shape = tuple[int, ...]
# One entry of a PartitionSpec: None, an axis name, or a tuple of axis names (major-to-minor).
SpecEntry = None | str | tuple[str, ...]


@functools.cache
def prime_factors(n: int) -> tuple[int, ...]:
    """Prime factors of ``n`` in ascending order, with multiplicity (``12 -> (2, 2, 3)``)."""
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1 if p == 2 else 2
        if p * p > n and n > 1:
            out.append(n)
            break
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Factor:
    """A prime factor of a mesh axis: ``a#1:2`` is the second (more minor) factor of axis ``a``."""

    name: str
    axis: AxisName
    size: int


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Named mesh axes with sizes (major-to-minor), without devices: the pure view of a mesh.

    Example:
        >>> MeshShape.of({"x": 4, "y": 6}).factor_names
        ('x#0', 'x#1', 'y#0', 'y#1')
    """

    axes: tuple[tuple[AxisName, int], ...]

    def __post_init__(self) -> None:
        names = [n for n, _ in self.axes]
        for name, size in self.axes:
            if not isinstance(name, str):
                raise TypeError(f"mesh axis names must be strings, got {name!r}")
            if not isinstance(size, (int, np.integer)) or size < 1:
                raise ValueError(
                    f"mesh axis {name!r} must have a positive integer size, got {size!r}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be unique, got {names}")
        factor_names = [f.name for f in self.factors]
        if len(set(factor_names)) != len(factor_names):
            raise ValueError(
                f"the prime factors of mesh axes {names} would be named alike ({factor_names}); "
                "rename the axes that end in '#<digit>'"
            )

    @classmethod
    def of(cls, axes: Mapping[AxisName, int] | Iterable[tuple[AxisName, int]]) -> MeshShape:
        items = axes.items() if isinstance(axes, Mapping) else axes
        return cls(tuple((str(n), int(s)) for n, s in items))

    @functools.cached_property
    def sizes(self) -> dict[AxisName, int]:
        return dict(self.axes)

    @property
    def axis_names(self) -> tuple[AxisName, ...]:
        return tuple(n for n, _ in self.axes)

    @functools.cached_property
    def num_devices(self) -> int:
        return math.prod(s for _, s in self.axes)

    @functools.cached_property
    def factors(self) -> tuple[Factor, ...]:
        """Prime factors of all axes in device order (major-to-minor); size-1 axes have none."""
        out = []
        for name, size in self.axes:
            primes = prime_factors(size)
            if len(primes) == 1:
                out.append(Factor(name, name, size))
            else:
                out.extend(Factor(f"{name}#{k}", name, p) for k, p in enumerate(primes))
        return tuple(out)

    @functools.cached_property
    def factor_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.factors)

    @functools.cached_property
    def factor_size(self) -> dict[str, int]:
        return {f.name: f.size for f in self.factors}

    @functools.cached_property
    def factor_axis(self) -> dict[str, AxisName]:
        return {f.name: f.axis for f in self.factors}

    @functools.cached_property
    def factor_index(self) -> dict[str, int]:
        return {f.name: k for k, f in enumerate(self.factors)}

    def axis_factors(self, axis: AxisName) -> tuple[str, ...]:
        """Factor names of ``axis``, major first."""
        return tuple(f.name for f in self.factors if f.axis == axis)

    @functools.cached_property
    def primes(self) -> tuple[int, ...]:
        """Multiset of prime factor sizes, sorted."""
        return tuple(sorted(f.size for f in self.factors))

    @functools.cached_property
    def factor_coords(self) -> np.ndarray:
        """``(num_devices, num_factors)`` coordinates of every device (row-major device order)."""
        sizes = [f.size for f in self.factors]
        if not sizes:
            return np.zeros((self.num_devices, 0), dtype=np.int64)
        grid = np.indices(sizes).reshape(len(sizes), -1).T
        return np.ascontiguousarray(grid)

    def __str__(self) -> str:
        return "{" + ", ".join(f"{n}:{s}" for n, s in self.axes) + "}"


@dataclasses.dataclass(frozen=True)
class DistDim:
    """A distributed dimension ``local{axes}size`` with factor axes listed minor-to-major."""

    local: int
    axes: tuple[str, ...]
    size: int

    def __str__(self) -> str:
        if not self.axes:
            return str(self.size)
        return f"{self.local}{{{','.join(self.axes)}}}{self.size}"


@dataclasses.dataclass(frozen=True)
class DistType:
    """A distributed array type ``[d_0, ..., d_{r-1}]`` over the prime factors of a mesh.

    Construct through :meth:`from_spec` or :meth:`from_axes`, which check well-formedness (Fig. 7b).
    ``pending`` lists mesh factors over which the array is a sum still to be taken (JAX's
    ``unreduced`` axes): every device holds a partial tile and the value is the sum of the
    partials over those factors. It prints as ``[...] + sum{c}``.
    """

    dims: tuple[DistDim, ...]
    pending: tuple[str, ...] = ()

    @classmethod
    def from_axes(
        cls, shape: Sequence[int], axes: Sequence[Sequence[str]], mesh: MeshShape
    ) -> DistType:
        """Build a type from factor axes per dimension, minor-to-major (the paper's order)."""
        if len(shape) != len(axes):
            raise ValueError(
                f"shape {tuple(shape)} has rank {len(shape)} but {len(axes)} dims of axes"
            )
        seen: dict[str, int] = {}
        dims = []
        for i, (n, dim_axes) in enumerate(zip(shape, axes)):
            parts = 1
            for a in dim_axes:
                if a not in mesh.factor_size:
                    raise ValueError(
                        f"dimension {i} names unknown mesh factor {a!r}; valid: {mesh.factor_names}"
                    )
                if a in seen:
                    raise ValueError(f"mesh factor {a!r} is used by dimensions {seen[a]} and {i}")
                seen[a] = i
                parts *= mesh.factor_size[a]
            if n % parts:
                raise ValueError(
                    f"dimension {i} of size {n} is not divisible by the {parts} parts of {tuple(dim_axes)}"
                )
            dims.append(DistDim(n // parts, tuple(dim_axes), int(n)))
        return cls(tuple(dims))

    @classmethod
    def from_spec(
        cls,
        spec: Sequence[SpecEntry],
        shape: Sequence[int],
        mesh: MeshShape,
        unreduced: Iterable[AxisName] = (),
    ) -> DistType:
        """Convert a ``PartitionSpec`` (major-to-minor axis names) for an array of ``shape``;
        ``unreduced`` names the mesh axes of a pending sum.

        Raises:
            ValueError: naming the dimension and axis for unknown or repeated axes, a spec longer
                than the rank, or a dimension not divisible by its axes.
        """
        shape = tuple(int(n) for n in shape)
        spec = tuple(spec)
        if len(spec) > len(shape):
            raise ValueError(
                f"PartitionSpec {spec} has {len(spec)} entries but the array has rank {len(shape)} "
                f"(shape {shape}); give at most {len(shape)} entries"
            )
        spec = spec + (None,) * (len(shape) - len(spec))
        used: dict[str, int] = {}
        all_axes = []
        for i, entry in enumerate(spec):
            names = _entry_names(entry, i)
            parts = 1
            for name in names:
                if name not in mesh.sizes:
                    raise ValueError(
                        f"dimension {i} of the spec names mesh axis {name!r}, which is not in the "
                        f"mesh {mesh}; valid axes: {mesh.axis_names}"
                    )
                if name in used:
                    raise ValueError(
                        f"mesh axis {name!r} is used twice (dimensions {used[name]} and {i}); "
                        "each mesh axis may partition at most one dimension once"
                    )
                used[name] = i
                parts *= mesh.sizes[name]
            if shape[i] % parts:
                raise ValueError(
                    f"dimension {i} of size {shape[i]} is split by mesh axes {names} into {parts} "
                    f"parts, but {parts} does not divide {shape[i]}; uneven sharding is not "
                    "supported yet: pad the array or choose axes whose size divides the dimension"
                )
            major_to_minor = [f for name in names for f in mesh.axis_factors(name)]
            all_axes.append(tuple(reversed(major_to_minor)))
        pending = []
        for name in sorted(
            unreduced, key=lambda n: mesh.axis_names.index(n) if n in mesh.sizes else -1
        ):
            if name not in mesh.sizes:
                raise ValueError(
                    f"unreduced names mesh axis {name!r}, which is not in the mesh {mesh}; "
                    f"valid axes: {mesh.axis_names}"
                )
            if name in used:
                raise ValueError(
                    f"mesh axis {name!r} is both unreduced and splits dimension {used[name]}"
                )
            pending.extend(mesh.axis_factors(name))
        t = cls.from_axes(shape, all_axes, mesh)
        return dataclasses.replace(t, pending=tuple(pending)) if pending else t

    def to_spec(self, mesh: MeshShape) -> tuple[SpecEntry, ...]:
        """Back to ``PartitionSpec`` entries; factors of one axis in order merge into the axis name.

        A dimension that holds only part of an axis's factors, or them out of order, keeps factor
        names (such a spec is valid on the factored mesh, see ``redist.execute``).
        """
        out: list[SpecEntry] = []
        for d in self.dims:
            names: list[str] = []
            rest = list(reversed(d.axes))  # major-to-minor
            while rest:
                axis = mesh.factor_axis[rest[0]]
                full = list(mesh.axis_factors(axis))
                if rest[: len(full)] == full:
                    names.append(axis)
                    rest = rest[len(full) :]
                else:
                    names.append(rest.pop(0))
            out.append(None if not names else names[0] if len(names) == 1 else tuple(names))
        while out and out[-1] is None:
            out.pop()
        return tuple(out)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def global_shape(self) -> Shape:
        return tuple(d.size for d in self.dims)

    @property
    def local_shape(self) -> Shape:
        return tuple(d.local for d in self.dims)

    @property
    def local_size(self) -> int:
        return math.prod(self.local_shape)

    @property
    def global_size(self) -> int:
        return math.prod(self.global_shape)

    @property
    def axes(self) -> frozenset[str]:
        return frozenset(a for d in self.dims for a in d.axes)

    def dim_of(self, factor: str) -> int | None:
        for i, d in enumerate(self.dims):
            if factor in d.axes:
                return i
        return None

    def base_offsets(self, mesh: MeshShape) -> np.ndarray:
        """The base offset map of Fig. 7a: ``(num_devices, rank)`` offsets, devices row-major."""
        coords = mesh.factor_coords
        out = np.zeros((mesh.num_devices, self.rank), dtype=np.int64)
        for i, d in enumerate(self.dims):  # axes minor-to-major: the first digit is fastest
            block = number([coords[:, mesh.factor_index[a]] for a in d.axes],
                           [mesh.factor_size[a] for a in d.axes])  # fmt: skip
            out[:, i] += d.local * block
        return out

    def __str__(self) -> str:
        out = "[" + ", ".join(str(d) for d in self.dims) + "]"
        return out + (f" + sum{{{','.join(self.pending)}}}" if self.pending else "")

    def __repr__(self) -> str:
        axes = tuple(d.axes for d in self.dims)
        tail = f", pending={self.pending!r}" if self.pending else ""
        return f"DistType.from_axes({self.global_shape!r}, {axes!r}, mesh){tail}"


def _entry_names(entry: SpecEntry, dim: int) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple) and all(isinstance(n, str) for n in entry):
        return entry
    raise TypeError(
        f"dimension {dim} of the spec is {entry!r}; expected None, a mesh axis name, or a tuple of "
        "axis names"
    )
