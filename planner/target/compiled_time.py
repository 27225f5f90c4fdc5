"""A compiled program's step time as the calibration prices it: the compiler's own estimate of its
kernels (``cost_analysis()["optimal_seconds"]``) plus every collective of its optimized HLO at
the calibration's latency + wire bytes / bandwidth, counted as often as it runs (a collective in a
loop body times the loop's trip count; a ragged all-to-all, MaxText's expert dispatch, as an
all-to-all of the smaller of its buffers: :func:`redist.hlo.ragged_bytes`). This is the
reference the simulator's predicted time is checked against (``experiments/time_check.py``).

Where ``optimal_seconds`` is not positive (libtpu's v6e estimate reads negative, e.g. -20 s for
one layer of a 134 M-parameter LM on v6e:16x16), the kernels are priced by the calibration's
roofline of the compiler's own ``flops`` and ``bytes accessed`` instead (:func:`kernel_seconds`).

Off TPUs, and wherever the compiler gives no cost analysis (XLA:GPU's is None for compile-only
devices, :func:`planner.gpu_mesh`; on a real GPU it leaves out cuBLAS's matmuls and its
``optimal_seconds`` reads negative; XLA:CPU's has no ``optimal_seconds`` and counts a loop's body
once), the kernels are priced from the optimized HLO itself
(:func:`hlo_kernel_seconds`, ``kernel_source="roofline(hlo)"``): each kernel
(:func:`redist.hlo.hlo_kernels`) at the calibration's roofline of its matmuls' flops, at the rate
of their dtype and size (:meth:`~redist.calibration.Calibration.dense_rate`, as the simulator
prices them), and the bytes it reads and writes, plus its launch (``kernel_s``), as often as it
runs. Other flops (elementwise, reductions) are left out: memory traffic bounds those kernels.

The compiler's ``optimal_seconds`` (and its ``flops`` and ``bytes accessed``) count a loop's body
once whatever its trip count: compile a scanned program with the scan unrolled (``unroll=True``)
to have every layer counted. The HLO's counts run a loop's body its trip count times.

Example:
    >>> compiled = jax.jit(f).lower(*structs).compile()                    # doctest: +SKIP
    >>> compiled_time(compiled, Calibration.named("tpu_v5p")).seconds    # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json

from planner.target.compiled import _devices_of
from redist.calibration import Calibration
from redist.collectives import CollectiveKind
from redist.hlo import (
    KINDS,
    CountedCollective,
    Kernel,
    counted_collectives,
    hlo_kernels,
    kernel_counts,
)

COST_ANALYSIS_PLATFORMS = ("tpu",)  # whose cost_analysis() prices the kernels (optimal_seconds)


def collective_seconds(
    collectives, calibration: Calibration, num_devices: int, crosses: bool = False
) -> float:
    """Seconds of ``collectives`` (:class:`CountedCollective`\\ s, or :class:`redist.hlo.CollectiveKind`\\ s
    counted once) at the calibration's prices; a group of unstated size is all ``num_devices``.
    The HLO states each collective's result per device; the calibration prices a reduce-scatter
    by its input (the result times the group)."""
    total = 0.0
    for c in collectives:
        coll, runs = (c.collective, c.runs) if isinstance(c, CountedCollective) else (c, 1)
        if coll.kind not in KINDS:
            continue
        n = coll.group_size or num_devices
        nbytes = coll.bytes * n if coll.kind == CollectiveKind.REDUCE_SCATTER else coll.bytes
        total += runs * calibration.collective_time(coll.kind, nbytes, n, crosses)
    return total


def hlo_kernel_seconds(kernels: tuple[Kernel, ...], calibration: Calibration) -> float:
    """Seconds of ``kernels`` (:func:`redist.hlo.hlo_kernels`), each as often as it runs, at the
    calibration's roofline: the slower of its matmuls (each at
    :meth:`~redist.calibration.Calibration.dense_rate` of its dtype, precision and flops) and its
    bytes read and written, plus ``kernel_s`` for its launch.

    Example:
        >>> k = Kernel("gemm", "fusion", runs=4, read_bytes=2**25, written_bytes=2**24,
        ...            dots=(("bfloat16", 2 * 4096.0**3),))
        >>> round(hlo_kernel_seconds((k,), Calibration.named("h100_sxm")) * 1e3, 3)  # 4 x 0.196 ms
        0.786
    """
    total = 0.0
    for k in kernels:
        flops = dense_s = 0.0
        for key, f in k.dots:
            dtype, _, precision = key.partition(":")
            flops += f
            dense_s += f / calibration.dense_rate(dtype, precision or "default", f)
        rate = flops / dense_s if dense_s else None
        seconds = calibration.compute_time(flops, k.read_bytes, k.written_bytes, rate)
        total += k.runs * (seconds + calibration.kernel_s)
    return total


def kernel_seconds(cost: dict, calibration: Calibration) -> tuple[float, str]:
    """The kernels' seconds of a compiled program from its ``cost_analysis()``, and where they come
    from: ``"compiler"`` (its ``optimal_seconds``), or ``"roofline"`` where that is not positive
    (the calibration's :meth:`~redist.calibration.Calibration.compute_time` of its ``flops`` and
    ``bytes accessed``). Off TPUs and without a cost analysis :func:`compiled_time` prices the
    HLO's kernels instead (:func:`hlo_kernel_seconds`).

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
    ``seconds = optimal_seconds + collective_s``. Where the kernels are priced from the HLO
    (``kernel_source="roofline(hlo)"``), ``flops`` are its matmuls' and ``bytes_accessed`` its
    kernels' reads and writes, loops counted by their trips (:func:`redist.hlo.hlo_kernels`)."""

    flops: float
    bytes_accessed: float
    transcendentals: float
    optimal_seconds: float  # the kernels' seconds (see kernel_source)
    collective_s: float
    collectives: int  # collective instructions run per call
    kernel_source: str = "compiler"  # or "roofline", "roofline(hlo)": see kernel_seconds

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
    devices = _devices_of(compiled, ())
    if num_devices is None:
        num_devices = len(devices) or 1
    text = compiled.as_text()
    counted = counted_collectives(text)
    priced_by_compiler = not devices or devices[0].platform in COST_ANALYSIS_PLATFORMS
    if not (priced_by_compiler and cost):  # XLA:GPU's leaves out cuBLAS, XLA:CPU's loops
        found = hlo_kernels(text)
        kernels, source = hlo_kernel_seconds(found, calibration), "roofline(hlo)"
        counts = kernel_counts(found)
        flops, traffic = counts.flops, counts.bytes_accessed
    else:
        kernels, source = kernel_seconds(cost, calibration)
        flops = float(cost.get("flops", 0.0))
        traffic = float(cost.get("bytes accessed", 0.0))
    return CompiledTime(
        flops=flops,
        bytes_accessed=traffic,
        transcendentals=float(cost.get("transcendentals", 0.0)),
        optimal_seconds=kernels,
        collective_s=collective_seconds(counted, calibration, num_devices),
        collectives=sum(c.runs for c in counted),
        kernel_source=source,
    )
