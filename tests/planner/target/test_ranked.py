"""planner.plan(..., rank_by="compiled"): the compiler ranks the few best candidates
(planner.target.ranked)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import planner
from planner.solver.ties import best_of
from planner.target import ranked as ranked_module
from planner.target.compiled import input_structs
from planner.target.compiled_time import compiled_time


def step(params, batch):
    def loss(p):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), value


def _inputs():
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(64, 128)).astype(np.float32),
              "w2": rng.normal(size=(128, 32)).astype(np.float32)}  # fmt: skip
    batch = (rng.normal(size=(1024, 64)).astype(np.float32),
             rng.normal(size=(1024, 32)).astype(np.float32))  # fmt: skip
    return params, batch


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def _assert_exact(p, params, batch):
    got, want = p(params, batch), jax.jit(step)(params, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_the_plan_is_the_fastest_compiled_candidate_and_exact(mesh):
    """Every candidate compiled once (the search's plan first, the same layout once), the one
    chosen the best of their compiled prices (ties as the search breaks them), priced again from
    its own compile to the same seconds, and computing the unsharded step."""
    params, batch = _inputs()
    p = planner.plan(step, params, batch, mesh=mesh, rank_by="compiled")
    rows = p.compiled_ranking
    assert rows[0].label == "this plan" and len(rows) >= 2
    assert len({r.label for r in rows}) == len(rows) and sum(r.chosen for r in rows) == 1
    scores = [(r.compiled_s, r.compiled_bytes, i, r) for i, r in enumerate(rows)]
    assert best_of(scores)[3].chosen
    chosen = next(r for r in rows if r.chosen)
    compiled = p.jit().lower(*input_structs(p)).compile()
    again = compiled_time(compiled, p.calibration, 8).seconds
    assert again == pytest.approx(chosen.compiled_s, rel=1e-9)
    assert p.prediction.time_s == pytest.approx(chosen.predicted_s)
    assert "ranked by compiling" in p.explain()
    _assert_exact(p, params, batch)


def test_the_compilers_order_not_the_models_chooses(mesh, monkeypatch):
    """Where a candidate the model prices slower compiles faster, it is the plan, and exact."""
    params, batch = _inputs()
    model = planner.plan(step, params, batch, mesh=mesh)
    priced = {}

    def reversed_price(compiled, plan):  # the slower predicted, the faster compiled
        priced[plan.prediction.time_s] = 1.0 / plan.prediction.time_s
        return priced[plan.prediction.time_s]

    monkeypatch.setattr(ranked_module, "compiled_seconds", reversed_price)
    p = planner.plan(step, params, batch, mesh=mesh, rank_by="compiled")
    chosen = next(r for r in p.compiled_ranking if r.chosen)
    slowest = max(p.compiled_ranking, key=lambda r: r.predicted_s)
    assert chosen is slowest and chosen.label != "this plan"
    assert p.prediction.time_s > model.prediction.time_s
    _assert_exact(p, params, batch)


def test_a_candidate_the_compiler_refuses_is_left_out_with_a_warning(mesh, monkeypatch):
    params, batch = _inputs()
    model = planner.plan(step, params, batch, mesh=mesh)
    compile_and_report = ranked_module.plan_compile_and_report

    def refusing(plan):
        if plan is not model:
            raise RuntimeError("INTERNAL: refused")
        return compile_and_report(plan)

    monkeypatch.setattr(ranked_module, "plan_compile_and_report", refusing)
    with pytest.warns(UserWarning, match="the compiler refused .*RuntimeError"):
        p = ranked_module.ranked(model, None, None)
    assert p.schedule is model.schedule
    assert [r.note for r in p.compiled_ranking[1:]] == ["did not compile"] * (
        len(p.compiled_ranking) - 1)  # fmt: skip


def test_over_the_capacity_nothing_counts_and_the_models_plan_stands(mesh):
    params, batch = _inputs()
    model = planner.plan(step, params, batch, mesh=mesh)
    p = ranked_module.ranked(model, None, capacity=1)
    assert p.schedule is model.schedule and p.compiled_ranking[0].chosen
    assert all(math.isinf(r.compiled_s) and r.note == "over the memory limit"
               for r in p.compiled_ranking)  # fmt: skip


def test_an_unknown_ranking_is_refused_naming_the_argument(mesh):
    params, batch = _inputs()
    with pytest.raises(ValueError, match=r"rank_by='fastest'.*\['model', 'compiled'\]"):
        planner.plan(step, params, batch, mesh=mesh, rank_by="fastest")
