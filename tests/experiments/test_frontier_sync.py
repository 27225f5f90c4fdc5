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


@pytest.mark.parametrize("model", ["qwen3_235b", "deepseek_v3"])
def test_on_eight_gpus_the_sync_is_cut_into_buckets_within_the_budget(model):
    """The trees outgrow one H100, so the sync compiles bucket by bucket: every leaf is covered
    once (stacked weights in slices), and each bucket's moves, planned anew, hold at most the
    budget in flight."""
    import math

    from redist.buckets import in_flight_bytes

    mesh = jax.make_mesh((1, 8), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2)
    shapes, train, serve = frontier_sync.specs(model)
    src = {k: NamedSharding(mesh, s) for k, s in train.items()}
    dst = {k: NamedSharding(mesh, s) for k, s in serve.items()}
    budget = 4 * 2**30
    groups = frontier_sync.bucketed(shapes, train, serve, src, dst, mesh, budget, "h100_sxm")
    covered: dict[str, int] = {}
    for group in groups:
        held = 0
        for k, piece in group:
            cut = [d for d, (a, b) in enumerate(zip(piece, shapes[k])) if a != b]
            assert len(cut) <= 1 and all(piece[d] < shapes[k][d] for d in cut), (k, piece)
            covered[k] = covered.get(k, 0) + math.prod(piece)
            p = redist.plan(piece, train[k], serve[k], dict(mesh.shape), "bfloat16",
                            cost_model="calibrated:h100_sxm")  # fmt: skip
            held += in_flight_bytes(p, math.prod(dst[k].shard_shape(piece)) * 2)
        assert held <= budget, [k for k, _ in group]
    assert covered == {k: math.prod(s) for k, s in shapes.items()}
    assert sum(map(len, groups)) > len(shapes)  # the experts are moved in slices
