"""Flops, transcendentals and bytes per op as the XLA compiler counts them (planner.cost.costs), the
prediction's totals, and pricing a compiled program's collectives (planner.target.compiled_time).
CPU only: the numbers in the table are what the TPU compiler's cost_analysis() reports for these
ops (see tests/planner/target/test_time.py for the check against the compiler itself)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import planner
from planner.cost.costs import fusion, op_flops
from planner.target.compiled_time import collective_seconds
from redist.calibration import Calibration
from redist.hlo import Collective, CountedCollective, counted_collectives

M, N, K = 16, 12, 8
x, w = np.ones((M, K), np.float32), np.ones((K, N), np.float32)
y = np.ones((M, N), np.float32)


def only(fn, *args, primitive: str):
    prog = planner.analyze(fn, *args)
    (op,) = [o for o in prog.ops if o.primitive == primitive]
    return op


@pytest.mark.parametrize(
    "fn, args, primitive, want",
    [
        (lambda a, b: a @ b, (x, w), "dot_general", (2 * M * N * K, 0)),
        (lambda a, b: a + b, (y, y), "add", (M * N, 0)),
        (lambda a, b: a / b, (y, y), "div", (M * N, 0)),
        (lambda a: -a, (y,), "neg", (M * N, 0)),
        (lambda a: a > 0, (y,), "gt", (M * N, 0)),
        (lambda a, b: jnp.where(a > 0, a, b), (y, y), "select_n", (M * N, 0)),
        (lambda a: a.astype(jnp.bfloat16), (y,), "convert_element_type", (M * N, 0)),
        (lambda a: jnp.tanh(a), (y,), "tanh", (0, M * N)),
        (lambda a: jnp.exp(a), (y,), "exp", (0, M * N)),
        (lambda a: lax.rsqrt(a), (y,), "rsqrt", (0, M * N)),
        (lambda a: jax.nn.sigmoid(a), (y,), "logistic", (3 * M * N, M * N)),
        (lambda a: a**3, (y,), "integer_pow", (2 * M * N, 0)),
        (lambda a: a**-2, (y,), "integer_pow", (2 * M * N, 0)),
        (lambda a: jnp.sum(a, axis=1), (y,), "reduce_sum", (M * N - M, 0)),
        (lambda a: jnp.max(a, axis=0), (y,), "reduce_max", (M * N - N, 0)),
        (lambda a: jnp.argmax(a, axis=1), (y,), "argmax", (9 * (M * N - M), 0)),
        (lambda a: a.T, (y,), "transpose", (0, 0)),
        (lambda a: a.reshape(N, M), (y,), "reshape", (0, 0)),
        (lambda a: jnp.broadcast_to(a, (4, M, N)), (y,), "broadcast_in_dim", (0, 0)),
        (lambda t, i: t[i], (y, np.arange(4, dtype=np.int32)), "gather", (0, 0)),
        (lambda t, i, u: t.at[i].add(u), (y, np.arange(4, dtype=np.int32), y[:4]),
         "scatter-add", (4 * N, 0)),
    ],
)  # fmt: skip
def test_flops_per_primitive_as_the_compiler_counts_them(fn, args, primitive, want):
    assert op_flops(only(fn, *args, primitive=primitive)) == want


def test_flops_of_a_split_op_are_its_local_share():
    op = only(lambda a, b: a @ b, x, w, primitive="dot_general")
    m, n, k = (lp.name for lp in op.loops)
    assert op_flops(op, {m: M // 4, n: N, k: K // 2}) == (2 * M * N * K / 8, 0)
    red = only(lambda a: jnp.sum(a, axis=1), y, primitive="reduce_sum")
    kept, summed = (lp.name for lp in red.loops)
    # each device reduces its (M/2) x (N/2) block to M/2 partial sums
    assert op_flops(red, {kept: M // 2, summed: N // 2}) == (M // 2 * (N // 2 - 1), 0)


def test_fusion_writes_kernel_results_only():
    """tanh(x @ w * 2 + 1) summed over rows: the product is written and the elementwise chain
    fuses into the sum that reads it; gelu(x @ w) returned: the product fuses into its consumer
    (output fusion) and only the result is written."""
    prog = planner.analyze(lambda a, b: jnp.sum(jnp.tanh(a @ b * 2.0 + 1.0), axis=0), x, w)
    f = fusion(prog)
    written = [o.primitive for o in prog.ops if any(f.writes[o.name])]
    assert written == ["dot_general", "reduce_sum"]
    assert all(f.runs[o.name] == 1 for o in prog.ops)
    reads = {o.primitive: f.reads[o.name] for o in prog.ops}
    assert reads["dot_general"] == (1, 1) and reads["mul"] == (1,) and reads["tanh"] == (0,)
    prog = planner.analyze(lambda a, b: jnp.tanh(a @ b), x, w)
    f = fusion(prog)
    dot, tanh = prog.ops
    assert dot.results[0].value.name not in f.materialized and f.writes[tanh.name] == (1,)
    assert f.reads[dot.name] == (1, 1) and f.reads[tanh.name] == (0,)


def test_fusion_copies_a_cheap_op_into_each_consumer_and_writes_for_a_scatter():
    def fn(a, i, v):
        b = a * 2.0  # two consumers: computed in both kernels
        c = v * 2.0  # read by two products: each product's kernel computes and reads it
        return (jnp.sum(b, axis=0), jnp.max(b, axis=1), jnp.zeros_like(a).at[i].add(a * 3.0),
                c @ w, c @ w.T[:, :K].T)  # fmt: skip

    prog = planner.analyze(fn, y, np.arange(M, dtype=np.int32), x)
    f = fusion(prog)
    a, _, v = prog.inputs
    muls = [o for o in prog.ops if o.primitive == "mul"]
    (mulc,) = [o for o in muls if o.operands[0].value == v]
    (mul3,) = [o for o in muls if any(c.primitive == "scatter-add"
                                      for c, _ in prog.uses[o.results[0].value.name])]  # fmt: skip
    (mul2,) = [o for o in muls if o not in (mulc, mul3)]
    assert f.runs[mul2.name] == 2 and mul2.results[0].value.name not in f.materialized
    # the two reductions reading a are siblings: one kernel with two outputs reads it once
    assert f.reads[mul2.name][0] == 1
    assert mul3.results[0].value.name in f.materialized  # a scatter's updates are written
    # zeros broadcast into the scatter are not written: the scatter writes its result
    zeros = next(o for o in prog.ops if o.primitive == "broadcast_in_dim")
    assert zeros.results[0].value.name not in f.materialized
    assert f.runs[mulc.name] == 2 and f.reads[mulc.name][0] == 2  # products read for themselves


def _mlp_grad(ws, a):
    h = a @ ws[0]
    h = jnp.tanh(h) * jax.nn.sigmoid(h)
    return jnp.mean((h @ ws[1] - a) ** 2)


def _twice(t, s):
    return t * s, t + 1  # t read by two kernels


def _once(t):
    return t * 2 + t * 3  # t read twice in one kernel


CPU_PROGRAMS = {
    "dot_bias_relu": (lambda a, b, c: jax.nn.relu(a @ b + c), (16, 24), (24, 32), (32,)),
    "tanh_two_kernels": (lambda a: _twice(jnp.tanh(a), jax.nn.sigmoid(a)), (64, 32)),
    "tanh_one_kernel": (lambda a: _once(jnp.tanh(a)), (64, 32)),
    "reduce_and_other": (lambda a: ((a * 3).sum(1), (a * 3) + 2), (64, 32)),
    "siblings": (lambda a: (a * 2, a + 1, a - 3), (64, 32)),
    "elementwise_into_dot": (lambda a, b: (a * 2) @ jnp.tanh(b), (64, 32), (32, 32)),
    "softmax": (lambda a: jax.nn.softmax(a, -1), (64, 32)),
    "mlp_grad": (jax.grad(_mlp_grad), ((32, 48), (48, 32)), (64, 32)),
}


@pytest.mark.parametrize("name", sorted(CPU_PROGRAMS))
def test_cpu_fusion_counts_the_bytes_xla_cpu_compiles(name):
    """XLA:CPU's kernels (planner.cost.costs.SEPARATE_KERNELS): products fuse nothing, an
    expensive value that two kernels read is written once, a reduction fuses only what it alone
    reads, siblings each read their input. The predicted bytes accessed of the whole program on
    one device are the compiled program's ``cost_analysis()`` figure (within 10%: a softmax's
    maximum is computed in the kernel that reads it), and the TPU's model is another."""
    fn, *shapes = CPU_PROGRAMS[name]
    rng = np.random.default_rng(0)
    args = jax.tree.map(lambda s: rng.normal(size=s).astype(np.float32), shapes,
                        is_leaf=lambda s: isinstance(s, tuple) and all(isinstance(n, int) for n in s))  # fmt: skip
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    compiled = (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]
    prog = planner.analyze(fn, *args)
    sched = prog.schedule({}, {"a": 1}, default="replicate")
    cpu = planner.simulate(prog, sched, Calibration.named("cpu")).bytes_accessed
    assert cpu == pytest.approx(compiled, rel=0.1), (cpu, compiled)
    tpu = planner.simulate(prog, sched, Calibration.named("tpu_v5p")).bytes_accessed
    if name in ("mlp_grad", "elementwise_into_dot", "tanh_two_kernels", "siblings"):
        assert tpu < 0.9 * compiled  # the TPU's compiler fuses these; XLA:CPU does not


def test_cpu_fusion_writes_an_expensive_value_read_by_two_kernels():
    prog = planner.analyze(lambda a: _twice(jnp.tanh(a), 2.0), y)
    tanh = next(o for o in prog.ops if o.primitive == "tanh")
    cpu, tpu = fusion(prog, "cpu"), fusion(prog, "tpu")
    assert cpu.writes[tanh.name] == (1,)
    assert tpu.writes[tanh.name] == (0,) and tpu.runs[tanh.name] == 2
    prog = planner.analyze(lambda a, b: jnp.tanh(a @ b), x, w)
    dot, tanh = prog.ops
    cpu, tpu = fusion(prog, "cpu"), fusion(prog, "tpu")
    assert cpu.writes[dot.name] == (1,) and cpu.reads[tanh.name] == (1,)
    assert tpu.writes[dot.name] == (0,)


def test_prediction_sums_flops_bytes_and_trips():
    def layers(h, ws):
        return lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, ws)[0]

    hs, ws = np.ones((M, K), np.float32), np.ones((3, K, K), np.float32)
    prog = planner.analyze(layers, hs, ws)
    sched = prog.schedule({}, {"a": 2}, default="replicate")
    pred = planner.simulate(prog, sched)
    assert pred.flops == sum(c.flops for c in pred.ops) == 3 * 2 * M * K * K
    assert pred.transcendentals == 3 * M * K
    assert pred.bytes_accessed == sum(c.bytes_accessed for c in pred.ops) > 0
    # split over rows on 2 devices: half the flops each
    dot = next(o for o in prog.ops if o.primitive == "dot_general")
    m = dot.loops[0].name
    split = planner.simulate(prog, prog.schedule({dot.name: {m: "a"}}, {"a": 2}))
    assert split.flops == pred.flops / 2


def test_a_pending_sum_adds_a_flop_per_element():
    prog = planner.analyze(lambda a, b: a @ b, x, w)
    dot = prog.ops[0]
    k = next(lp for lp, _ in dot.reductions)
    pred = planner.simulate(prog, prog.schedule({dot.name: {k: "a"}}, {"a": 2}))
    assert pred.flops == 2 * M * N * K / 2 + M * N  # local products, then the all-reduce


HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %all-reduce.1 = f32[8]{0} all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %t = (s32[], f32[8]) tuple(%i, %all-reduce.1)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body2 (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]) parameter(0)
  %y = f32[8]{0} get-tuple-element(%q), index=1
  %collective-permute = f32[8]{0} collective-permute(%y), source_target_pairs={{0,1},{1,0}}
}

%cond2 (q: (s32[], f32[8])) -> pred[] {
  %c = s32[]{:T(128)} constant(3)
  %q = (s32[], f32[8]) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%q), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[32] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %v = (s32[], f32[8]) while(%init), condition=%cond2, body=%body2
  %all-gather = f32[32]{0} all-gather(%a), replica_groups=[1,4]<=[4], dimensions={0}
}
"""  # fmt: skip


def test_collectives_in_a_loop_count_its_trips():
    counted = counted_collectives(HLO)
    by = {c.collective.kind: c for c in counted}
    assert by["all-reduce"].runs == 5 and by["all-gather"].runs == 1
    assert by["collective-permute"].runs == 3  # i < 3 in the loop's condition
    assert by["all-reduce"].collective == Collective("all-reduce", 32, 2)
    cal = Calibration.named("tpu_v5p")
    want = (5 * cal.collective_time("all-reduce", 32, 2) + cal.collective_time("all-gather", 128, 4)
            + 3 * cal.collective_time("collective-permute", 32, 4))  # fmt: skip
    assert collective_seconds(counted, cal, 4) == pytest.approx(want)
    # a reduce-scatter is priced by its input: the result times the group
    rs = CountedCollective(Collective("reduce-scatter", 64, 4), 2)
    assert collective_seconds([rs], cal, 4) == pytest.approx(
        2 * cal.collective_time("reduce-scatter", 256, 4)
    )
