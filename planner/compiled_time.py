"""A compiled program's step time as the calibration prices it: the compiler's own estimate of its
kernels (``cost_analysis()["optimal_seconds"]``) plus every collective of its optimized HLO at
the calibration's latency + wire bytes / bandwidth, counted as often as it runs (a collective in a
loop body times the loop's trip count). This is the reference the simulator's predicted time is
checked against (``experiments/time_check.py``).

Where ``optimal_seconds`` is not positive (libtpu's v6e estimate reads negative, e.g. -20 s for
one layer of a 134 M-parameter LM on v6e:16x16), the kernels are priced by the calibration's
roofline of the compiler's own ``flops`` and ``bytes accessed`` instead (:func:`kernel_seconds`).

The compiler's ``optimal_seconds`` (and its ``flops`` and ``bytes accessed``) count a loop's body
once whatever its trip count: compile a scanned program with the scan unrolled (``unroll=True``)
to have every layer counted.

Example:
    >>> compiled = jax.jit(f).lower(*structs).compile()                    # doctest: +SKIP
    >>> compiled_seconds(compiled, Calibration.named("tpu_v5p"))
"""

from __future__ import annotations

import dataclasses
import json

from planner.compiled import _devices_of
from redist.calibration import Calibration
from redist.hlo import KINDS, CountedCollective, counted_collectives


def collective_seconds(
    collectives, calibration: Calibration, num_devices: int, crosses: bool = False
) -> float:
    """Seconds of ``collectives`` (:class:`CountedCollective`\\ s, or :class:`redist.hlo.Collective`\\ s
    counted once) at the calibration's prices; a group of unstated size is all ``num_devices``.
    The HLO states each collective's result per device; the calibration prices a reduce-scatter
    by its input (the result times the group)."""
    total = 0.0
    for c in collectives:
        coll, runs = (c.collective, c.runs) if isinstance(c, CountedCollective) else (c, 1)
        if coll.kind not in KINDS:
            continue
        n = coll.group_size or num_devices
        nbytes = coll.bytes * n if coll.kind == "reduce-scatter" else coll.bytes
        total += runs * calibration.collective_time(coll.kind, nbytes, n, crosses)
    return total


def kernel_seconds(cost: dict, calibration: Calibration) -> tuple[float, str]:
    """The kernels' seconds of a compiled program from its ``cost_analysis()``, and where they come
    from: ``"compiler"`` (its ``optimal_seconds``), or ``"roofline"`` where that is not positive
    (the calibration's :meth:`~redist.calibration.Calibration.compute_time` of its ``flops`` and
    ``bytes accessed``).

    Example:
        >>> kernel_seconds({"optimal_seconds": -20.0, "flops": 4.6e14, "bytes accessed": 0.0},
        ...                Calibration.named("tpu_v5p"))[1]
        'roofline'
    """
    optimal = float(cost.get("optimal_seconds", 0.0))
    if optimal > 0:
        return optimal, "compiler"
    flops, traffic = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    return calibration.compute_time(flops, traffic), "roofline"


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    return cost or {}


@dataclasses.dataclass(frozen=True)
class CompiledTime:
    """The compiler's per-device counts of one compiled program and the step time they price to:
    ``seconds = optimal_seconds + collective_s``."""

    flops: float
    bytes_accessed: float
    transcendentals: float
    optimal_seconds: float  # the kernels' seconds (see kernel_source)
    collective_s: float
    collectives: int  # collective instructions run per call
    kernel_source: str = "compiler"  # or "roofline": see kernel_seconds

    @property
    def seconds(self) -> float:
        return self.optimal_seconds + self.collective_s

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "seconds": self.seconds})


def compiled_time(
    compiled, calibration: Calibration, num_devices: int | None = None
) -> CompiledTime:
    """:class:`CompiledTime` of a ``jax`` ``Compiled`` (``jit(f).lower(...).compile()``)."""
    cost = _cost(compiled)
    if num_devices is None:
        num_devices = len(_devices_of(compiled, ())) or 1
    counted = counted_collectives(compiled.as_text())
    kernels, source = kernel_seconds(cost, calibration)
    return CompiledTime(
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        transcendentals=float(cost.get("transcendentals", 0.0)),
        optimal_seconds=kernels,
        collective_s=collective_seconds(counted, calibration, num_devices),
        collectives=sum(c.runs for c in counted),
        kernel_source=source,
    )
