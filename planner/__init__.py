"""planner: split the work (iteration spaces) of a jitted program over a mesh.

:func:`analyze` turns a function into a :class:`Program` of loop nests with access maps;
``program.schedule(...)`` assigns mesh axes to loops (:class:`Schedule`); :func:`lower` runs it as
one SPMD program; :func:`simulate` predicts its time, bytes and peak memory (calibrated cost model,
``python -m experiments.calibrate``). :func:`plan` / :func:`auto_shard` search a schedule (:func:`search`) and run it;
``plan.save(path)`` and :func:`load` keep it in a file and restore it without searching.
"""

from planner.analysis import analyze
from planner.auto import AutoPlan, auto_shard, plan
from planner.ir import Access, Loop, Op, Program, Value
from planner.lowering import Lowered, lower
from planner.persistence import load
from planner.schedule import Schedule, make_schedule
from planner.schedule_search import search
from planner.simulator import Prediction, simulate

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
    "Prediction",
    "simulate",
    "AutoPlan",
    "auto_shard",
    "load",
    "plan",
    "search",
]
