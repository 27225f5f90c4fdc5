"""The planner chooses what checkpointed layers save (``planner.remat_policy``): the fastest plan
that fits among the candidates, every candidate's plan exact, the choice kept in saved plans, and
JAX's caches left as the user's program expects them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import planner
from planner.program.remat import DEFAULT_CANDIDATES, RematChoice, choosing
from planner.solver.ties import TIME_TIE

L, D, B = 4, 64, 128


def make_step(policy):
    def layer(h, w):
        return jnp.tanh(jnp.sin(h @ w["a"]) @ w["b"]), None

    def loss(ws, x):
        h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, ws)
        return jnp.mean(h**2)

    def step(ws, x):
        return jax.tree.map(lambda p, g: p - 0.1 * g, ws, jax.grad(loss)(ws, x))

    return step


CHOICE = planner.remat_policy()
STEP = make_step(CHOICE)


@pytest.fixture(scope="module")
def mesh():
    """Four devices: the choices below are those made on eight, and two axes of one factor each
    search in about 80% of the time of (2, 4)'s three factors."""
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def args():
    ka, kb, kx = jax.random.split(jax.random.key(0), 3)
    ws = {"a": jax.random.normal(ka, (L, D, 4 * D)) / 8,
          "b": jax.random.normal(kb, (L, 4 * D, D)) / 16}  # fmt: skip
    return ws, jax.random.normal(kx, (B, D))


@pytest.fixture(scope="module")
def free(mesh, args):
    """``STEP`` planned without a memory limit (every candidate's fastest plan), made once for the
    module's tests."""
    return planner.plan(STEP, *args, mesh=mesh, memory_limit_bytes=None)


@pytest.fixture(scope="module")
def tight(mesh, args, free):
    """``(limit, plan)``: ``STEP`` planned under a limit that keeping everything exceeds (90% of
    that candidate's fastest plan's peak), made once for the module's tests."""
    limit = 0.9 * free.remat.candidates["everything"][1]
    return limit, planner.plan(STEP, *args, mesh=mesh, memory_limit_bytes=limit)


def assert_exact(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)


def test_the_fastest_candidate_that_fits_is_chosen(mesh, args, free, tight):
    assert set(free.remat.candidates) == set(DEFAULT_CANDIDATES)
    times = {n: c[0] for n, c in free.remat.candidates.items()}
    assert times[free.remat.chosen] == min(times.values())
    assert times["nothing"] > times["everything"]  # recomputing the layer is priced
    # under a limit that keeping everything exceeds, a candidate that keeps less is chosen
    limit, tight = tight
    found = {n: c for n, c in tight.remat.candidates.items() if c is not None}
    fitting = {n: c for n, c in found.items() if c[1] is not None}
    assert fitting and all(peak <= limit for _, peak in fitting.values())
    assert tight.remat.chosen in fitting and tight.prediction.peak_bytes <= limit
    chosen_s, chosen_peak = tight.remat.candidates[tight.remat.chosen]
    fastest_s = min(t for t, _ in found.values())  # as fast (TIME_TIE): the least memory wins
    assert chosen_s <= fastest_s * (1 + TIME_TIE)
    assert all(
        chosen_peak <= peak for t, peak in fitting.values() if t <= fastest_s * (1 + TIME_TIE)
    )
    # a candidate not searched under the limit (its fastest plan over it, and no faster than the
    # chosen plan) has no plan under the limit faster than the chosen one: searched alone
    skipped = [n for n, c in found.items() if c[1] is None]
    for name in skipped:
        assert found[name][0] >= chosen_s
        alone = planner.plan(make_step(planner.remat_policy(**{name: DEFAULT_CANDIDATES[name]})),
                             *args, mesh=mesh, memory_limit_bytes=limit)  # fmt: skip
        assert alone.prediction.time_s >= found[name][0] * (1 - 1e-9)
    assert "remat: " in tight.summary() and tight.remat.describe() in tight.explain()


def test_a_candidate_no_faster_than_a_plan_that_fits_is_not_searched_under_the_limit():
    """``_choose_remat`` with stand-in searches: each candidate's fastest plan first; ``slow``,
    whose fastest plan is over the limit and slower than ``lean``'s plan that fits, is never
    searched under the limit; ``keep_all``, the fastest but over the limit, is."""
    from types import SimpleNamespace

    from planner.auto import _choose_remat

    limit = 100
    free = {"keep_all": (1.0, 150), "lean": (2.0, 80), "slow": (3.0, 120)}
    limited = {"keep_all": (2.5, 95), "lean": (2.0, 80)}
    searched = []

    def plan(time_s, peak):
        return None, SimpleNamespace(time_s=time_s, peak_bytes=peak)

    def free_for(name, prog):
        return plan(*free[name])

    def search_for(name, prog):
        searched.append(name)
        t, peak = free[name] if free[name][1] <= limit else limited[name]
        return plan(t, peak)

    prog, sched, pred, decision = _choose_remat(list(free), lambda n: n, search_for, free_for)
    assert decision.chosen == "lean" and pred.time_s == 2.0
    assert "slow" not in searched and "keep_all" in searched
    assert decision.candidates["slow"] == (3.0, None)
    assert decision.candidates["keep_all"] == (2.5, 95)
    assert "at least 3 s" in decision.describe()


def test_nothing_fits_names_the_smallest_peak_and_holds_its_plan(mesh, args):
    """The error's plan is the candidate's of that peak, and runs exactly."""
    with pytest.raises(planner.MemoryLimitError, match="smallest predicted peak") as info:
        planner.plan(STEP, *args, mesh=mesh, memory_limit_bytes=1e5)
    e = info.value
    leanest = e.leanest
    assert isinstance(leanest, planner.AutoPlan)
    assert leanest.prediction.peak_bytes == e.peak.bytes > 1e5
    assert leanest.remat.chosen in DEFAULT_CANDIDATES
    assert leanest.remat.candidates[leanest.remat.chosen] is None  # none fits
    assert_exact(leanest.jit()(*args), jax.jit(STEP)(*args))


@pytest.mark.parametrize("name", list(DEFAULT_CANDIDATES))
def test_every_candidates_plan_is_exact(mesh, args, name):
    """... and differentiating the plan (its checkpoints partially evaluated again) too."""
    step = make_step(planner.remat_policy(**{name: DEFAULT_CANDIDATES[name]}))
    p = planner.plan(step, *args, mesh=mesh, memory_limit_bytes=None)
    assert p.remat.chosen == name
    want = jax.jit(step)(*args)
    assert_exact(p(*args), want)
    if name != "dots":  # one mix of saved and recomputed values is enough under grad
        return

    def scalar(f):
        return lambda ws, x: sum(jnp.sum(v**2) for v in jax.tree.leaves(f(ws, x)))

    assert_exact(jax.grad(scalar(p))(*args), jax.grad(scalar(step))(*args))


def test_a_saved_plan_is_traced_again_with_its_choice(mesh, args, tight, tmp_path):
    """A plan whose choice is not the default one loads: without tracing under it the program
    would differ from the saved one."""
    _, p = tight
    assert p.remat.chosen != next(iter(CHOICE.candidates))
    path = str(tmp_path / "step.plan.json")
    p.save(path)
    q = planner.load(path, STEP, *args, mesh=mesh)
    assert q.remat == p.remat and q.schedule.assign == p.schedule.assign
    assert_exact(q(*args), jax.jit(STEP)(*args))


def test_the_users_own_traces_see_the_default_after_planning(args):
    """Planning traces the step under every candidate whatever the mesh: planned on 2 devices
    (one axis of one factor, the quickest search)."""
    before = str(jax.make_jaxpr(STEP)(*args))
    with choosing("nothing"):
        assert str(jax.make_jaxpr(STEP)(*args)) != before
    two = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
    p = planner.plan(STEP, *args, mesh=two, memory_limit_bytes=None)
    assert set(p.remat.candidates) == set(DEFAULT_CANDIDATES)  # each candidate traced
    assert str(jax.make_jaxpr(STEP)(*args)) == before


def test_a_fixed_policy_is_left_alone(mesh, args):
    p = planner.plan(make_step(jax.checkpoint_policies.nothing_saveable), *args, mesh=mesh)
    assert p.remat is None


def test_bad_candidates_are_refused():
    with pytest.raises(TypeError, match="candidate 'x' is a int"):
        planner.remat_policy(x=3)
    with pytest.raises(ValueError, match="at least one"):
        RematChoice({})
    assert repr(planner.remat_policy(a=jax.checkpoint_policies.nothing_saveable)) == (
        "remat_policy(a)"
    )


def test_searches_under_lower_limits_reuse_what_earlier_ones_found():
    """The compile check searches again under lower limits: a candidate's best plan under more
    memory is its best where it still fits, and nothing fits where nothing fitted under more."""
    from types import SimpleNamespace

    from planner.auto import _remembered

    calls, tried = [], []

    def search(peak=None, error=None):
        def run():
            calls.append(peak)
            if error:
                raise error
            return "schedule", SimpleNamespace(peak_bytes=peak)

        return run

    assert _remembered(tried, 100, search(50))[1].peak_bytes == 50
    assert _remembered(tried, 60, search(45))[1].peak_bytes == 50  # still fits: not searched
    assert _remembered(tried, 40, search(35))[1].peak_bytes == 35  # no longer fits: searched
    none = planner.MemoryLimitError(30)
    with pytest.raises(planner.MemoryLimitError):
        _remembered(tried, 30, search(error=none))
    with pytest.raises(planner.MemoryLimitError):
        _remembered(tried, 20, search(10))  # nothing fitted under 30: not searched
    assert calls == [50, 35, None]
