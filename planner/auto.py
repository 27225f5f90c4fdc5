"""``plan`` and ``auto_shard``: search a schedule for a function, then run it.

Example:
    >>> p = planner.plan(step_fn, params, batch, mesh=mesh)        # doctest: +SKIP
    >>> print(p.explain()); p.in_specs; p.to_json()
    >>> fast = planner.auto_shard(step_fn, mesh=mesh)              # plans once per input shapes
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from planner.analysis import analyze
from planner.dataflow import dataflow, input_spec
from planner.ir import Program
from planner.lowering import Lowered, lower
from planner.schedule import Schedule, Spec
from planner.schedule_search import search
from redist.calibration import Calibration
from redist.types import DistType, MeshShape


def _user_spec(spec: Spec, shape, mesh: MeshShape) -> PartitionSpec:
    """Factor-level spec -> PartitionSpec over the user's axes (factors merged where whole)."""
    axes = [tuple(reversed(a)) for a in spec]
    t = DistType.from_axes(shape, axes, mesh)
    return PartitionSpec(*t.to_spec(mesh))


@dataclasses.dataclass
class AutoPlan:
    """A searched schedule with its prediction; callable (lowers on first use)."""

    program: Program
    schedule: Schedule
    prediction: object
    mesh: object
    search_s: float
    in_tree: object
    out_tree: object

    @functools.cached_property
    def lowered(self) -> Lowered:
        return lower(self.program, self.schedule, self.mesh)

    @property
    def in_specs(self):
        m = MeshShape.of(dict(self.mesh.shape))
        specs = [_user_spec(input_spec(self.program, self.schedule, v), v.shape, m)
                 for v in self.program.inputs]  # fmt: skip
        return jax.tree.unflatten(self.in_tree, specs)

    @property
    def out_specs(self):
        m = MeshShape.of(dict(self.mesh.shape))
        final = {}
        for step in dataflow(self.program, self.schedule):
            for r, s in zip(step.op.results, step.out_specs):
                final[r.value.name] = s
        specs = [
            _user_spec(final.get(v.name, ((),) * len(v.shape)), v.shape, m)
            for v in self.program.outputs
        ]
        return jax.tree.unflatten(self.out_tree, specs)

    def __call__(self, *args):
        outs = self.lowered(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return jax.tree.unflatten(self.out_tree, list(outs))

    def explain(self) -> str:
        head = f"{self.prediction}; search {self.search_s:.2f} s"
        return head + "\n" + self.lowered.explain()

    def to_json(self) -> str:
        return json.dumps({
            "prediction": {
                "time_s": self.prediction.time_s,
                "comm_bytes": self.prediction.comm_bytes,
                "peak_bytes": self.prediction.peak_bytes,
            },
            "search_s": self.search_s,
            "schedule": {op: {lp: list(ax) for lp, ax in loops.items()}
                         for op, loops in self.schedule.assign.items() if loops},
            "ops": self.lowered.explain_json(),
        }, indent=2)  # fmt: skip


def plan(
    fn: Callable,
    *args,
    mesh,
    memory_limit_bytes: int | None = None,
    calibration: Calibration | None = None,
) -> AutoPlan:
    """Analyse ``fn`` on ``args``, search the best schedule on ``mesh``, return the plan."""
    prog = analyze(fn, *args)
    start = time.perf_counter()
    sched, pred = search(prog, mesh, calibration, memory_limit_bytes)
    elapsed = time.perf_counter() - start
    in_tree = jax.tree.structure(args)
    out_tree = jax.tree.structure(jax.eval_shape(fn, *args))
    return AutoPlan(prog, sched, pred, mesh, elapsed, in_tree, out_tree)


def auto_shard(fn: Callable, *, mesh, memory_limit_bytes: int | None = None) -> Callable:
    """``fn`` planned on its first call for each input structure, shapes and dtypes, then run."""
    plans: dict = {}

    def wrapped(*args):
        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
        if key not in plans:
            plans[key] = plan(fn, *args, mesh=mesh, memory_limit_bytes=memory_limit_bytes)
        return plans[key](*args)

    wrapped.plans = plans
    return wrapped
