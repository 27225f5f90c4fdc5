"""planner: split the work (iteration spaces) of a jitted program over a mesh.

Stage 1 (this package so far): :func:`analyze` turns a function into a :class:`Program` of loop
nests with access maps. Schedules and lowering come next.
"""

from planner.analyze import analyze
from planner.ir import Access, Loop, Op, Program, Value
from planner.lower import Lowered, lower
from planner.schedule import Schedule, make_schedule

__all__ = [
    "Access",
    "Loop",
    "Lowered",
    "Op",
    "Program",
    "Schedule",
    "Value",
    "analyze",
    "lower",
    "make_schedule",
]
