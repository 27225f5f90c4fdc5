"""Stage 1, the program: a jitted function as loop nests, and the schedules valid for it.

Takes a function and example arguments (arrays or ``jax.ShapeDtypeStruct``s); gives a
:class:`Program` (:mod:`.ir`): its ops as loop nests with access maps (:mod:`.ops`), written by
the rules of the core primitives (:mod:`.rules`, :mod:`.halo` for windows, :mod:`.discover` for
the others), scans and loops marked as regions (:mod:`.jaxpr_params` reads them on every JAX),
and which scans may run as pipelines (:mod:`.microbatch`). A :class:`Schedule`
(:mod:`.schedule`) assigns mesh factors to the program's loops; ``program.schedule(...)``
checks one and fills in the rest by propagation.

Example:
    >>> prog = analyze(lambda x, w: jnp.tanh(x @ w), x, w)          # doctest: +SKIP
    >>> sched = prog.schedule({"dot_general_0": {"m": "a"}}, mesh)
"""

from planner.program.analysis import analyze
from planner.program.ir import Program
from planner.program.ops import Access, Loop, Op, Region, Value
from planner.program.schedule import Schedule, Stages, make_schedule

__all__ = [
    "Access",
    "Loop",
    "Op",
    "Program",
    "Region",
    "Schedule",
    "Stages",
    "Value",
    "analyze",
    "make_schedule",
]
