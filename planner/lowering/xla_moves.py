"""Which layout changes of a plan XLA's SPMD partitioner should carry out, and which ``redist``.

For each change of layout (a :class:`planner.layout.dataflow.Move`) a one-line program that asks XLA
for that change is compiled (not run) on the plan's mesh, and the collectives in its HLO are read
(:mod:`redist.hlo`). ``redist`` takes the change when XLA *rematerialises* (one of its
collectives returns more than the larger of the two tiles: it replicates, then slices) or when
``redist``'s plan is predicted faster on the calibration (both priced by the same model: latency
plus bytes over bandwidth per collective; XLA's local copies are not counted, so ties go to XLA,
and its groups, read from HLO without their devices, are priced on the fast network).
Probes are cached per mesh, shape, dtype and layouts.

Example:
    >>> choice = choose(mesh, move, calibration)       # doctest: +SKIP
    >>> choice.use_redist, choice.xla, choice.redist_s, choice.xla_s
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import redist
from planner.layout.dataflow import Move
from planner.layout.explanation import entries
from planner.program.ops import itemsize
from planner.program.schedule import is_even, local_shape
from redist.calibration import Calibration
from redist.collectives import CollectiveKind
from redist.cost import plan_cost
from redist.hlo import Collective, captured_stderr, hlo_collectives


@dataclasses.dataclass(frozen=True)
class MoveChoice:
    """How XLA and ``redist`` would each carry out one change of layout, and which is used."""

    move: Move
    xla: tuple[Collective, ...]
    xla_s: float
    redist_s: float
    rematerialises: bool
    uneven: bool = False  # a layout is uneven: XLA's partitioner, which pads, makes it unasked

    @property
    def use_redist(self) -> bool:
        if self.uneven and not math.isinf(self.xla_s):
            return False
        return self.rematerialises or self.redist_s < self.xla_s

    def __str__(self) -> str:
        v = self.move.value
        xla = " ".join(f"{c.kind}({c.bytes})" for c in self.xla) or "nothing"
        why = "XLA rematerialises" if self.rematerialises else "predicted faster"
        if math.isinf(self.xla_s):
            xla, why = "not asked", "asked for"
        elif self.uneven:
            xla = "not probed (an uneven layout enters no jit)"
        return (
            f"{v.name} {v.shape}: {entries(self.move.src)} -> {entries(self.move.dst)}: XLA {xla} "
            f"({self.xla_s * 1e6:.1f} us), redist {self.redist_s * 1e6:.1f} us -> "
            + (f"redist ({why})" if self.use_redist else "XLA")
        )


@functools.lru_cache(maxsize=4096)
def xla_collectives(mesh, shape: tuple[int, ...], dtype: str, src: PartitionSpec,
                    dst: PartitionSpec) -> tuple[Collective, ...]:  # fmt: skip
    """The collectives XLA compiles to move an array of ``shape`` from ``src`` to ``dst``."""
    probe = jax.jit(
        lambda x: lax.with_sharding_constraint(x, NamedSharding(mesh, dst)),
        in_shardings=NamedSharding(mesh, src),
    )
    with captured_stderr():  # its rematerialisation warnings are what is being asked
        text = probe.lower(jax.ShapeDtypeStruct(shape, dtype)).compile().as_text()
    return hlo_collectives(text)


def _seconds(colls: tuple[Collective, ...], devices: int, cal: Calibration) -> float:
    total = 0.0
    for c in colls:
        n = c.group_size if c.group_size and c.kind != CollectiveKind.PERMUTE else devices
        named = c.bytes * n if c.kind == CollectiveKind.REDUCE_SCATTER else c.bytes  # its operand
        total += cal.collective_time(c.kind, named, n)
    return total


def choose(mesh, move: Move, cal: Calibration, probe: bool = True) -> MoveChoice:
    """XLA's and ``redist``'s ways of making ``move`` on ``mesh`` (a ``jax.sharding.Mesh`` whose
    axes are the prime factors the specs name), and which is used; without ``probe``, ``redist``
    (XLA is not asked)."""
    v = move.value
    sizes = dict(mesh.shape)
    src, dst = PartitionSpec(*entries(move.src)), PartitionSpec(*entries(move.dst))
    plan = redist.plan(v.shape, src, dst, sizes, dtype=v.dtype)
    redist_s = plan_cost(plan, cal)[0]
    if not probe:
        return MoveChoice(move, (), math.inf, redist_s, False)
    if not all(is_even(v.shape, s, sizes) for s in (move.src, move.dst)):
        return MoveChoice(move, (), 0.0, redist_s, False, uneven=True)
    colls = xla_collectives(mesh, tuple(v.shape), v.dtype, src, dst)
    tile = max(math.prod(local_shape(v.shape, s, sizes)) for s in (move.src, move.dst))
    remat = any(c.bytes > tile * itemsize(v.dtype) for c in colls)
    return MoveChoice(move, colls, _seconds(colls, mesh.size, cal), redist_s, remat)
