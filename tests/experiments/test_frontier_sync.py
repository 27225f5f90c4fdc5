"""Frontier models' weight trees (public configs) and the weight-sync lower bound."""

import math

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import redist
from experiments import frontier_sync
from experiments.frontier_weights import kv_cache_bytes_per_chip, parameter_count, parameters


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


# --- tunix's layouts (MaxText RL's trainer and vLLM sampler) ---------------------------------


@pytest.mark.parametrize("model", ["qwen3_235b", "deepseek_v3"])
def test_the_tunix_layouts_differ_from_the_vllm_ones_where_maxtext_rl_does(model):
    """The sampler keeps every expert on a chip (vLLM's expert parallelism off), its hidden
    dimension over ``tp``; the trainer differs only in DeepSeek's router (``embed_router``)."""
    vllm, tunix = parameters(model), parameters(model, layouts="tunix")
    assert vllm.keys() == tunix.keys()
    experts = {k for k in tunix if k.endswith(("moe/wi_0", "moe/wi_1", "moe/wo"))}
    assert experts and {k for k in tunix if tunix[k].serve != vllm[k].serve} == experts
    for k in experts:
        ffn = 3 if k.endswith("wi_0") or k.endswith("wi_1") else 2
        assert tunix[k].serve == tuple("tp" if d == ffn else None for d in range(4)), k
    changed = {k for k in tunix if tunix[k].train != vllm[k].train}
    assert changed == ({"moe_layers/moe/gate"} if model == "deepseek_v3" else set())
    with pytest.raises(ValueError, match="layouts must be one of"):
        parameters(model, layouts="sglang")


def test_the_kv_cache_per_chip_is_the_models_cache_per_token():
    """Qwen3-235B: 94 layers x its key/value heads on the chip x 128 x (key, value) x bfloat16;
    DeepSeek-V3: 61 layers x its 576-value latent x bfloat16 on every chip."""
    assert kv_cache_bytes_per_chip("qwen3_235b", 1, 1, 1) == 94 * 4 * 128 * 2 * 2
    assert kv_cache_bytes_per_chip("qwen3_235b", 2, 1, 1) == 94 * 2 * 128 * 2 * 2
    assert kv_cache_bytes_per_chip("qwen3_235b", 16, 1, 1) == 94 * 1 * 128 * 2 * 2  # repeated
    for tp in (1, 32):
        assert kv_cache_bytes_per_chip("deepseek_v3", tp, 1, 1) == 61 * (512 + 64) * 2
    assert kv_cache_bytes_per_chip("qwen3_235b", 16, 256, 1280) == 256 * 1280 * 48128


def test_the_sampler_takes_the_smallest_tensor_parallelism_that_fits():
    """On a v5p chip (vLLM's 72 % of it) Qwen3-235B needs 16, DeepSeek-V3 32; half of either
    overflows. On 8 H100s nothing fits and the sampler spans the host."""
    hbm, share = 102_803_378_176, 0.72
    for model, want in (("qwen3_235b", 16), ("deepseek_v3", 32)):
        tp = frontier_sync.rollout_tp(model, 512, hbm)
        assert tp == want, model
        for t, fits in ((tp, True), (tp // 2, False)):
            held = (frontier_sync.sampler_bytes_per_chip(model, t)
                    + kv_cache_bytes_per_chip(model, t, 256, 1280))  # fmt: skip
            assert (held <= share * hbm) == fits, (model, t)
        assert frontier_sync.rollout_tp(model, 8, 80e9) == 8


@pytest.mark.parametrize("expert,tp", [(2, 4), (4, 2), (8, 8)])
def test_the_trainer_and_the_sampler_are_the_same_devices_in_the_same_order(expert, tp):
    """Device ``d`` of the mesh is the trainer's (fsdp, expert) = divmod(d, expert) and the
    sampler's (data, tensor) = divmod(d, tp), as both meshes are the device list reshaped."""
    axes, train, serve = frontier_sync.tunix_mesh_axes(8, expert, tp)
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * 3)
    flat = list(mesh.devices.flat)
    trainer = NamedSharding(mesh, P(train["fsdp"] + train["expert"]))
    sampler = NamedSharding(mesh, P(None, serve["tp"]))
    held = trainer.devices_indices_map((8,))
    tiles = sampler.devices_indices_map((1, tp))
    for d, device in enumerate(flat):
        assert held[device][0].start == d
        assert tiles[device][1].start == d % tp
    with pytest.raises(ValueError, match="make no mesh"):
        frontier_sync.tunix_mesh_axes(8, 2, 3)


@pytest.mark.parametrize("model", ["qwen3_235b", "deepseek_v3"])
def test_every_leaf_has_a_plan_between_the_tunix_layouts_on_a_v5p_1024(model):
    tp = frontier_sync.rollout_tp(model, 512, 102_803_378_176)
    axes, shapes, train, serve = frontier_sync.tunix_specs(model, 512, tp)
    for k, shape in shapes.items():
        for spec in (train[k], serve[k]):
            assert len(spec) == len(shape), k
            for n, names in zip(shape, spec):
                names = () if names is None else (names,) if isinstance(names, str) else names
                assert n % math.prod(axes[a] for a in names) == 0, (k, spec)
        p = redist.plan(shape, train[k], serve[k], axes, "bfloat16")
        assert p.peak_bytes <= p.bound_bytes, k


def test_with_the_trainers_weights_kept_a_chip_holds_them_and_what_is_made():
    """Each program's peak over the whole source tree less its own inputs, plus the outputs
    made before it."""
    from types import SimpleNamespace

    reports = [SimpleNamespace(total_bytes=12), SimpleNamespace(total_bytes=15)]
    assert frontier_sync.held_kept(reports, [4, 6], [5, 7], 10) == [18, 24]
