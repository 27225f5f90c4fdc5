"""tunix's own GRPO loop (PyPI ``google-tunix`` 0.1.7), tiny, on 8 CPU devices.

tunix's Qwen3 (``tunix.models.qwen3``, built from a config: nothing downloaded), its GRPO learner
with the vanilla rollout on an ``RLCluster``: the actor and the reference on a trainer mesh, the
sampler on another (``fsdp`` x ``tp`` meshes, the axis names tunix's models shard over), a weight
sync (``tunix.rl.reshard.reshard_pytree``) after every policy update. :func:`train` runs it with
tunix's own sync or redist's (``redist.integrations.tunix``) and times every sync it makes.

The caller sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before importing jax.

Example:
    >>> run = train(qwen3_config(), "colocated", steps=2, sync="redist")  # doctest: +SKIP
    >>> run.sync_s, run.sampler_weights  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any


def meshes(kind: str):
    """(trainer, sampler) meshes: ``"colocated"``: FSDP over the 8 devices to data 2 x tensor 4
    on the same devices; ``"disjoint"``: FSDP over the first 4 to tensor 4 over the other 4."""
    import jax
    import numpy as np

    d = np.array(jax.devices()[:8])
    if kind == "colocated":
        return (jax.sharding.Mesh(d.reshape(8, 1), ("fsdp", "tp")),
                jax.sharding.Mesh(d.reshape(2, 4), ("fsdp", "tp")))  # fmt: skip
    if kind == "disjoint":
        return (jax.sharding.Mesh(d[:4].reshape(4, 1), ("fsdp", "tp")),
                jax.sharding.Mesh(d[4:].reshape(1, 4), ("fsdp", "tp")))  # fmt: skip
    raise ValueError(f"kind must be 'colocated' or 'disjoint', got {kind!r}")


def qwen3_config(layers: int = 2, vocab: int = 32, d_model: int = 64, ffn: int = 128,
                 heads: int = 4, experts: int = 0):  # fmt: skip
    """tunix's ``qwen3.ModelConfig`` at these sizes (``experts`` > 0: its mixture of experts)."""
    from tunix.models.qwen3 import model as qwen3

    moe = dict(num_experts=experts, num_experts_per_tok=2) if experts else {}
    return qwen3.ModelConfig(num_layers=layers, vocab_size=vocab, embed_dim=d_model,
                             hidden_dim=ffn, num_heads=heads, head_dim=d_model // heads,
                             num_kv_heads=heads, rope_theta=1_000_000, norm_eps=1e-6,
                             **moe)  # fmt: skip


def placed(config, mesh, seed: int = 0):
    """tunix's Qwen3 of ``config`` with its parameters on ``mesh``, in the layouts its own
    partition annotations name (as tunix's ``RLCluster`` places a model it is handed)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec
    from tunix.models.qwen3 import model as qwen3

    graph, state = nnx.split(qwen3.Qwen3(config, rngs=nnx.Rngs(seed)))
    shardings = jax.tree.map(lambda p: NamedSharding(mesh, PartitionSpec() if p is None else p),
                             nnx.get_partition_spec(state))  # fmt: skip
    return nnx.merge(graph, jax.device_put(state, shardings))


@dataclasses.dataclass
class Run:
    """What :func:`train` returns."""

    sampler_weights: Any  # the sampler's nnx.Param state after the last sync
    actor_weights: Any  # the actor's, after the last update
    logps: Any  # the sampler's per-token log-probabilities of a fixed completion (numpy)
    sync_s: list[float]  # every sync's seconds, its result ready (the first compiles)
    global_steps: int


def train(config, kind: str, steps: int, sync: str, **redist_options) -> Run:
    """tunix's GRPO learner on its Qwen3 of ``config``, trainer and sampler on :func:`meshes`
    ``kind``, ``steps`` policy updates, each followed by a weight sync made by ``sync``:
    ``"tunix"`` (its own ``reshard_pytree``: on CPU its ``jax.device_put`` copies through the
    host, which tunix's ``sync_weights`` forbids there, so the guard is lifted for it) or
    ``"redist"`` (``redist.integrations.tunix`` installed with ``redist_options``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from grain import python as grain
    from tunix.rl import reshard, rl_cluster
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.tests import test_common

    from redist.integrations import tunix as redist_tunix

    words = dict(test_common.MockVocab.DEFAULT_MAPPING)
    words.update({f"w{i}": i for i in range(len(words), config.vocab_size)})
    vocab = test_common.MockVocab(words)
    trainer, sampler = meshes(kind)
    roles = {rl_cluster.Role.ACTOR: trainer, rl_cluster.Role.REFERENCE: trainer,
             rl_cluster.Role.ROLLOUT: sampler}  # fmt: skip
    cluster_config = rl_cluster.ClusterConfig(
        role_to_mesh=roles, rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster.RLTrainingConfig(actor_optimizer=optax.sgd(1e-2),
                                                    eval_every_n_steps=1000, max_steps=steps),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=4, max_prompt_length=8,
                                                  kv_cache_size=32, temperature=0.9, seed=0),
    )  # fmt: skip
    cluster = rl_cluster.RLCluster(actor=placed(config, trainer), reference=placed(config, trainer),
                                   tokenizer=vocab, cluster_config=cluster_config)  # fmt: skip
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=grpo_learner.GRPOConfig(num_generations=2),
        reward_fns=lambda completions, **_: jnp.arange(len(completions), dtype=jnp.float32),
    )  # fmt: skip
    prompts = ["input string", "hello world", "My name", "hello there"] * steps
    data = grain.MapDataset.source(prompts).batch(2).map(lambda x: {"prompts": x, "answer": x})
    if sync not in ("tunix", "redist"):
        raise ValueError(f"sync must be 'tunix' or 'redist', got {sync!r}")
    if sync == "redist":
        redist_tunix.install(**redist_options)
    inner, times = reshard.reshard_pytree, []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        with jax.transfer_guard("allow") if sync == "tunix" else contextlib.nullcontext():
            out = jax.block_until_ready(inner(*args, **kwargs))
        times.append(time.perf_counter() - start)
        return out

    reshard.reshard_pytree = timed
    try:
        learner.train(data)
    finally:
        reshard.reshard_pytree = inner
        redist_tunix.uninstall()
    tokens = jnp.array([[1, 5, 6, 3]]), jnp.array([[4, 8, 2, 0]])
    return Run(nnx.state(cluster.rollout.model(), nnx.Param),
               nnx.state(cluster.actor_trainer.model, nnx.Param),
               np.asarray(cluster.rollout.get_per_token_logps(*tokens)), times,
               cluster.global_steps)  # fmt: skip
