"""The hand strategies of planner.baselines on real model code with scanned layers."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import planner
from experiments.language_model import lm_step
from planner import baselines

DATA, TENSOR = ("a", "b"), "c"


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)


def _lm(scan: bool):
    return lm_step(8, 16, 32, 4, 2, 64, scan, np.random.default_rng(0))


def test_the_legacy_baselines_find_scanned_weights(mesh):
    """megatron and fsdp_stored see through scans: the body's products are the layers, and a
    stacked weight is split within a layer, its layer axis whole."""
    step, args = _lm(True)
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
