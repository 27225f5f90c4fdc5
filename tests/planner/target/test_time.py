"""The simulator's per-device flops against the TPU compiler's cost_analysis() of the same plans
(compiled on this host for a v5p topology; skipped without libtpu), and a compiled program's
collectives counted per loop trip."""

import dataclasses
import importlib.util
import random

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from markers import needs_xla_gpu
from planner_programs import random_schedule

import planner
from planner.program.schedule import make_schedule
from planner.target.compiled_time import compiled_time
from redist.calibration import Calibration
from redist.hlo import counted_collectives, kernel_counts

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the TPU compiler (libtpu) is not installed: pip install "redist[tpu]"',
)
CAL = Calibration.named("tpu_v5p")


def _loss(x, w1, w2):
    return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)


def sgd_step(x, w1, w2):
    g1, g2 = jax.grad(_loss, argnums=(1, 2))(x, w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2


def _compiled(p, sched, topo):
    """The plan ``p`` with schedule ``sched``, its prediction, and the compiler's count."""
    pred = planner.simulate(p.program, sched, CAL)
    bound = dataclasses.replace(p, schedule=sched, prediction=pred).bind(topo)
    from planner.target.compiled import input_structs

    compiled = bound.jit().lower(*input_structs(bound)).compile()
    return pred, compiled_time(compiled, CAL, topo.devices.size)


def _check_flops(p, topo, schedules):
    ratios = []
    for sched in schedules:
        pred, got = _compiled(p, sched, topo)
        ratios.append(pred.flops / got.flops)
        assert got.seconds > 0 and pred.bytes_accessed > 0
    assert all(abs(r - 1) <= 0.1 for r in ratios), ratios
    return ratios


@needs_libtpu
def test_predicted_flops_of_random_mlp_plans_match_the_compiler():
    axes = {"data": 2, "model": 2}
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((512, 256), (256, 1024), (1024, 256))]
    p = planner.plan(sgd_step, *shapes, mesh=axes, calibration=CAL)
    prog = p.program
    scheds = [p.schedule] + [
        make_schedule(prog, random_schedule(prog, axes, random.Random(seed)), axes,
                      default="replicate")
        for seed in range(3)
    ]  # fmt: skip
    _check_flops(p, planner.topology_mesh("v5p:2x2x1", axes), scheds)


def branching(x, w1, w2):
    """Two branches of equal work (and a tanh more in the first): one runs."""
    return jax.lax.cond(x.sum() > 0, lambda: jnp.tanh(x @ w1) @ w2, lambda: (x @ w1) @ w2)


@needs_libtpu
def test_a_cond_is_predicted_as_its_dearest_branch_as_the_compiler_counts_it():
    """XLA's cost analysis counts a conditional as its dearest branch; priced as both branches,
    the prediction would be twice the compiler's flops."""
    axes = {"data": 2, "model": 2}
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((512, 256), (256, 1024), (1024, 256))]
    p = planner.plan(branching, *shapes, mesh=axes, calibration=CAL)
    prog = p.program
    assert sorted(o.trips for o in prog.ops if o.primitive == "dot_general") == [0, 0, 1, 1]
    random_plan = random_schedule(prog, axes, random.Random(1))
    scheds = [p.schedule, make_schedule(prog, random_plan, axes, default="replicate")]
    _check_flops(p, planner.topology_mesh("v5p:2x2x1", axes), scheds)


@needs_libtpu
def test_predicted_flops_of_random_lm_plans_match_the_compiler():
    """The flax LM (adamw, integer labels; layers scanned) on v5p:2x2x2: the searched plan and
    a random point of the search's space. The program is compiled with its scan unrolled, since
    the compiler's cost analysis counts a loop's body once (unrolled, it is the Python loop's
    program)."""
    from experiments.language_model import lm_step
    from experiments.time_check import random_anchor_plan

    axes = {"data": 2, "fsdp": 2, "tensor": 2}
    # planned and compiled, never run: the arguments' shapes
    step, args = lm_step(8, 32, 64, 4, 2, 128, True, unroll=True, shapes_only=True)
    p = planner.plan(step, *args, mesh=axes, calibration=CAL)
    prog = p.program
    # a random plan whose layout changes plan.jit asks XLA about in 37 probes (one compile
    # each; seed 0's plan needs 60, 23 compiles more)
    rng = random.Random(5)
    scheds = [p.schedule]
    while len(scheds) < 2:  # one random plan (the MLP's test above checks three)
        try:
            scheds.append(make_schedule(prog, random_anchor_plan(prog, axes, rng), axes))
        except ValueError:
            continue
    _check_flops(p, planner.topology_mesh("v5p:2x2x2", axes), scheds)


@needs_libtpu
def test_a_collective_in_a_scan_counts_once_per_trip():
    """The compiler's HLO keeps a scan as a loop: its all-reduce is written once and run length
    times (the loop's known trip count), and priced so."""
    mesh = planner.topology_mesh("v5p:2x2x1", {"x": 4})

    def layers(h, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, ws)[0]

    h = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "x")))
    ws = jax.ShapeDtypeStruct((5, 256, 256), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, "x", None)))  # fmt: skip
    f = jax.jit(layers, out_shardings=NamedSharding(mesh, P(None, "x")))
    compiled = f.lower(h, ws).compile()
    counted = counted_collectives(compiled.as_text())
    assert counted and max(c.runs for c in counted) == 5
    t = compiled_time(compiled, CAL, 4)
    assert t.collectives == sum(c.runs for c in counted) and t.collective_s > 0
    assert t.seconds == t.optimal_seconds + t.collective_s
    assert t.kernel_source == "compiler"


def test_kernels_priced_by_the_roofline_where_the_compilers_estimate_is_not_positive():
    from planner.target.compiled_time import kernel_seconds

    cost = {"optimal_seconds": 2e-3, "flops": 4e12, "bytes accessed": 1e9}
    assert kernel_seconds(cost, CAL) == (2e-3, "compiler")
    seconds, source = kernel_seconds({**cost, "optimal_seconds": -20.0}, CAL)
    assert source == "roofline" and seconds == CAL.compute_time(4e12, 1e9) > 0
    assert kernel_seconds({}, CAL) == (0.0, "roofline")


H100 = Calibration.named("h100_sxm")
M, K, N = 1024, 512, 2048  # x: (M, K), w1: (K, N), w2: (N, K)


def _mlp_structs(mesh, dtype=jnp.float32):
    """sgd_step's arguments: the batch over data and fsdp, the hidden dimension over model."""
    specs = (P(("data", "fsdp"), None), P(None, "model"), P("model", None))
    return [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, spec))
            for s, spec in zip(((M, K), (K, N), (N, K)), specs)]  # fmt: skip


# per device: two matmuls forward, three backward (no gradient of x), each of
# 2 x (M / 4) x K x (N / 2) flops
MLP_FLOPS = 5 * 2.0 * (M // 4) * K * (N // 2)


@needs_xla_gpu
def test_gpu_kernels_priced_from_the_hlo_count_the_steps_matmuls():
    """XLA:GPU gives no cost analysis for compile-only H100s: the kernels are priced from the
    HLO, whose matmul flops are the step's."""
    try:
        mesh = planner.gpu_mesh({"data": 2, "fsdp": 2, "model": 2})
    except ValueError as e:  # JAX left the plugin out
        pytest.skip(str(e))
    compiled = jax.jit(sgd_step).lower(*_mlp_structs(mesh)).compile()
    assert not compiled.cost_analysis()
    t = compiled_time(compiled, H100)
    assert t.kernel_source == "roofline(hlo)"
    assert abs(t.flops / MLP_FLOPS - 1) <= 0.1, t.flops / MLP_FLOPS
    assert t.bytes_accessed > 0
    assert t.seconds > t.collective_s > 0
    # at least the matmuls at the H100's float32 rate
    assert t.optimal_seconds >= MLP_FLOPS / H100.dense_rate("float32")


def test_hlo_matmul_flops_agree_with_the_cpu_compilers_count():
    """Where the compiler counts flops (XLA:CPU), the HLO's matmul flops are its count of a
    matmul-heavy step, within 10 %. XLA:CPU's cost analysis has no ``optimal_seconds`` (and
    counts a loop once): its kernels are priced from the HLO, as on a GPU, at least the matmuls
    at the calibration's rate."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)
    compiled = jax.jit(sgd_step).lower(*_mlp_structs(mesh)).compile()
    counts = kernel_counts(compiled.as_text())
    cost = compiled.cost_analysis()
    assert abs(counts.flops / cost["flops"] - 1) <= 0.1, (counts.flops, cost["flops"])
    assert abs(counts.flops / MLP_FLOPS - 1) <= 0.01
    assert "optimal_seconds" not in cost
    cal = Calibration.default()
    t = compiled_time(compiled, cal)
    assert t.kernel_source == "roofline(hlo)" and t.flops == counts.flops
    assert t.optimal_seconds >= MLP_FLOPS / cal.dense_rate("float32")


def test_hlo_matmul_flops_of_a_scan_count_every_layer():
    """The compiler counts a rolled loop's body once; the HLO's count runs it its trip count
    times: a scanned step's matmul flops are the unrolled step's as XLA:CPU counts them (within
    10 %: the loop also computes the first layer's input gradient, which the unrolled program
    drops)."""

    def loss(h, ws, unroll):
        return jnp.sum(jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, ws, unroll=unroll)[0])

    h = jax.ShapeDtypeStruct((128, 512), jnp.float32)
    ws = jax.ShapeDtypeStruct((6, 512, 512), jnp.float32)
    flops, compiled_steps = {}, {}
    for name, u in (("rolled", 1), ("unrolled", True)):
        compiled = jax.jit(jax.grad(loss, argnums=1), static_argnums=2).lower(h, ws, u).compile()
        compiled_steps[name] = compiled
        flops[name] = (kernel_counts(compiled.as_text()).flops, compiled.cost_analysis()["flops"])
    (rolled, compiler_rolled), (unrolled, compiler_unrolled) = flops["rolled"], flops["unrolled"]
    matmul = 2.0 * 128 * 512 * 512
    assert rolled == 6 * 3 * matmul and unrolled == (6 * 3 - 1) * matmul
    assert compiler_rolled < 4 * matmul  # the compiler's count: the loop's body once
    assert abs(unrolled / compiler_unrolled - 1) <= 0.01, flops
    assert abs(rolled / compiler_unrolled - 1) <= 0.1, flops
    # priced from the HLO, the rolled loop's kernels are every layer's matmuls at least, where
    # the compiler's loop-once count would price one layer's
    cal = Calibration.default()
    rolled_s = compiled_time(compiled_steps["rolled"], cal).optimal_seconds
    assert rolled_s >= 6 * 3 * matmul / cal.dense_rate("float32", "default", matmul), rolled_s
