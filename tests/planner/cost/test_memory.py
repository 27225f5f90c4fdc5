"""Memory per device in the calibrations, the default memory limit of plan, and the error that
names the largest buffers when nothing fits."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import planner
from planner.cost.memory import MEMORY_RESERVE, MemoryLimitError, default_memory_limit
from planner.cost.simulator import peak_buffers
from redist.calibration import Calibration, host_memory_bytes


def _loss(x, w1, w2):
    return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)


STEP = jax.grad(_loss, argnums=(1, 2))
ARGS = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1024, 128), (128, 512), (512, 128))]
MESH = {"data": 2, "model": 4}


@pytest.mark.parametrize("name", ["tpu_v5p", "tpu_v5e", "tpu_v6e", "tpu_v7x", "tpu_v4", "h100_sxm"])
def test_accelerator_calibrations_state_their_memory_with_a_source(name):
    cal = Calibration.named(name)
    assert cal.memory_bytes > 10e9 and cal.memory_source and not cal.host_memory
    assert cal.device_memory_bytes(64) == cal.memory_bytes  # HBM is per device
    assert cal.sources and cal.flops_per_s > 1e14 and cal.domain_devices


def test_tpu_memory_is_what_the_compiler_reports_as_available():
    # The TPU compiler's "exceeds available HBM (95.74G)" counts G as 2**30 bytes.
    assert Calibration.named("tpu_v5p").memory_bytes / 2**30 == pytest.approx(95.74, abs=0.005)
    assert Calibration.named("tpu_v5e").memory_bytes / 2**30 == pytest.approx(15.75, abs=0.005)
    assert Calibration.named("tpu_v6e").memory_bytes / 2**30 == pytest.approx(31.25, abs=0.005)
    assert Calibration.named("tpu_v7x").memory_bytes / 2**30 == pytest.approx(94.74, abs=0.005)
    kinds = {"TPU v5": "tpu_v5p", "TPU v5 lite": "tpu_v5e", "TPU v6 lite": "tpu_v6e", "TPU7x": "tpu_v7x",
             "TPU v4": "tpu_v4", "cpu": "cpu"}  # fmt: skip
    for kind, name in kinds.items():
        assert Calibration.for_device_kind(kind) == Calibration.named(name)
    assert Calibration.for_device_kind("NVIDIA H100 80GB HBM3") == Calibration.named("h100_sxm")
    assert Calibration.for_device_kind("some accelerator") is None


def test_cpu_memory_is_the_hosts_shared_by_its_devices(tmp_path):
    cal = Calibration.default()
    assert cal.host_memory and cal.memory_bytes == host_memory_bytes() > 0
    assert cal.device_memory_bytes(8) == pytest.approx(cal.memory_bytes / 8)
    assert json.loads(cal.to_json())["memory_bytes"] == "host"  # read again where it is loaded
    path = tmp_path / "c.json"
    cal.save(str(path))
    assert Calibration.load(str(path)) == cal
    # the planner divides by the mesh's devices on this host (8 forced CPU devices here)
    assert default_memory_limit(cal, 4) == int(cal.memory_bytes / 4 * (1 - MEMORY_RESERVE))
    assert default_memory_limit(cal, 4096) == int(cal.memory_bytes / 8 * (1 - MEMORY_RESERVE))


def test_default_limit_is_the_capacity_less_the_reserve():
    v5p = Calibration.named("tpu_v5p")
    assert MEMORY_RESERVE == 0.1
    assert default_memory_limit(v5p, 4096) == int(v5p.memory_bytes * 0.9)
    unknown = dataclasses.replace(v5p, memory_bytes=None)
    assert default_memory_limit(unknown, 8) is None


def test_plan_keeps_under_the_default_limit():
    # on an H100's calibration the fastest plan holds more than it must (on this CPU's, the
    # fastest plan is also the smallest)
    slow = Calibration.named("h100_sxm")
    free = planner.plan(STEP, *ARGS, mesh=MESH, memory_limit_bytes=None, calibration=slow)
    # A machine whose memory the fastest plan overflows (by the default's reserve), but where a
    # plan that keeps less per device fits.
    small = dataclasses.replace(
        slow, memory_bytes=free.prediction.peak_bytes / 0.95, host_memory=False
    )
    limit = default_memory_limit(small, 8)
    assert free.prediction.peak_bytes > limit
    p = planner.plan(STEP, *ARGS, mesh=MESH, calibration=small)  # memory_limit_bytes="auto"
    assert p.prediction.peak_bytes <= limit
    over = planner.plan(STEP, *ARGS, mesh=MESH, calibration=small, memory_limit_bytes=None)
    assert over.prediction.peak_bytes > limit  # asked for: no limit
    inf = planner.plan(STEP, *ARGS, mesh=MESH, calibration=small, memory_limit_bytes=float("inf"))
    assert inf.prediction.peak_bytes == over.prediction.peak_bytes
    # where the fastest plan fits, the default changes nothing
    roomy = planner.plan(STEP, *ARGS, mesh=MESH, calibration=slow)
    assert roomy.schedule.assign == free.schedule.assign


def test_a_limit_nothing_fits_names_the_smallest_peak_and_its_largest_buffers():
    message = r"no schedule fits memory_limit_bytes=1000; the smallest predicted peak seen is \d+ "
    with pytest.raises(MemoryLimitError, match=message + "bytes per device") as info:
        planner.plan(STEP, *ARGS, mesh=MESH, memory_limit_bytes=1000)
    err = info.value
    assert isinstance(err, ValueError) and err.limit == 1000
    bufs = err.peak.buffers
    assert bufs and [b.bytes for b in bufs] == sorted((b.bytes for b in bufs), reverse=True)
    assert sum(b.bytes for b in bufs) == err.peak.bytes  # every byte of the peak accounted for
    text = str(err)
    largest = bufs[0]
    assert f"{largest.name} {largest.dtype}{list(largest.shape)}" in text
    assert f"{largest.bytes:,} bytes per device" in text
    assert "float32[" in text and err.peak.op in text
    assert err.leanest.prediction.peak_bytes == err.peak.bytes  # the plan of that peak, to run
    assert err.leanest.mesh == MESH and err.leanest.program.ops


def test_the_default_limit_says_where_it_comes_from_when_nothing_fits():
    tiny = dataclasses.replace(Calibration.default(), memory_bytes=2000.0, host_memory=False)
    with pytest.raises(MemoryLimitError, match=r"memory_limit_bytes=1800 \(the default: 90% of"):
        planner.plan(STEP, *ARGS, mesh=MESH, calibration=tiny)
    with pytest.raises(ValueError, match="give bytes per device"):
        planner.plan(STEP, *ARGS, mesh=MESH, memory_limit_bytes="lots")


def test_peak_buffers_name_moved_copies_and_values_at_the_peak():
    prog = planner.analyze(STEP, *ARGS)
    sched = prog.schedule({}, MESH, default="replicate")
    peak = peak_buffers(prog, sched)
    assert peak.bytes == planner.simulate(prog, sched).peak_bytes
    kinds = {b.kind.split()[0] for b in peak.buffers}
    assert kinds <= {"input", "output", "constant", "from", "moved", "scratch"}
    assert any(b.kind == "input" and b.shape == (128, 512) for b in peak.buffers)


def _experts(x, w):
    return jnp.tanh(x @ w)


def _summed_step(a, b, x):
    """MaxText's mixture of experts in small: a weight made whole, read whole by a shard_map
    over every device, its gradient summed there whole (a psum) after the backward product
    last reads it."""
    mesh = jax.sharding.get_abstract_mesh()

    def loss(w, x):
        w = jax.lax.with_sharding_constraint(w, jax.sharding.PartitionSpec())
        y = jax.shard_map(_experts, mesh=mesh, in_specs=(jax.sharding.PartitionSpec("fsdp"),
                                                         jax.sharding.PartitionSpec()),
                          out_specs=jax.sharding.PartitionSpec("fsdp"), check_vma=False)(x, w)  # fmt: skip
        return (y**2).mean()

    return jax.grad(loss, argnums=(0, 1))(a @ b, x)


def test_a_summed_shard_map_result_is_held_in_place_of_what_dies_there(monkeypatch):
    from planner.cost import simulator

    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8],
                         axis_types=(jax.sharding.AxisType.Auto,))  # fmt: skip
    # 250 x 510 (no dimension the 8 devices divide): the gradient's sum stays a psum
    args = (jax.ShapeDtypeStruct((250, 128), jnp.float32),
            jax.ShapeDtypeStruct((128, 510), jnp.float32),
            jax.ShapeDtypeStruct((64, 250), jnp.float32))  # fmt: skip
    with jax.set_mesh(mesh):
        plan = planner.plan(_summed_step, *args, mesh=mesh)
    prog, sched, cal = plan.program, plan.schedule, plan.calibration
    (backward,) = [o for o in prog.ops if o.how == "manual"
                   and any(b.primitive == "psum" for b in o.body)]  # fmt: skip
    grad = 250 * 510 * 4  # the weight's gradient, whole on every device
    assert simulator.summed_bytes(backward, [grad]) == grad
    assert simulator.summed_bytes(backward, [grad // 8]) == 0  # no psum of that size
    held = peak_buffers(prog, sched, cal, at=backward.name)
    (shared,) = [b for b in held.buffers if b.kind == "in place"]
    assert shared.bytes == -grad  # the weight, as large, dies there
    monkeypatch.setattr(
        simulator, "summed_in_place", lambda steps, priced, ending: [0] * len(steps)
    )
    assert peak_buffers(prog, sched, cal, at=backward.name).bytes == held.bytes + grad
