"""The memory model: which values are buffers (the fusion rule), how long they live, and the
predicted peak against the compiled program's total (arguments + outputs + temporaries -
aliased) on XLA:CPU and the TPU compiler."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from markers import needs_xla_gpu

import planner
from planner.cost.buffers import BUFFER, FUSED, VIEW, kernel_copies, lifetimes
from planner.cost.simulator import peak_buffers

F32 = jnp.float32


def kinds(fn, *shapes, backend="tpu"):
    prog = planner.analyze(fn, *[jax.ShapeDtypeStruct(s, F32) for s in shapes])
    lt = lifetimes(prog, backend)
    return prog, {o.name.rsplit("_", 1)[0]: lt.kind[o.results[0].value.name] for o in prog.ops}


def compiled_total(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)  # fmt: skip


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)


def test_a_broadcast_feeding_a_multiply_is_no_buffer_and_a_dots_output_is():
    _, k = kinds(lambda x, w, s: jnp.sum((x @ w) * s[None, :]), (64, 32), (32, 16), (16,))
    assert k["broadcast_in_dim"] == FUSED and k["mul"] == FUSED
    assert k["dot_general"] == BUFFER and k["reduce_sum"] == BUFFER


def test_cheap_values_are_recomputed_by_each_reader_and_expensive_ones_stored():
    def f(x, w):
        a, e = x + 1.0, jnp.exp(x)
        return (a * 2.0) @ w, (a * 3.0) @ w, (e * 2.0) @ w, (e * 3.0) @ w

    _, k = kinds(f, (64, 32), (32, 16))
    assert k["add"] == FUSED  # cheap: duplicated into both products' operands
    assert k["exp"] == BUFFER  # expensive, two readers
    assert k["mul"] == BUFFER  # a product's operand is in memory


def test_reshapes_and_transposes_are_views_and_returned_values_buffers():
    prog, k = kinds(lambda x: (x.T.reshape(-1) * 2.0, x.reshape(8, 8)), (16, 4))
    assert k["transpose"] == VIEW and k["mul"] == BUFFER
    lt = lifetimes(prog)
    returned = [o for o in prog.ops if o.results[0].value in prog.outputs]
    assert all(lt.kind[o.results[0].value.name] == BUFFER for o in returned)


def test_an_elementwise_result_is_written_into_the_product_it_reads():
    # tanh(x @ w): the product's buffer becomes the output; XLA needs no temporary either
    args = [jax.ShapeDtypeStruct(s, F32) for s in ((512, 256), (256, 128))]
    fn = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
    prog = planner.analyze(fn, *args)
    pred = planner.simulate(prog, prog.schedule({}, {"a": 8}, default="replicate"))
    assert pred.peak_bytes == (512 * 256 + 256 * 128 + 512 * 128) * 4
    assert pred.peak_bytes == compiled_total(jax.jit(fn).lower(*args).compile())


def test_batched_products_copy_operands_whose_batch_is_not_leading_on_cpu_only():
    prog = planner.analyze(lambda q, k: jnp.einsum("bqhe,bkhe->bhqk", q, k),
                           *[jax.ShapeDtypeStruct((2, 8, 4, 16), F32)] * 2)  # fmt: skip
    op = next(o for o in prog.ops if o.primitive == "dot_general")
    assert len(kernel_copies(op, "cpu")) == 2 and kernel_copies(op, "tpu") == ()
    prog = planner.analyze(lambda q, k: jnp.einsum("bhqe,bhke->bhqk", q, k),
                           *[jax.ShapeDtypeStruct((2, 4, 8, 16), F32)] * 2)  # fmt: skip
    op = next(o for o in prog.ops if o.primitive == "dot_general")
    assert kernel_copies(op, "cpu") == ()


def _scanned_attention_step(batch=4, seq=32, heads=2, e=16, layers=3):
    d = heads * e

    def loss(ws, x):
        mask = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
        big = jnp.broadcast_to(mask, (batch, heads, seq, seq))  # passed into the scan whole

        def layer(h, w):
            q = jnp.einsum("bsd,dhe->bhse", h, w)
            s = jnp.where(big, jnp.einsum("bhqe,bhke->bhqk", q, q), -1e9)
            return h + jnp.einsum("bhqk,bhke,dhe->bqd", jax.nn.softmax(s), q, w), None

        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.mean(h**2)

    shapes = [(layers, d, heads, e), (batch, seq, d)]
    return jax.grad(loss), [jax.ShapeDtypeStruct(s, F32) for s in shapes]


def test_a_constant_mask_sinks_into_the_scan_and_residuals_are_stacked():
    from redist.calibration import Calibration

    step, args = _scanned_attention_step()
    prog = planner.analyze(step, *args)
    sched = prog.schedule({}, {"a": 8}, default="replicate")
    # The TPU compiler sinks the broadcast mask into the loop: no buffer of it, in or out.
    peak = peak_buffers(prog, sched, Calibration.named("tpu_v5p"))
    assert not any(b.dtype == "bool" for b in peak.buffers)
    # The forward loop's stacked residuals (layers first) are live while the backward runs.
    assert any(b.shape[:1] == (3,) and b.kind.startswith("from scan_ys") for b in peak.buffers)
    # XLA:CPU keeps the broadcast mask that both loops read, as the model does for it.
    peak = peak_buffers(prog, sched)
    assert any(b.dtype == "bool" and b.shape == (4, 2, 32, 32) for b in peak.buffers)
    compiled = compiled_total(jax.jit(step).lower(*args).compile())
    assert 0.75 <= peak.bytes / compiled <= 1.25


def test_remat_stores_less_and_the_prediction_follows_the_compiler():
    def step(remat):
        layer = lambda h, w: (jnp.tanh(jnp.tanh(h @ w) * 2.0), None)  # noqa: E731
        body = jax.checkpoint(layer) if remat else layer
        return jax.grad(lambda ws, x: jnp.mean(jax.lax.scan(body, x, ws)[0] ** 2))

    args = [jax.ShapeDtypeStruct(s, F32) for s in ((6, 256, 256), (512, 256))]
    got, compiled = {}, {}
    for remat in (False, True):
        prog = planner.analyze(step(remat), *args)
        pred = planner.simulate(prog, prog.schedule({}, {"a": 8}, default="replicate"))
        compiled[remat] = compiled_total(jax.jit(step(remat)).lower(*args).compile())
        assert 0.75 <= pred.peak_bytes / compiled[remat] <= 1.25
        got[remat] = pred.peak_bytes
    # remat keeps 0.41x (JAX 0.10) / 0.58x (JAX 0.12) of the compiler's memory without it
    assert got[True] < 0.7 * got[False]
    assert abs(got[True] / got[False] - compiled[True] / compiled[False]) < 0.05, (got, compiled)


def test_donated_inputs_hold_the_outputs():
    mesh = jax.make_mesh((8,), ("a",), axis_types=(AxisType.Auto,))

    def step(w, x):
        new = w - 0.1 * jnp.sign(w)  # returned, and made before the big temporaries
        h = jnp.tanh(x @ new)
        y = h @ new.T  # (XLA:CPU fuses product, tanh, product and a sum of it into one kernel)
        return new, jnp.sum(y * y[:, ::-1])  # reversed along what each device holds

    args = (np.ones((512, 512), np.float32), np.ones((4096, 512), np.float32))
    got = {}
    for donate in ((), 0):
        # data parallelism, the user's layout priced (a searched plan's peak depends on the
        # calibration; this test is about the donated buffer)
        p = planner.price(step, *args, mesh=mesh, in_shardings=(P(), P("a")),
                          donate_argnums=donate)  # fmt: skip
        c = p.jit().lower(*args).compile()  # donates what the plan was told, by default
        got[donate] = (p.prediction.peak_bytes, compiled_total(c))
        assert 0.75 <= got[donate][0] / got[donate][1] <= 1.25
    assert p.program.donated == {p.program.inputs[0].name} and p.donate_argnums == (0,)
    assert c.memory_analysis().alias_size_in_bytes > 0
    saved = [kept - donated for kept, donated in zip(got[()], got[0])]
    assert saved[0] == saved[1] > 0  # the new weights' buffer, predicted as compiled
    with pytest.raises(ValueError, match="donate_argnums=5"):
        planner.plan(step, *args, mesh=mesh, donate_argnums=5)


# Workloads of the planner benchmark (configs/planner_benchmark/default.py)
CPU_WORKLOADS = ["mlp:1024x64x2", "transformer:8x16x8x64x1", "moe:512x64x8x256",
                 "lm_scan:8x32x64x4x2x256"]  # fmt: skip


@pytest.mark.parametrize("spec", CPU_WORKLOADS)
def test_predicted_peak_is_within_a_quarter_of_the_compiled_total_on_cpu(spec, mesh):
    from experiments.workloads import workload

    kind, sizes = spec.split(":")
    # planned and compiled, not run: the arguments' shapes (no arrays drawn, no flax init)
    fn, args = workload(kind, [int(n) for n in sizes.split("x")], np.random.default_rng(0),
                        shapes_only=True)  # fmt: skip
    p = planner.plan(fn, *args, mesh=mesh, memory_limit_bytes=None)
    compiled = compiled_total(p.jit().lower(*args).compile())
    # lm_scan's searched plan (a scan's stacked residuals split over all axes) reads 0.74: the
    # compiler's temporaries of the rolled loop are under-predicted (a known gap, left open)
    low = 0.7 if kind == "lm_scan" else 0.75
    assert low <= p.prediction.peak_bytes / compiled <= 1.25, (p.prediction, compiled)


@pytest.mark.parametrize("strategy", ["data", "fsdp", "megatron"])
def test_hand_written_strategies_too(strategy, mesh):
    # data parallelism all-reduces whole weight gradients, FSDP gathers whole weights: XLA
    # combines the gradients' collectives, so their partial sums wait for the last one
    from experiments.memory_check import cpu_case

    row = cpu_case("mlp", "mlp", [32, 512, 2], strategy, mesh, np.random.default_rng(0))
    assert 0.75 <= row["ratio"] <= 1.25, row


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason='the TPU compiler (libtpu) is not installed: pip install "redist[tpu]"')  # fmt: skip
def test_predicted_peak_is_within_a_quarter_of_the_tpu_compilers_total():
    from experiments.language_model import lm_step
    from redist.calibration import Calibration

    # nothing allocated; at 8 x 64 tokens of width 128 (30 MB per chip compiled, the scores
    # and activations still most of it) the TPU compiler takes half the time of 16 x 128
    step, shapes = lm_step(8, 64, 128, 4, 2, 256, True, shapes_only=True)
    axes = {"data": 2, "tensor": 2}
    p = planner.plan(step, *shapes, mesh=axes, calibration=Calibration.named("tpu_v5p"),
                     memory_limit_bytes=None)  # fmt: skip
    report = p.compiled_report(planner.topology_mesh("v5p:2x2x1", axes))
    assert 0.75 <= p.prediction.peak_bytes / report.total_bytes <= 1.25, (p.prediction, report)


def _replicated_on_four_v5p_chips(prog, step, args):
    """``prog`` (of ``step(*args)``) run whole on each of 4 v5p chips: its prediction and the
    TPU compiler's report."""
    from redist.calibration import Calibration

    sched = prog.schedule({}, {"d": 4}, default="replicate")
    pred = planner.simulate(prog, sched, Calibration.named("tpu_v5p"))
    mesh = planner.topology_mesh("v5p:2x2x1", {"d": 4})
    p = planner.AutoPlan.of(prog, sched, mesh, prediction=pred,
                            in_tree=jax.tree.structure(tuple(args)),
                            out_tree=jax.tree.structure(jax.eval_shape(step, *args)))  # fmt: skip
    return pred, p.compiled_report()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason='the TPU compiler (libtpu) is not installed: pip install "redist[tpu]"')  # fmt: skip
def test_tpu_keeps_residuals_only_products_read_in_bfloat16():
    """Linear layers in a scan: each layer's input is kept for its weight's gradient, a product
    alone reads it, and the TPU compiler stores it in bfloat16 (XLA:CPU in float32)."""

    def step(ws, x):
        return jax.grad(lambda ws: jnp.sum(jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]))(ws)

    # 8 layers of 128 x 128 on 4096 rows: the stack 16 times the weights, as at 256 on 8192 rows
    # (the same ratios to the compiler's peak, a sixth of its compile time)
    args = [jax.ShapeDtypeStruct((8, 128, 128), F32), jax.ShapeDtypeStruct((4096, 128), F32)]
    prog = planner.analyze(step, *args)
    assert lifetimes(prog, "tpu").narrowed and not lifetimes(prog, "cpu").narrowed
    pred, report = _replicated_on_four_v5p_chips(prog, step, args)
    residuals = 8 * 4096 * 128 * 2  # the stacked layer inputs, in bfloat16
    assert report.temp_bytes >= residuals
    # against the compiler's peak: 1.14x, the stack held over the backward loop and each layer
    # read inside the product (no slice of its own), as the compiler does; in float32 the
    # residuals alone would be 1.7x
    assert 0.9 <= pred.peak_bytes / report.total_bytes <= 1.15, (pred.peak_bytes, report)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason='the TPU compiler (libtpu) is not installed: pip install "redist[tpu]"')  # fmt: skip
def test_attention_scores_are_exponentiated_in_place_on_tpu_and_beside_them_on_gpu():
    """Attention over 8 x 2048 x 16 heads in float32 (2 GiB of scores): one H100 compiled it to
    4240 MiB (the exponentiated scores a second buffer: XLA:GPU computes them with their sum in
    one kernel), the TPU compiler to 2224 MiB (in place); the predictions follow both."""
    from experiments.workloads import workload
    from redist.calibration import Calibration

    fn, args = workload("attention", [8, 2048, 16, 64], np.random.default_rng(0))
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    prog = planner.analyze(fn, *shapes)
    sched = prog.schedule({}, {"d": 4}, default="replicate")  # each chip computes it whole
    predicted = {name: planner.simulate(prog, sched, Calibration.named(name)).peak_bytes
                 for name in ("h100_sxm", "tpu_v5p")}  # fmt: skip
    assert 0.9 <= predicted["h100_sxm"] / (4240 * 2**20) <= 1.1, predicted
    mesh = planner.topology_mesh("v5p:2x2x1", {"d": 4})
    p = planner.AutoPlan.of(prog, sched, mesh, in_tree=jax.tree.structure(tuple(shapes)),
                            out_tree=jax.tree.structure(jax.eval_shape(fn, *shapes)))  # fmt: skip
    report = p.compiled_report()
    assert 0.9 <= predicted["tpu_v5p"] / report.total_bytes <= 1.1, (predicted, report)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason='the TPU compiler (libtpu) is not installed: pip install "redist[tpu]"')  # fmt: skip
def test_a_one_hot_read_by_products_is_computed_inside_them_on_tpu():
    """An embedding by one-hot product (MaxText's ``use_iota_embed``): the 1024 x 2048 float32
    one-hot (8 MiB) is read by the lookup's product and by the table's gradient. The TPU
    compiler computes it inside both, never holding it (0.76 MiB in all); XLA:CPU's fusion
    stores it. Predicted as a buffer it would be 11.5x the compiled total. (At 4x each size,
    4096 x 8192, the same ratios: 12 MiB in all, the prediction 0.83x; 8 times the compile.)"""
    from planner.cost.buffers import expansions

    vocab, width, tokens = 2048, 32, 1024

    def step(table, ids):
        def loss(table):
            one_hot = jnp.asarray(ids[..., None] == jnp.arange(vocab), F32)
            return jnp.sum(jnp.tanh(one_hot @ table))

        return table - 0.1 * jax.grad(loss)(table)

    args = [jax.ShapeDtypeStruct((vocab, width), F32), jax.ShapeDtypeStruct((tokens,), jnp.int32)]
    prog = planner.analyze(step, *args)
    (one_hot,) = [o.results[0].value.name for o in prog.ops
                  if o.primitive == "convert_element_type" and o.results[0].value.shape == (
                      tokens, vocab)]  # fmt: skip
    assert one_hot in expansions(prog)
    assert lifetimes(prog, "tpu").kind[one_hot] == FUSED
    assert lifetimes(prog, "cpu").kind[one_hot] == BUFFER
    pred, report = _replicated_on_four_v5p_chips(prog, step, args)
    assert report.total_bytes < tokens * vocab * 4 / 4  # the compiler holds no one-hot
    assert 0.75 <= pred.peak_bytes / report.total_bytes <= 1.25, (pred.peak_bytes, report)


def test_a_value_made_of_values_of_its_own_size_is_no_expansion():
    """Cheap ops on an activation (its size, not smaller) make no expansion; a broadcast
    vector does."""
    from planner.cost.buffers import expansions

    prog = planner.analyze(lambda x, s: jnp.sum((x * 2.0) @ jnp.broadcast_to(s, (64, 64))),
                           jax.ShapeDtypeStruct((64, 64), F32), jax.ShapeDtypeStruct((64,), F32))  # fmt: skip
    made = {o.primitive: o.results[0].value.name for o in prog.ops}
    got = expansions(prog)
    assert made["broadcast_in_dim"] in got and made["mul"] not in got


def _offloading_step(offload: bool):
    """SGD through 8 scanned layers whose ``tanh(x @ w)`` is saved for the backward pass, on
    the device or offloaded to the host (a remat policy as MaxText's ``custom`` writes it)."""
    from jax.ad_checkpoint import checkpoint_name

    policies = jax.checkpoint_policies
    policy = (policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_src="device",
        offload_dst="pinned_host") if offload else policies.save_only_these_names("h"))  # fmt: skip

    @jax.checkpoint
    def layer(x, w):
        h = checkpoint_name(jnp.tanh(x @ w), "h")
        return jnp.tanh(h @ w), None

    layer = jax.checkpoint(layer.__wrapped__, policy=policy)

    def step(ws, x):
        g = jax.grad(lambda ws: jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2))(ws)
        return ws - 0.1 * g

    return step


def test_values_offloaded_to_the_host_take_no_device_memory_where_the_host_has_its_own():
    """On TPU and GPU an offloaded residual lives in host memory: the stacked residual (8
    layers x 256 x 64 float32, 512 KiB) leaves the device's peak. XLA:CPU's host memory is its
    devices' own: nothing changes there."""
    from redist.calibration import Calibration

    args = [jax.ShapeDtypeStruct((8, 64, 64), F32), jax.ShapeDtypeStruct((256, 64), F32)]
    progs = {o: planner.analyze(_offloading_step(o), *args) for o in (True, False)}
    host = lifetimes(progs[True], "tpu").host
    stacked = [v for v in host if progs[True].producer[v].primitive == "scan_ys"]
    assert len(stacked) == 1 and not lifetimes(progs[False], "tpu").host
    assert not lifetimes(progs[True], "cpu").host
    peaks = {}
    for cal in ("tpu_v5p", "h100_sxm", "cpu"):
        for o, prog in progs.items():
            sched = prog.schedule({}, {"a": 4}, default="replicate")
            peaks[cal, o] = planner.simulate(prog, sched, Calibration.named(cal)).peak_bytes
    residuals = 8 * 256 * 64 * 4
    assert peaks["tpu_v5p", False] - peaks["tpu_v5p", True] >= residuals // 2  # bf16 on TPU
    assert peaks["h100_sxm", False] - peaks["h100_sxm", True] >= residuals
    assert abs(peaks["cpu", False] - peaks["cpu", True]) < residuals // 8


def test_a_residual_a_shard_map_offloads_inside_its_body_takes_no_device_memory(mesh):
    """MaxText's flash attention checkpoints inside its own ``shard_map``: the residual it
    offloads leaves the region as an output typed ``<host>``, and stays off the device's peak
    on TPU (Llama 3.1 405B's 67.6 GB of attention contexts per chip)."""
    from jax.ad_checkpoint import checkpoint_name

    from planner.cost.buffers import host_values

    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_src="device",
        offload_dst="pinned_host")  # fmt: skip

    def body(x, w):
        return jnp.tanh(checkpoint_name(jnp.tanh(x @ w), "h") @ w)

    region = jax.shard_map(jax.checkpoint(body, policy=policy), mesh=mesh,
                           in_specs=(P(("a", "b", "c")), P()), out_specs=P(("a", "b", "c")))  # fmt: skip

    def step(x, w):
        return jax.grad(lambda w: jnp.sum(region(x, w) ** 2))(w)

    args = [jax.ShapeDtypeStruct((256, 64), F32), jax.ShapeDtypeStruct((64, 64), F32)]
    with jax.set_mesh(mesh):
        prog = planner.analyze(step, *args)
    manual = [o for o in prog.ops if o.how == "manual"]
    offloaded = {r.value.name for o in manual for r in o.results} & host_values(prog)
    assert len(offloaded) == 1 and len(prog.producer[min(offloaded)].results) > 1


def test_a_plan_that_offloads_computes_what_the_step_computes(mesh):
    """The offloading step split over the batch on 8 CPU devices: the same update as the
    unsharded step, the device_put to the host and back kept in the plan."""
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.standard_normal((4, 32, 32)) / 6, F32)
    x = jnp.asarray(rng.standard_normal((64, 32)), F32)
    step = _offloading_step(True)
    want = np.asarray(jax.jit(step)(ws, x))
    prog = planner.analyze(step, ws, x)
    assert any(o.primitive == "device_put" for o in prog.ops)
    from planner.baselines import expert_plans

    plans = expert_plans(step, ws, x, mesh=mesh, data_axes=("a", "b"), tensor_axis="c")
    for name in ("data_parallel", "fsdp_tensor"):
        p = plans[name]
        assert p.in_specs[1] != P(), name  # the batch is split
        np.testing.assert_allclose(np.asarray(p(ws, x)), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("math", ["exp", "div", "sqrt", "rsqrt", "logistic"])
def test_on_gpu_float_exp_division_roots_and_logistic_are_recomputed_by_each_reader(math):
    """XLA:GPU fuses these into each of their readers as cheap ops (float32, and bfloat16 that it
    computes in float32); the TPU compiler and XLA:CPU store them when several ops read them, and
    XLA:GPU a tanh."""
    fns = {"exp": jnp.exp, "div": lambda v: 1.0 / v, "sqrt": jnp.sqrt, "rsqrt": jax.lax.rsqrt,
           "logistic": jax.nn.sigmoid}  # fmt: skip

    def f(x, w, g=fns[math]):
        e = g(x)
        return (e * 2.0) @ w, (e * 3.0) @ w

    assert kinds(f, (64, 32), (32, 16), backend="gpu")[1][math] == FUSED
    assert kinds(f, (64, 32), (32, 16), backend="tpu")[1][math] == BUFFER
    assert kinds(f, (64, 32), (32, 16), backend="cpu")[1][math] == BUFFER
    prog = planner.analyze(
        f, *[jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((64, 32), (32, 16))]
    )
    op = next(o for o in prog.ops if o.primitive == math)
    assert lifetimes(prog, "gpu").kind[op.results[0].value.name] == FUSED
    tanh = lambda x, w: f(x, w, jnp.tanh)  # noqa: E731
    assert kinds(tanh, (64, 32), (32, 16), backend="gpu")[1]["tanh"] == BUFFER


def test_on_gpu_a_row_normalization_is_not_written_into_the_values_it_normalizes():
    """A softmax over the rows of a product (one H100's compiler: the inputs, the scores and the
    probabilities, 4 buffers of the scores' size; the probabilities are made in one kernel with
    the rows' max and sum, so not in place) and a centering of its rows (4); a centering of its
    columns is in place (3), as on TPU."""
    from redist.calibration import Calibration

    n = 256
    args = [jax.ShapeDtypeStruct((n, n), F32)] * 2

    def buffers(fn, cal):
        prog = planner.analyze(fn, *args)
        sched = prog.schedule({}, {"a": 1}, default="replicate")
        return planner.simulate(prog, sched, Calibration.named(cal)).peak_bytes // (n * n * 4)

    softmax = lambda x, w: jax.nn.softmax(x @ w, axis=-1)  # noqa: E731
    rows = lambda x, w: (lambda s: s - jnp.mean(s, 1, keepdims=True))(x @ w)  # noqa: E731
    cols = lambda x, w: (lambda s: s - jnp.mean(s, 0, keepdims=True))(x @ w)  # noqa: E731
    assert buffers(softmax, "h100_sxm") == 4 and buffers(softmax, "tpu_v5p") == 3
    assert buffers(rows, "h100_sxm") == 4 and buffers(cols, "h100_sxm") == 3


def _attention_like_layers(unroll, layers=4, n=128):
    """The gradient of ``layers`` layers ``tanh(softmax(h @ w) @ w.T)``: scanned with ``unroll``,
    or written out (``"python"``)."""

    def layer(h, w):
        a = jnp.exp(h @ w)
        return jnp.tanh((a / jnp.sum(a, -1, keepdims=True)) @ w.T), None

    def loss(ws, x):
        if unroll == "python":
            h = x
            for i in range(layers):
                h, _ = layer(h, ws[i])
        else:
            h, _ = jax.lax.scan(layer, x, ws, unroll=unroll)
        return jnp.sum(h**2)

    return jax.grad(loss), [jax.ShapeDtypeStruct((layers, n, n), F32),
                            jax.ShapeDtypeStruct((n, n), F32)]  # fmt: skip


def test_an_unrolled_scan_keeps_each_layers_residuals_and_no_stack_on_gpu_and_tpu():
    """``unroll=True``: XLA:GPU and the TPU compiler compile the layers as if written out (one
    H100's compiler, 4 layers of 1024 wide: 21 buffers of a product's size unrolled, 41 scanned;
    the TPU compiler at 512: 19 and 29.5): no residual stack; each layer's residuals are its own
    buffers, and the exponentiated scores, fused across the stack, are recomputed by the backward
    pass on GPU. XLA:CPU is left as it was."""
    from redist.calibration import Calibration

    peaks, progs = {}, {}
    for name, unroll in (("scanned", 1), ("unrolled", True), ("written out", "python")):
        step, args = _attention_like_layers(unroll)
        progs[name] = prog = planner.analyze(step, *args)
        sched = prog.schedule({}, {"a": 1}, default="replicate")
        for cal in ("h100_sxm", "tpu_v5p", "cpu"):
            peaks[name, cal] = planner.simulate(prog, sched, Calibration.named(cal)).peak_bytes
    prog = progs["unrolled"]
    forward = prog.regions[0]
    stacks = [o.results[0].value.name for o in prog.ops[forward.body : forward.stop]
              if o.primitive == "scan_ys"]  # fmt: skip
    for backend in ("gpu", "tpu"):
        lt = lifetimes(prog, backend)
        assert all(lt.kind[v] == FUSED for v in stacks)
        assert lt.repeated and all(n == 3 for spans in lt.repeated.values() for *_, n in spans)
        assert all(lifetimes(progs["scanned"], backend).kind[v] == BUFFER for v in stacks)
    assert all(lifetimes(prog, "cpu").kind[v] == BUFFER for v in stacks)
    assert not lifetimes(prog, "cpu").repeated and not lifetimes(progs["scanned"], "gpu").repeated
    unit = 128 * 128 * 4
    for cal in ("h100_sxm", "tpu_v5p"):
        # less than the stacks (26-30 units on the TPU, by JAX version), as written out
        assert peaks["unrolled", cal] < peaks["scanned", cal] - 1 * unit, peaks
        assert abs(peaks["unrolled", cal] - peaks["written out", cal]) <= 2 * unit, peaks
    assert peaks["unrolled", "cpu"] == peaks["scanned", "cpu"]


@needs_xla_gpu
def test_the_gpu_rules_against_xla_gpu_compiling_for_one_h100():
    """XLA:GPU compiling for one compile-only H100 (planner.gpu_mesh): the row normalizations
    beside the product, the column one in place, and the layers scanned and unrolled (1024 wide:
    smaller products are split along their sum into larger temporaries)."""
    from jax.sharding import NamedSharding

    from redist.calibration import Calibration

    mesh = planner.gpu_mesh({"d": 1})
    n = 1024

    def check(fn, args, low, high):
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P()))
                   for a in args]  # fmt: skip
        compiled = planner.compiled_report(jax.jit(fn), *structs).total_bytes
        prog = planner.analyze(fn, *args)
        sched = prog.schedule({}, {"d": 1}, default="replicate")
        pred = planner.simulate(prog, sched, Calibration.named("h100_sxm")).peak_bytes
        assert low <= pred / compiled <= high, (pred / (n * n * 4), compiled / (n * n * 4))

    args = [jax.ShapeDtypeStruct((n, n), F32)] * 2
    check(lambda x, w: jax.nn.softmax(x @ w, axis=-1), args, 0.99, 1.01)  # 4 products' sizes
    check(lambda x, w: (lambda s: s - jnp.mean(s, 1, keepdims=True))(x @ w), args, 0.99, 1.01)
    check(lambda x, w: (lambda s: s - jnp.mean(s, 0, keepdims=True))(x @ w), args, 0.99, 1.01)
    check(*_attention_like_layers(1, n=n), 0.95, 1.1)  # 42 to 41 (JAX 0.10), 38 to 35 (0.12)
    check(*_attention_like_layers(True, n=n), 1.0, 1.2)  # 24 against 21 (36 without the rule)


def _language_model_step(unroll=1, vocab=4096):
    """A step of a small language model: embedding, scanned layers, an output layer and a
    float32 softmax cross-entropy, the parameters updated by their gradients."""

    def loss(params, tokens):
        emb, ws, out = params
        h = emb[tokens]
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws, unroll=unroll)
        logits = (h @ out).astype(F32)
        picked = jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)

    def step(params, tokens):
        grads = jax.grad(loss)(params, tokens)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    bf16 = jnp.bfloat16
    args = ((jax.ShapeDtypeStruct((vocab, 64), bf16), jax.ShapeDtypeStruct((3, 64, 64), bf16),
             jax.ShapeDtypeStruct((64, vocab), bf16)), jax.ShapeDtypeStruct((4, 128), jnp.int32))  # fmt: skip
    return step, args


def test_the_tpu_compiler_makes_the_output_layers_weight_gradient_after_the_backward_loop():
    """DEFERRED_PRODUCTS: the output layer's weight gradient, which only the update reads, runs
    after the layers' backward loop on the TPU (as its compiler scheduled MaxText's DeepSeek-V3,
    Qwen3-235B and Llama 3.1 405B steps), so the logits' gradient it reads is held over that
    loop and the predicted peak there grows by it; elsewhere, and past an unrolled scan, it runs
    where the program has it."""
    from redist.calibration import Calibration

    step, args = _language_model_step()
    prog = planner.analyze(step, *args)
    backward = max((r for r in prog.regions if r.kind == "scan"), key=lambda r: r.start)
    tpu, cpu = lifetimes(prog, "tpu"), lifetimes(prog, "cpu")
    moved = [k for k, at in enumerate(tpu.at) if at != k]
    assert len(moved) == 1 and cpu.at == tuple(range(len(prog.ops)))
    (k,) = moved
    dw = prog.ops[k]
    assert dw.primitive == "dot_general" and sorted(dw.results[0].value.shape) == [64, 4096]
    assert k < backward.start and tpu.at[k] == backward.stop
    # its result is made after the loop; the logits' gradient it reads (the other product's
    # operand too) is freed only then, not where the program reads it first
    assert any(key[0] == k for key in tpu.alloc[backward.stop])
    grad_logits = next(a.value.name for a in dw.operands if a.value.shape == (4, 128, 4096))
    made = prog.index[prog.producer[grad_logits].name]
    assert tpu.kind[grad_logits] == cpu.kind[grad_logits] == BUFFER
    assert _freed(tpu)[(made, 0)] >= backward.stop and _freed(cpu)[(made, 0)] < backward.start
    sched = prog.schedule({}, {"a": 1}, default="replicate")
    cal = Calibration.named("tpu_v5p")
    during = _backward_memory(prog, planner.simulate(prog, sched, cal), backward)
    before = _backward_memory(prog, _without_deferral(prog, sched, cal), backward)
    # over the loop: the logits' gradient and the last layer's output the product reads, not
    # the weight gradient it makes (all bfloat16)
    held = (4 * 128 * 4096 + 4 * 128 * 64 - 64 * 4096) * 2
    assert before and all(b - a == held for a, b in zip(before, during)), (before, during)
    inside = peak_buffers(prog, sched, cal, at=prog.ops[backward.body].name)  # what is held there
    assert grad_logits in {b.name for b in inside.buffers} and inside.bytes == during[0]
    with pytest.raises(ValueError, match="no op named"):
        peak_buffers(prog, sched, cal, at="no_such_op")
    step, args = _language_model_step(unroll=True)
    unrolled = planner.analyze(step, *args)
    assert lifetimes(unrolled, "tpu").at == tuple(range(len(unrolled.ops)))


def _freed(lt) -> dict:
    """Buffer -> the op after which ``lt`` frees it."""
    return {key: end for end, keys in enumerate(lt.free) for key in keys}


def _backward_memory(prog, prediction, loop) -> list[int]:
    """The predicted bytes live while each op of ``loop``'s body runs."""
    names = {o.name for o in prog.ops[loop.body : loop.stop]}
    return [c.memory_bytes for c in prediction.ops if c.op in names]


def _without_deferral(prog, sched, cal):
    """``sched``'s prediction without :data:`DEFERRED_PRODUCTS`."""
    from planner.cost import buffers

    saved = buffers.DEFERRED_PRODUCTS
    try:
        buffers.DEFERRED_PRODUCTS = frozenset()
        buffers.LIFETIMES.get(prog, dict).clear()
        return planner.simulate(prog, sched, cal)
    finally:
        buffers.DEFERRED_PRODUCTS = saved
        buffers.LIFETIMES.get(prog, dict).clear()


def test_a_stack_a_loop_slices_is_held_for_the_whole_loop_and_the_tpu_reads_its_layers_in_place():
    """A rolled backward loop reads each layer of the forward's stacked residuals: the stack lives
    to the loop's end, also where the layer's slice is a buffer of its own (XLA:CPU); the TPU
    compiler reads the layer inside the product (SLICED_IN_PRODUCTS), so its slice is none."""

    def step(ws, x):
        body = lambda h, w: (h @ w, None)  # noqa: E731
        return jax.grad(lambda ws: jnp.sum(jax.lax.scan(body, x, ws)[0]))(ws)

    prog = planner.analyze(step, jax.ShapeDtypeStruct((4, 64, 64), F32),
                           jax.ShapeDtypeStruct((256, 64), F32))  # fmt: skip
    forward, backward = sorted((r for r in prog.regions if r.kind == "scan"), key=lambda r: r.start)
    stack = next(k for k in range(forward.body, forward.stop) if prog.ops[k].primitive == "scan_ys")
    slices = [prog.ops[k].results[0].value.name for k in range(backward.start, backward.body)
              if prog.ops[k].primitive == "scan_xs"]  # fmt: skip
    for backend, slice_kind in (("cpu", BUFFER), ("tpu", FUSED)):
        lt = lifetimes(prog, backend)
        assert _freed(lt)[(stack, 0)] == backward.stop - 1, backend
        assert slices and all(lt.kind[v] == slice_kind for v in slices), backend


def _two_stacks_step(clipped: bool):
    """A step over two stacks of MLP layers (3 of width 512 -> 1024, then 4 of 512 -> 512), each
    layer's input and hidden activation offloaded to the host as MaxText offloads its
    residuals, updated by SGD, ``clipped`` by the gradients' global norm."""
    from jax.ad_checkpoint import checkpoint_name

    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["x", "a"],
        offload_src="device", offload_dst="pinned_host")  # fmt: skip

    def layer(h, w):
        def body(h, w):
            h = checkpoint_name(h, "x")
            return checkpoint_name(jnp.tanh(h @ w[0]), "a") @ w[1]

        return jax.checkpoint(body, policy=policy)(h, w), None

    def step(wa, wb, x):
        def loss(wa, wb):
            return jnp.sum(jax.lax.scan(layer, jax.lax.scan(layer, x, wa)[0], wb)[0] ** 2)

        grads = jax.grad(loss, (0, 1))(wa, wb)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        scale = 0.1 / jnp.maximum(1.0, norm) if clipped else 0.1
        return jax.tree.map(lambda w, g: w - scale * g, (wa, wb), grads)

    def stack(n, width):
        return (
            jax.ShapeDtypeStruct((n, 512, width), F32),
            jax.ShapeDtypeStruct((n, width, 512), F32),
        )

    return step, [stack(3, 1024), stack(4, 512), jax.ShapeDtypeStruct((2048, 512), F32)]


@pytest.mark.parametrize("clipped", [True, False])
def test_the_last_layers_weight_gradient_work_waits_for_the_next_stacks_backward_loop(clipped):
    """PEELED_LAST_LAYER: the TPU compiler runs a backward loop's last layer after the loop, and
    on MaxText's DeepSeek-V3 step its weight gradients after the next stack's backward loop (the
    first MoE layer's after the dense layers'): what they read of that layer (here its input and
    hidden activation back from the host, and the hidden activation's gradient) is held over
    that loop. Only where the gradients' first use waits for that loop (clipped by a global
    norm the other stack's gradients are part of); a plain update does not wait, and the
    compiler runs it before the loop."""
    step, args = _two_stacks_step(clipped)
    prog = planner.analyze(step, *args)
    loops = sorted((r for r in prog.regions if r.kind == "scan"), key=lambda r: r.start)
    assert len(loops) == 4
    second, first = loops[2], loops[3]  # the backward loops: the second stack's, then the first's
    tpu, cpu = lifetimes(prog, "tpu"), lifetimes(prog, "cpu")
    temporaries = [key for key, end in _freed(cpu).items()
                   if second.body <= key[0] < second.stop and end < second.stop - 1]  # fmt: skip
    assert len(temporaries) >= 5
    held = {key for key in temporaries if _freed(tpu)[key] >= tpu.times[first.stop - 1]}
    if not clipped:
        assert not held, held
        return
    weight_gradients = {c.name for key in held for c, _ in prog.uses[_value(prog, key)]
                        if c.primitive == "dot_general" and c.results[0].value.shape == (512, 512)}  # fmt: skip
    assert len(held) == 3 and all(
        prog.ops[k].results[0].value.shape == (2048, 512) for k, _ in held
    )
    assert all(any(c.name in weight_gradients for c, _ in prog.uses[_value(prog, key)])
               for key in held) and len(weight_gradients) == 2  # fmt: skip


def _value(prog, key) -> str:
    """The name of buffer ``(op index, result index)``'s value."""
    return prog.ops[key[0]].results[key[1]].value.name


def test_a_shard_maps_results_depend_on_the_operands_its_body_computes_them_from(mesh):
    """What a ``shard_map``'s deferred results hold (:func:`_operands_feeding`): the operands its
    body computes them from, through calls inside it (a ``jax.jit`` reading ``a`` whose result
    used is computed from ``b`` and ``c`` only); an op without a jaxpr holds all its operands."""
    from planner.cost.buffers import _operands_feeding

    def body(a, b, c):
        made, _ = jax.jit(lambda b, c, a: (jnp.sin(b) @ c, a + 1))(b, c, a)
        return a * 2, made

    def f(a, b, c):
        return jax.shard_map(body, mesh=mesh, in_specs=(P("a"), P("a"), P()),
                             out_specs=(P("a"), P("a")))(a, b, c)  # fmt: skip

    prog = planner.analyze(f, *[jax.ShapeDtypeStruct((8, 8), F32)] * 3)
    (op,) = [o for o in prog.ops if o.primitive == "shard_map"]
    a, b, c = (x.value.name for x in op.operands)
    assert _operands_feeding(op, frozenset({0})) == (a,)
    assert _operands_feeding(op, frozenset({1})) == (b, c)
    assert _operands_feeding(op, frozenset({0, 1})) == (a, b, c)
    product = planner.analyze(jnp.dot, *[jax.ShapeDtypeStruct((8, 8), F32)] * 2).ops[0]
    assert _operands_feeding(product, frozenset({0})) == tuple(
        x.value.name for x in product.operands
    )
