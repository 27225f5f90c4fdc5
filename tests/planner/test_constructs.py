"""planner on the constructs real programs use: reductions of every kind, control flow, indexing,
random numbers, custom rules, rematerialisation, literals; each checked against the unsharded
function."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import planner
from experiments.measure import hlo_collectives
from planner.program import discover

RNG = np.random.default_rng(1)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def run(fn, args, assign, mesh):
    """Lower ``fn`` under ``assign`` (a dict, or a function of the program) and compare."""
    prog = planner.analyze(fn, *args)
    sched = prog.schedule(assign(prog) if callable(assign) else assign, mesh)
    low = planner.lower(prog, sched, mesh)
    for got, want in zip(jax.tree.leaves(low(*args)), jax.tree.leaves(jax.jit(fn)(*args))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    return prog, sched, low


def split_first_loop(primitives, axes="a"):
    def assign(prog):
        return {o.name: {o.loops[0].name: axes} for o in prog.ops
                if o.primitive in primitives and o.loops}  # fmt: skip

    return assign


# ----- 1. every partitioned reduction is combined by its own operation -----


@pytest.mark.parametrize(
    "reduce, collective",
    [(jnp.max, "all-reduce"), (jnp.min, "all-reduce"), (jnp.sum, "all-reduce")],
)
def test_split_max_and_min_are_combined_by_their_own_op(reduce, collective, mesh):
    # The reported bug: max over a split dimension combined by psum gave 8.0 instead of 1.0.
    x = np.ones((1, 256), np.float32)
    w = np.abs(rand(256, 2048)) + 1.0
    fn = lambda x, w: reduce(jnp.tanh(x @ w), axis=1)  # noqa: E731
    prog, sched, low = run(fn, (x, w), {"dot_general_0": {"n": ("a", "b", "c")}}, mesh)
    red = next(o for o in prog.ops if o.primitive.startswith("reduce_"))
    assert sched.pending(red) and sched.combine(red) == reduce.__name__.replace("amax", "max")
    assert np.allclose(low(x, w), fn(x, w))


def test_boolean_any_all_split_and_exact(mesh):
    x = rand(8, 16)
    for fn in (lambda x: jnp.any(x > 1.0, axis=1), lambda x: jnp.all(x > -1.0, axis=1)):
        boolean = ("reduce_or", "reduce_and")
        split = lambda p: {o.name: {"r1": ("a", "b")} for o in p.ops if o.primitive in boolean}  # noqa: E731, B023
        prog, sched, _ = run(fn, (x,), split, mesh)
        assert [sched.combine(o) for o in prog.ops if sched.pending(o)] in (["or"], ["and"])


@pytest.mark.parametrize(
    "fn, dtype",
    [(lambda x: jnp.prod(x, axis=1), np.float32), (lambda x: jnp.argmax(x, axis=1), np.float32),
     (lambda x: jnp.bitwise_and.reduce(x, axis=1), np.int32)],
)  # fmt: skip
def test_uncombinable_reductions_are_never_split(fn, dtype, mesh):
    x = (rand(4, 8) * 3).astype(dtype)
    prog = planner.analyze(fn, x)
    red = prog.ops[-1]
    loop = next(name for name, _ in red.reductions)
    assert not red.loop[loop].partitionable
    with pytest.raises(ValueError, match="cannot be partitioned|cannot be combined"):
        prog.schedule({red.name: {loop: "a"}}, mesh)


# ----- 3. no crash on real code -----


def test_prng_keys_typed_and_raw_run_whole_and_exact(mesh):
    x = rand(16, 8)
    for key in (jax.random.key(0), jax.random.PRNGKey(0)):
        fn = lambda k, x: jnp.where(jax.random.bernoulli(k, 0.5, x.shape), x / 0.5, 0.0)  # noqa: E731
        prog, _, _ = run(fn, (key, x), split_first_loop(("select_n",), ("a", "b")), mesh)
        rand_ops = [o for o in prog.ops if o.primitive.startswith("random_")]
        assert rand_ops and not any(lp.partitionable for o in rand_ops for lp in o.loops)


def test_literals_through_nested_jit(mesh):
    inner = jax.jit(lambda y, s: (y * s, 2.0))
    run(lambda x: inner(x, 3.0), (rand(8, 4),), {}, mesh)
    run(lambda x: (x + 1.0, 7), (rand(8, 4),), {}, mesh)


def test_custom_jvp_rule_is_kept_when_the_plan_is_differentiated(mesh):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), 3.0 * t[0]))  # not sin's derivative: the rule must be used
    fn = lambda x: jnp.sum(f(x) * 2.0)  # noqa: E731
    x = rand(8, 4)
    prog = planner.analyze(fn, x)
    assert [r.kind for r in prog.regions] == ["custom_jvp"]
    low = planner.lower(prog, prog.schedule(split_first_loop(("sin",))(prog), mesh), mesh)
    np.testing.assert_allclose(jax.grad(low)(x), np.full((8, 4), 6.0), rtol=1e-6)


def test_custom_vjp_rule_is_kept(mesh):
    @jax.custom_vjp
    def f(x):
        return x * 2.0

    f.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 5.0,))
    x = rand(8, 4)
    prog = planner.analyze(lambda x: jnp.sum(f(x)), x)
    low = planner.lower(prog, prog.schedule({}, mesh), mesh)
    np.testing.assert_allclose(jax.grad(low)(x), np.full((8, 4), 5.0))


def test_checkpoint_keeps_its_region_and_barrier(mesh):
    body = jax.checkpoint(lambda y: jnp.sin(jnp.sin(y)))
    fn = jax.grad(lambda x: jnp.sum(body(x)))
    x = rand(16, 8)
    prog, _, low = run(fn, (x,), split_first_loop(("sin", "cos", "mul")), mesh)
    assert "checkpoint" in [r.kind for r in prog.regions]
    assert "optimization_barrier" in low.lower(x).as_text()


def test_unknown_ops_run_replicated_and_say_so(mesh, monkeypatch):
    monkeypatch.setattr(planner.program.rules, "rule_for", lambda p: None)
    monkeypatch.setattr(discover, "discover", lambda *a, **k: None)
    with pytest.warns(UserWarning, match=r"tanh x1 \(\d+\.\d% of flops\)"):
        prog = planner.analyze(lambda x: jnp.tanh(x), rand(4, 4))
    assert prog.ops[0].how == "replicated"


def test_known_programs_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planner.analyze(lambda x, w: jax.nn.relu(x @ w).sum(), rand(8, 4), rand(4, 4))


# ----- 4. control flow is planned -----


def _layers(x, ws):
    return lax.scan(lambda c, w: (jnp.tanh(c @ w), jnp.sum(c)), x, ws)


def test_scan_body_is_split_with_collectives_inside_the_loop(mesh):
    x, ws = rand(16, 32), rand(3, 32, 32) / 4
    dot = lambda p: {o.name: {"n": "a", "m": "b"} for o in p.ops if o.primitive == "dot_general"}  # noqa: E731
    prog, sched, low = run(_layers, (x, ws), dot, mesh)
    (region,) = prog.regions
    assert region.kind == "scan" and sum(o.primitive == "dot_general" for o in prog.ops) == 1
    body = prog.ops[region.body]
    assert body.trips == 3 and sched.axes_of(body, "n") == ("a",)
    xs = next(o for o in prog.ops if o.primitive == "scan_xs")
    assert sched.spec(xs, xs.operands[0])[0] == ()  # the layer axis stays whole
    carry_in, carry_out = prog.ties[0]
    assert sched.assign[carry_in] == sched.assign[carry_out]  # one layout at entry and exit
    hlo = low.lower(x, ws).compile().as_text()
    assert "while" in hlo and hlo_collectives(hlo)


def test_gradient_through_a_planned_scan(mesh):
    x, ws = rand(16, 32), rand(3, 32, 32) / 4
    loss = lambda ws, x: jnp.sum(_layers(x, ws)[0] ** 2)  # noqa: E731
    dot = lambda p: {o.name: {o.loops[0].name: "a"} for o in p.ops if o.primitive == "dot_general"}  # noqa: E731
    prog, sched, low = run(jax.grad(loss), (ws, x), dot, mesh)
    assert [r.kind for r in prog.regions] == ["scan", "scan"]
    # and the planned forward, differentiated by JAX
    fprog = planner.analyze(loss, ws, x)
    flow = planner.lower(fprog, fprog.schedule(dot(fprog), mesh), mesh)
    np.testing.assert_allclose(jax.grad(flow)(ws, x), jax.grad(loss)(ws, x), rtol=1e-4, atol=1e-5)


def test_scan_is_priced_as_trips_times_its_body(mesh):
    from redist.calibration import Calibration

    x = rand(16, 32)
    times = []
    for n in (2, 4):
        ws = rand(n, 32, 32)
        prog = planner.analyze(_layers, x, ws)
        times.append(planner.simulate(prog, prog.schedule({}, mesh)).time_s)
    call = Calibration.default().step_s  # the program's call, once whatever the trips
    assert times[1] - call == pytest.approx(2 * (times[0] - call), rel=0.05)


def test_while_and_cond_keep_operands_split(mesh):
    x, w = rand(16, 32), rand(32, 32) / 4
    dense = split_first_loop(("dot_general", "tanh", "add"))
    fori = lambda x, w, n: lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w), x)  # noqa: E731
    prog, sched, _ = run(fori, (x, w, np.int32(3)), dense, mesh)
    assert [r.kind for r in prog.regions] == ["while"]
    carry = next(o for o in prog.ops if o.primitive == "while_carry" and o.loops)
    assert sched.axes_of(carry, "i0") == ("a",)
    branch = lambda p, x: lax.cond(p, lambda x: jnp.tanh(x @ w), lambda x: x + 1.0, x)  # noqa: E731
    for p in (True, False):
        prog, sched, _ = run(branch, (np.bool_(p), x), dense, mesh)
    merge = next(o for o in prog.ops if o.primitive == "cond_merge")
    assert sched.axes_of(merge, "i0") == ("a",)


# ----- 5. indexing ops split the dimensions they do not index -----


def test_embedding_lookup_and_its_scatter_add_gradient_split_by_tokens(mesh):
    table, ids = rand(50, 16), RNG.integers(0, 50, (8, 12)).astype(np.int32)
    fn = jax.grad(lambda e, i: jnp.sum(jnp.take(e, i, axis=0) ** 2))

    def scatter(p):
        return {o.name: {"r0": "a", "r1": "b"} for o in p.ops if o.primitive == "scatter-add"}

    prog, sched, _ = run(fn, (table, ids), scatter, mesh)
    op = next(o for o in prog.ops if o.primitive == "scatter-add")
    assert sched.pending(op) == ("a", "b")


def test_cross_entropy_with_take_along_axis_splits_the_batch(mesh):
    logits, labels = rand(16, 10), RNG.integers(0, 10, (16,)).astype(np.int32)

    def xent(z, y):
        z = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)
        return -jnp.mean(jnp.take_along_axis(z, y[:, None], axis=-1))

    gather = lambda p: {o.name: {"i0": ("a", "b")} for o in p.ops if o.primitive == "gather"}  # noqa: E731
    run(xent, (logits, labels), gather, mesh)
    run(jax.grad(xent), (logits, labels), gather, mesh)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: jnp.split(x, 2, axis=-1)[1] * 2.0,
        lambda x: x[:, 2:6] + 1.0,
        lambda x: jnp.pad(x, ((0, 0), (1, 2))),
        lambda x: jnp.cumsum(x, axis=1),
        lambda x: jnp.sort(x, axis=1),
        lambda x: lax.top_k(x, 3)[0],
        lambda x: jnp.flip(x, axis=1),
        lambda x: lax.dynamic_slice_in_dim(x, 2, 3, axis=1),
        lambda x: lax.dynamic_update_slice_in_dim(x, jnp.ones((8, 2)), 3, axis=1),
        lambda x: jnp.concatenate([x, x], axis=1),
        lambda x: jnp.tile(x, (1, 3)) * 2.0,  # the tile primitive of JAX >= 0.11
    ],
)
def test_indexing_ops_split_their_free_dimension(fn, mesh):
    x = rand(8, 8)
    prog, sched, _ = run(fn, (x,), lambda p: {p.ops[-1].name: {"i0": ("a", "b", "c")}}, mesh)
    main = max(prog.ops, key=lambda o: len(o.loops))
    assert main.loop["i0"].partitionable


def _regroup(shape):
    return lambda x: (x * 2.0).reshape(shape) + jnp.tile(x[:1, :1], (16, 4, 1)).reshape(shape)


@pytest.mark.parametrize("shape", [(16, 4, 3), (64, 3), (2, 32, 3)])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("transform", ["none", "vmap", "grad"])
def test_a_regrouping_reshape_splits_through_the_sizes_both_sides_merge(
    shape, seed, transform, mesh
):
    # MaxText's vocabulary tiling: (4 chunks, 2M tokens, d) -> (1024, 8192, d), its result
    # constrained to the batch split. (4, 16) -> (16, 4) goes through (4, 4, 4): a loop after
    # the first may be split where the loops before it are split into single iterations.
    base = _regroup(shape)
    fn, x = {"none": (base, rand(4, 16, 3)), "vmap": (jax.vmap(base), rand(2, 4, 16, 3)),
             "grad": (jax.grad(lambda x: jnp.sum(base(x) ** 2)), rand(4, 16, 3))}[transform]  # fmt: skip
    rng = np.random.default_rng(seed)

    def random_split(p):
        op = next(o for o in p.ops if o.primitive == "reshape")
        axes, out = ["a", "b", "c"], {}
        rng.shuffle(axes)
        for lp in op.loops:  # major first, each loop split fully before the next is split
            take = [a for a in axes if a not in {b for v in out.values() for b in v}]
            k = int(rng.integers(0, len(take) + 1))
            while k and lp.extent % 2**k:
                k -= 1
            if k:
                out[lp.name] = tuple(take[:k])
            if 2**k != lp.extent:
                break
        return {op.name: out}

    prog, sched, _ = run(fn, (x,), random_split, mesh)
    op = next(o for o in prog.ops if o.primitive == "reshape")
    assert all(lp.partitionable for lp in op.loops)


def test_a_regrouped_result_constrained_by_its_batch_is_reshaped_split(mesh):
    def step(x):
        y = jax.lax.with_sharding_constraint(x * 2.0, P(None, ("a", "b", "c")))
        return jax.lax.with_sharding_constraint(y.reshape(16, 4, 3), P(("a", "b", "c"))) + 1.0

    x = rand(4, 16, 3)
    with jax.set_mesh(mesh):
        asked = planner.price(step, x, mesh=mesh)  # the layout the constraints complete
        op = next(o for o in asked.program.ops if o.primitive == "reshape")
        assert asked.schedule.spec(op, op.results[0])[0] == ("a", "b", "c")  # not made whole
        low = planner.lower(asked.program, asked.schedule, mesh)
        np.testing.assert_array_equal(np.asarray(low(x)), np.asarray(jax.jit(step)(x)))


def test_tile_from_size_one_is_a_broadcast_split_along_its_copies(mesh):
    # MaxText's segment ids: jnp.tile(int32[1, 1, 1, 128], (batch, length, heads, 1)). Kept
    # whole they were 550 GB per chip on Llama 3.1 405B; split by batch they fit.
    x = rand(1, 4, 8)

    def copies(p):
        return {o.name: {"i0": ("a", "b", "c")} for o in p.ops
                if o.primitive in ("tile", "broadcast_in_dim")}  # fmt: skip

    prog, sched, _ = run(lambda x: jnp.tile(x, (8, 1, 2)) * 2.0, (x,), copies, mesh)
    op = next(o for o in prog.ops if o.primitive in ("tile", "broadcast_in_dim"))
    assert op.loop["i0"].partitionable and sched.spec(op, op.results[0])[0] == ("a", "b", "c")
    if op.primitive == "tile":  # JAX >= 0.11: the dimension repeated from 4 stays whole
        assert op.loop["i1"].partitionable and not op.loop["i2"].partitionable


# ----- 6. discovery is cheap -----


def test_discovery_runs_on_shrunk_shapes(monkeypatch):
    monkeypatch.setattr(planner.program.rules, "rule_for", lambda p: None)
    x = jnp.ones((1024, 2048))  # 2M elements: above the full-size limit, so only a probe works
    prog = planner.analyze(lambda x: lax.bessel_i0e(x), x)
    assert prog.ops[0].how == "discovered" and all(lp.partitionable for lp in prog.ops[0].loops)
    assert [lp.extent for lp in prog.ops[0].loops] == [1024, 2048]
