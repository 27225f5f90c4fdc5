"""Plans under the transformations users apply: ``jax.jit`` of a plan, ``jax.grad`` through it,
``jax.vmap`` over it, and all three inside ``jax.set_mesh`` of a mesh whose axis of size 4 the
plan splits into its prime factors; searched plans and pipelined ones, both lowering backends,
against the unsharded function."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType

import planner
from planner.program.schedule import Stages, make_schedule


def _loss(ws, x, y):
    """Four scanned residual MLP layers and a squared error."""

    def layer(h, w):
        return jnp.tanh(h @ w[0] + w[2]) @ w[1] + h, None

    h, _ = lax.scan(layer, x, ws)
    return jnp.mean((h - y) ** 2)


def _args(seed=0, layers=4, batch=16, d=8, hidden=16):
    rng = np.random.default_rng(seed)
    f = np.float32
    ws = ((rng.standard_normal((layers, d, hidden)) / np.sqrt(d)).astype(f),
          (rng.standard_normal((layers, hidden, d)) / np.sqrt(hidden)).astype(f),
          rng.standard_normal((layers, hidden)).astype(f))  # fmt: skip
    return ws, rng.standard_normal((batch, d)).astype(f), rng.standard_normal((batch, d)).astype(f)


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.shape(g) == np.shape(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("a", "pipe"), axis_types=(AxisType.Auto,) * 2)


def _transformed(fn, args, mesh):
    """``fn`` jitted, differentiated, vmapped over 3 scaled copies of its arguments, and each
    of them again inside ``jax.set_mesh(mesh)``."""
    batched = jax.tree.map(lambda a: np.stack([a * (1 + 0.1 * i) for i in range(3)]), args)
    runs = {
        "jit": lambda: jax.jit(fn)(*args),
        "grad": lambda: jax.grad(fn)(*args),
        "vmap": lambda: jax.vmap(fn)(*batched),
    }
    out = {}
    for name, run in runs.items():
        out[name] = run()
        with jax.set_mesh(mesh):
            out[f"{name} under set_mesh"] = run()
    return out


def _want(args, mesh):
    return _transformed(_loss, args, mesh)


@pytest.mark.parametrize("backend", ["xla", "explicit"])
def test_a_pipelined_plan_under_jit_grad_vmap_and_set_mesh(backend, mesh):
    args = _args()
    prog = planner.analyze(_loss, *args)
    (scan,) = [r for r in prog.regions if r.kind == "scan"]
    base = make_schedule(prog, {}, dict(mesh.shape), default="replicate")
    sched = dataclasses.replace(base, stages=(Stages(scan.start, "pipe", 2),))
    low = planner.lower(prog, sched, mesh, backend=backend)
    got, want = _transformed(low, args, mesh), _want(args, mesh)
    assert set(got) == set(want)
    for name in want:
        _close(got[name], want[name])


def test_a_searched_plan_under_jit_grad_vmap_and_set_mesh(mesh):
    args = _args(1, batch=512, d=64, hidden=256)
    p = planner.plan(_loss, *args, mesh=mesh, memory_limit_bytes=None)
    used = {a for loops in p.schedule.assign.values() for axes in loops.values() for a in axes}
    assert any(a.startswith("pipe#") for a in used)  # the plan splits by factors of pipe:4
    got, want = _transformed(p, args, mesh), _want(args, mesh)
    for name in want:
        _close(got[name], want[name])
