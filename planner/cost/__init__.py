"""Stage 3, prices: a schedule's time, bytes and peak memory per device, predicted (pure, no JAX).

Takes a program, a schedule and a :class:`redist.calibration.Calibration`; gives a
:class:`Prediction` (:mod:`.simulator`) from each op's flops and bytes (:mod:`.costs`), the
buffers the compiler keeps and when (:mod:`.buffers`), the layout changes' collectives (priced as
``redist`` plans) and GPipe's arithmetic for pipelined scans (:mod:`.pipeline`). :mod:`.memory`
holds the memory limit a search stays under and :class:`MemoryLimitError`.

Example:
    >>> pred = simulate(prog, sched, Calibration.named("tpu_v5p"))   # doctest: +SKIP
    >>> pred.time_s, pred.peak_bytes
"""

from planner.cost.memory import MEMORY_RESERVE, MemoryLimitError
from planner.cost.simulator import Peak, Prediction, peak_buffers, simulate

__all__ = ["MEMORY_RESERVE", "MemoryLimitError", "Peak", "Prediction", "peak_buffers", "simulate"]
