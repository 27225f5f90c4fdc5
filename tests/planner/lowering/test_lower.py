"""planner: schedules lowered to SPMD programs, checked against the unsharded function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from planner_programs import ALL, attention, dots, matmul, mlp_args, rand, sgd_step

import planner
from experiments.measure import hlo_collectives


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ALL, axis_types=(AxisType.Auto,) * 3)


def collectives(lowered, *args):
    return [c.kind for c in hlo_collectives(lowered.lower(*args).compile().as_text())]


def device_bytes(jitted, *args):
    """Per-device memory of a compiled program: arguments + outputs + temporaries."""
    m = jitted.lower(*args).compile().memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def below_replicated(lowered, fn, *args):
    """The planned program needs less memory per device than the replicated one."""
    ours, replicated = device_bytes(lowered, *args), device_bytes(jax.jit(fn), *args)
    assert ours < replicated, (ours, replicated)


@pytest.mark.parametrize(
    "grid, expected",
    [
        ({"m": ALL}, []),  # data-parallel (8, 1, 1): no communication
        ({"k": ALL}, ["all-reduce"]),  # reduction-parallel (1, 1, 8): one psum
        ({"m": "a", "n": "b", "k": "c"}, ["all-reduce"]),  # hybrid (2, 2, 2)
    ],
)
def test_thesis_matmul_schedules(mesh, grid, expected):
    x, w = rand(64, 32), rand(32, 16)
    prog = planner.analyze(matmul, x, w)
    f = planner.lower(prog, prog.schedule({"dot_general_0": grid}, mesh), mesh)
    np.testing.assert_allclose(f(x, w), matmul(x, w), rtol=1e-4, atol=1e-4)
    assert collectives(f, x, w) == expected
    below_replicated(f, matmul, x, w)
    kinds = [e["kind"] for row in f.explain_json() for e in row["collectives"]]
    assert kinds == ["psum"] * len(expected)


def test_softmax_partitioned_on_leading_dims_needs_no_communication(mesh):
    x = rand(8, 4, 32)
    prog = planner.analyze(lambda v: jax.nn.softmax(v, axis=-1), x)
    first = prog.ops[0].name
    f = planner.lower(prog, prog.schedule({first: {"i0": ("a", "b"), "i1": "c"}}, mesh), mesh)
    np.testing.assert_allclose(f(x), jax.nn.softmax(x, axis=-1), rtol=1e-5, atol=1e-6)
    assert collectives(f, x) == []
    assert all("i0:axb" in f.sched.grid(o) for o in prog.ops)
    below_replicated(f, lambda v: jax.nn.softmax(v, axis=-1), x)


def test_megatron_attention_one_all_reduce(mesh):
    args = (rand(2, 8, 16), rand(16, 8, 4), rand(16, 8, 4), rand(16, 8, 4), rand(8, 4, 16))
    prog = planner.analyze(attention, *args)
    heads = {d: {"n0": ALL} for d in dots(prog)[:3]}  # q, k, v projections split over heads
    f = planner.lower(prog, prog.schedule(heads, mesh), mesh)
    np.testing.assert_allclose(f(*args), attention(*args), rtol=1e-4, atol=1e-4)
    assert collectives(f, *args) == ["all-reduce"]
    rows = f.explain_json()
    assert [(r["op"], [e["kind"] for e in r["collectives"]]) for r in rows if r["collectives"]] == [
        (dots(prog)[-1], ["psum"])
    ]
    below_replicated(f, attention, *args)


def test_mlp_training_step_data_parallel(mesh):
    params, x, y = mlp_args()
    prog = planner.analyze(sgd_step, params, x, y)
    first = dots(prog)[0]
    f = planner.lower(prog, prog.schedule({first: {"m": ALL}}, mesh), mesh)
    got = f(params, x, y)
    want = sgd_step(params, x, y)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    # The two weight gradients are summed over the batch split (XLA may combine the all-reduces);
    # the loss the step drops is dead code, not planned, so its batch sum is not.
    inserted = [(r["op"], e["kind"]) for r in f.explain_json() for e in r["collectives"]]
    assert not [o for o in prog.ops if o.primitive == "reduce_sum"]
    assert inserted == [(dots(prog)[2], "psum"), (dots(prog)[4], "psum")]
    assert set(collectives(f, params, x, y)) == {"all-reduce"}
    below_replicated(f, sgd_step, params, x, y)


def test_mlp_training_step_megatron(mesh):
    params, x, y = mlp_args()
    prog = planner.analyze(sgd_step, params, x, y)
    d = dots(prog)
    # Column split of w1 (its output features), row split of w2 (the contraction).
    sched = prog.schedule({d[0]: {"n": ALL}, d[1]: {"k": ALL}}, mesh)
    f = planner.lower(prog, sched, mesh)
    for g, w in zip(f(params, x, y), sgd_step(params, x, y)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    inserted = [(r["op"], e["kind"]) for r in f.explain_json() for e in r["collectives"]]
    assert inserted == [(d[1], "psum")]  # the row-parallel layer's forward output, nothing else
    assert collectives(f, params, x, y) == ["all-reduce"]
    below_replicated(f, sgd_step, params, x, y)


def conv(x, w):
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )


@pytest.mark.parametrize("grid", [{"n": ALL}, {"o": ALL}, {"n": "a", "o": ("b", "c")}])
def test_conv_split_on_batch_and_output_features(mesh, grid):
    x, w = rand(8, 3, 8, 8), rand(8, 3, 3, 3)
    prog = planner.analyze(conv, x, w)
    f = planner.lower(prog, prog.schedule({"conv_general_dilated_0": grid}, mesh), mesh)
    np.testing.assert_allclose(f(x, w), conv(x, w), rtol=1e-4, atol=1e-4)
    assert collectives(f, x, w) == []
    below_replicated(f, conv, x, w)


@pytest.mark.parametrize("backend", ["xla", "xla-inputs"])
def test_xla_baseline_backends_match(mesh, backend):
    args = (rand(2, 8, 16), rand(16, 8, 4), rand(16, 8, 4), rand(16, 8, 4), rand(8, 4, 16))
    prog = planner.analyze(attention, *args)
    sched = prog.schedule({d: {"n0": ALL} for d in dots(prog)[:3]}, mesh)
    f = planner.lower(prog, sched, mesh, backend=backend)
    np.testing.assert_allclose(f(*args), attention(*args), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="backend must be one of"):
        planner.lower(prog, sched, mesh, backend="gspmd")


def test_explain_prints_grid_types_and_collectives(mesh):
    x, w = rand(64, 32), rand(32, 16)
    prog = planner.analyze(matmul, x, w)
    f = planner.lower(prog, prog.schedule({"dot_general_0": {"m": "a", "k": "c"}}, mesh), mesh)
    text = f.explain()
    assert "dot_general_0: grid m:a n:- k:c" in text
    assert "in  [32{a}64, 16{c}32], [16{c}32, 16]" in text
    assert "+ psum" in text and '"grid"' in f.to_json()


@pytest.mark.parametrize(
    "assign, match",
    [
        ({"dot_general_9": {"m": "a"}}, r"unknown op 'dot_general_9'"),
        ({"dot_general_0": {"q": "a"}}, r"op 'dot_general_0' has no loop 'q'"),
        ({"dot_general_0": {"m": "a", "n": "a"}}, r"mesh axis 'a' is used twice"),
        ({"dot_general_0": {"m": "z"}}, r"unknown mesh axis 'z'"),
        ({"dot_general_0": {"n": ALL}}, r"loop 'n' of extent 12 is not divisible by the 8 parts"),
    ],
)
def test_bad_schedules(mesh, assign, match):
    prog = planner.analyze(matmul, rand(64, 32), rand(32, 12))
    with pytest.raises(ValueError, match=match):
        prog.schedule(assign, mesh)


def test_unpartitionable_loop_is_refused(mesh):
    prog = planner.analyze(lambda v: jnp.argmax(v, axis=1), rand(8, 8))
    with pytest.raises(ValueError, match="cannot be partitioned"):
        prog.schedule({"argmax_0": {"r1": "a"}}, mesh)


def test_prime_factors_of_mesh_axes_as_schedule_axes():
    """On {a:4, b:2}, 'a#0' (major factor of a) splits m and ('a#1', 'b') split n."""
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    x, w = rand(64, 32), rand(32, 16)
    prog = planner.analyze(matmul, x, w)
    sched = prog.schedule({"dot_general_0": {"m": "a#0", "n": ("a#1", "b")}}, mesh)
    assert sched.grid(prog.ops[0]) == "m:a#0 n:a#1xb k:-"
    f = planner.lower(prog, sched, mesh)
    np.testing.assert_allclose(f(x, w), matmul(x, w), rtol=1e-4, atol=1e-4)
    whole = prog.schedule({"dot_general_0": {"k": "a"}}, mesh)  # whole axis = both factors
    assert whole.grid(prog.ops[0]) == "m:- n:- k:a#0xa#1"
    np.testing.assert_allclose(
        planner.lower(prog, whole, mesh)(x, w), matmul(x, w), rtol=1e-4, atol=1e-4
    )
    with pytest.raises(ValueError, match=r"unknown mesh axis 'a#2'.*prime factors"):
        prog.schedule({"dot_general_0": {"m": "a#2"}}, mesh)


def test_layout_change_between_ops_uses_a_redist_plan():
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    x, w1, w2 = rand(64, 32), rand(32, 16), rand(16, 8)
    chain = lambda x, w1, w2: (x @ w1) @ w2  # noqa: E731
    prog = planner.analyze(chain, x, w1, w2)
    sched = prog.schedule(
        {
            "dot_general_0": {"m": "a#0", "n": ("a#1", "b")},
            "dot_general_1": {"m": "a#1", "k": "a#0"},
        },
        mesh,
    )
    f = planner.lower(prog, sched, mesh)
    np.testing.assert_allclose(f(x, w1, w2), chain(x, w1, w2), rtol=1e-4, atol=1e-4)
    events = [(r["op"], e["kind"]) for r in f.explain_json() for e in r["collectives"]]
    assert events == [("dot_general_1", "redistribute"), ("dot_general_1", "psum")]


def test_pending_sum_becomes_reduce_scatter_when_the_consumer_wants_it_split(mesh):
    x, w1, w2 = rand(64, 32), rand(32, 16), rand(16, 8)
    chain = lambda x, w1, w2: jnp.tanh(x @ w1) @ w2  # noqa: E731
    prog = planner.analyze(chain, x, w1, w2)
    d = dots(prog)
    # The first product sums over k split 8 ways; tanh and the second product want rows split
    # the same 8 ways: a reduce-scatter, not an all-reduce then a slice.
    sched = prog.schedule({d[0]: {"k": ALL}, "tanh_1": {"i0": ALL}, d[1]: {"m": ALL}}, mesh)
    f = planner.lower(prog, sched, mesh)
    np.testing.assert_allclose(f(x, w1, w2), chain(x, w1, w2), rtol=1e-4, atol=1e-4)
    events = [(r["op"], e["kind"]) for r in f.explain_json() for e in r["collectives"]]
    assert events == [(d[0], "psum_scatter")]
    assert collectives(f, x, w1, w2) == ["reduce-scatter"]


@pytest.mark.parametrize("strategy", ["data", "megatron", "2d"])
def test_baseline_strategies_as_schedules(mesh, strategy):
    from planner import baselines

    params, x, y = mlp_args()
    prog = planner.analyze(sgd_step, params, x, y)
    assign = {
        "data": baselines.data_parallel(prog, ALL),
        "megatron": baselines.megatron(prog, ALL),
        "2d": baselines.data_and_model(prog, ("a",), ("b", "c")),
    }[strategy]
    f = planner.lower(prog, prog.schedule(assign, mesh), mesh)
    for g, w in zip(f(params, x, y), sgd_step(params, x, y)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    below_replicated(f, sgd_step, params, x, y)
    d = dots(prog)
    inserted = [(e.op, e.kind) for e in f.events]
    if strategy == "data":  # both weight gradients (the dropped loss is not computed)
        assert inserted == [(d[2], "psum"), (d[4], "psum")]
    if strategy == "megatron":  # one all-reduce after the row-parallel layer
        assert inserted == [(d[1], "psum")]


def test_fsdp_weights_stored_sharded_and_gathered_before_use(mesh):
    from planner import baselines

    params, x, y = (rand(16, 32), rand(32, 8)), rand(64, 16), rand(64, 8)
    prog = planner.analyze(sgd_step, params, x, y)
    stored = baselines.fsdp_stored(prog, ALL, dict(mesh.shape))
    w1, w2 = prog.inputs[0].name, prog.inputs[1].name
    assert stored == {w1: (ALL, ()), w2: (ALL, ())}
    sched = prog.schedule(baselines.data_parallel(prog, ALL), mesh, stored=stored)
    f = planner.lower(prog, sched, mesh)
    assert f.in_specs[:2] == ((ALL, ()), (ALL, ()))
    for g, w in zip(f(params, x, y), sgd_step(params, x, y)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    gathered = [e.value for e in f.events if e.kind == "redistribute" and "allgather" in e.detail]
    assert w1 in gathered and w2 in gathered  # each layer's weight is gathered before its use
    dp = planner.lower(prog, prog.schedule(baselines.data_parallel(prog, ALL), mesh), mesh)
    assert device_bytes(f, params, x, y) < device_bytes(dp, params, x, y)
    with pytest.raises(ValueError, match="stored names unknown input 'nope'"):
        prog.schedule({}, mesh, stored={"nope": ((),)})


def test_megatron_transformer_block_training_step(mesh):
    from experiments.workloads import workload
    from planner import baselines

    fn, args = workload("transformer", [8, 8, 8, 2, 1], np.random.default_rng(1))
    prog = planner.analyze(fn, *args)
    assign = baselines.megatron(prog, ALL)
    # q, k, v by heads (their weights' first free dim), the output projection by heads (its
    # leading contracted dim), the MLP's first layer by columns and its second by rows.
    layers = sorted(assign, key=lambda name: dots(prog).index(name))
    assert [next(iter(assign[n])) for n in layers] == ["n0", "n0", "n0", "k1", "n", "k"]
    f = planner.lower(prog, prog.schedule(assign, mesh), mesh)
    for g, w in zip(jax.tree.leaves(f(*args)), jax.tree.leaves(fn(*args))):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    psums = [e.op for e in f.events if e.kind == "psum"]
    assert psums[:2] == [layers[3], layers[5]]  # forward: after each row-parallel layer only


def _two_ops(mesh, first, second):
    """sin(tanh(x)) with tanh and sin split as given: one change of layout between them."""
    fn = lambda x: jnp.sin(jnp.tanh(x))  # noqa: E731
    x = rand(16, 64)
    prog = planner.analyze(fn, x)
    sched = prog.schedule({"tanh_0": first, "sin_1": second}, mesh, default="replicate")
    return fn, x, prog, sched


def test_xla_backend_gives_redist_the_changes_xla_rematerialises(mesh):
    """P('b','a') -> P(('b','c','a'), None): XLA gathers the whole array, then slices (logged as
    a full rematerialization); with moves='auto' redist makes it with one all-to-all."""
    fn, x, prog, sched = _two_ops(mesh, {"i0": "b", "i1": "a"}, {"i0": ("b", "c", "a")})
    tile = 16 * 64 * 4 // 4  # the larger tile: a quarter of the array
    by_xla = planner.lower(prog, sched, mesh, backend="xla", moves="xla")
    assert max(c.bytes for c in hlo_collectives(by_xla.lower(x).compile().as_text())) > tile
    auto = planner.lower(prog, sched, mesh, backend="xla")
    [choice] = auto.choices.values()
    assert choice.rematerialises and choice.use_redist and "redist" in str(choice)
    colls = hlo_collectives(auto.lower(x).compile().as_text())
    assert colls and max(c.bytes for c in colls) <= tile
    for f in (by_xla, auto, planner.lower(prog, sched, mesh, backend="xla", moves="redist")):
        np.testing.assert_allclose(f(x), fn(x), rtol=1e-6)


def test_xla_backend_leaves_xla_the_changes_it_makes_well(mesh):
    fn, x, prog, sched = _two_ops(mesh, {"i0": "a"}, {"i1": "a"})
    f = planner.lower(prog, sched, mesh, backend="xla")
    [choice] = f.choices.values()
    assert [c.kind for c in choice.xla] == ["all-to-all"] and not choice.rematerialises
    assert not choice.use_redist  # the same all-to-all either way: ties go to XLA
    assert collectives(f, x) == ["all-to-all"]
    np.testing.assert_allclose(f(x), fn(x), rtol=1e-6)
    with pytest.raises(ValueError, match="moves must be one of"):
        planner.lower(prog, sched, mesh, backend="xla", moves="sometimes")


def _mlp_sgd(params, x):
    loss = lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])  # noqa: E731
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, jax.grad(loss)(params))


def test_a_step_that_discards_its_loss_computes_the_step():
    """The loss the step drops is not planned (dead code); both lowerings still compute the
    step exactly, on the mesh and calibration of the TPU case."""
    from redist.calibration import Calibration

    params, x = {"w1": rand(16, 64), "w2": rand(64, 16)}, rand(64, 16)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    p = planner.plan(_mlp_sgd, params, x, mesh=mesh, calibration=Calibration.named("tpu_v5p"))
    want = jax.jit(_mlp_sgd)(params, x)
    for got in (p(params, x), p.lowered(params, x)):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
