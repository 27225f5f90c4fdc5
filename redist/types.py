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
from typing import Any

import numpy as np

from redist.radix import number

AxisName = str
Shape = tuple[int, ...]
# One entry of a PartitionSpec: None, an axis name, or a tuple of axis names (major-to-minor).
SpecEntry = None | str | tuple[str, ...]


# Bounds on what the pure layer accepts, so that no input makes it hang or exhaust memory.
MAX_DEVICES = 1 << 20
"""The most devices a mesh may have (1,048,576, far beyond any machine): per-device tables such as
:attr:`MeshShape.factor_coords`, tile offsets and device groups stay within a few hundred MiB."""
MAX_SIZE = (1 << 63) - 1
"""The largest dimension size and element count of an array (XLA's sizes are int64)."""
MAX_RANK = 64
"""The largest array rank (numpy's limit, which the tile maps and the simulator use)."""


def check_size(value: Any, what: str) -> int:
    """``value`` as a Python ``int`` if it is an integer (numpy integers included, bools not).

    Raises:
        TypeError: naming ``what``, for anything else (floats, strings, bools, None...).

    Example:
        >>> check_size(np.int64(4), "mesh axis 'a'")
        4
        >>> check_size(2.5, "mesh axis 'a'")
        Traceback (most recent call last):
        TypeError: mesh axis 'a' must be an integer, got 2.5 of type float
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {value!r} of type {type(value).__name__}")
    return int(value)


def check_shape(shape: Any, *, argname: str = "shape") -> Shape:
    """``shape`` as a tuple of Python ints: a tuple or list of non-negative integers (numpy
    integers included; floats, strings and bools refused), at most :data:`MAX_RANK` of them, with
    at most :data:`MAX_SIZE` elements.

    Raises:
        TypeError: for a shape that is no tuple or list, or an entry that is no integer.
        ValueError: for a negative size, too high a rank or too many elements.

    Example:
        >>> check_shape([8, np.int32(4)])
        (8, 4)
        >>> check_shape((8.7, 8))
        Traceback (most recent call last):
        TypeError: shape[0] must be an integer, got 8.7 of type float; shape was (8.7, 8)
    """
    if not isinstance(shape, (tuple, list)):
        raise TypeError(
            f"{argname} must be a tuple of non-negative integers, got {shape!r} of type "
            f"{type(shape).__name__}"
        )
    out = []
    for i, n in enumerate(shape):
        try:
            n = check_size(n, f"{argname}[{i}]")
        except TypeError as e:
            raise TypeError(f"{e}; {argname} was {tuple(shape)!r}") from None
        if n < 0:
            raise ValueError(f"{argname}[{i}] must be non-negative, got {n}; {argname} was {shape}")
        if n > MAX_SIZE:
            raise ValueError(
                f"{argname}[{i}] is {n}, more than the largest size {MAX_SIZE} (2**63 - 1)"
            )
        out.append(n)
    if len(out) > MAX_RANK:
        raise ValueError(
            f"{argname} has rank {len(out)}; redist supports arrays of rank at most {MAX_RANK}"
        )
    if math.prod(out) > MAX_SIZE:
        raise ValueError(
            f"{argname} {tuple(out)} has {math.prod(out)} elements, more than {MAX_SIZE} (2**63 - 1)"
        )
    return tuple(out)


_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the first 13 primes as witnesses: exact below 3.3e24."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _divisor(n: int) -> int:
    """A proper divisor of the odd composite ``n`` (Pollard's rho, Floyd's cycle finding)."""
    for c in range(1, n):
        x = y = 2
        d = 1
        while d == 1:
            x = (x * x + c) % n
            y = (y * y + c) % n
            y = (y * y + c) % n
            d = math.gcd(abs(x - y), n)
        if d != n:
            return d
    raise AssertionError(f"no divisor found for {n}")  # unreachable for composite n


@functools.cache
def prime_factors(n: int) -> tuple[int, ...]:
    """Prime factors of ``n`` in ascending order, with multiplicity (``12 -> (2, 2, 3)``).

    Trial division by small primes, then Miller-Rabin and Pollard's rho: fast for any size up to
    :data:`MAX_SIZE` (``prime_factors(2**61 - 1)`` takes microseconds).
    """
    if n < 2:
        return ()
    out = []
    for p in (2, 3, 5, 7, 11, 13):
        while n % p == 0:
            out.append(p)
            n //= p
    p = 17
    while n > 1 and p * p <= n and p < 1000:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 2
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if m < p * p or _is_prime(m):
            out.append(m)
        else:
            d = _divisor(m)
            stack += [d, m // d]
    return tuple(sorted(out))


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
        if not isinstance(self.axes, tuple):
            raise TypeError(
                f"MeshShape.axes must be a tuple of (name, size) pairs, got {self.axes!r}"
            )
        for pair in self.axes:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"mesh axes must be (name, size) pairs, got {pair!r}")
            name, size = pair
            if not isinstance(name, str):
                raise TypeError(
                    f"mesh axis names must be strings, got {name!r} of type {type(name).__name__}"
                )
            if not isinstance(size, int) or isinstance(size, bool):
                raise TypeError(
                    f"mesh axis {name!r} must have a positive integer size, got {size!r} of type "
                    f"{type(size).__name__} (build meshes with MeshShape.of)"
                )
            if size < 1:
                raise ValueError(
                    f"mesh axis {name!r} must have a positive integer size, got {size}"
                )
        names = [n for n, _ in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be unique, got {names}")
        if self.num_devices > MAX_DEVICES:
            raise ValueError(
                f"mesh {self} has {self.num_devices} devices; redist supports meshes of at most "
                f"{MAX_DEVICES} (2**20) devices"
            )
        factor_names = [f.name for f in self.factors]
        if len(set(factor_names)) != len(factor_names):
            raise ValueError(
                f"the prime factors of mesh axes {names} would be named alike ({factor_names}); "
                "rename the axes that end in '#<digit>'"
            )

    @classmethod
    def of(cls, axes: Mapping[AxisName, int] | Iterable[tuple[AxisName, int]]) -> MeshShape:
        """From ``{name: size}`` or ``(name, size)`` pairs, major first. Sizes are integers
        (numpy integers too; not floats, strings or bools); names are strings.

        Raises:
            TypeError: for a name that is no string or a size that is no integer.
            ValueError: for a size below 1, repeated names, or more than :data:`MAX_DEVICES`
                devices.

        Example:
            >>> MeshShape.of({"a": 2, "b": np.int64(4)}).sizes
            {'a': 2, 'b': 4}
            >>> MeshShape.of({"a": 2.5})
            Traceback (most recent call last):
            TypeError: mesh axis 'a' must have a positive integer size, got 2.5 of type float
        """
        items = axes.items() if isinstance(axes, Mapping) else axes
        out = []
        for pair in items:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise TypeError(f"mesh axes must be (name, size) pairs, got {pair!r}")
            name, size = pair
            if not isinstance(name, str):
                raise TypeError(
                    f"mesh axis names must be strings, got {name!r} of type {type(name).__name__}"
                )
            try:
                size = check_size(size, f"mesh axis {name!r}")
            except TypeError:
                raise TypeError(
                    f"mesh axis {name!r} must have a positive integer size, got {size!r} of type "
                    f"{type(size).__name__}"
                ) from None
            out.append((name, size))
        return cls(tuple(out))

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


def padded_size(n: int, parts: int) -> int:
    """``n`` rounded up to a multiple of ``parts``: the extent of ``parts`` tiles of
    ``ceil(n / parts)`` (XLA's layout of a dimension its parts do not divide).

    Example:
        >>> padded_size(12, 8)
        16
    """
    return parts * -(-n // parts)


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
        shape = check_shape(shape)
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
            dims.append(DistDim(n // parts, tuple(dim_axes), n))
        return cls(tuple(dims))

    @classmethod
    def from_spec(
        cls,
        spec: Sequence[SpecEntry],
        shape: Sequence[int],
        mesh: MeshShape,
        unreduced: Iterable[AxisName] = (),
        *,
        padded: bool = False,
    ) -> DistType:
        """Convert a ``PartitionSpec`` (major-to-minor axis names) for an array of ``shape``;
        ``unreduced`` names the mesh axes of a pending sum. With ``padded``, a dimension of size
        ``n`` that its ``k`` parts do not divide is typed at its padded size ``k * ceil(n / k)``
        (every device holds ``ceil(n / k)``, the last ones padding, as XLA lays it out).

        Raises:
            ValueError: naming the dimension and axis for unknown or repeated axes, a spec longer
                than the rank, or a dimension not divisible by its axes (and as
                :func:`check_shape` for the shape).
            TypeError: for a spec that is no tuple or list, or a malformed entry.
        """
        shape = check_shape(shape)
        if not isinstance(spec, (tuple, list)):
            raise TypeError(
                f"the spec must be a tuple or list of entries (None, a mesh axis name, or a tuple "
                f"of names), got {spec!r} of type {type(spec).__name__}"
            )
        if isinstance(unreduced, str):
            raise TypeError(f"unreduced must be a collection of mesh axis names, got {unreduced!r}")
        spec = tuple(spec)
        if len(spec) > len(shape):
            raise ValueError(
                f"PartitionSpec {spec} has {len(spec)} entries but the array has rank {len(shape)} "
                f"(shape {shape}); give at most {len(shape)} entries"
            )
        spec = spec + (None,) * (len(shape) - len(spec))
        used: dict[str, int] = {}
        all_axes = []
        sizes: list[int] = []
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
                    where = (
                        f"in dimension {i}"
                        if used[name] == i
                        else f"(dimensions {used[name]} and {i})"
                    )
                    raise ValueError(
                        f"mesh axis {name!r} is used twice {where}; "
                        "each mesh axis may partition at most one dimension once"
                    )
                used[name] = i
                parts *= mesh.sizes[name]
            if shape[i] % parts and not padded:
                raise ValueError(
                    f"dimension {i} of size {shape[i]} is split by mesh axes {names} into {parts} "
                    f"parts, but {parts} does not divide {shape[i]}; this type needs even tiles "
                    "(uneven layouts are typed at their padded size, see padded=True)"
                )
            sizes.append(padded_size(shape[i], parts))
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
        t = cls.from_axes(sizes, all_axes, mesh)
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
    if isinstance(entry, (tuple, list)) and all(isinstance(n, str) for n in entry):
        return tuple(entry)
    raise TypeError(
        f"dimension {dim} of the spec is {entry!r}; expected None, a mesh axis name, or a tuple of "
        "axis names"
    )
