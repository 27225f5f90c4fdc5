"""planner on a flax nnx + optax language-model training step (Python-loop and scanned layers).

Tolerances: the loss to 1e-5 relative; gradients (Adam's first moment after one step, 0.1 x the
gradient) to 1e-3 relative + 1e-7 absolute; parameters to 1e-5 absolute, except where the exact
gradient is zero (the attention key bias: softmax is shift-invariant, so its gradient is float
noise of ~1e-10, which Adam turns into a step of up to the learning rate, 1e-3, in either
direction): there to twice the learning rate.
"""

import warnings

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from planner_checks import LR, assert_step_equal

import planner
from experiments.language_model import lm_step


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)


def device_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)  # fmt: skip


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_flax_lm_training_step_is_planned_exactly_and_fits(scan, mesh):
    step, args = lm_step(8, 16, 32, 4, 2, 64, scan, np.random.default_rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op of this program may run replicated unannounced
        prog = planner.analyze(step, *args)
    assert [r.kind for r in prog.regions] == (["scan", "scan"] if scan else [])
    replicated = planner.simulate(prog, prog.schedule({}, mesh))
    limit = int(0.7 * replicated.peak_bytes)
    p = planner.plan(step, *args, mesh=mesh, memory_limit_bytes=limit)
    want = jax.jit(step)(*args)
    # A split contraction sums in another order than the whole one; adam's update divides by
    # sqrt(nu), so an element with a tiny second moment moves by a few percent of the learning
    # rate (through the explicit lowering and through plan.jit, where XLA orders the sums).
    assert_step_equal(jax.tree.unflatten(p.out_tree, list(p.lowered(*args))), want,
                      param_atol=0.05 * LR)  # fmt: skip
    assert_step_equal(p(*args), want, param_atol=0.05 * LR)
    # the heavy products are split ...
    dense = sorted((o for o in prog.ops if o.dense), key=lambda o: -o.flops * o.trips)
    heaviest = [o for o in dense if o.flops * o.trips == dense[0].flops * dense[0].trips]
    assert all(p.schedule.assign.get(o.name) for o in heaviest)
    # ... and the plan needs less memory per device than the replicated program, predicted and
    # compiled
    assert p.prediction.peak_bytes <= limit < replicated.peak_bytes
    compiled = device_bytes(p.lowered.lower(*args).compile())
    assert compiled < device_bytes(jax.jit(step).lower(*args).compile())


def test_llama_like_step_is_planned_exactly(mesh):
    """RMSNorm, rotary embeddings, SwiGLU, scanned layers and fp32 Adam on fp32 master copies;
    planned, run, and compared with the unsharded step (fp32 parameters, so the tolerances above
    hold; bf16 ones are planned from shapes below)."""
    from experiments.language_model import llama_step

    step, args = llama_step(8, 16, 32, 4, 2, 64, 96, rng=np.random.default_rng(0),
                            param_dtype="float32")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prog = planner.analyze(step, *args)
    replicated = planner.simulate(prog, prog.schedule({}, mesh))
    limit = int(0.7 * replicated.peak_bytes)  # at this size replication is fastest: make it split
    p = planner.plan(step, *args, mesh=mesh, memory_limit_bytes=limit)
    assert any(p.schedule.assign.values()) and p.prediction.peak_bytes <= limit
    assert_step_equal(p(*args), jax.jit(step)(*args), param_atol=0.05 * LR)


def test_a_billion_parameter_llama_is_planned_from_shapes():
    from experiments.language_model import llama_step
    from redist.calibration import Calibration

    step, args = llama_step(64, 1024, 2048, 16, 2, 32000, 5632, shapes_only=True)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(args))
    assert {str(a.dtype) for a in jax.tree.leaves(args[0])} == {"bfloat16"}
    assert {str(a.dtype) for a in jax.tree.leaves(args[1]) if a.ndim} == {"float32"}
    p = planner.plan(step, *args, mesh={"data": 4, "fsdp": 4, "tensor": 4},
                     calibration=Calibration.named("tpu_v5p"))  # fmt: skip
    assert p.prediction.peak_bytes < p.replicated.peak_bytes / 4
    assert p.prediction.time_s < p.replicated.time_s / 8
