"""The simulator's per-device flops against the TPU compiler's cost_analysis() of the same plans
(compiled on this host for a v5p topology; skipped without libtpu), and a compiled program's
collectives counted per loop trip."""

import dataclasses
import importlib.util
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from planner_programs import random_schedule

import planner
from planner.compiled_time import compiled_time
from planner.program.schedule import make_schedule
from redist.calibration import Calibration
from redist.hlo import counted_collectives

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
    from planner.compiled import input_structs

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


@needs_libtpu
def test_predicted_flops_of_random_lm_plans_match_the_compiler():
    """The flax LM (adamw, integer labels; layers scanned) on v5p:2x2x2: the searched plan and
    random points of the search's space. The program is compiled with its scan unrolled, since
    the compiler's cost analysis counts a loop's body once (unrolled, it is the Python loop's
    program)."""
    from experiments.language_model import lm_step
    from experiments.time_check import random_anchor_plan

    axes = {"data": 2, "fsdp": 2, "tensor": 2}
    step, args = lm_step(8, 32, 64, 4, 2, 128, True, np.random.default_rng(0), unroll=True)
    p = planner.plan(step, *args, mesh=axes, calibration=CAL)
    prog = p.program
    rng = random.Random(0)
    scheds = [p.schedule]
    while len(scheds) < 3:
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
    from planner.compiled_time import kernel_seconds

    cost = {"optimal_seconds": 2e-3, "flops": 4e12, "bytes accessed": 1e9}
    assert kernel_seconds(cost, CAL) == (2e-3, "compiler")
    seconds, source = kernel_seconds({**cost, "optimal_seconds": -20.0}, CAL)
    assert source == "roofline" and seconds == CAL.compute_time(4e12, 1e9) > 0
    assert kernel_seconds({}, CAL) == (0.0, "roofline")
