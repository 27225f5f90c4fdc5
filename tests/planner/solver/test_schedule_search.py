"""planner.search / plan / auto_shard: optimal on small chains, memory limits, end to end."""

import functools
import types

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from planner_checks import brute_force
from planner_programs import ALL, chain, matmul, mlp_args, rand, sgd_step

import planner
from planner.cost.simulator import simulate
from planner.program.schedule import make_schedule
from planner.solver.schedule_search import search
from planner.solver.ties import wins_on_memory


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ALL, axis_types=(AxisType.Auto,) * 3)


CHAINS = [((512, 64), (64, 32), (32, 16)), ((16, 64), (64, 512), (512, 8))]


@functools.cache
def _brute_forced(shapes) -> tuple[float, float]:
    """``brute_force(prog, sizes, with_peak=True)`` of :func:`chain` on arrays of ``shapes`` on the
    2x2x2 mesh: the fastest time, and the leanest peak at that time (every assignment simulated,
    most of a second), made once for the two tests below."""
    prog = planner.analyze(chain, *[jax.ShapeDtypeStruct(s, np.float32) for s in shapes])
    return brute_force(prog, dict.fromkeys(ALL, 2), with_peak=True)


@pytest.mark.parametrize("shapes", CHAINS)
def test_dynamic_programming_search_is_optimal_on_small_chains(mesh, shapes):
    prog = planner.analyze(chain, *[rand(*s) for s in shapes])
    _, pred = search(prog, dict(mesh.shape), exhaustive_limit=0, greedy_ops=0)  # DP passes only
    assert pred.time_s == pytest.approx(_brute_forced(shapes)[0])


@pytest.mark.parametrize("shapes", CHAINS)
def test_search_is_optimal_on_small_chains(mesh, shapes):
    args = [rand(*s) for s in shapes]
    prog = planner.analyze(chain, *args)
    sched, pred = search(prog, mesh)
    fastest = _brute_forced(shapes)
    best = fastest[0]  # what brute_force(prog, sizes) returns
    assert pred.time_s == pytest.approx(best)
    again, _ = search(prog, mesh)
    assert again.assign == sched.assign  # deterministic
    # exhaustive up to relabelling interchangeable factors: 816 simulations instead of 4096;
    # the fastest, or within the time tie one that frees enough memory (planner.solver.ties)
    _, joint = search(prog, mesh, exhaustive_limit=4096)
    assert joint.time_s == pytest.approx(best) or wins_on_memory(
        (joint.time_s, joint.peak_bytes), fastest)  # fmt: skip


def test_equal_plans_prefer_whole_mesh_axes():
    from planner.solver.schedule_search import _whole_axes, interchangeable
    from redist.calibration import Calibration
    from redist.types import MeshShape

    shape = MeshShape.of({"a": 2, "b": 4})
    classes = interchangeable(shape, Calibration.default())
    assert classes == [("a", "b#0", "b#1")]
    # one factor of b alone would need b split into parts; a is the same size and whole
    assert _whole_axes({"op": {"m": ("b#0",)}}, shape, classes) == {"op": {"m": ("a",)}}
    whole = {"op": {"m": ("b#0", "b#1"), "n": ("a",)}}
    assert _whole_axes(whole, shape, classes) == whole
    h100 = Calibration.named("h100_sxm")  # groups can leave an 8-GPU host: factors differ
    big = MeshShape.of({"data": 64, "model": 8})
    assert len(interchangeable(big, h100)) == len(big.factor_names)


def test_search_picks_data_parallel_for_tall_and_columns_for_wide(mesh):
    tall = planner.analyze(matmul, rand(4096, 256), rand(256, 64))
    wide = planner.analyze(matmul, rand(64, 256), rand(256, 4096))
    assert search(tall, mesh)[0].grid(tall.ops[0]) == "m:axbxc n:- k:-"
    assert search(wide, mesh)[0].grid(wide.ops[0]) == "m:- n:axbxc k:-"


def test_memory_limit_is_respected_and_explained(mesh):
    x, w = rand(4096, 256), rand(256, 64)
    prog = planner.analyze(matmul, x, w)
    replicated = simulate(prog, make_schedule(prog, {}, dict(mesh.shape), default="replicate"))
    _, lpred = search(prog, mesh, memory_limit_bytes=replicated.peak_bytes // 2)
    assert lpred.peak_bytes <= replicated.peak_bytes // 2
    with pytest.raises(ValueError, match=r"no schedule fits memory_limit_bytes=1000; the smallest"):
        search(prog, mesh, memory_limit_bytes=1000)


def test_where_nothing_fits_the_error_holds_the_fastest_schedule_of_least_memory(mesh):
    """Of the schedules the failing search made (its memo), the one the error holds has the least
    predicted peak, the peak it names, and is the fastest at that peak."""
    from planner.solver import schedule_search as ss

    prog = planner.analyze(sgd_step, *mlp_args())
    memo = ss.Evaluations()
    with pytest.raises(planner.MemoryLimitError) as info:
        search(prog, mesh, memory_limit_bytes=1000, memo=memo, greedy_ops=0)
    sched, pred = info.value.leanest
    made = [m[2] for _, table in memo._tables.values() for m in table.values() if m is not None]
    least = min(p.peak_bytes for p in made)
    assert pred.peak_bytes == least == info.value.peak.bytes
    assert pred.time_s == min(p.time_s for p in made if p.peak_bytes == least)
    assert simulate(prog, sched).peak_bytes == least  # the schedule, as the search returns one
    # of schedules tied at the least peak, the faster is held, whatever the order they came in
    evaluate = ss._Evaluator(prog, dict(mesh.shape), None, 1000, ss.groups(prog))
    for peak, time_s, name in [(9, 1.0, "lean"), (5, 3.0, "slow"), (5, 2.0, "fast"), (5, 2.5, "x")]:
        evaluate._score((name, name, types.SimpleNamespace(peak_bytes=peak, time_s=time_s)))
    assert evaluate.leanest[0] == "fast" and evaluate.best_peak == 5


def test_searches_under_several_limits_share_the_schedules_they_make(mesh, monkeypatch):
    """One memo across searches under different memory limits: each schedule is made once, and
    every search finds what it finds alone (the limit is applied per search, not remembered)."""
    from planner.solver import schedule_search as ss

    prog = planner.analyze(sgd_step, *mlp_args())
    made = []
    real = ss.make_schedule
    monkeypatch.setattr(ss, "make_schedule", lambda *a, **k: made.append(1) or real(*a, **k))
    free = search(prog, mesh)[1].peak_bytes
    limits = [None, int(free * 0.9), int(free * 0.3)]
    made.clear()
    alone = [search(prog, mesh, memory_limit_bytes=b) for b in limits]
    made_alone = len(made)
    memo = ss.Evaluations()
    made.clear()
    shared = [search(prog, mesh, memory_limit_bytes=b, memo=memo) for b in limits]
    for (s1, p1), (s2, p2) in zip(alone, shared):
        assert s2.assign == s1.assign
        assert (p2.time_s, p2.peak_bytes) == (p1.time_s, p1.peak_bytes)
    assert alone[2][1].peak_bytes <= limits[2] < alone[1][1].peak_bytes  # the limits bite
    tables = [table for _, table in memo._tables.values()]
    assert len(made) == sum(key[0] == "made" for t in tables for key in t)  # each made once
    assert len(made) < made_alone
    made.clear()
    assert (
        search(prog, mesh, memory_limit_bytes=limits[1], memo=memo)[0].assign == alone[1][0].assign
    )
    assert not made
    with pytest.raises(ValueError, match="the smallest predicted peak seen"):  # seen in the memo
        search(prog, mesh, memory_limit_bytes=1000, memo=memo)


def test_the_greedy_fallback_runs_only_where_asked(mesh, monkeypatch):
    """On a program past ``greedy_ops``, the greedy passes run only where every other candidate
    breaks the limit, and not at all without ``greedy_fallback`` (what :func:`leaner` asks for:
    a plan found only so trades time for memory); that search raises where nothing else fits."""
    from planner.solver import schedule_search as ss

    prog = planner.analyze(sgd_step, *mlp_args())
    calls = []
    real = ss._greedy
    monkeypatch.setattr(ss, "_greedy", lambda *a: calls.append(1) or real(*a))
    free = search(prog, mesh, greedy_ops=0)[1]
    assert not calls
    for fallback in (True, False):  # nothing fits 1000 bytes: the greedy passes run, or not
        with pytest.raises(ValueError, match="memory_limit_bytes=1000"):
            search(prog, mesh, memory_limit_bytes=1000, greedy_ops=0, greedy_fallback=fallback)
        assert bool(calls) == fallback
        calls.clear()
    asked = []
    monkeypatch.setattr(
        ss,
        "search",
        lambda *a, **k: asked.append(k) or (_ for _ in ()).throw(planner.MemoryLimitError(1)),
    )
    found = (None, free)
    assert ss.leaner(prog, ss.mesh_shape(mesh), None, found, free.peak_bytes * 1.5) is found
    assert asked and all(k["greedy_fallback"] is False for k in asked)


def test_plan_and_auto_shard_end_to_end(mesh):
    params, x, y = mlp_args()
    p = planner.plan(sgd_step, params, x, y, mesh=mesh)
    got = p(params, x, y)
    want = sgd_step(params, x, y)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert (
        len(
            jax.tree.leaves(p.in_specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
        )
        == 4
    )
    assert "predicted" in p.explain() and '"schedule"' in p.to_json()
    f = planner.auto_shard(matmul, mesh=mesh)
    a, b = rand(4096, 256), rand(256, 64)
    np.testing.assert_allclose(f(a, b), matmul(a, b), rtol=1e-4, atol=1e-4)
    f(a, b)
    assert len(f.plans) == 1


def _norm_mlp_layer(h, p):
    """A pre-norm MLP block: LayerNorm (scale, offset), then two biased layers, residual."""
    g, o, w1, b1, w2, b2 = p
    mu = h.mean(-1, keepdims=True)
    y = (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + o
    return h + jax.nn.gelu(y @ w1 + b1) @ w2 + b2


def _scanned_sgd_step(params, x):
    """Two stacked layers run with ``lax.scan`` (as ``hk.layer_stack`` and flax's ``nn.scan``
    produce), ``value_and_grad`` of ``mean(h**2)`` and an SGD update."""

    def loss(params, x):
        h, _ = jax.lax.scan(lambda h, p: (_norm_mlp_layer(h, p), None), x, params)
        return jax.numpy.mean(h**2)

    value, grads = jax.value_and_grad(loss)(params, x)
    return [p - 0.1 * d for p, d in zip(params, grads)], value


def test_scanned_layers_split_at_least_as_well_as_by_hand(mesh):
    """The forward and backward scans read each layer's weight (and saved activation) as
    different body values; the search groups a layer's products through the scans' boundaries
    (as with a Python loop of layers) and finds a plan at least as fast as splitting every
    product of the body on its 128-wide loop over the whole mesh, which it used to miss."""
    rng = np.random.default_rng(0)
    layers, d, hidden = 2, 32, 128
    params = [1 + 0.1 * rand(layers, d), 0.1 * rand(layers, d),
              0.1 * rand(layers, d, hidden), 0.1 * rand(layers, hidden),
              0.1 * rand(layers, hidden, d), 0.1 * rand(layers, d)]  # fmt: skip
    # (a batch of 64: at 8 the simulator prices replication fastest, rightly on this host)
    x = rng.standard_normal((64, 16, d)).astype(np.float32)
    p = planner.plan(_scanned_sgd_step, params, x, mesh=mesh)
    prog = p.program
    assert [r.kind for r in prog.regions] == ["scan", "scan"]
    dense = [o for o in prog.ops if o.dense]
    assert len(dense) == 6
    hand = {o.name: {next(lp.name for lp in o.loops if lp.extent == hidden): ALL} for o in dense}
    by_hand = simulate(prog, prog.schedule(hand, mesh))
    assert by_hand.time_s < 0.75 * p.replicated.time_s  # splitting pays here
    assert p.prediction.time_s <= by_hand.time_s * (1 + 1e-9)
    assert all(p.schedule.assign.get(o.name) for o in dense)
    want = jax.jit(_scanned_sgd_step)(params, x)
    got = jax.tree.unflatten(p.out_tree, list(p.lowered(params, x)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def _embedding_step(table, w, tokens, y):
    def loss(table, w):
        return jax.numpy.mean((jax.numpy.tanh(table[tokens] @ w) - y) ** 2)

    value, (g_table, g_w) = jax.value_and_grad(loss, argnums=(0, 1))(table, w)
    return table - 0.1 * g_table, w - 0.1 * g_w, value


def test_refine_moves_an_embeddings_gradient_off_the_batch_split():
    """Data parallel over 8 devices, the lookup and its gradient's scatter-add follow the batch
    split, so the whole table's gradient is all-reduced; ``refine`` (the search's last pass over
    the propagated ops) gives the scatter-add the fastest of its other layouts (each of its
    loops over the same factors, or none), is predicted faster, leaves the ops the search chose
    as they were, and the refined schedule runs exactly."""
    import dataclasses

    from planner.solver.schedule_search import _Evaluator, groups, refine
    from planner.solver.strategies import data_parallel
    from redist.calibration import Calibration
    from redist.types import MeshShape

    rng = np.random.default_rng(0)
    f = np.float32
    args = (rng.standard_normal((4096, 128)).astype(f), (rng.standard_normal((128, 128)) / 12).astype(f),
            rng.integers(0, 4096, (16, 32)).astype(np.int32), rng.standard_normal((16, 32, 128)).astype(f))  # fmt: skip
    prog = planner.analyze(_embedding_step, *args)
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    sizes, cal = {"d": 8}, Calibration.named("tpu_v5p")
    sched = make_schedule(prog, data_parallel(prog, ["d"]), sizes)
    evaluate = _Evaluator(prog, sizes, cal, None, groups(prog))
    before = evaluate.schedule(sched)
    after = refine(before, evaluate, MeshShape.of(sizes))
    scatter = next(o for o in prog.ops if o.primitive == "scatter-add")
    factors = sum(sched.assign[scatter.name].values(), ())
    assert factors and before[3].ops[prog.index[scatter.name]].comm_s > 0
    options = [{}] + [{lp.name: factors} for lp in scatter.loops]
    times = {str(o): evaluate.schedule(dataclasses.replace(sched, assign={**sched.assign,
                                                                         scatter.name: o}))[0]
             for o in options}  # fmt: skip
    assert after[2].assign[scatter.name] != sched.assign[scatter.name]
    assert after[0] <= min(times.values()) * (1 + 1e-9) and after[0] < before[0], times
    dots = [o.name for o in prog.ops if o.dense]
    assert all(after[2].assign.get(n) == sched.assign.get(n) for n in dots)
    want = jax.jit(_embedding_step)(*args)
    got = planner.lower(prog, after[2], mesh, backend="xla")(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def _attention_step(params, x):
    """A grouped-query attention block (few key and value heads) and an MLP, ``value_and_grad``
    of ``mean(h**2)`` and an SGD update."""
    import jax.numpy as jnp

    def loss(params, x):
        wq, wk, wv, wo, w1, w2 = params
        q, k, v = (jnp.einsum("bse,ehd->bshd", x, w) for w in (wq, wk, wv))
        k, v = (jnp.repeat(t, q.shape[2] // t.shape[2], 2) for t in (k, v))
        a = jax.nn.softmax(jnp.einsum("bshd,bthd->bhst", q, k), -1)
        h = x + jnp.einsum("bshd,hde->bse", jnp.einsum("bhst,bthd->bshd", a, v), wo)
        return jnp.mean((h + jax.nn.silu(h @ w1) @ w2) ** 2)

    value, grads = jax.value_and_grad(loss)(params, x)
    return [p - 0.1 * d for p, d in zip(params, grads)], value


def _attention_args(embed, heads, kv, head, mlp, batch, seq, dtype):
    shapes = [(embed, heads, head), (embed, kv, head), (embed, kv, head), (heads, head, embed),
              (embed, mlp), (mlp, embed)]  # fmt: skip
    return [jax.ShapeDtypeStruct(s, dtype) for s in shapes], jax.ShapeDtypeStruct(
        (batch, seq, embed), dtype
    )


def test_refine_products_moves_one_axis_of_a_product_at_a_time():
    """``refine_products`` improves an expert's strategy product by product: each product it
    changes is one of :func:`axis_moves` of its split (one mesh axis moved to another loop, or
    dropped), the result is what :func:`best_of` prefers to the strategy, and on a
    grouped-query attention block at pod-like size on v5p it is faster for some strategy (the
    few key and value heads split over their contraction rather than the activation gathered)."""
    import jax.numpy as jnp

    from planner.solver import strategies
    from planner.solver.schedule_search import _Evaluator, axis_moves, groups, refine_products
    from planner.solver.ties import best_of
    from redist.calibration import Calibration
    from redist.types import MeshShape

    params, x = _attention_args(1024, 8, 2, 128, 4096, 32, 1024, jnp.bfloat16)
    prog = planner.analyze(_attention_step, params, x)
    sizes = {"fsdp": 4, "tensor": 2}
    shape = MeshShape.of(sizes)
    evaluate = _Evaluator(prog, sizes, Calibration.named("tpu_v5p"), None, groups(prog), xla=True)
    gained = []
    for seed in strategies.experts(prog, sizes).seeds:
        before = evaluate.schedule(seed)
        after = refine_products(before, evaluate, shape)
        assert best_of([before, after]) is after
        for o in prog.ops:
            was, now = before[2].assign.get(o.name, {}), after[2].assign.get(o.name, {})
            if was != now:
                assert o.dense and now in axis_moves(o, was, shape, True), o.name
        gained.append(before[0] / after[0])
    assert max(gained) > 1.01, gained


def test_products_moved_an_axis_at_a_time_run_exactly():
    """Every schedule ``refine_products`` can emit (an expert's strategy with products moved by
    :func:`axis_moves`), drawn at random, computes the unsharded step."""
    import random

    import jax.numpy as jnp

    from planner.solver import strategies
    from planner.solver.schedule_search import axis_moves
    from redist.types import MeshShape

    params, x = _attention_args(32, 4, 2, 8, 64, 8, 16, jnp.float32)
    prog = planner.analyze(_attention_step, params, x)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    sizes = dict(mesh.shape)
    shape = MeshShape.of(sizes)
    rng, nprng = random.Random(0), np.random.default_rng(0)
    real = [nprng.standard_normal(p.shape).astype(np.float32) * 0.1 for p in params]
    xs = nprng.standard_normal(x.shape).astype(np.float32)
    want = jax.jit(_attention_step)(real, xs)
    for seed in strategies.experts(prog, sizes).seeds[:4]:
        assign = dict(seed.assign)
        for o in prog.ops:
            moves = axis_moves(o, assign.get(o.name, {}), shape, True) if o.dense else []
            if moves and rng.random() < 0.5:
                assign[o.name] = rng.choice(moves)
        sched = make_schedule(prog, assign, sizes, stored=seed.stored, xla=True)
        got = planner.lower(prog, sched, mesh, backend="xla")(real, xs)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
