"""Propagation remembers the ops that settled unchanged (``_propagate``'s ``remember``): the
schedules it completes are the ones settling every op in every round completes."""

import random

import numpy as np
import pytest
from planner_programs import PROGRAMS, random_schedule

import planner
from planner.program import schedule as schedule_mod
from planner.program.schedule import ORDERS
from redist.types import MeshShape

MESH = {"a": 2, "b": 4}


def _completed(prog, fixed: dict, order: str, remember: bool) -> dict:
    result = dict(fixed)
    schedule_mod._propagate(prog, MeshShape.of(MESH).factor_size, result, set(fixed), {}, True,
                            order, remember=remember)  # fmt: skip
    return result


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_remembering_settled_ops_completes_the_same_schedules(name, monkeypatch):
    settled = []  # one entry per call of the backward pass's refinement
    real = schedule_mod._refine
    monkeypatch.setattr(schedule_mod, "_refine", lambda *a, **k: settled.append(1) or real(*a, **k))
    fn, make = PROGRAMS[name]
    prog = planner.analyze(fn, *make(np.random.default_rng(0)))
    rng = random.Random(name)
    fewer = 0
    for trial in range(6):
        assign = random_schedule(prog, MESH, rng, xla=True)
        named = {k: v for k, v in assign.items() if rng.random() < 0.3 and v}
        named.update(prog.manual_assignment)
        order = ORDERS[trial % len(ORDERS)]
        want = _completed(prog, named, order, False)
        every = len(settled)
        assert _completed(prog, named, order, True) == want
        fewer += len(settled) - every < every
        settled.clear()
    assert fewer or len(prog.ops) < 8  # where there is anything to skip, something was
