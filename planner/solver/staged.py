"""Searching a pipelined schedule: the layers on the other mesh axes, then the microbatch count.

:func:`search_staged` searches the program on every mesh axis but the pipeline's
(:func:`planner.solver.schedule_search.search`), pipelines the result for each microbatch count
(:func:`planner.layout.staging.staged`) and searches again with the best count's pipeline priced,
keeping the fastest that fits the memory limit.

Example:
    >>> sched, pred = search_staged(prog, {"pipe": 4, "data": 2}, cal, None, "pipe")  # doctest: +SKIP
    >>> sched.stages
    (Stages(region=37, axis='pipe', microbatches=8),)
"""

from __future__ import annotations

from planner.cost.memory import MemoryLimitError
from planner.cost.simulator import simulate
from planner.layout.donation import keep_state_layouts
from planner.layout.staging import microbatch_choices, repeat_choices, staged
from planner.program.ir import Program
from planner.program.schedule import Schedule
from planner.solver.schedule_search import search
from redist.specs import mesh_shape
from redist.types import MeshShape


def search_staged(prog: Program, mesh: MeshShape | dict[str, int], calibration, memory_limit_bytes,
                  axis: str, microbatches=None, repeats=None):  # fmt: skip
    """The best pipelined schedule over mesh axis ``axis``, ``(schedule, prediction)``, or
    ``None`` when no scan can be pipelined or nothing fits ``memory_limit_bytes``.

    The layers (and the rest of the program) are searched on the other mesh axes
    (:func:`planner.solver.schedule_search.search`), first priced unpipelined; each microbatch count
    of :func:`microbatch_choices` and circular repeat count of :func:`repeat_choices` pipelines
    that schedule (:func:`staged`, donated state stored as it leaves the step). The search then
    runs again with every candidate priced as the pipeline of the best choice so far (the fastest
    layouts of a layer differ inside a pipeline, where a layer's weights and gradient sums travel
    on every tick), and the fastest that fits is kept."""
    shape = mesh_shape(mesh)
    sizes = shape.sizes
    if axis not in sizes:
        raise ValueError(f"pipeline_axis {axis!r} is not a mesh axis; the mesh has {list(sizes)}")
    others = {a: n for a, n in sizes.items() if a != axis}
    factors = shape.factor_size

    def pipelined(sched: Schedule, k: int, reps: int) -> Schedule | None:
        full = Schedule(prog, factors, sched.assign, sched.stored)
        out = staged(prog, full, axis, k, reps)
        return None if out is None else keep_state_layouts(prog, out)

    best = None

    def consider(base: Schedule, k: int, reps: int) -> None:
        nonlocal best
        sched = pipelined(base, k, reps)
        if sched is None:
            return
        pred = simulate(prog, sched, calibration)
        fits = memory_limit_bytes is None or pred.peak_bytes <= memory_limit_bytes
        if fits and (best is None or pred.time_s < best[1].time_s):
            best = (sched, pred, (k, reps))

    try:
        base, _ = search(prog, others or {"_": 1}, calibration, None, xla=False)
    except MemoryLimitError:
        return None
    choices = [(k, reps) for k in microbatch_choices(sizes[axis], microbatches)
               for reps in repeat_choices(repeats)]  # fmt: skip
    for k, reps in choices:
        consider(base, k, reps)
    k, reps = best[2] if best else (choices[-1][0], 1)
    try:
        again, _ = search(prog, others or {"_": 1}, calibration, memory_limit_bytes,
                          priced_as=lambda s: pipelined(s, k, reps) or s, xla=False)  # fmt: skip
    except MemoryLimitError:
        again = None
    if again is not None:
        for k, reps in choices:
            consider(again, k, reps)
    return None if best is None else best[:2]
