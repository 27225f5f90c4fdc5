"""planner: split the work (iteration spaces) of a jitted program over a mesh.

Stage 1 (this package so far): :func:`analyze` turns a function into a :class:`Program` of loop
nests with access maps. Schedules and lowering come next.
"""

from planner.analyze import analyze
from planner.ir import Access, Loop, Op, Program, Value

__all__ = ["Access", "Loop", "Op", "Program", "Value", "analyze"]
