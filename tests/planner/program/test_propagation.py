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


def _head(x, w):
    """Logits (squashed), their maximum over the vocabulary, and their exponential."""
    import jax.numpy as jnp

    logits = jnp.tanh(x @ w)
    return logits.max(-1), jnp.exp(logits)


@pytest.mark.parametrize("order", ORDERS)
def test_a_reduction_splits_as_its_operand_arrives_split_later(order):
    """The logits' split over the vocabulary arrives from a later op (their exponential, split
    so) after their maximum settled on the batch's split: the maximum then splits its reduced loop as they arrive
    (partial maxima combined, as XLA partitions a reduce), rather than gathering the logits; the
    schedule runs exactly."""
    import jax
    from jax.sharding import AxisType

    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (8, 32)))
    prog = planner.analyze(_head, x, w)
    exp = next(o for o in prog.ops if o.primitive == "exp")
    sizes = {"a": 2, "b": 4}
    factors = MeshShape.of(sizes)
    pinned = {exp.name: {exp.loops[0].name: factors.axis_factors("a"),
                         exp.loops[1].name: factors.axis_factors("b")}}  # fmt: skip
    stored = {prog.inputs[0].name: (("a",), ())}  # the batch split: the maximum settles early
    sched = planner.program.schedule.make_schedule(prog, pinned, sizes, stored=stored, xla=True,
                                                   order=order)  # fmt: skip
    top = next(o for o in prog.ops if o.primitive == "reduce_max")
    (reduced,) = [name for name, _ in top.reductions]
    assert sched.assign[top.name].get(reduced) == factors.axis_factors("b")
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    got = planner.lower(prog, sched, mesh, backend="xla")(x, w)
    for g, want in zip(got, jax.jit(_head)(x, w), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-5)
