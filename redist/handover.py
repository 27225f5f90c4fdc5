"""Where a move onto another device set is staged before its tiles are handed over whole.

A move across processes (a trainer's devices to a server's) is made in two parts: the array is
moved to the server's layout on the trainer's own devices (the *stage*), then every staged tile is
handed to the server's device that holds it, once (``jax.device_put``'s cross-host transfers pair
the tiles of two arrays of one layout on equally many devices). The stage depends on the sizes:

- equally many devices: the server's mesh shape and layout, on the trainer's devices;
- the trainer has ``k`` times the devices: a leading axis of ``k`` copies (:data:`COPIES`), whose
  first copy is handed over;
- the server has ``k`` times the devices: ``k`` of the server's mesh axes (sizes multiplying to
  ``k``, each the minor part of every dimension it splits) are left whole on the stage, so that
  each trainer device holds the ``k`` tiles of one server position; the stage is cut into ``k``
  pieces, one per index of those axes, each handed to the server's devices at that index.

Example:
    >>> s = Staging.of(trainer, NamedSharding(server, P("ep", None, "tp")), 3)  # doctest: +SKIP
    >>> s.mesh.shape, s.spread                                                 # doctest: +SKIP
    ({'ep': 4}, ('tp',))
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from redist.specs import entry_axes, padded_entries

COPIES = "redist_copies"
"""The staging mesh's leading axis where the source has more devices than the destination."""


def spread_axes(sizes: dict[str, int], entries: tuple, k: int) -> tuple[str, ...] | None:
    """Mesh axes (of ``sizes``, in mesh order) whose sizes multiply to ``k`` and that are the
    minor part of every dimension entry naming them, preferring axes no entry names (their
    pieces are whole copies), or ``None`` where no such set exists.

    Example:
        >>> spread_axes({"ep": 2, "tp": 4}, (("ep", "tp"), None), 4)
        ('tp',)
        >>> spread_axes({"ep": 2, "tp": 4}, (("tp", "ep"), None), 4) is None
        True
    """
    names = list(sizes)
    named = {a for e in entries for a in entry_axes(e)}
    options = []
    for r in range(len(names) + 1):
        for chosen in itertools.combinations(names, r):
            if math.prod(sizes[a] for a in chosen) != k:
                continue
            minor = all(
                not any(a in chosen for a in entry_axes(e)[: len(entry_axes(e)) - n])
                for e in entries
                for n in [sum(a in chosen for a in entry_axes(e))]
            )
            if minor:
                options.append((sum(a in named for a in chosen), chosen))
    return min(options)[1] if options else None


@dataclasses.dataclass(frozen=True, eq=False)
class Staging:
    """How a move to ``dst`` (on other devices) is staged on the source ``devices`` (a numpy
    array of them) and handed over."""

    devices: Any
    dst: NamedSharding
    ndim: int

    @staticmethod
    def of(devices, dst: NamedSharding, ndim: int) -> Staging:
        """The staging of a move from ``devices`` to ``dst``; ``NotImplementedError`` where one
        device count does not divide the other or no axes of ``dst``'s mesh can be spread."""
        s = Staging(np.asarray(devices), dst, ndim)
        s.mesh  # noqa: B018 (checks the sizes)
        return s

    @property
    def copies(self) -> int:
        """How many copies of the destination's tiles the stage holds (1 unless the source has
        more devices)."""
        n, m = self.devices.size, self.dst.mesh.devices.size
        return n // m if n % m == 0 else 1

    @functools.cached_property
    def spread(self) -> tuple[str, ...]:
        """The destination's mesh axes left whole on the stage (where it has more devices)."""
        n, m = self.devices.size, self.dst.mesh.devices.size
        if m <= n:
            if n % m:
                raise self._refused(n, m)
            return ()
        entries = padded_entries(self.dst.spec, self.ndim)
        chosen = spread_axes(dict(self.dst.mesh.shape), entries, m // n) if m % n == 0 else None
        if chosen is None:
            raise self._refused(n, m)
        return chosen

    def _refused(self, n: int, m: int) -> NotImplementedError:
        return NotImplementedError(
            f"moving across processes from {n} devices to dst's mesh {dict(self.dst.mesh.shape)}"
            f" ({m} devices) with dst {self.dst.spec}: the tiles are staged on x's devices and "
            "handed over whole, which needs one device count to divide the other and, where dst "
            "has more devices, axes of dst's mesh with sizes multiplying to the ratio that are "
            "the minor part of every dimension they split; move to a mesh whose device count "
            f"divides or is a multiple of {n}"
        )

    @functools.cached_property
    def mesh(self):
        """The stage: a mesh of the source devices, named and shaped as the destination's mesh
        (less the :attr:`spread` axes, plus a leading :data:`COPIES` axis of :attr:`copies`)."""
        dst = self.dst.mesh
        keep = [i for i, a in enumerate(dst.axis_names) if a not in self.spread]
        names = [dst.axis_names[i] for i in keep]
        sizes = [dst.devices.shape[i] for i in keep]
        kinds = [dst.axis_types[i] for i in keep]
        if self.copies > 1 or not names:
            names, sizes = [COPIES, *names], [self.copies, *sizes]
            kinds = [dst.axis_types[0], *kinds]
        return jax.sharding.Mesh(self.devices.reshape(sizes), tuple(names), axis_types=tuple(kinds))

    @property
    def spec(self) -> PartitionSpec:
        """The destination's layout less the :attr:`spread` axes."""
        out = []
        for e in padded_entries(self.dst.spec, self.ndim):
            kept = tuple(a for a in entry_axes(e) if a not in self.spread)
            out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        return PartitionSpec(*out)

    @property
    def pieces(self) -> list[dict[str, int]]:
        """The index of the :attr:`spread` axes of each piece handed over ([{}]: one piece)."""
        sizes = dict(self.dst.mesh.shape)
        return [dict(zip(self.spread, j))
                for j in itertools.product(*(range(sizes[a]) for a in self.spread))]  # fmt: skip

    def cut(self, y, shape: tuple[int, ...]) -> list:
        """The staged array ``y`` (traced, of global ``shape``) cut into its pieces: per
        dimension a spread axis splits, each device's block of that piece (no data moves)."""
        if not self.spread:
            return [y]
        sizes = dict(self.dst.mesh.shape)
        mesh, spec = self.mesh, self.spec

        def blocks(v):
            out = []
            for at in self.pieces:
                piece = v
                for d, e in enumerate(padded_entries(self.dst.spec, self.ndim)):
                    spread = [a for a in entry_axes(e) if a in self.spread]
                    if not spread:
                        continue
                    q = math.prod(sizes[a] for a in spread)
                    index = 0
                    for a in spread:  # mixed radix, major first, as the entry orders them
                        index = index * sizes[a] + at[a]
                    step = piece.shape[d] // q
                    piece = jax.lax.slice_in_dim(piece, index * step, (index + 1) * step, axis=d)
                out.append(piece)
            return out

        return list(jax.shard_map(blocks, mesh=mesh, in_specs=spec,
                                  out_specs=[spec] * len(self.pieces))(y))  # fmt: skip

    def targets(self) -> list[NamedSharding]:
        """Where each piece is handed over: the destination's devices at its spread index."""
        if not self.spread:
            return [self.dst]
        dst = self.dst.mesh
        keep = tuple(a for a in dst.axis_names if a not in self.spread)
        out = []
        for at in self.pieces:
            index = tuple(at.get(a, slice(None)) for a in dst.axis_names)
            devices = dst.devices[index]
            kinds = tuple(t for a, t in zip(dst.axis_names, dst.axis_types) if a in keep)
            if not keep:
                devices, keep, kinds = devices.reshape(1), (COPIES,), (dst.axis_types[0],)
            out.append(NamedSharding(jax.sharding.Mesh(devices, keep, axis_types=kinds),
                                     self.spec))  # fmt: skip
        return out

    def handed(self, y: jax.Array) -> jax.Array:
        """The staged (or cut) array ``y`` as handed over: itself, or where it is staged in
        copies the first copy's tiles as an array on those devices alone (its buffers)."""
        if self.copies == 1:
            return y
        first = self.mesh.devices[0]
        mine = {d.id for d in first.flat}
        names, kinds = self.mesh.axis_names[1:], self.mesh.axis_types[1:]
        if not names:
            first, names, kinds = first.reshape(1), (COPIES,), self.mesh.axis_types[:1]
        sub = jax.sharding.Mesh(first, names, axis_types=kinds)
        return jax.make_array_from_single_device_arrays(
            y.shape,
            NamedSharding(sub, self.spec),
            [s.data for s in y.addressable_shards if s.device.id in mine],
            dtype=y.dtype,
        )

    def received(self, pieces: list[jax.Array], shape: tuple[int, ...], dtype) -> jax.Array:
        """The destination array from its handed-over ``pieces`` (their buffers, nothing
        moved; a process holding none of ``dst``'s devices gets an array with no local tiles)."""
        if len(pieces) == 1:
            return pieces[0]
        held = {s.device.id: s.data for p in pieces for s in p.addressable_shards}
        order = self.dst.mesh.devices.flat  # JAX takes the buffers in the mesh's device order
        shards = [held[d.id] for d in order if d.id in held]
        return jax.make_array_from_single_device_arrays(shape, self.dst, shards, dtype=dtype)
