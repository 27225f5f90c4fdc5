"""The one-screen summary that ``AutoPlan.explain()`` opens with (planner/report/)."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import planner
from planner.report import summarize
from planner.report.leaves import classify
from planner.report.words import spec_text, split_words
from redist.types import MeshShape

SECTIONS = ("Prediction per step", "Layouts of the inputs", "Heavy ops", "Collectives per step",
            "Memory per device", "Runs whole on every device")  # fmt: skip
TX = optax.adam(1e-3)


def _mlp(params, x):
    for i in range(len(params)):
        p = params[f"layer{i}"]
        x = x @ p["kernel"] + p["bias"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def _train_step(params, opt_state, batch):
    def loss_fn(params):
        return jnp.mean((_mlp(params, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _args(sizes=(64, 256, 256, 32), batch=64):
    rng = np.random.default_rng(0)
    params = {
        f"layer{i}": {"kernel": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
                      "bias": jnp.zeros((b,), jnp.float32)}
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))
    }  # fmt: skip
    data = {"x": jnp.asarray(rng.standard_normal((batch, sizes[0])), jnp.float32),
            "y": jnp.asarray(rng.standard_normal((batch, sizes[-1])), jnp.float32)}  # fmt: skip
    return params, TX.init(params), data


@pytest.fixture(scope="module")
def plan():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    return planner.plan(_train_step, *_args(), mesh=mesh)


def test_summary_has_its_sections_in_order_in_one_screen(plan):
    text = plan.explain()
    lines = text.splitlines()
    assert len(lines) <= 45, text
    starts = [next(k for k, line in enumerate(lines) if line.startswith(s)) for s in SECTIONS]
    assert starts == sorted(starts), text
    for name in ("full replication", "data parallelism", "FSDP"):
        row = next(line for line in lines if line.lstrip().startswith(name))
        assert re.search(r"this plan \d+\.\d\dx as fast", row), row


def test_summary_speaks_pytree_paths_and_the_users_axis_names(plan):
    text = plan.explain()
    assert "params['layer0']['kernel']" in text and "batch['x']" in text
    assert "opt_state[0].count" in text
    assert "opt_state[0].mu, opt_state[0].nu" in text and "as params" in text  # written once
    assert "#" not in text and "model_0" not in text  # no prime factors
    names = set(re.findall(r"'(\w+)'", " ".join(re.findall(r"P\([^\n]*\)", text))))
    assert names <= {"data", "model"}, names


def test_heavy_ops_name_the_lines_of_this_file(plan):
    lines = plan.explain().splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("Heavy ops"))
    stop = next(k for k, line in enumerate(lines) if line.startswith("Collectives"))
    heavy = lines[start + 1 : stop]
    assert 1 <= len(heavy) <= 8
    source = open(__file__).read().splitlines()
    me = os.path.basename(__file__)
    for line in heavy:
        found = re.search(re.escape(me) + r":(\d+)", line)
        assert found, line
        assert 0 < int(found.group(1)) <= len(source)
    assert any("dot_general" in line and "over" in line for line in heavy)
    # the optimizer's arithmetic is reported at the user's TX.update line, inside optax
    update = next(k for k, s in enumerate(source, 1) if "TX.update(grads" in s)
    ops = plan.program.ops
    assert any(o.source and o.source[1:] == (update, "optax") for o in ops)


def test_summary_numbers_add_up(plan):
    s = summarize(plan)
    total = sum(c["bytes"] for k, c in s.collectives.items() if k != "copy")
    assert total == pytest.approx(plan.prediction.comm_bytes, rel=1e-9, abs=1e-6)
    mem = s.memory
    parts = sum(mem.get(k, 0) for k in ("parameters", "optimizer state", "batch", "rest_bytes"))
    assert parts == mem["peak_bytes"] == plan.prediction.peak_bytes
    assert mem["optimizer state"] == 2 * mem["parameters"] + 4  # mu, nu and the count
    data = json.loads(json.dumps(s.as_dict()))
    assert {r["name"].split(" (")[0] for r in data["prediction"]} == {
        "this plan", "full replication", "data parallelism", "FSDP", "FSDP x tensor"}  # fmt: skip
    assert plan.explain(verbose=True).startswith(plan.explain())
    assert "grid" in plan.explain(verbose=True)


def test_inputs_are_classified_by_what_the_step_returns(plan):
    kinds = {leaf.path: leaf.kind for leaf in classify(plan.program, plan.in_tree, plan.out_tree)}
    assert kinds["params['layer1']['kernel']"] == "parameters"
    assert kinds["opt_state[0].mu['layer1']['kernel']"] == "optimizer state"
    assert kinds["opt_state[0].count"] == "optimizer state"
    assert kinds["batch['y']"] == "batch"


def test_parts_of_axes_are_said_in_words():
    m = MeshShape.of({"data": 2, "model": 4, "c": 8})
    assert spec_text((("model#0",), ("data", "model#1"), ()), m) == (
        "P(major half of 'model', ('data', minor half of 'model'))")  # fmt: skip
    assert spec_text((("c#1", "c#2"),), m) == "P(minor half of 'c')"
    assert spec_text((("c#1",),), m) == "P(a middle quarter of 'c')"
    assert spec_text(((), ()), m) == "P()"
    assert split_words(("data", "model#0", "model#1"), m) == "data and model"


def test_a_strategy_that_does_not_apply_says_so():
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((6, 32), (32, 16))]
    p = planner.plan(lambda x, w: jnp.tanh(x @ w), *args, mesh={"a": 4})
    text = p.explain()
    assert "data parallelism (4-way batch)" in text and "n/a: the batch does not split" in text
    assert "Plan for <lambda> on a:4" in text


def test_a_batch_of_a_parameters_shape_is_not_state():
    """``sgd(params, x)`` returns ``params``; ``x`` has ``w2``'s shape but is not returned: two
    state arrays, not three."""
    from planner.report.leaves import state_pairs

    def sgd(params, x):
        def loss(p):
            return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])

        return jax.tree.map(lambda w, g: w - 0.1 * g, params, jax.grad(loss)(params))

    f = jax.ShapeDtypeStruct
    params = {"w1": f((64, 256), jnp.float32), "w2": f((256, 64), jnp.float32)}
    p = planner.plan(sgd, params, f((256, 64), jnp.float32), mesh={"data": 2, "model": 4})
    assert state_pairs(p.program, p.in_tree, p.out_tree) == [(0, 0), (1, 1)]
    kinds = [leaf.kind for leaf in classify(p.program, p.in_tree, p.out_tree)]
    assert kinds == ["parameters", "parameters", "batch"]
    text = p.explain()
    assert "of the 3 state arrays" not in text
    assert "the state it returns keeps these layouts" in text or "of the 2 state arrays" in text


def test_a_keras_style_optimizer_state_is_named_by_its_shapes():
    """Keras keeps the optimizer's variables in a list beside the weights (no optax type, no
    key to read): the part of the state that repeats the weights' shapes is optimizer state."""

    def step(state, x):
        (w1, w2), (count, m1, m2, v1, v2) = state
        g1 = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) @ w2))(w1)
        m1 = 0.9 * m1 + g1
        v1 = 0.9 * v1 + g1 * g1
        return ((w1 - m1 / (jnp.sqrt(v1) + 1.0), w2), (count + 1, m1, m2, v1, v2)), g1.sum()

    w1, w2, x = jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.ones((32, 8))
    state = ((w1, w2), (jnp.zeros((), jnp.int32), w1, w2, w1, w2))
    p = planner.plan(step, state, x, mesh={"a": 2})
    kinds = [leaf.kind for leaf in classify(p.program, p.in_tree, p.out_tree)]
    assert kinds == ["parameters"] * 2 + ["optimizer state"] * 5 + ["batch"]


# A faster row over the memory limit the search kept to, marked in explain(): in
# test_baselines.py (test_a_faster_row_over_the_limit_the_search_kept_to_says_so), which reads
# the plan the search-against-the-experts test there makes (one search of the flax LM for both).
