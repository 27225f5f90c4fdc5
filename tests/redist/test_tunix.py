"""redist as tunix's weight sync (``redist.integrations.tunix``), checked against tunix's own
``reshard_pytree`` on tunix's own Qwen3 model and on tunix's GRPO loop, 8 CPU devices."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

tunix_reshard = pytest.importorskip("tunix.rl.reshard")

from flax import nnx  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402

from redist.integrations import tunix as redist_tunix  # noqa: E402

_CONFIG = qwen3.ModelConfig(num_layers=2, vocab_size=32, embed_dim=64, hidden_dim=128,
                            num_heads=4, head_dim=16, num_kv_heads=4, rope_theta=10_000,
                            norm_eps=1e-6)  # fmt: skip


def _meshes(kind: str) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
    """(trainer, sampler): FSDP 8 to data 2 x tensor 4 on the same devices, or FSDP over 4
    devices to tensor 4 over the other 4."""
    d = np.array(jax.devices())
    if kind == "colocated":
        return (jax.sharding.Mesh(d.reshape(8, 1), ("fsdp", "tp")),
                jax.sharding.Mesh(d.reshape(2, 4), ("fsdp", "tp")))  # fmt: skip
    return (jax.sharding.Mesh(d[:4].reshape(4, 1), ("fsdp", "tp")),
            jax.sharding.Mesh(d[4:].reshape(1, 4), ("fsdp", "tp")))  # fmt: skip


def _placed(model: nnx.Module, mesh) -> nnx.Module:
    """``model`` with its parameters on ``mesh`` in the layouts its own annotations name."""
    graph, state = nnx.split(model)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec() if s is None else s),
                             nnx.get_partition_spec(state))  # fmt: skip
    return nnx.merge(graph, jax.device_put(state, shardings))


def _states(kind: str):
    trainer, sampler = _meshes(kind)
    source = nnx.state(_placed(qwen3.Qwen3(_CONFIG, rngs=nnx.Rngs(0)), trainer), nnx.Param)
    target = nnx.state(_placed(qwen3.Qwen3(_CONFIG, rngs=nnx.Rngs(1)), sampler), nnx.Param)
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
    with jax.transfer_guard_host_to_device("disallow_explicit"), \
            jax.transfer_guard_device_to_host("disallow_explicit"):  # fmt: skip
        _assert_same(redist_tunix.reshard_pytree(source, target), want)
        _assert_same(redist_tunix.reshard_pytree(source, shardings), want)
        _assert_same(redist_tunix.reshard_pytree(source, target, memory_budget=64 << 10), want)
        donated = jax.tree.map(jnp.copy, source)
        _assert_same(redist_tunix.reshard_pytree(donated, target, donate_input=True), want)
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
    with pytest.raises(TypeError, match="target leaves must be jax.Array or jax.sharding"):
        redist_tunix.reshard_pytree({"w": jnp.ones(2)}, {"w": "fsdp"})


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


def _grpo_run(kind: str, with_redist: bool):
    """tunix's GRPO learner on its Qwen3 (2 layers) with the vanilla rollout, trainer and
    sampler on ``kind``'s meshes, 2 policy updates with a weight sync after each: the sampler's
    parameters and its log-probabilities of a fixed completion."""
    import optax
    from grain import python as grain
    from tunix.rl import rl_cluster
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.tests import test_common

    words = dict(test_common.MockVocab.DEFAULT_MAPPING)
    words.update({f"w{i}": i for i in range(len(words), _CONFIG.vocab_size)})
    vocab = test_common.MockVocab(words)
    trainer, sampler = _meshes(kind)
    actor = _placed(qwen3.Qwen3(_CONFIG, rngs=nnx.Rngs(0)), trainer)
    reference = _placed(qwen3.Qwen3(_CONFIG, rngs=nnx.Rngs(0)), trainer)
    roles = {rl_cluster.Role.ACTOR: trainer, rl_cluster.Role.REFERENCE: trainer,
             rl_cluster.Role.ROLLOUT: sampler}  # fmt: skip
    config = rl_cluster.ClusterConfig(
        role_to_mesh=roles, rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster.RLTrainingConfig(actor_optimizer=optax.sgd(1e-2),
                                                    eval_every_n_steps=100, max_steps=2),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=4, max_prompt_length=8,
                                                  kv_cache_size=32, temperature=0.9, seed=0),
    )  # fmt: skip
    cluster = rl_cluster.RLCluster(actor=actor, reference=reference, tokenizer=vocab,
                                   cluster_config=config)  # fmt: skip
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=grpo_learner.GRPOConfig(num_generations=2),
        reward_fns=lambda completions, **_: jnp.arange(len(completions), dtype=jnp.float32),
    )  # fmt: skip
    prompts = ["input string", "hello world", "My name", "hello there"]
    data = grain.MapDataset.source(prompts).batch(2).map(lambda x: {"prompts": x, "answer": x})
    if with_redist:
        with redist_tunix.installed():
            learner.train(data)
    else:  # tunix's own sync; on CPU its device_put goes through the host, which it forbids
        synced = tunix_reshard.reshard_pytree

        def allowed(*args, **kwargs):
            with jax.transfer_guard("allow"):
                return synced(*args, **kwargs)

        tunix_reshard.reshard_pytree = allowed
        try:
            learner.train(data)
        finally:
            tunix_reshard.reshard_pytree = synced
    assert cluster.global_steps == 2
    weights = nnx.state(cluster.rollout.model(), nnx.Param)
    tokens = jnp.array([[1, 5, 6, 3]]), jnp.array([[4, 8, 2, 0]])
    return weights, np.asarray(cluster.rollout.get_per_token_logps(*tokens)), cluster


@pytest.mark.parametrize("kind", ["colocated", "disjoint"])
def test_tunix_s_grpo_loop_with_redist_s_sync_trains_as_with_tunix_s(kind):
    weights, logps, cluster = _grpo_run(kind, with_redist=True)
    want_weights, want_logps, _ = _grpo_run(kind, with_redist=False)
    _assert_same(weights, want_weights)  # the sampler's weights, in the sampler's layouts
    np.testing.assert_array_equal(logps, want_logps)
    actor = nnx.state(cluster.actor_trainer.model, nnx.Param)
    for w, a in zip(jax.tree.leaves(weights), jax.tree.leaves(actor)):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(a))  # the last update, synced
