"""Stage 2, layouts: what a schedule implies, op by op, without devices or prices.

Takes a :class:`planner.program.Program` and a :class:`planner.program.Schedule`; gives its data
flow (:mod:`.dataflow`: per op the operands' layout changes as :class:`Move`s, the kernel's
layouts and pending reductions, as :class:`OpStep`s), the collectives that follow
(:mod:`.explanation`: :class:`Event`s), the layouts donated state keeps (:mod:`.donation`) and,
for scans run as pipelines, the stages' facts (:mod:`.staging`: which scans can, the layer axis
split around them, the runs of ops a pipeline repeats).

Example:
    >>> steps = dataflow(prog, sched)                                # doctest: +SKIP
    >>> [m.value.name for s in steps for m in s.moves]
"""

from planner.layout.dataflow import Move, OpStep, dataflow
from planner.layout.explanation import Event, events

__all__ = ["Event", "Move", "OpStep", "dataflow", "events"]
