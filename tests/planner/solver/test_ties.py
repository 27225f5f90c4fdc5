"""Ties in time, and the search's invariant: no layout it can price beats the plan it returns.

A plan slower than the fastest by at most ``TIME_TIE`` wins only where it frees at least
``MEMORY_SHARE`` of the fastest's peak, and ``explain()`` says so; no expert strategy and no
layout of the inputs ``planner.price`` can price is predicted faster than the plan beyond that
(the programs are far under any memory limit)."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from planner_programs import (
    attention,
    mlp_args,
    rand,
    residual_layers_args,
    residual_layers_loss,
    sgd_step,
)

import planner
from planner.report.summary import summarize
from planner.solver.ties import MEMORY_SHARE, TIME_TIE, best_of


def test_a_tie_goes_to_the_leaner_plan_only_where_it_frees_a_share_that_matters():
    """The issue's MLP: data parallelism 14.2 ms / 4.58 MiB against FSDP 14.6 ms / 4.57 MiB
    (0.2 % less memory for 3 % of time): the faster wins; 40 % less memory for 2 % wins."""
    dp, fsdp = (14.2e-3, 4.58 * 2**20, "dp", None), (14.6e-3, 4.57 * 2**20, "fsdp", None)
    assert best_of([fsdp, dp])[2] == "dp"
    lean = (14.4e-3, 2.7 * 2**20, "lean", None)
    assert best_of([fsdp, dp, lean])[2] == "lean"
    over = (float("inf"), 2**20, "over", None)  # over the memory limit: never a winner
    assert best_of([dp, over])[2] == "dp"
    slow = (14.2e-3 * (1 + 2 * TIME_TIE), 2**20, "slow", None)  # leaner, but not a tie
    assert best_of([dp, slow])[2] == "dp"


def _adam_step(state, x, y):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(x @ p[0]) @ p[1] - y) ** 2))(
        params
    )
    updates, opt_state = optax.adam(1e-2).update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def _programs():
    params = (rand(64, 128), rand(128, 64))
    adam = ((params, optax.adam(1e-2).init(params)), rand(512, 64), rand(512, 64))
    att = (rand(8, 16, 32), rand(32, 4, 8), rand(32, 4, 8), rand(32, 4, 8), rand(4, 8, 32))
    return {
        "sgd": (sgd_step, mlp_args()),
        "adam": (_adam_step, adam),
        "attention": (attention, att),
        "residual": (jax.grad(residual_layers_loss), residual_layers_args(batch=32)),
    }


def _random_specs(args, mesh, rng: random.Random):
    """Each input array a random valid PartitionSpec: each mesh axis on one dimension it divides
    (or none)."""

    def one(x):
        dims: list[list[str]] = [[] for _ in x.shape]
        for axis, n in mesh.shape.items():
            options = [d for d in range(len(x.shape))
                       if x.shape[d] % (n * int(np.prod([mesh.shape[a] for a in dims[d]]))) == 0]  # fmt: skip
            d = rng.choice([None, *options])
            if d is not None:
                dims[d].append(axis)
        return NamedSharding(mesh, P(*(tuple(a) if a else None for a in dims)))

    return jax.tree.map(one, args)


@pytest.mark.parametrize("shape", [(4, 2), (2, 2, 2)], ids=["2-axis", "3-axis"])
@pytest.mark.parametrize("name", ["sgd", "adam", "attention", "residual"])
def test_nothing_the_planner_can_price_beats_its_plan(name, shape):
    names = ("a", "b", "c")[: len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    fn, args = _programs()[name]
    p = planner.plan(fn, *args, mesh=mesh, compare=None, constraints="drop")
    t, peak = p.prediction.time_s, p.prediction.peak_bytes
    rows = [r for r in summarize(p).prediction[1:] if "time_s" in r]
    rng = random.Random(f"{name}{shape}")
    for k in range(6):
        yours = planner.price(fn, *args, mesh=mesh, in_shardings=_random_specs(args, mesh, rng),
                              constraints="drop")  # fmt: skip
        rows.append({"name": f"random layout {k}", "time_s": yours.prediction.time_s,
                     "peak_bytes": yours.prediction.peak_bytes})  # fmt: skip
    assert len(rows) >= 8
    for row in rows:
        if row["time_s"] >= t:
            continue
        # faster: only by a tie the plan wins on memory, and explain() says so
        assert t <= row["time_s"] * (1 + TIME_TIE), (row, t)
        assert peak <= row["peak_bytes"] * (1 - MEMORY_SHARE), (row, peak)
    faster = [r for r in rows[: len(summarize(p).prediction) - 1] if r["time_s"] < t]
    assert bool(faster) == ("for its memory" in p.explain())
