"""Pipeline parallelism (GPipe in SPMD over a mesh axis): exact against the scanned layers,
forward and gradient, over random stage counts, microbatch counts and meshes; its prices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from planner.cost.pipeline import bubble, gpipe_activation_bytes, gpipe_seconds
from planner.lowering.gpipe import gpipe


def layer(h, w):
    return jnp.tanh(h @ w["w"] + w["b"])


def _stack(rng, layers: int, d: int) -> dict:
    return {"w": (rng.standard_normal((layers, d, d)) / np.sqrt(d)).astype(np.float32),
            "b": rng.standard_normal((layers, d)).astype(np.float32)}  # fmt: skip


def _loss(run):
    return lambda h, ws: jnp.sum(jnp.sin(run(h, ws)) * 3.0)


SCANNED = _loss(lambda h, ws: lax.scan(lambda c, w: (layer(c, w), None), h, ws)[0])

CASES = [  # (mesh shape, axis names, pipeline axis, layers, batch, microbatches)
    ((4, 2), ("stage", "data"), "stage", 8, 16, 4),
    ((2, 4), ("data", "stage"), "stage", 4, 8, 8),
    ((8,), ("pipe",), "pipe", 8, 8, 2),
    ((2, 2, 2), ("a", "pipe", "c"), "pipe", 6, 12, 3),
    ((2, 2, 2), ("a", "pipe", "c"), "pipe", 2, 4, 1),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}-L{c[3]}-K{c[5]}" for c in CASES])
def test_gpipe_is_the_scanned_layers_forward_and_gradient(case):
    shape, names, axis, layers, batch, k = case
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    rng = np.random.default_rng(sum(shape) + layers + k)
    ws, h = _stack(rng, layers, 16), rng.standard_normal((batch, 16)).astype(np.float32)
    # the weights rest split over the stages along their layer dimension
    ws = jax.device_put(ws, NamedSharding(mesh, P(axis)))
    got = jax.jit(jax.value_and_grad(_loss(gpipe(layer, mesh, axis, k)), argnums=(0, 1)))(h, ws)
    want = jax.value_and_grad(SCANNED, argnums=(0, 1))(h, ws)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)


def test_each_stage_holds_its_layers_and_passes_activations_to_the_next():
    mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
    ws = _stack(np.random.default_rng(0), 8, 64)
    h = np.ones((16, 64), np.float32)
    split = NamedSharding(mesh, P("stage"))
    f = jax.jit(_loss(gpipe(layer, mesh, "stage", 4)),
                in_shardings=(NamedSharding(mesh, P()), jax.tree.map(lambda _: split, ws)))  # fmt: skip
    compiled = f.lower(h, ws).compile()
    weights = sum(w.nbytes for w in jax.tree.leaves(ws))
    assert compiled.memory_analysis().argument_size_in_bytes < weights / 4 + h.nbytes + 1024
    assert "collective-permute" in compiled.as_text()


def test_bad_stage_and_microbatch_counts_are_refused_by_name():
    mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="6 layers do not split into 4 pipeline stages"):
        gpipe(layer, mesh, "stage", 2)(np.ones((8, 16), np.float32), _stack(rng, 6, 16))
    with pytest.raises(ValueError, match="batch of 8 does not split into microbatches=3"):
        gpipe(layer, mesh, "stage", 3)(np.ones((8, 16), np.float32), _stack(rng, 8, 16))
    with pytest.raises(ValueError, match="axis 'pipe' is not a mesh axis"):
        gpipe(layer, mesh, "pipe", 2)


def test_gpipe_prices():
    assert bubble(1, 8) == 0 and bubble(4, 12) == pytest.approx(3 / 15)
    assert gpipe_seconds(4e-3, 4, 12, 1e-4) == pytest.approx(15 * 4e-3 + 30 * 1e-4)
    assert gpipe_seconds(4e-3, 1, 12, 1e-4) == pytest.approx(12 * 4e-3)
    assert gpipe_activation_bytes(1000, 8) == 8000
    with pytest.raises(ValueError, match="microbatches=0"):
        bubble(4, 0)


def test_the_grid_finds_a_mix_where_memory_rules_out_every_pure_strategy(tmp_path):
    """DistIR's grid on a small MLP: with 80 GB, the best configuration is at least as fast as
    pure data, tensor and pipeline parallelism; with 75 MB per device none of those fits and the
    best is a mix of data and pipeline parallelism."""
    from configs.pipeline_search import default as configs
    from experiments import pipeline_search

    config = configs.get_config()
    config.models = "tiny=16x512x32768"
    config.planner = False  # the grid alone (test_pipeline_search_smoke plans on every mesh)
    roomy = pipeline_search.run(config, str(tmp_path))["tiny"]
    for kind in ("data", "tensor", "pipeline"):
        assert roomy[kind] is not None and roomy[f"best_over_{kind}"] >= 1.0
    config.memory_gb = 0.075
    tight = pipeline_search.run(config, str(tmp_path))["tiny"]
    assert tight["data"] is tight["tensor"] is tight["pipeline"] is None
    best = tight["best"]
    assert best["fits"] and sum(best[k] > 1 for k in ("D", "T", "P")) >= 2
    assert "| best found |" in (tmp_path / "report.md").read_text()
