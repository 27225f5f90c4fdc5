"""Frontier models' weight trees (public configs) and the weight-sync lower bound."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import redist
from experiments import frontier_sync
from experiments.frontier_weights import parameter_count, parameters


def test_the_trees_have_the_public_parameter_counts():
    assert round(parameter_count("qwen3_235b") / 1e9, 2) == 235.09
    assert round(parameter_count("deepseek_v3") / 1e9, 2) == 671.03  # without the MTP layer
    with pytest.raises(ValueError, match="model must be one of"):
        parameters("llama5")


@pytest.mark.parametrize("model", ["qwen3_235b", "deepseek_v3"])
def test_every_leaf_has_a_plan_between_its_layouts_on_a_v5p_1024(model):
    shapes, train, serve = frontier_sync.specs(model)
    sizes = frontier_sync.mesh_axes(frontier_sync.CHIPS["v5p-1024"])
    for k, shape in shapes.items():
        p = redist.plan(shape, train[k], serve[k], sizes, "bfloat16")
        assert p.peak_bytes <= p.bound_bytes, k


def test_the_lower_bound_is_what_each_device_lacks():
    mesh = jax.make_mesh((4, 2), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2)
    shape, src, dst = (
        (16, 8),
        NamedSharding(mesh, P("fsdp")),
        NamedSharding(mesh, P(None, "expert")),
    )
    have, want = src.devices_indices_map(shape), dst.devices_indices_map(shape)
    most = 0
    for d in mesh.devices.flat:
        mine = np.zeros(shape, bool)
        mine[have[d]] = True
        needed = np.zeros(shape, bool)
        needed[want[d]] = True
        most = max(most, int((needed & ~mine).sum()))
    assert frontier_sync.received_lower_bound(shape, 2, src, dst) == most * 2 == 48 * 2
    assert frontier_sync.received_lower_bound(shape, 2, src, src) == 0
