"""Reference checks several planner test modules share: comparing a plan's results with the
unsharded program's (``assert_same``, ``assert_close``, ``assert_step_equal`` for an optimizer
step), running a function under JAX's transformations (``transformed``), and the exhaustive
search the solver is checked against (``brute_force``)."""

from __future__ import annotations

import itertools
import math

import jax
import numpy as np

from planner.cost.simulator import simulate
from planner.program.schedule import make_schedule
from planner.solver.schedule_search import _options, anchors

LR = 1e-3
"""The learning rate of the language-model steps whose results ``assert_step_equal`` compares."""


def assert_same(got, want):
    """Equal pytrees of arrays: same shapes and dtypes, exact for integers and booleans, floats
    to 1e-4 relative + 1e-5 absolute."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype
        if np.issubdtype(w.dtype, np.floating):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
        else:
            np.testing.assert_array_equal(g, w)


def assert_close(got, want):
    """Pytrees of the same shapes, close to 1e-4 relative + 1e-5 absolute."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.shape(g) == np.shape(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def assert_step_equal(got, want, param_atol=1e-5):
    """Two results ``(params, optimizer state, loss)`` of an Adam training step are equal.

    Tolerances: the loss to 1e-5 relative; gradients (Adam's first moment after one step, 0.1 x
    the gradient) to 1e-3 relative + 1e-7 absolute; parameters to ``param_atol``, except where
    the exact gradient is zero (the attention key bias: softmax is shift-invariant, so its
    gradient is float noise of ~1e-10, which Adam turns into a step of up to the learning rate,
    :data:`LR`, in either direction): there to twice the learning rate."""
    (p_got, s_got, l_got), (p_want, s_want, l_want) = got, want
    np.testing.assert_allclose(l_got, l_want, rtol=1e-5)
    mu_got, mu_want = s_got[0].mu, s_want[0].mu
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-7),
                 mu_got, mu_want)  # fmt: skip

    def param(g, w, mu):
        zero_gradient = np.max(np.abs(mu)) < 1e-8
        np.testing.assert_allclose(g, w, rtol=0, atol=2 * LR if zero_gradient else param_atol)

    jax.tree.map(param, p_got, p_want, mu_want)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-12),
                 s_got[0].nu, s_want[0].nu)  # fmt: skip


def transformed(fn, args, mesh):
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


def brute_force(prog, sizes, with_peak: bool = False):
    """Every assignment of every mesh axis to a loop (or none) of every anchor, simulated: the
    fastest time (with ``with_peak``, ``(time, peak)`` of the fastest, the leanest of those)."""
    ops = anchors(prog)
    best = (math.inf, math.inf)
    per_axis = [
        list(itertools.product(*(_options(o, {}, n, sizes) for o in ops))) for n in sizes.values()
    ]
    for combo in itertools.product(*per_axis):
        assign = {o.name: {} for o in ops}
        for axis, choices in zip(sizes, combo):
            for o, loop in zip(ops, choices):
                if loop is not None:
                    assign[o.name][loop] = assign[o.name].get(loop, ()) + (axis,)
        try:
            sched = make_schedule(prog, {k: v for k, v in assign.items() if v}, sizes)
        except ValueError:
            continue
        pred = simulate(prog, sched)
        best = min(best, (pred.time_s, pred.peak_bytes))
    return best if with_peak else best[0]
