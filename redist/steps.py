"""Plan and Step: the immutable result of synthesis, and the only thing execution reads.

A plan prints in the paper's notation (minor-to-major axes), one type per line, each step between
the types it connects. Factor axes ``a#k`` name the prime factors of mesh axis ``a`` (major first).

Example:
    >>> p = redist.plan((8, 8), P("a"), P(None, "a"), {"a": 8})   # doctest: +SKIP
    >>> print(p)
    [1{a#2,a#1,a#0}8, 8]
      alltoall(0->1, {a#2,a#1,a#0})  8 devices/group  32 B
    [8, 1{a#2,a#1,a#0}8]
"""

from __future__ import annotations

import dataclasses

from redist.types import DistType, MeshShape

Group = tuple[int, ...]
Round = tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int, int, int], ...]]
"""One round of a reblock: ``(sender, receiver)`` pairs and a per-device table."""


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """One collective of a plan.

    Attributes:
        kind: ``"dynslice"``, ``"alltoall"``, ``"allgather"``, ``"allpermute"``, or, first in a
            plan from a pending sum, ``"reducescatter"`` (onto ``dim``) or ``"allreduce"``.
        dim: the array dimension sliced, gathered, or (alltoall) gathered from.
        to_dim: for alltoall, the dimension that becomes partitioned; else ``None``.
        axes: mesh factors the step acts on, minor-to-major (empty for allpermute).
        before, after: the (concrete) types around the step, relative to ``device_map``s.
        cost_bytes: bytes per device under the paper's cost model.
        groups: communicating device groups (physical row-major indices), member order = rank.
        offsets: for dynslice, the start of the slice on every physical device.
        perm: for allpermute, ``(source, destination)`` pairs of devices whose tile moves; for an
            alltoall, the result a device would receive goes instead to the paired device (a
            permutation folded into the alltoall).
        device_map: after the step, ``device_map[h]`` is the physical device at logical point ``h``.
        moves: for alltoall, ``(from_dim, to_dim, factor)`` per group of moved factors; ``axes``
            lists them in move order, and a member's rank is their mixed-radix index (first
            fastest). One all-to-all may move factors between several pairs of dimensions.
        move_axes: for alltoall, the factors of each move.
        rounds: for ``"reblock"`` (a dimension ``dim`` of true extent ``extent`` changes its
            padded extent, so a device's block of rows moves a little, see :mod:`redist.uneven`):
            per round ``(pairs, table)``, ``pairs`` the ``(sender, receiver)`` devices (a device
            pairs with itself for rows it keeps) and ``table[d] = (send start, send length,
            receive start, receive length)`` within device ``d``'s tiles along ``dim``.
        serial: run as rounds of ``ppermute`` one after another (:attr:`Calibration.
            serial_rounds`): an alltoall that permutes its results (rounds already) without
            starting them all at once; an allgather by rounds rather than one all-gather.
    """

    kind: str
    dim: int | None
    to_dim: int | None
    axes: tuple[str, ...]
    before: DistType
    after: DistType
    cost_bytes: int
    groups: tuple[Group, ...] = ()
    offsets: tuple[tuple[int, ...], ...] = ()
    perm: tuple[tuple[int, int], ...] = ()
    device_map: tuple[int, ...] = ()
    moves: tuple[tuple[int, int, int], ...] = ()
    move_axes: tuple[tuple[str, ...], ...] = ()
    rounds: tuple[Round, ...] = ()
    serial: bool = False

    @property
    def collectives(self) -> int:
        """Collectives the step runs: none for a dynslice, one round of ``ppermute`` per round of
        a reblock that moves rows between devices, else one."""
        if self.kind == "dynslice":
            return 0
        if self.kind == "reblock":
            return sum(any(a != b for a, b in pairs) for pairs, _ in self.rounds)
        return 1

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if len(self.groups) else 1

    def __str__(self) -> str:
        axes = "{" + ",".join(self.axes) + "}"
        if self.kind == "dynslice":
            head = f"dynslice({self.dim}, {axes})"
        elif self.kind == "allgather":
            head = f"allgather({self.dim}, {axes})"
        elif self.kind == "reducescatter":
            head = f"reducescatter({self.dim}, {axes})"
        elif self.kind == "allreduce":
            head = f"allreduce({axes})"
        elif self.kind == "reblock":
            n, m = self.before.dims[self.dim].size, self.after.dims[self.dim].size
            head = f"reblock({self.dim}, {axes}, extent {n}->{m}, {len(self.rounds)} rounds)"
        elif self.kind == "alltoall" and len(self.moves) > 1:
            parts = [
                f"{i}->{j}, {{{','.join(x)}}}" for (i, j, _), x in zip(self.moves, self.move_axes)
            ]
            head = f"alltoall({'; '.join(parts)})"
            if self.perm:
                head += f" permuting {len(self.perm)} results"
        elif self.kind == "alltoall":
            head = f"alltoall({self.dim}->{self.to_dim}, {axes})"
            if self.perm:
                head += f" permuting {len(self.perm)} results"
        else:
            head = f"allpermute({len(self.perm)} tiles move)"
        if self.serial:
            head += " in series"
        detail = f"  {self.group_size} devices/group" if len(self.groups) else ""
        return f"{head}{detail}  {self.cost_bytes} B"


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A synthesized redistribution: ``src`` to ``dst`` on ``mesh`` through ``steps``.

    Attributes:
        cost_bytes: total bytes per device under the paper's cost model (Fig. 11).
        peak_bytes: largest local tile along the sequence, bytes per device.
        held_bytes: the most one step holds at once (its input and output tiles).
        extent: the array's true shape where some layout is uneven (``src`` and ``dst`` are
            then typed at their padded sizes, :mod:`redist.uneven`); ``None`` otherwise.
    """

    mesh: MeshShape
    src: DistType
    dst: DistType
    dtype: str
    itemsize: int
    steps: tuple[Step, ...]
    extent: tuple[int, ...] | None = None

    @property
    def cost_bytes(self) -> int:
        return sum(s.cost_bytes for s in self.steps)

    @property
    def peak_bytes(self) -> int:
        sizes = [self.src.local_size] + [s.after.local_size for s in self.steps]
        return max(sizes) * self.itemsize

    @property
    def held_bytes(self) -> int:
        """The most one step holds at once, bytes per device: its input and output tiles (a
        collective writes its result beside its operand); 0 for a plan of no steps."""
        return max((s.before.local_size + s.after.local_size for s in self.steps), default=0) * (
            self.itemsize
        )

    @property
    def bound_bytes(self) -> int:
        """``max(src tile, dst tile)`` in bytes: the memory bound every plan respects. For an
        uneven move the tiles are those of the padded extent the move runs on (one dimension's
        tile there exceeds its padded tile by less than ``lcm(src parts, dst parts) / parts``
        rows, see :mod:`redist.uneven`)."""
        ends = [self.src, self.dst]
        ends += [t for s in self.steps if s.kind == "reblock" for t in (s.before, s.after)]
        return max(t.local_size for t in ends) * self.itemsize

    @property
    def num_collectives(self) -> int:
        return sum(s.collectives for s in self.steps)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.steps)

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The array's shape (its true extent where a layout is uneven)."""
        return self.extent if self.extent is not None else self.src.global_shape

    @property
    def uneven(self) -> bool:
        """Whether some dimension of the array is padded in ``src`` or ``dst``."""
        shape = self.global_shape
        return shape != self.src.global_shape or shape != self.dst.global_shape

    def __str__(self) -> str:
        lines = [
            f"# {self.global_shape} {self.dtype} on {self.mesh}: {len(self.steps)} steps, "
            f"cost {self.cost_bytes} B/device, peak {self.peak_bytes} B/device "
            f"(bound {self.bound_bytes})",
            str(self.src),
        ]
        for s in self.steps:
            lines.append(f"  {s}")
            lines.append(str(s.after))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Plan(src={self.src}, dst={self.dst}, mesh={self.mesh}, dtype={self.dtype!r}, "
            f"steps={self.kinds}, cost_bytes={self.cost_bytes}, peak_bytes={self.peak_bytes})"
        )
