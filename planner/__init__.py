"""planner: split the work (iteration spaces) of a jitted program over a mesh.

:func:`analyze` turns a function into a :class:`Program` of loop nests with access maps;
``program.schedule(...)`` assigns mesh axes to loops (:class:`Schedule`); :func:`lower` runs it as
one SPMD program; :func:`simulate` predicts its time, bytes and peak memory (calibrated cost model,
``python -m experiments.calibrate``). :func:`plan` / :func:`auto_shard` search a schedule
(:func:`search`) and run it, within a memory limit (:mod:`planner.cost.memory`).
:func:`topology_mesh` / :func:`compiled_report` compile a plan or any jitted program for a TPU
topology on any host and read the compiler's verdict (:func:`gpu_mesh`: for a multi-GPU host); ``plan.save(path)`` and :func:`load` keep a
plan in a file and restore it without searching. :func:`remat_policy` is a ``jax.checkpoint``
policy the planner chooses (what each layer saves for the backward pass). :func:`expert_plans` gives the hand strategies
(data parallelism, FSDP, FSDP + tensor parallelism) as plans of the same kind, to compare with;
:func:`price` the layout the program already asks for (its sharding constraints and its inputs'
shardings) as a plan, predicted on the same model.

The stages, each a package importing only those before it:

1. :mod:`planner.program`: the function as a :class:`Program`, and the schedules valid for it;
2. :mod:`planner.layout`: what a schedule implies (data flow, collectives, donation, stages);
3. :mod:`planner.cost`: its predicted time and memory (pure, no JAX);
4. :mod:`planner.solver` (the search) and :mod:`planner.lowering` (running a schedule);
5. here, the user's objects: :func:`plan`, :class:`AutoPlan` (:mod:`planner.autoplan`), calls
   (:mod:`planner.calls`), saved plans (:mod:`planner.persistence`), the summary
   (:mod:`planner.report`), compiled reports (:mod:`planner.target.compiled`,
   :mod:`planner.target.compiled_time`) and the experts' plans (:mod:`planner.baselines`).
"""

import importlib

from planner import baselines
from planner.auto import auto_shard, load, plan, price
from planner.autoplan import AutoPlan
from planner.baselines import expert_plans
from planner.cost import MEMORY_RESERVE, MemoryLimitError, Prediction, simulate
from planner.lowering import Lowered, lower
from planner.program import Access, Loop, Op, Program, Schedule, Value, analyze, make_schedule
from planner.program.remat import RematChoice, remat_policy
from planner.solver import search
from planner.target import CompiledReport, compiled_report, gpu_mesh, topology_mesh
from redist import moved

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
    "RematChoice",
    "remat_policy",
    "simulate",
    "AutoPlan",
    "auto_shard",
    "expert_plans",
    "load",
    "plan",
    "price",
    "search",
    "CompiledReport",
    "MEMORY_RESERVE",
    "MemoryLimitError",
    "compiled_report",
    "gpu_mesh",
    "topology_mesh",
]


def __getattr__(name: str):
    """Modules that moved into the stages' packages, read as attributes (``planner.compiled``),
    with a ``DeprecationWarning`` naming the new place (``redist.moved``)."""
    old = f"planner.{name}"
    if old not in moved.MOVED_MODULES:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    return importlib.import_module(old)
