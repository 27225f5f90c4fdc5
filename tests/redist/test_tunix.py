"""redist as tunix's weight sync (``redist.integrations.tunix``), checked against tunix's own
``reshard_pytree`` on tunix's own Qwen3 model and on tunix's GRPO loop, 8 CPU devices."""

from __future__ import annotations

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

tunix_reshard = pytest.importorskip("tunix.rl.reshard")

from flax import nnx  # noqa: E402

from experiments.libraries import tunix_grpo  # noqa: E402
from redist.integrations import tunix as redist_tunix  # noqa: E402

_CONFIG = tunix_grpo.qwen3_config()  # 2 layers, width 64, vocab 32
_meshes = tunix_grpo.meshes


@functools.cache
def _states(kind: str):
    """tunix's Qwen3 parameters on the trainer's and the sampler's meshes, built once per kind
    (the tests read them and move copies: nothing donates or changes them)."""
    trainer, sampler = _meshes(kind)
    source = nnx.state(tunix_grpo.placed(_CONFIG, trainer, seed=0), nnx.Param)
    target = nnx.state(tunix_grpo.placed(_CONFIG, sampler, seed=1), nnx.Param)
    return source, target


def _tunix_s(source, target, **kwargs):
    """tunix's own path (``jax.device_put``), the host transfers it makes on CPU allowed."""
    with jax.transfer_guard("allow"):
        return redist_tunix.tunix_reshard_pytree()(source, target, **kwargs)


def _assert_same(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, w.ndim), (g.sharding, w.sharding)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("kind", ["colocated", "disjoint"])
def test_reshard_pytree_moves_tunix_s_qwen3_weights_as_tunix_does(kind):
    source, target = _states(kind)
    want = _tunix_s(source, target)
    shardings = jax.tree.map(lambda x: x.sharding, target)
    # tunix's sync_weights forbids transfers between host and devices on CPU: redist makes none
    donated = jax.tree.map(jnp.copy, source)
    with jax.transfer_guard_host_to_device("disallow_explicit"), \
            jax.transfer_guard_device_to_host("disallow_explicit"):  # fmt: skip
        got = [redist_tunix.reshard_pytree(source, target),
               redist_tunix.reshard_pytree(source, shardings),
               redist_tunix.reshard_pytree(source, target, memory_budget=64 << 10),
               redist_tunix.reshard_pytree(donated, target, donate_input=True)]  # fmt: skip
        jax.block_until_ready(got)
    for g in got:  # (read back outside the guards)
        _assert_same(g, want)
    assert all(x.is_deleted() for x in jax.tree.leaves(donated))


def test_leaves_redist_does_not_move_go_as_tunix_sends_them():
    trainer, sampler = _meshes("colocated")
    x = jax.device_put(
        jnp.arange(64.0).reshape(8, 8), NamedSharding(trainer, PartitionSpec("fsdp"))
    )
    host = NamedSharding(sampler, PartitionSpec(None, "tp"), memory_kind="pinned_host")
    source = {"offloaded": x, "in_place": x, "host_value": np.ones(4, np.float32)}
    target = {"offloaded": host, "in_place": x.sharding,
              "host_value": NamedSharding(sampler, PartitionSpec("tp"))}  # fmt: skip
    got = redist_tunix.reshard_pytree(source, target)
    for name in source:
        assert got[name].sharding.is_equivalent_to(target[name], got[name].ndim), name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(source[name]))
    assert got["offloaded"].sharding.memory_kind == "pinned_host"
    # one sharding for the whole tree, as jax.device_put takes a prefix
    one = NamedSharding(sampler, PartitionSpec(None, "tp"))
    assert all(y.sharding == one for y in jax.tree.leaves(redist_tunix.reshard_pytree([x, x], one)))


def test_reshard_pytree_refuses_a_target_of_another_structure():
    source, target = _states("colocated")
    with pytest.raises(ValueError, match="target must have the structure of source"):
        redist_tunix.reshard_pytree(source, [target, target])
    with pytest.raises(
        ValueError,
        match=r"less than what moving x\['embedder'\]\['input_embedd"
        r"ing'\]\.value holds in flight, \d+ B per device",
    ):
        redist_tunix.reshard_pytree(source, target, memory_budget=1024)  # the leaf, its bytes
    with pytest.raises(TypeError, match="target leaves must be jax.Array or jax.sharding"):
        redist_tunix.reshard_pytree({"w": jnp.ones(2)}, {"w": "fsdp"})


def test_backend_is_a_factory_tunix_s_own_backend_selection_takes():
    source, target = _states("colocated")
    move = tunix_reshard._get_reshard_fn(cache_resharding_plans=True, donate=False,
                                         use_experimental_pre_reshard=True,
                                         get_reshard_fns=[redist_tunix.backend])  # fmt: skip
    _assert_same(move(source, jax.tree.map(lambda a: a.sharding, target)),
                 _tunix_s(source, target))  # fmt: skip


def test_install_routes_every_binding_of_tunix_s_function_and_uninstall_restores_it():
    original = tunix_reshard.reshard_pytree
    assert original is redist_tunix.tunix_reshard_pytree()  # importing redist patched nothing
    user = types.ModuleType("user_code_bound_before_install")
    user.reshard_pytree = original  # `from tunix.rl.reshard import reshard_pytree`
    sys.modules[user.__name__] = user
    try:
        with pytest.raises(ValueError, match="memory_budget must be positive"):
            redist_tunix.install(memory_budget=0)
        assert tunix_reshard.reshard_pytree is original
        with redist_tunix.installed(memory_budget=1 << 20):
            for f in (tunix_reshard.reshard_pytree, user.reshard_pytree):
                assert f.func is redist_tunix.reshard_pytree
                assert f.keywords["memory_budget"] == 1 << 20
            assert redist_tunix.tunix_reshard_pytree() is original
        assert tunix_reshard.reshard_pytree is original and user.reshard_pytree is original
    finally:
        del sys.modules[user.__name__]
        redist_tunix.uninstall()


def test_tunix_s_grpo_loop_with_redist_s_sync_trains_as_with_tunix_s():
    """Trainer and sampler on 4 devices each; on one device set the loop is checked by
    tests/experiments' smoke test of ``experiments.weight_sync``'s tunix source. One decoder
    layer: a second one adds leaves of the same kinds and compile time (the sync of every kind
    of leaf, and of two layers, is checked against tunix's above)."""
    config = tunix_grpo.qwen3_config(layers=1)
    runs = [tunix_grpo.train(config, "disjoint", steps=2, sync=s) for s in ("redist", "tunix")]
    assert [r.global_steps for r in runs] == [2, 2] and [len(r.sync_s) for r in runs] == [2, 2]
    _assert_same(runs[0].sampler_weights, runs[1].sampler_weights)  # in the sampler's layouts
    np.testing.assert_array_equal(runs[0].logps, runs[1].logps)
    for w, a in zip(
        jax.tree.leaves(runs[0].sampler_weights), jax.tree.leaves(runs[0].actor_weights)
    ):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(a))  # the last update, synced
