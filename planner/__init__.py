"""planner: split the work (iteration spaces) of a jitted program over a mesh.

:func:`analyze` turns a function into a :class:`Program` of loop nests with access maps;
``program.schedule(...)`` assigns mesh axes to loops (:class:`Schedule`); :func:`lower` runs it as
one SPMD program; :func:`simulate` predicts its time, bytes and peak memory (calibrated cost model,
``python -m experiments.calibrate``). :func:`plan` / :func:`auto_shard` search a schedule (:func:`search`) and run it,
within a memory limit (:mod:`planner.memory`). :func:`topology_mesh` / :func:`compiled_report` compile a
plan or any jitted program for a TPU topology on any host and read the compiler's verdict;
``plan.save(path)`` and :func:`load` keep a plan in a file and restore it without searching.
:func:`planner.baselines.expert_plans` gives the hand strategies (data parallelism, FSDP, FSDP +
tensor parallelism) as plans of the same kind, to compare with.
"""

from planner import baselines
from planner.analysis import analyze
from planner.auto import AutoPlan, auto_shard, plan
from planner.compiled import CompiledReport, compiled_report, topology_mesh
from planner.ir import Access, Loop, Op, Program, Value
from planner.lowering import Lowered, lower
from planner.memory import MEMORY_RESERVE, MemoryLimitError
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
    "baselines",
    "lower",
    "make_schedule",
    "Prediction",
    "simulate",
    "AutoPlan",
    "auto_shard",
    "load",
    "plan",
    "search",
    "CompiledReport",
    "MEMORY_RESERVE",
    "MemoryLimitError",
    "compiled_report",
    "topology_mesh",
]
