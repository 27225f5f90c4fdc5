"""Plans for a multi-GPU host compiled by XLA:GPU on a machine without a GPU (planner.gpu_mesh:
compile-only H100s from JAX's CUDA plugin, which the test extra installs on x86-64 Linux)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from markers import needs_xla_gpu

import planner
from planner.target import gpus
from redist.calibration import Calibration


@needs_xla_gpu
def test_gpu_mesh_compiles_a_sharded_program_with_its_collectives():
    mesh = planner.gpu_mesh({"data": 2, "model": 4})
    assert mesh.devices.shape == (2, 4) and mesh.axis_names == ("data", "model")
    assert {d.device_kind for d in mesh.devices.flat} == {"NVIDIA H100 80GB HBM3"}
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((512, 1024), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "model")))  # fmt: skip
    loss = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)))
    report = planner.compiled_report(loss, w, x)
    assert report.num_devices == 8 and report.fits
    assert "all-reduce" in report.collectives_by_kind  # the batch's partial gradients summed
    # the gradient of w is w's tile: 512 x 1024 / 4 floats per device, plus x's 256 / 2 x 512
    assert report.argument_bytes == (512 * 1024 // 4 + 128 * 512) * 4


@needs_xla_gpu
def test_planned_steps_on_8_gpus_compile_to_the_predicted_memory():
    """The searched plan and the experts' on data 2 x fsdp 2 x tensor 2 H100s: the simulator
    (the h100_sxm calibration, chosen from the devices) within 15 % of XLA:GPU's compiled
    arguments + outputs + temporaries - aliased."""
    from experiments import memory_check

    rows = memory_check.gpu_cases("lm=lm_scan:16x128x128x4x2x256@h100_sxm=data:2,fsdp:2,tensor:2")
    assert [r["strategy"] for r in rows] == ["auto", "data_parallel", "fsdp", "fsdp_tensor"]
    for r in rows:
        assert r["fits"] and r["compiled_bytes"] > 0, r
        assert abs(r["ratio"] - 1) <= 0.15, r
    # the experts differ in what they store: tensor parallelism holds the least
    assert rows[3]["compiled_bytes"] < rows[2]["compiled_bytes"] < rows[1]["compiled_bytes"]


@needs_xla_gpu
def test_gpu_mesh_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="do not split over 3 hosts"):
        planner.gpu_mesh({"data": 8}, hosts=3)
    with pytest.raises(ValueError, match="'a100'.*known: \\['h100_sxm'\\]"):
        planner.gpu_mesh({"data": 8}, gpu="a100")


def test_gpu_mesh_without_the_plugin_names_the_extra(monkeypatch):
    monkeypatch.setattr(gpus, "xla_gpu_missing", lambda: True)
    with pytest.raises(ValueError, match=r'pip install "redist\[gpu\]"'):
        planner.gpu_mesh({"data": 8})


def test_the_shipped_description_is_the_calibrations_chip():
    text = gpus.gpu_target_config("h100_sxm")
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text
    memory = int(text.split("device_memory_size: ")[1].split()[0])
    cal = Calibration.named("h100_sxm")
    assert memory >= cal.device_memory_bytes(1)  # the compiler's HBM holds what the file says
    assert np.isclose(float(text.split("memory_bandwidth: ")[1].split()[0]), 3.35232e12)
