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


def _completed(prog, fixed: dict, order: str, remember: bool, settled: list) -> dict:
    shape = MeshShape.of(MESH)
    result = dict(fixed)
    real = schedule_mod._refine

    def counted(*args, **kwargs):
        settled.append(1)
        return real(*args, **kwargs)

    schedule_mod._refine = counted
    try:
        schedule_mod._propagate(prog, shape.factor_size, result, set(fixed), {}, True, order,
                                remember=remember)  # fmt: skip
    finally:
        schedule_mod._refine = real
    return result


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_remembering_settled_ops_completes_the_same_schedules(name):
    fn, make = PROGRAMS[name]
    prog = planner.analyze(fn, *make(np.random.default_rng(0)))
    rng = random.Random(name)
    fewer = 0
    for trial in range(6):
        assign = random_schedule(prog, MESH, rng, xla=True)
        named = {k: v for k, v in assign.items() if rng.random() < 0.3 and v}
        named.update(prog.manual_assignment)
        order = ORDERS[trial % len(ORDERS)]
        every, once = [], []
        want = _completed(prog, named, order, False, every)
        assert _completed(prog, named, order, True, once) == want
        fewer += len(once) < len(every)
    assert fewer or len(prog.ops) < 8  # where there is anything to skip, something was
