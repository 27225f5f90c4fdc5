"""Plans kept in files: what ``plan.save(path)`` writes and :func:`planner.load` checks.

A saved plan is plain JSON (``"format": "redist.planner.plan"``, ``"version": 1``): the schedule
(every op's loop -> mesh factor assignment, the inputs' layouts at rest), a fingerprint of the
program (a hash of its jaxpr's text without source information, the same in every process and on
every host), the arguments (pytree structure, shapes and dtypes, static values), the structure of
the outputs, the mesh's axis names and sizes, the calibration (its shipped name and its figures),
the prediction, and the remat candidate the planner chose (:mod:`planner.program.remat`), under
which :func:`planner.load` traces the function again. :func:`planner.load` traces the function again but does not search: it refuses,
with a ``ValueError`` saying what differs, another program, other arguments or another mesh.

Example:
    >>> p = planner.plan(step, *shapes, mesh=AbstractMesh((2, 2, 2), ("a", "b", "c")))  # doctest: +SKIP
    >>> p.save("step.plan.json")
    >>> q = planner.load("step.plan.json", step, *arrays, mesh=jax.make_mesh(...))  # elsewhere
    >>> q(*arrays)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax

from planner.calls import without_addresses
from planner.layout.staging import check_stages
from planner.program.ir import Program
from planner.program.remat import RematDecision
from planner.program.schedule import Schedule, Stages
from redist.calibration import Calibration
from redist.types import MeshShape

FORMAT = "redist.planner.plan"
VERSION = 1


def fingerprint(prog: Program) -> str:
    """A hash of the program's jaxpr as text, without source information or memory addresses."""
    text = prog.jaxpr.pretty_print(source_info=False, name_stack=False)
    return "sha256:" + hashlib.sha256(without_addresses(text).encode()).hexdigest()


def mesh_differences(planned: MeshShape, given: MeshShape) -> list[str]:
    """What differs between two meshes' axis names, order and sizes."""
    a, b = planned.axis_names, given.axis_names
    out = []
    if a != b:
        how = "in another order" if sorted(a) == sorted(b) else f"the plan's are {a}"
        out.append(f"mesh axes {b}, {how}")
    for name in a:
        if name in given.sizes and given.sizes[name] != planned.sizes[name]:
            out.append(
                f"mesh axis {name!r} has size {given.sizes[name]}, the plan's has "
                f"{planned.sizes[name]}"
            )
    return out


def _shipped_name(cal: Calibration) -> str | None:
    folder = os.path.join(os.path.dirname(__import__("redist").__file__), "calibrations")
    for name in sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".json")):
        if Calibration.named(name) == cal:
            return name
    return None


def prediction_record(pred) -> dict | None:
    if pred is None:
        return None
    return {"time_s": pred.time_s, "comm_bytes": pred.comm_bytes, "peak_bytes": pred.peak_bytes}


def document(plan) -> dict:
    """An :class:`planner.autoplan.AutoPlan` as plain data (what :func:`save` writes)."""
    sched, cal = plan.schedule, plan.calibration or Calibration.for_backend()
    return {
        "format": FORMAT,
        "version": VERSION,
        "jax_version": jax.__version__,
        "program": {
            "fingerprint": fingerprint(plan.program),
            "ops": [o.name for o in plan.program.ops],
        },
        "arguments": plan._signature.describe(),
        "outputs": str(plan.out_tree),
        "mesh": [[name, size] for name, size in plan.mesh_shape.axes],
        "calibration": {"name": _shipped_name(cal), "figures": json.loads(cal.to_json())},
        "prediction": prediction_record(plan.prediction),
        "replicated": prediction_record(plan.replicated),
        "search_s": plan.search_s,
        "remat": _remat_record(plan.remat),
        "schedule": {
            "assign": {
                op: {lp: list(axes) for lp, axes in loops.items()}
                for op, loops in sched.assign.items()
            },  # fmt: skip
            "stored": {name: [list(axes) for axes in spec] for name, spec in sched.stored.items()},
            "stages": [dataclasses.asdict(st) for st in sched.stages],
        },
    }


def _remat_record(remat) -> dict | None:
    if remat is None:
        return None
    costs = {n: None if v is None else list(v) for n, v in remat.candidates.items()}
    return {"chosen": remat.chosen, "candidates": costs}


def saved_remat(doc: dict) -> RematDecision | None:
    """The remat choice a saved plan was made with (:func:`_remat_record` read back)."""
    record = doc.get("remat")
    if record is None:
        return None
    costs = {n: None if v is None else tuple(v) for n, v in record["candidates"].items()}
    return RematDecision(record["chosen"], costs)


def save(plan, path: str) -> None:
    """Write ``plan`` to ``path`` as JSON (see the module docstring)."""
    with open(path, "w") as f:
        json.dump(document(plan), f, indent=1)
        f.write("\n")


def program_differences(doc: dict, prog: Program) -> str:
    saved, ours = doc["program"]["ops"], [o.name for o in prog.ops]
    if saved != ours:
        k = next(
            (k for k, (a, b) in enumerate(zip(saved, ours)) if a != b), min(len(saved), len(ours))
        )
        parts = [] if len(ours) == len(saved) else [f"has {len(ours)} ops, the plan's {len(saved)}"]
        here = repr(ours[k]) if k < len(ours) else "missing"
        parts.append(f"op {k} is {here}, the plan's is {saved[k]!r}" if k < len(saved) else
                     f"op {k} is {here}, the plan has none")  # fmt: skip
        how = "; ".join(parts)
    else:
        how = "has the same ops, with other parameters, literals or constants' shapes"
    if doc.get("jax_version") != jax.__version__:
        how += f" (the plan was saved with jax {doc.get('jax_version')}, this is {jax.__version__})"
    return how


def saved_schedule(doc: dict, prog: Program, shape: MeshShape) -> Schedule:
    sizes = shape.factor_size
    ops = {o.name: o for o in prog.ops}
    assign = {}
    for name, loops in doc["schedule"]["assign"].items():
        op = ops.get(name)
        if op is None or any(lp not in op.loop for lp in loops):
            raise ValueError(f"the saved schedule names op {name!r} or its loops {sorted(loops)}, "
                             "which the program lacks")  # fmt: skip
        assign[name] = {lp: tuple(axes) for lp, axes in loops.items()}
    stored = {name: tuple(tuple(axes) for axes in spec)
              for name, spec in doc["schedule"]["stored"].items()}  # fmt: skip
    used = {a for loops in assign.values() for axes in loops.values() for a in axes}
    used |= {a for spec in stored.values() for axes in spec for a in axes}
    if used - set(sizes):
        raise ValueError(f"the saved schedule uses mesh factors {sorted(used - set(sizes))}, "
                         f"which {shape} lacks")  # fmt: skip
    stages = tuple(Stages(**st) for st in doc["schedule"].get("stages", ()))
    sched = Schedule(prog, sizes, assign, stored, stages)
    check_stages(prog, sched)
    return sched
