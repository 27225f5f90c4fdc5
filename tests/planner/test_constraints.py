"""Sharding constraints are the user's words: understood, priced as the user's layout, kept, or
departed from where the plan predicts better, and never a crash (``plan(..., constraints=...)``,
``planner.price``)."""

import collections
import random
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from planner_programs import random_schedule

import planner
from planner.program.constraints import requested_assignment, requests
from planner.program.schedule import ORDERS, make_schedule
from planner.solver.requested import Requested
from planner.solver.schedule_search import users_on_a_tie
from planner.solver.ties import MEMORY_TIE, TIME_TIE, best_of
from redist.types import MeshShape


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)


def _close(got, want, rtol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol)


HIDDEN = P("fsdp", "tensor")


def _mlp(mesh, spec=HIDDEN):
    def f(x, w1, w2):
        h = jax.lax.with_sharding_constraint(x @ w1, NamedSharding(mesh, spec))
        h = checkpoint_name(jnp.tanh(h), "hidden")
        return jnp.sum((h @ w2) ** 2)

    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
            jnp.asarray(rng.normal(size=(32, 128)) / 6, jnp.float32),
            jnp.asarray(rng.normal(size=(128, 32)) / 11, jnp.float32))  # fmt: skip
    return f, args


def test_the_ten_line_reproducer_runs(mesh):
    """The issue's reproducer: tanh of a constrained product planned, then run by plan.jit()."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(32, 16)), jnp.float32)

    def f(x, w):
        return jnp.tanh(
            jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("fsdp", "tensor")))
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing "not understood"
        p = planner.plan(f, x, w, mesh=mesh)
    _close(p.jit()(x, w), f(x, w))
    assert "your layout" in p.explain()


def test_constraints_read_as_loop_assignments(mesh):
    f, args = _mlp(mesh)
    prog = planner.analyze(f, *args)
    (req,) = requests(prog)
    assert req.spec == (("fsdp",), ("tensor",))
    assign, problems = requested_assignment(prog, MeshShape.of(dict(mesh.shape)))
    assert problems == []
    assert assign == {req.op: {"i0": ("fsdp#0", "fsdp#1"), "i1": ("tensor",)}}
    assert {o.primitive: o.how for o in prog.ops}["name"] == "rule"


@pytest.mark.parametrize("mode", ["hint", "keep", "drop"])
def test_every_mode_runs_exactly_and_under_grad(mesh, mode):
    f, args = _mlp(mesh)
    p = planner.plan(f, *args, mesh=mesh, constraints=mode)
    _close(p.jit()(*args), f(*args))
    g = jax.grad(lambda *a: p.jit()(*a), argnums=(1, 2))(*args)
    _close(g, jax.grad(f, argnums=(1, 2))(*args), rtol=1e-4)
    prog, sched = p.program, p.schedule
    op = next(o for o in prog.ops if o.primitive == "sharding_constraint")
    if mode == "keep":
        assert sched.spec(op, op.results[0]) == (("fsdp#0", "fsdp#1"), ("tensor",))
    text = p.explain()
    assert "Sharding constraints: 1 in the program" in text
    assert ("your layout" in text) == (mode != "drop")


def test_keep_holds_a_layout_the_search_would_not_choose(mesh):
    """Asked to keep the hidden activations split by columns only, the plan does so, and it is
    predicted no faster than the free plan, which departs and says what that buys."""
    f, args = _mlp(mesh, P(None, ("fsdp", "tensor")))
    kept = planner.plan(f, *args, mesh=mesh, constraints="keep")
    free = planner.plan(f, *args, mesh=mesh, constraints="hint")
    op = next(o for o in kept.program.ops if o.primitive == "sharding_constraint")
    assert kept.schedule.spec(op, op.results[0]) == ((), ("fsdp#0", "fsdp#1", "tensor"))
    assert free.prediction.time_s <= kept.prediction.time_s * (1 + TIME_TIE)
    _close(kept.jit()(*args), f(*args))
    if free.schedule.spec(op, op.results[0]) != kept.schedule.spec(op, op.results[0]):
        assert "departs from 1" in free.explain()


def test_the_plan_is_never_predicted_slower_than_the_users_layout(mesh):
    f, args = _mlp(mesh, P(None, "tensor"))
    layout = (P("fsdp"), P(None, "tensor"), P("tensor"))
    mine = planner.price(f, *args, mesh=mesh, in_shardings=layout)
    p = planner.plan(f, *args, mesh=mesh, compare=layout)
    assert p.prediction.time_s <= mine.prediction.time_s * (1 + TIME_TIE)
    assert p.prediction.peak_bytes <= mine.prediction.peak_bytes or (
        p.prediction.time_s < mine.prediction.time_s / (1 + TIME_TIE)
    )
    assert mine.search_s == 0.0
    assert [str(s) for s in mine.in_specs] == ["P('fsdp',)", "P(None, 'tensor')", "P('tensor',)"]
    _close(mine.jit()(*args), f(*args))
    asked = Requested("keep", stored=((("fsdp",), ()), ((), ("tensor",)), (("tensor",), ())))
    ways = asked.completions(mine.program, dict(mesh.shape))
    times = [planner.simulate(mine.program, s, mine.calibration).time_s for s in ways]
    assert mine.prediction.time_s == min(times)


def test_compare_auto_reads_the_arrays_own_shardings(mesh):
    f, args = _mlp(mesh)
    placed = [jax.device_put(a, NamedSharding(mesh, s))
              for a, s in zip(args, (P("fsdp"), P(None, "tensor"), P("tensor")))]  # fmt: skip
    mine = planner.price(f, *placed, mesh=mesh)
    assert [str(s) for s in mine.in_specs] == ["P('fsdp',)", "P(None, 'tensor')", "P('tensor',)"]
    with pytest.raises(ValueError, match="compare"):
        planner.plan(f, *args, mesh=mesh, compare=(P("fsdp"), P()))
    with pytest.raises(ValueError, match="constraints must be one of"):
        planner.plan(f, *args, mesh=mesh, constraints="always")


def test_a_constraint_on_another_mesh_warns_and_runs(mesh):
    other = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    f, args = _mlp(other, P("data"))
    with pytest.warns(UserWarning, match="cannot hold on the mesh.*'data'"):
        p = planner.plan(f, *args, mesh=mesh, constraints="keep")
    _close(p.jit()(*args), f(*args))


def test_size_one_axes_neither_mislead_the_search_nor_the_rows():
    """A mesh whose last axis has size 1 (MaxText's ``autoregressive``) plans as the mesh without
    it, and the plan is predicted no slower than any strategy explain() prints."""
    f, args = _mlp(jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2))
    plain = {"fsdp": 4, "tensor": 2}
    padded = {"data": 1, "fsdp": 4, "tensor": 2, "autoregressive": 1}
    a = planner.plan(f, *args, mesh=plain, compare=None)
    b = planner.plan(f, *args, mesh=padded, compare=None)
    assert b.prediction.time_s == pytest.approx(a.prediction.time_s, rel=1e-9)
    from planner.report import summarize
    from planner.solver.schedule_search import _Evaluator, _seeds, groups

    for row in summarize(b).prediction:  # faster, or as fast (TIME_TIE) with no more memory
        if "time_s" in row and b.prediction.time_s > row["time_s"] * (1 + 1e-9):
            assert b.prediction.time_s <= row["time_s"] * (1 + TIME_TIE), row["name"]
            assert b.prediction.peak_bytes <= row["peak_bytes"], row["name"]
    prog = planner.analyze(f, *args)  # the search starts from the same strategies on both
    seeds = []
    for sizes in (plain, padded):
        shape = MeshShape.of(sizes)
        evaluate = _Evaluator(prog, shape.sizes, b.calibration, None, groups(prog))
        seeds.append(sorted(s[0] for s in _seeds(prog, shape, evaluate)))
    assert seeds[0] == seeds[1]


def test_expert_plans_of_a_step_with_typed_keys_jit(mesh):
    def step(state, x):
        w, key = state
        key, sub = jax.random.split(key)
        y = jnp.tanh(x @ w) + 0.01 * jax.random.normal(sub, (x.shape[0], w.shape[1]))
        return (w - 0.1 * (x.T @ y), key), y.sum()

    state, x = (jnp.ones((32, 16)), jax.random.key(0)), jnp.ones((64, 32))
    want = jax.jit(step)(state, x)
    plans = planner.expert_plans(step, state, x, mesh=mesh, data_axes=("fsdp",),
                                 tensor_axis="tensor")  # fmt: skip
    for p in plans.values():
        got = p.jit()(state, x)
        _close(got[0][0], want[0][0], rtol=1e-4)
        _close(got[1], want[1], rtol=1e-4)


def test_plan_jit_takes_arrays_placed_in_another_layout(mesh):
    """MaxText's state arrives committed to MaxText's shardings: plan.jit() moves such arrays to
    the plan's layouts (jax.jit alone refuses them), donated ones included, and still lowers."""
    f, args = _mlp(mesh)
    placed = [jax.device_put(a, NamedSharding(mesh, s))
              for a, s in zip(args, (P(None, "fsdp"), P("tensor"), P(None, "fsdp")))]  # fmt: skip
    p = planner.plan(f, *args, mesh=mesh, compare=None)
    assert any(not a.sharding.is_equivalent_to(s, a.ndim)
               for a, s in zip(placed, p.in_shardings))  # fmt: skip
    _close(p.jit()(*placed), f(*args))
    _close(p.jit(donate_argnums=(0,))(*[a.copy() for a in placed]), f(*args))
    assert p.jit().lower(*args).compile() is not None
    # made once for the same arguments (a new jax.jit would trace and compile again)
    assert p.jit() is p.jit() and p.jit(donate_argnums=(0,)) is not p.jit()
    assert p.jit(moves="xla") is not p.jit()


def test_a_constrained_plan_runs_under_set_mesh_and_jit_of_grad(mesh):
    f, args = _mlp(mesh)
    p = planner.plan(f, *args, mesh=mesh)
    with jax.set_mesh(mesh):
        _close(p.jit()(*args), f(*args))
    g = jax.jit(jax.grad(lambda *a: p.jit()(*a), argnums=1))(*args)
    _close(g, jax.grad(f, argnums=1)(*args), rtol=1e-4)


def test_the_users_layout_returns_donated_state_as_it_was_given(mesh):
    """A step jitted with ``out_shardings=in_shardings`` (MaxText's, Keras's): the momentum's
    update is laid out as the momentum was given, so the priced layout stores it as given and
    reduce-scatters the gradient into it, rather than storing it as the gradient comes."""

    def step(state, x):
        w, m = state
        g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        m = g + 0.9 * m  # the gradient's layout first: propagation alone would follow it
        return w - 0.1 * m, m

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(32, 16)) / 6, jnp.float32)
    state, x = (w, jnp.zeros_like(w)), jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    given = ((P("fsdp", "tensor"), P("tensor", "fsdp")), P("fsdp"))
    mine = planner.price(step, state, x, mesh=mesh, in_shardings=given, donate_argnums=0)
    specs = [*mine.in_specs[0], mine.in_specs[1]]
    assert specs == [P("fsdp", "tensor"), P("tensor", "fsdp"), P("fsdp")]
    out = mine.jit()(jax.tree.map(jnp.copy, state), x)
    assert [a.sharding.spec for a in out] == specs[:2]
    _close(out, step(state, x))


def _constrained_step(mesh):
    """A training step whose activations are constrained as MaxText constrains them (batch
    over ``fsdp``), and the weights' layout its author gives."""

    def constrained(x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def loss(x, w1, w2, s):
        h = constrained(x, "fsdp", None)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * s
        h = constrained(jnp.tanh(constrained(h @ w1, "fsdp", "tensor")) @ w2, "fsdp", None)
        return jnp.mean(jax.nn.logsumexp(h, -1))

    def step(w1, w2, s, x):
        return jax.grad(loss, argnums=(1, 2, 3))(x, w1, w2, s)

    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.normal(size=(64, 128)) / 11, jnp.float32),
            jnp.asarray(rng.normal(size=(128, 64)) / 11, jnp.float32),
            jnp.asarray(rng.normal(size=(64,)), jnp.float32),
            jnp.asarray(rng.normal(size=(32, 64)), jnp.float32))  # fmt: skip
    layout = (P("fsdp", "tensor"), P("tensor", "fsdp"), P("fsdp"), P("fsdp"))
    return step, args, layout


def _compiled_traffic(compiled) -> tuple:
    """``(bytes accessed, collectives by kind)`` of a compiled program."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    kinds = re.findall(r"= \S+ (all-gather|all-reduce|all-to-all|collective-permute|"
                       r"reduce-scatter)(?:-start)?\(", compiled.as_text())  # fmt: skip
    return cost["bytes accessed"], collections.Counter(kinds)


def test_the_users_layout_runs_as_their_own_jit(mesh):
    """Priced as the program's constraints ask, ``jit()`` constrains those and the state's
    layout, and leaves XLA to propagate from them as the user's own ``jax.jit`` does: no more
    compiled traffic than their jit, with or without ``out_shardings`` for the state (constraining
    every value as the planner propagates them compiles otherwise here, and on MaxText's step
    took twice the time). The outputs of the arguments' shapes (the gradients of ``w1``, ``w2``
    and ``s``) are state: they come back as those arguments went in, as a training step's
    ``jax.jit(out_shardings=...)`` returns them (there XLA propagates to 8 all-gathers and 2
    permutes, and 1.18x the bytes of its jit without them)."""
    step, args, layout = _constrained_step(mesh)
    mine = planner.price(step, *args, mesh=mesh, in_shardings=layout)
    shardings = tuple(NamedSharding(mesh, s) for s in layout)
    placed = jax.device_put(args, shardings)
    ours = mine.jit().lower(*placed).compile()
    assert [s.spec for s in ours.output_shardings] == list(layout[:3])
    ours_bytes, ours_kinds = _compiled_traffic(ours)
    for out in ({}, {"out_shardings": shardings[:3]}):
        theirs = jax.jit(step, in_shardings=shardings, **out).lower(*placed).compile()
        their_bytes, their_kinds = _compiled_traffic(theirs)
        assert ours_bytes <= their_bytes and ours_kinds.total() <= their_kinds.total(), out
    _close(mine.jit()(*placed), step(*args), rtol=1e-4)


def test_random_plans_beside_the_users_layout_run_exactly(mesh):
    """Any plan, lowered beside the layout the program asks for (its departures and their
    neighbours constrained, XLA's propagation elsewhere), computes the unsharded step."""
    step, args, layout = _constrained_step(mesh)
    asked = planner.price(step, *args, mesh=mesh, in_shardings=layout)
    prog, sizes = asked.program, dict(mesh.shape)
    want = jax.jit(step)(*args)
    for seed in range(3):
        rng = random.Random(seed)
        departures = {op: loops for op, loops in random_schedule(prog, sizes, rng).items()
                      if rng.random() < 0.2}  # fmt: skip
        sched = make_schedule(prog, {**asked.schedule.assign, **departures}, sizes)
        f = planner.lower(prog, sched, mesh, "xla", asked=asked.schedule)
        assert f.anchors is not None and len(f.anchors) < len(prog.ops)
        _close(f(*args), want, rtol=1e-4)


@pytest.mark.parametrize("order", ORDERS)
def test_every_way_of_completing_the_users_layout_runs_exactly(mesh, order):
    """The ops the constraints leave free, completed each way propagation may settle operands
    wanting one axis, with random ops pinned beside the constrained ones, compute the unsharded
    step; the user's layout is priced as the fastest completion, or the leanest of those as fast."""
    step, args, layout = _constrained_step(mesh)
    mine = planner.price(step, *args, mesh=mesh, in_shardings=layout)
    prog, sizes = mine.program, dict(mesh.shape)
    stored = {v.name: mine.schedule.stored[v.name] for v in prog.inputs}
    asked = requested_assignment(prog, MeshShape.of(sizes), True)[0]
    want = jax.jit(step)(*args)
    for seed in range(2):
        rng = random.Random(seed)
        pinned = {op: loops for op, loops in random_schedule(prog, sizes, rng).items()
                  if rng.random() < 0.1}  # fmt: skip
        sched = make_schedule(prog, {**pinned, **asked}, sizes, stored=stored, order=order)
        _close(planner.lower(prog, sched, mesh, "xla")(*args), want, rtol=1e-4)
    ways = Requested("hint", stored=tuple(stored.values())).completions(prog, sizes)
    predicted = [planner.simulate(prog, s, mine.calibration) for s in ways]
    best = best_of([(p.time_s, p.peak_bytes, s, p) for p, s in zip(predicted, ways)])
    assert (mine.prediction.time_s, mine.prediction.peak_bytes) == best[:2]


def test_a_departure_must_buy_more_than_the_cost_models_error(mesh):
    """The user's own layout is returned where the search's best is predicted within
    ``TIME_TIE`` of it and ``MEMORY_TIE`` of its memory."""
    step, args, layout = _constrained_step(mesh)
    mine = planner.price(step, *args, mesh=mesh, in_shardings=layout)
    p = planner.plan(step, *args, mesh=mesh, compare=layout)
    t, m = p.prediction.time_s, p.prediction.peak_bytes
    ours, theirs = mine.prediction.time_s, mine.prediction.peak_bytes
    if p.schedule.assign != mine.schedule.assign:
        assert t * (1 + TIME_TIE) < ours or m * (1 + MEMORY_TIE) < theirs
    assert (
        users_on_a_tie((t, m, "plan", None), [(t * (1 + TIME_TIE), m, "yours", None)])[2] == "yours"
    )
    # a departure saving a few bytes is no departure; one saving more than the model's error is
    assert (
        users_on_a_tie((t, m, "plan", None), [(t * (1 + TIME_TIE), m + 1, "yours", None)])[2]
        == "yours"
    )
    assert (
        users_on_a_tie((t, m, "plan", None), [(t, m * (1 + 2 * MEMORY_TIE), "yours", None)])[2]
        == "plan"
    )
    assert users_on_a_tie((t, m, "plan", None), [(t * 1.1, m, "yours", None)])[2] == "plan"


def test_where_the_plan_is_the_users_layout_explain_says_what_the_search_chose_without_it(mesh):
    """Handed a layout the search keeps (here its own choice on its own, and data parallelism
    asked by a constraint), the plan says what it would have been without it: the prediction of
    ``plan(..., constraints="drop", compare=None)``; a plan that departs says nothing more."""
    step, args, layout = _constrained_step(mesh)
    mlp, mlp_args = _mlp(mesh, P(("fsdp", "tensor")))
    for f, a, mode in ((step, args, "drop"), (mlp, mlp_args, "hint")):
        alone = planner.plan(f, *a, mesh=mesh, constraints="drop", compare=None)
        p = planner.plan(f, *a, mesh=mesh, constraints=mode, compare=alone.in_shardings)
        assert p.asked is not None and p.on_its_own is not None
        got = (p.on_its_own.time_s, p.on_its_own.peak_bytes)
        assert got == (alone.prediction.time_s, alone.prediction.peak_bytes)
        (row,) = [line for line in p.explain().splitlines() if "without your layout" in line]
        assert "this plan 1.00x as fast, 1.00x the memory" in row
    departs = planner.plan(step, *args, mesh=mesh, compare=layout)
    assert departs.on_its_own is None and "without your layout" not in departs.explain()


def test_a_scan_carries_its_value_in_the_layout_its_body_asks(mesh):
    """A carry entering a scan in one layout (an embedding lookup's, from the table's split)
    whose body constrains it to another is carried in the body's layout, moved once as the loop
    starts (as XLA settles a while loop's carry; MaxText's decoder), and the step is exact."""
    batch_split = P("fsdp", None)

    def loss(table, ws, ids):
        def layer(h, w):
            h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, batch_split))
            h = jnp.tanh(h @ w)
            return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, batch_split)), None

        h, _ = jax.lax.scan(layer, table[ids], ws)
        return jnp.mean(h**2)

    step = jax.value_and_grad(loss, argnums=(0, 1))
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.normal(size=(128, 32)), jnp.float32),
            jnp.asarray(rng.normal(size=(3, 32, 32)) / 6, jnp.float32),
            jnp.asarray(rng.integers(0, 128, size=(16,)), jnp.int32))  # fmt: skip
    layout = (P(None, "fsdp"), P(None, None, "tensor"), P())
    mine = planner.price(step, *args, mesh=mesh, in_shardings=layout)
    carries = [o for o in mine.program.ops if o.primitive == "scan_carry"]
    assert carries
    fsdp = set(MeshShape.of(dict(mesh.shape)).axis_factors("fsdp"))
    for op in carries:
        rows, cols = mine.schedule.spec(op, op.results[0])
        assert set(rows) == fsdp and not cols, (rows, cols)
    _close(mine.jit()(*args), step(*args), rtol=1e-4)


def test_a_carry_started_from_zeros_takes_the_split_its_users_want(mesh):
    """An accumulator carried from zeros (MaxText's vocabulary tiling sums the unembedding's
    gradient over its chunks) takes the split the update after the loop wants, as XLA settles
    a while loop's carry on its users, not whole on every device; the step is exact."""

    def step(w, xs):
        def chunk(acc, x):
            return acc + jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w), None

        g, _ = jax.lax.scan(chunk, jnp.zeros_like(w), xs)
        return w - 0.1 * g

    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.normal(size=(32, 64)) / 6, jnp.float32),
            jnp.asarray(rng.normal(size=(4, 16, 32)), jnp.float32))  # fmt: skip
    mine = planner.price(step, *args, mesh=mesh, in_shardings=(P("fsdp"), P(None, "tensor")))
    (carry,) = [o for o in mine.program.ops if o.primitive == "scan_carry"]
    fsdp = set(MeshShape.of(dict(mesh.shape)).axis_factors("fsdp"))
    assert set(mine.schedule.spec(carry, carry.results[0])[0]) == fsdp
    _close(mine.jit()(*args), step(*args), rtol=1e-4)


def test_a_gradient_takes_the_more_specific_split_its_update_asks(mesh):
    """A weight's gradient whose product splits it over ``tensor`` alone (the activations'
    embedding split, MaxText's) takes the optimizer state's fsdp x tensor split from its update,
    through its elementwise ops and the norm that reads it first, as XLA keeps the more specific
    of two shardings that conflict (MaxText's Llama 3.1 405B on v6e: 131 GB per chip priced with
    the gradients held over ``tensor`` alone, 27.6 GB so, 31.1 compiled); the step is exact."""

    def constrained(x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def step(state, x, dy):
        w, mu = state
        g = constrained(x, "fsdp", "tensor").T @ constrained(dy, "fsdp", None)
        g = g * 0.5  # [E, H]: E over tensor as the product leaves it, summed over fsdp
        norm = jnp.sum(g * g)
        mu = 0.9 * mu + g / jnp.maximum(1.0, jnp.sqrt(norm))
        return (w - 0.1 * mu, mu), norm

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    args = ((w, jnp.zeros_like(w)), jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
            jnp.asarray(rng.normal(size=(64, 16)), jnp.float32))  # fmt: skip
    given = ((P("fsdp", "tensor"), P("fsdp", "tensor")), P("fsdp", "tensor"), P("fsdp"))
    mine = planner.price(step, *args, mesh=mesh, in_shardings=given, donate_argnums=0)
    factors = MeshShape.of(dict(mesh.shape))
    state = (factors.axis_factors("fsdp"), factors.axis_factors("tensor"))
    gradient = [o for o in mine.program.ops
                if o.primitive in ("mul", "div") and o.results[0].value.shape == (32, 16)]  # fmt: skip
    assert len(gradient) >= 3
    for o in gradient:
        assert mine.schedule.spec(o, o.results[0]) == state, o.name
    _close(mine.jit()(jax.tree.map(jnp.copy, args[0]), *args[1:]), step(*args), rtol=1e-4)


def _product_then_constraint(mesh):
    """An MLP's product whose activation a constraint splits after an elementwise op (its result
    the largest tensor), and a vocabulary head whose logits are summed over the vocabulary the
    weight splits, each with its inputs' layouts."""

    def constrained(x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def mlp(x, w):
        return constrained(jax.nn.silu(x @ w), "fsdp", "tensor")

    def head(x, w):
        logits = x @ w
        return constrained(logits - jax.nn.logsumexp(logits, -1, keepdims=True), "fsdp", "tensor")

    return [(mlp, (jnp.ones((512, 64)), jnp.ones((64, 128))), (P("fsdp", "tensor"),) * 2),
            (head, (jnp.ones((512, 32)), jnp.ones((32, 64))),
             (P("fsdp", "tensor"), P(None, "tensor")))]  # fmt: skip


@pytest.mark.parametrize("case", [0, 1], ids=["mlp", "head"])
def test_xlas_rule_completes_the_users_layout_as_xla_compiles_it(mesh, case):
    """XLA's rule for products (``order="largest"``): the largest tensor's split wins, a
    result's constraint reaching back through elementwise ops, and a reduction of one operand
    splits as that operand arrives (partial sums summed, not the logits gathered), so the
    collectives priced are XLA's own, kind for kind (before: the product split over its
    contraction, partial sums scattered, where XLA gathers the activation)."""
    f, args, layout = _product_then_constraint(mesh)[case]
    mine = planner.price(f, *args, mesh=mesh, in_shardings=layout)
    prog, sizes = mine.program, dict(mesh.shape)
    asked = requested_assignment(prog, MeshShape.of(sizes), True)[0]
    stored = {v.name: mine.schedule.stored[v.name] for v in prog.inputs}
    sched = make_schedule(prog, asked, sizes, stored=stored, xla=True, order="largest")
    ours = collections.Counter({k.value: int(t.count) for k, t in
                                planner.simulate(prog, sched, mine.calibration).traffic().items()
                                if k != "copy"})  # fmt: skip
    shardings = tuple(NamedSharding(mesh, s) for s in layout)
    _, theirs = _compiled_traffic(jax.jit(f, in_shardings=shardings).lower(*args).compile())
    assert ours == theirs
    _close(planner.lower(prog, sched, mesh, "xla")(*args), f(*args), rtol=1e-4)
