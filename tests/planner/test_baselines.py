"""Expert strategies (data parallelism, FSDP / ZeRO-3, FSDP + tensor parallelism as MaxText lays
them out) as plans, on real model code with scanned and unscanned layers: exact against the
unsharded program through ``plan.jit``, parameters stored as the strategy says, and compiled for
a TPU topology.

Tolerances as in ``planner_checks.assert_step_equal`` (adam divides by the square root of the second moment: an
element with a tiny one moves by a few percent of the learning rate when sums are reordered).
"""

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from planner_checks import LR, assert_step_equal

import planner
from experiments.language_model import lm_step
from planner import baselines
from planner.layout.dataflow import dataflow, input_spec
from planner.solver import strategies

DATA, TENSOR = ("a", "b"), "c"


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def _mlp_step(params, x, y):
    def loss(params):
        (w1, b1), (w2, b2) = params
        return jnp.mean((jax.nn.relu(x @ w1 + b1) @ w2 + b2 - y) ** 2)

    return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params))


def test_expert_plans_of_an_mlp_step(mesh):
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    params = ((f32(16, 32), f32(32)), (f32(32, 8), f32(8)))
    args = (params, f32(64, 16), f32(64, 8))
    plans = baselines.expert_plans(_mlp_step, *args, mesh=mesh, data_axes=DATA,
                                   tensor_axis=TENSOR)  # fmt: skip
    assert list(plans) == list(baselines.STRATEGIES)
    want = jax.jit(_mlp_step)(*args)
    for p in plans.values():
        _close(p(*args), want)
        _close(jax.tree.unflatten(p.out_tree, list(p.lowered(*args))), want)
    specs = {name: p.in_specs for name, p in plans.items()}
    assert all(s[1] == P(DATA) for s in specs.values())  # the batch over the data axes
    (w1, b1), (w2, b2) = specs["data_parallel"][0]
    assert w1 == w2 == b1 == b2 == P()
    # FSDP: weights stored split on their embedding width (the first layer's input features,
    # the second layer's outputs); biases whole
    (w1, b1), (w2, b2) = specs["fsdp"][0]
    assert (w1, w2, b1, b2) == (P(DATA), P(None, DATA), P(), P())
    # and the hidden dimension over the tensor axis (Megatron: column, then row)
    (w1, b1), (w2, b2) = specs["fsdp_tensor"][0]
    assert (w1, w2, b1, b2) == (P(DATA, TENSOR), P(TENSOR, DATA), P(TENSOR), P())
    assert plans["fsdp"].prediction.peak_bytes < plans["data_parallel"].prediction.peak_bytes


def _lm(scan: bool, shapes_only: bool = False):
    """The (2 layers, 32 wide, 4 heads, vocabulary 64) flax LM's step and arguments; with
    ``shapes_only`` (to analyse, plan or compile, not run) no parameters are initialised."""
    if shapes_only:
        return lm_step(8, 16, 32, 4, 2, 64, scan, shapes_only=True)
    return lm_step(8, 16, 32, 4, 2, 64, scan, np.random.default_rng(0))


@pytest.fixture(scope="module")
def scanned_lm():
    """The scanned LM's step, its arguments and ``jax.jit(step)``'s result: the reference the
    tests below check plans against, compiled once."""
    step, args = _lm(True)
    return step, args, jax.jit(step)(*args)


def _block_specs(params, scan: bool) -> dict:
    """The in_specs of the first block's weights by name."""
    blocks = params["blocks"] if scan else params["blocks"][0]
    names = {"q": ("attn", "query", "kernel"), "out": ("attn", "out", "kernel"),
             "up": ("up", "kernel"), "down": ("down", "kernel"), "scale": ("norm1", "scale"),
             "up_bias": ("up", "bias")}  # fmt: skip
    out = {}
    for name, path in names.items():
        node = blocks
        for key in path:
            node = node[key]
        out[name] = node.get_value()
    out["embedding"] = params["embed"]["embedding"].get_value()
    return out


# The expected layouts on the (2 layers, 32 wide, 4 heads of 8, MLP 128, vocabulary 64) LM, its
# layer axis first when scanned: FSDP stores the embedding width over the data axes; MaxText's
# FSDP + tensor parallelism adds heads, MLP hidden and vocabulary over the tensor axis.
LM_SPECS = {
    "data_parallel": dict(q=(), out=(), up=(), down=(), scale=(), up_bias=(), embedding=()),
    "fsdp": dict(q=(DATA,), out=(None, None, DATA), up=(DATA,), down=(None, DATA), scale=(),
                 up_bias=(), embedding=(None, DATA)),
    "fsdp_tensor": dict(q=(DATA, TENSOR), out=(TENSOR, None, DATA), up=(DATA, TENSOR),
                        down=(TENSOR, DATA), scale=(), up_bias=(TENSOR,),
                        embedding=(TENSOR, DATA)),
}  # fmt: skip


def _expected(name: str, scan: bool) -> dict:
    out = {}
    for weight, spec in LM_SPECS[name].items():
        stacked = scan and weight != "embedding"
        out[weight] = P(None, *spec) if stacked and spec else P(*spec)
    return out


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_expert_layouts_of_the_flax_lm(scan, mesh):
    """Scanned or a Python loop of layers, each layer's weights are laid out alike (the layer
    axis of stacked weights whole); Adam's moments as their parameters."""
    step, args = _lm(scan, shapes_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prog = planner.analyze(step, *args)
    scheds = baselines.expert_schedules(prog, mesh, DATA, TENSOR)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(args)]
    for name, sched in scheds.items():
        specs = [input_spec(prog, sched, v) for v in prog.inputs]
        by_path = dict(zip(paths, specs))
        for path, spec in by_path.items():
            if path.startswith("[1][0].mu"):  # the optimizer state is stored as its parameter
                assert spec == by_path["[0]" + path[len("[1][0].mu") :]], path
        assert by_path["[2]"] == (DATA, ())  # tokens: the batch over the data axes
        plan = planner.AutoPlan.of(prog, sched, mesh, in_tree=jax.tree.structure(args))
        got = _block_specs(plan.in_specs[0], scan)
        assert got == _expected(name, scan), name


def test_expert_plans_of_the_scanned_flax_lm_are_exact(mesh, scanned_lm):
    step, args, want = scanned_lm
    plans = baselines.expert_plans(step, *args, mesh=mesh, data_axes=DATA, tensor_axis=TENSOR)
    prog = plans["fsdp"].program
    up = next(v for v in prog.inputs if v.shape == (2, 32, 128))
    for name, p in plans.items():
        assert_step_equal(p(*args), want, param_atol=0.05 * LR)  # plan.jit
        assert _block_specs(p.in_specs[0], True) == _expected(name, True)
        steps = dataflow(prog, p.schedule)
        # The stacked weight enters the scan as stored; FSDP gathers it one layer at a time
        # inside the scan, where each layer's product reads it
        gathers = [st for st in steps for mv in st.moves if prog.origin.get(mv.value.name,
                   (None,))[0] == up]  # fmt: skip
        assert not any(mv.value == up for st in steps for mv in st.moves)
        assert bool(gathers) == (name != "data_parallel")
        assert all(st.op.trips == 2 and st.op.dense for st in gathers)
        # ZeRO: weight gradients are reduce-scattered onto the stored layout
        scattered = any(k is not None for st in steps if st.op.dense for k in st.scatter)
        assert scattered == (name != "data_parallel")
    by_name = {name: p.prediction.peak_bytes for name, p in plans.items()}
    assert by_name["fsdp_tensor"] < by_name["fsdp"] < by_name["data_parallel"]
    # Megatron: every layer product of the body is split over the tensor axis
    sched = plans["fsdp_tensor"].schedule
    for op, _, _ in strategies._layers(prog):
        assert any(TENSOR in axes for axes in sched.assign[op.name].values()), op.name


def _linen_step():
    import flax.linen as nn
    import optax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            y = nn.gelu(nn.Dense(64)(nn.LayerNorm()(h)))
            return h + nn.Dense(16)(y), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=2)  # fmt: skip
            h, _ = stack()(x, None)
            return nn.Dense(8)(h)

    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 4, 16)).astype(np.float32)
    y = rng.standard_normal((16, 4, 8)).astype(np.float32)
    model = Model()
    params = jax.jit(model.init)(jax.random.key(0), x)  # one compile, not one per op
    tx = optax.adam(LR)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), x, y)


def test_expert_plans_of_a_linen_nn_scan_model_are_exact(mesh):
    step, args = _linen_step()
    plans = baselines.expert_plans(step, *args, mesh=mesh, data_axes=DATA, tensor_axis=TENSOR)
    want = jax.jit(step)(*args)
    for name, p in plans.items():
        assert_step_equal(p(*args), want, param_atol=0.05 * LR)
        stack = p.in_specs[0]["params"]["ScanBlock_0"]
        up, down = stack["Dense_0"]["kernel"], stack["Dense_1"]["kernel"]
        expected = {"data_parallel": (P(), P()), "fsdp": (P(None, DATA), P(None, None, DATA)),
                    "fsdp_tensor": (P(None, DATA, TENSOR), P(None, TENSOR, DATA))}[name]  # fmt: skip
        assert (up, down) == expected, name


def test_the_legacy_baselines_find_scanned_weights(mesh):
    """megatron and fsdp_stored see through scans: the body's products are the layers, and a
    stacked weight is split within a layer, its layer axis whole."""
    step, args = _lm(True, shapes_only=True)
    prog = planner.analyze(step, *args)
    assign = baselines.megatron(prog, (TENSOR,))
    assert len(assign) == 7  # q, k, v, out, up, down, and the tied unembedding
    stored = baselines.fsdp_stored(prog, DATA, dict(mesh.shape))
    stacked = [name for name, spec in stored.items() if len(spec) == 3]
    assert stacked and all(stored[n][0] == () for n in stacked)
    dp = baselines.data_parallel(prog, DATA)
    assert planner.simulate(prog, prog.schedule(dp, mesh, stored=stored)).peak_bytes < (
        planner.simulate(prog, prog.schedule(dp, mesh)).peak_bytes
    )


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_expert_plan_compiles_for_a_tpu_topology():
    from redist.calibration import Calibration

    axes = {"data": 2, "fsdp": 2, "tensor": 2}
    step, args = _lm(True, shapes_only=True)
    plans = baselines.expert_plans(step, *args, mesh=axes,
                                   calibration=Calibration.named("tpu_v5p"))  # fmt: skip
    report = plans["fsdp_tensor"].compiled_report(planner.topology_mesh("v5p:2x2x2", axes))
    assert report.fits and report.device_kind.startswith("TPU v5")
    assert "all-gather" in report.collectives_by_kind  # FSDP's gathers


@pytest.fixture(scope="module")
def limited_lm():
    """The scanned flax LM (shapes) planned for TPU v5p on (data 2, fsdp 2, tensor 2) under a
    memory limit between the expert strategies' peaks: ``(experts, limit, plan)``, searched once
    for the two tests below (5 s)."""
    from redist.calibration import Calibration

    step, args = lm_step(16, 64, 128, 4, 2, 512, True, shapes_only=True)
    cal, axes = Calibration.named("tpu_v5p"), {"data": 2, "fsdp": 2, "tensor": 2}
    experts = baselines.expert_plans(step, *args, mesh=axes, calibration=cal)
    peaks = sorted(e.prediction.peak_bytes for e in experts.values())
    bound = (peaks[0] + peaks[-1]) // 2
    p = planner.plan(step, *args, mesh=axes, calibration=cal, memory_limit_bytes=bound)
    return experts, bound, p


def test_the_search_is_never_predicted_slower_than_an_expert_strategy(limited_lm):
    """The expert strategies seed the search: on the scanned flax LM planned for TPU v5p on
    (data 2, fsdp 2, tensor 2) under a memory limit that only some of them meet, the plan fits
    and is predicted at least as fast as those."""
    experts, bound, p = limited_lm
    fitting = [e.prediction.time_s for e in experts.values() if e.prediction.peak_bytes <= bound]
    assert fitting and p.prediction.time_s <= min(fitting) * (1 + 1e-9)
    assert p.prediction.peak_bytes <= bound


def test_a_faster_row_over_the_limit_the_search_kept_to_says_so(limited_lm):
    """A strategy predicted faster than the plan but over the memory limit the plan was searched
    under is marked so in ``explain()`` (the summary of planner/report/; here beside the test
    above, whose plan it reads)."""
    import dataclasses

    from planner.report import summarize
    from planner.target.confirm import MemoryCheck

    _, bound, p = limited_lm
    checked = dataclasses.replace(p, memory_checks=(MemoryCheck(bound, p.prediction.peak_bytes,
                                                                p.prediction.peak_bytes),))  # fmt: skip
    rows = summarize(checked).prediction
    marked = [r for r in rows if "over" in r]
    assert marked and all(r["peak_bytes"] > bound and r["time_s"] < p.prediction.time_s
                          for r in marked)  # fmt: skip
    lines = [line for line in checked.explain().splitlines() if "searched under)" in line]
    assert len(lines) == len(marked)
    assert not any("over" in r for r in summarize(p).prediction)  # no compile, no limit to say


def _experts_step(mesh):
    """A layer, then a mixture of experts as MaxText writes it: the experts' stacked weight
    ``[experts, embed, mlp]`` constrained whole and read whole by ``shard_map``s over the batch
    (here twice, as a recomputed layer's forward and its gradient's kernels read it): no layer
    product of the program reads it."""
    from jax.sharding import NamedSharding

    def body(h, we):
        return jnp.tanh(jnp.einsum("bd,edh->beh", h, we)).sum(1)

    def step(params, x):
        def loss(params):
            w_in, stacked = params
            we = jax.lax.with_sharding_constraint(stacked, NamedSharding(mesh, P()))
            experts = jax.shard_map(body, mesh=mesh, in_specs=(P(DATA), P()), out_specs=P(DATA))
            h = jnp.tanh(x @ w_in)
            return jnp.mean(experts(h, we) ** 2) + jnp.mean(experts(h * h, we))

        return jax.tree.map(lambda p, g: p - LR * g, params, jax.grad(loss)(params))

    rng = np.random.default_rng(2)
    f32 = lambda *s: (rng.standard_normal(s) / 8).astype(np.float32)  # noqa: E731
    return step, ((f32(64, 64), f32(4, 64, 256)), f32(256, 64))


def test_fsdp_stores_a_weight_only_a_shard_map_reads_split(mesh):
    """ZeRO-3 splits every parameter: the experts' weight, which no layer product reads, is
    stored split over the data axes on its first dimension they divide (the experts), its
    update runs on the shards, and every strategy computes the step exactly."""
    step, args = _experts_step(mesh)
    plans = baselines.expert_plans(step, *args, mesh=mesh, data_axes=DATA, tensor_axis=TENSOR)
    want = jax.jit(step)(*args)
    for name, p in plans.items():
        _close(p(*args), want)
        (w_in, stacked), _ = p.in_specs
        assert stacked == (P() if name == "data_parallel" else P(DATA)), name
        assert p.out_specs[1] == stacked  # the update runs on the shards it is stored in
    stored = {name: p.prediction.input_bytes[1] for name, p in plans.items()}
    assert stored["fsdp"] * 4 == stored["data_parallel"]


def test_refine_gathers_a_weight_two_shard_maps_read_whole_once(mesh):
    """Under FSDP the experts' weight is gathered for each ``shard_map`` that reads it whole;
    ``refine`` tries the producers of a ``shard_map``'s gathered
    operands and lays the constraint before them out whole, so that one gather feeds both, as
    MaxText's constraint does: predicted faster, and exact."""
    from planner.solver.schedule_search import _Evaluator, _gathers, groups, refine
    from redist.calibration import Calibration
    from redist.types import MeshShape

    step, args = _experts_step(mesh)
    prog = planner.analyze(step, *args)
    sizes, cal = dict(mesh.shape), Calibration.named("tpu_v5p")
    sched = strategies.expert_schedules(prog, sizes, DATA, TENSOR)["fsdp"]
    evaluate = _Evaluator(prog, sizes, cal, None, groups(prog))
    before = evaluate.schedule(sched)
    after = refine(before, evaluate, MeshShape.of(sizes))
    stacked = prog.inputs[1]
    (constraint,) = [o for o in prog.ops if o.primitive == "sharding_constraint"
                     and o.operands[0].value == stacked]  # fmt: skip

    def gathers(s):
        return sum(1 for st in dataflow(prog, s) for mv in st.moves
                   if prog.origin.get(mv.value.name, (mv.value,))[0].shape == stacked.shape
                   and _gathers(mv))  # fmt: skip

    assert any(sched.assign[constraint.name].values()) and gathers(sched) == 2
    assert not any(after[2].assign[constraint.name].values()) and gathers(after[2]) == 1
    assert after[0] < before[0]
    got = planner.lower(prog, after[2], mesh, backend="xla")(*args)
    _close(got, jax.jit(step)(*args))


def _one_hot_lm_step(params, tokens):
    """An embedding looked up as a product with the tokens' one-hot (MaxText's
    ``use_iota_embed``), an MLP, and an output layer."""

    def loss(params):
        table, w1, w2, out = params
        x = jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype) @ table
        h = x + jax.nn.relu(x @ w1) @ w2
        return jnp.mean((h @ out) ** 2)

    return jax.tree.map(lambda p, g: p - LR * g, params, jax.grad(loss)(params))


def test_a_one_hot_embedding_is_a_row_layer_and_the_next_ones_columns(mesh):
    """The lookup's product reads no floating-point input but its table: it is a row layer (the
    vocabulary over the tensor axis, the embedding width over the data axes), and the MLP after
    it is column, then row, as without it (before, the lookup was taken for a column layer, so
    every later layer was split the other way round)."""
    rng = np.random.default_rng(3)
    f32 = lambda *s: (rng.standard_normal(s) / 8).astype(np.float32)  # noqa: E731
    args = ((f32(64, 32), f32(32, 128), f32(128, 32), f32(32, 16)),
            rng.integers(0, 64, (16, 8)).astype(np.int32))  # fmt: skip
    prog = planner.analyze(_one_hot_lm_step, *args)
    assert [row for _, _, row in strategies._layers(prog)] == [True, False, True, False]
    plans = baselines.expert_plans(_one_hot_lm_step, *args, mesh=mesh, data_axes=DATA,
                                   tensor_axis=TENSOR)  # fmt: skip
    table, w1, w2, out = plans["fsdp_tensor"].in_specs[0]
    assert (table, w1, w2, out) == (P(TENSOR, DATA), P(DATA, TENSOR), P(TENSOR, DATA),
                                    P(DATA, TENSOR))  # fmt: skip
    want = jax.jit(_one_hot_lm_step)(*args)
    for p in plans.values():
        _close(p(*args), want)


@pytest.mark.parametrize("case", ["scanned_lm", "one_hot_lm"])
def test_the_sequence_seed_computes_the_step(mesh, case, request):
    """The search's seed with the residual stream's embedding width over the tensor axis (MaxText's
    ``activation_embed``), no row of ``explain()`` and so not among ``expert_plans``, runs the
    step exactly, and does lay the residual stream out over the tensor axis."""
    if case == "scanned_lm":
        step, args, want = request.getfixturevalue("scanned_lm")
    else:
        rng = np.random.default_rng(3)
        f32 = lambda *s: (rng.standard_normal(s) / 8).astype(np.float32)  # noqa: E731
        step, args = _one_hot_lm_step, ((f32(64, 32), f32(32, 128), f32(128, 32), f32(32, 16)),
                                        rng.integers(0, 64, (16, 8)).astype(np.int32))  # fmt: skip
    prog = planner.analyze(step, *args)
    scheds = strategies.expert_schedules(prog, dict(mesh.shape), DATA, TENSOR, sequence=True)
    sched = scheds["fsdp_tensor_sequence"]

    def over_tensor(s, op):
        return TENSOR in sum(s.assign.get(op.name, {}).values(), ())

    # ops outside the tensor-parallel layers (the residual's adds, the norms) take the tensor axis
    assert any(over_tensor(sched, o) and not over_tensor(scheds["fsdp_tensor"], o)
               for o in prog.ops if not o.dense)  # fmt: skip
    if case != "scanned_lm":
        want = jax.jit(step)(*args)
    got = jax.tree.unflatten(jax.tree.structure(want),
                             list(planner.lower(prog, sched, mesh, backend="xla")(*args)))  # fmt: skip
    if case == "scanned_lm":  # Adam's first step (see the module)
        assert_step_equal(got, want, param_atol=0.05 * LR)
    else:
        _close(got, want)
