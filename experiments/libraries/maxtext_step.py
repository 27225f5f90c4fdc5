"""MaxText's own training step (PyPI ``maxtext`` 0.2.5), built tiny on 8 CPU devices.

:func:`build` sets the step up the way MaxText's ``train_loop`` does (``train_utils.
setup_train_loop``, ``maxtext_utils.get_functional_train_with_signature``, ``sharding.
maybe_update_params_sharding_with_opt``), from ``configs/base.yml`` with ``llama2-7b``'s model
config shrunk to 2 layers of width 256: MaxText's NNX ``train_step``, its train state (an
``nnx.State`` of the model and the AdamW optimizer, placed with MaxText's own shardings) and a
synthetic batch. Nothing is read from or written to disk or the network (no checkpoints,
tensorboard, goodput, compilation cache, distributed init or data pipeline).

Needs Python >= 3.12 and the packages of :data:`REQUIREMENTS` (``maxtext`` declares no
dependencies; these are what its train module imports); the caller sets ``XLA_FLAGS=
--xla_force_host_platform_device_count=8`` before importing jax. Importing MaxText's train module
replaces ``jax.lax.with_sharding_constraint`` and ``jax.lax.top_k`` for the whole process
(``maxtext/integration/tunix/tunix_adapter.py``: on an error they retry with
``jax.sharding.reshard``).

Example:
    >>> built = build()  # doctest: +SKIP
    >>> with built.context():  # doctest: +SKIP
    ...     state, metrics = built.authors_jit()(built.state, built.batch)  # donates built.state
    ...     state, metrics = built.authors_jit()(state, built.batch)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

#: What ``import maxtext.trainers.pre_train.train`` needs on top of ``redist[test]`` (flax, optax).
REQUIREMENTS = (
    "maxtext==0.2.5",  # declares no dependencies: the rest is what its train module imports
    "pathwaysutils==0.1.13",
    "omegaconf==2.4.0",
    "jinja2==3.1.6",
    "aqtp==0.9.0",
    "tokamax==0.0.17",  # and qwix 0.1.8
    "transformers==5.12.1",  # the newest beside google-tunix 0.1.7 (safetensors < 0.8)
    "grain==0.2.18",
    "drjax==0.2.1",
    "pillow==13.0.0",
    "tiktoken==0.14.0",
    "sentencepiece==0.2.3",
    "sympy==1.14.0",
)

#: The tiny llama2 MaxText trains here: ``pyconfig.initialize`` keyword overrides of ``base.yml``.
TINY_LLAMA = dict(
    model_name="llama2-7b",
    override_model_config=True,
    base_emb_dim=256,
    base_num_query_heads=4,
    base_num_kv_heads=4,
    head_dim=64,
    base_mlp_dim=512,
    base_num_decoder_layers=2,
    vocab_size=1024,
    max_target_length=128,
    per_device_batch_size=1,
    attention="dot_product",
    hardware="cpu",
    dataset_type="synthetic",
    ici_fsdp_parallelism=4,
    ici_tensor_parallelism=2,
    steps=10,  # the learning rate schedule's length (cosine over 10 steps)
    warmup_steps_fraction=0.0,  # so that the first step's learning rate is not 0
)

#: MaxText's DeepSeek-V3 shrunk (``deepseek3-tiny.yml``: multi-head latent attention, 16 routed
#: experts of which 8 per token, a shared expert, a dense first layer) to 4 layers and a small
#: vocabulary; its experts run as dense matmuls (``sparse_matmul=False``: megablox's Pallas
#: kernels are TPU kernels).
#: Experts as dense matmuls (megablox's Pallas kernels are TPU kernels), no token dropping.
DENSE_EXPERTS = dict(sparse_matmul=False, megablox=False, capacity_factor=-1.0)

TINY_DEEPSEEK = dict(
    TINY_LLAMA,
    model_name="deepseek3-tiny",
    override_model_config=True,
    base_num_decoder_layers=4,
    first_num_dense_layers=1,
    vocab_size=1024,
    **DENSE_EXPERTS,
)
for _key in (
    "base_emb_dim",
    "base_num_query_heads",
    "base_num_kv_heads",
    "head_dim",
    "base_mlp_dim",
):
    TINY_DEEPSEEK.pop(_key)

#: MaxText's Qwen3-235B-A22B shrunk (``qwen3-235b-a22b.yml``: grouped-query attention with
#: query/key norms, 128 routed experts of which 8 per token, normalized top-k) to 2 layers of 256
#: wide with 8 experts of which 2 per token; :data:`DENSE_EXPERTS` as in :data:`TINY_DEEPSEEK`.
TINY_QWEN3 = dict(
    TINY_LLAMA,
    model_name="qwen3-235b-a22b",
    base_num_kv_heads=2,
    base_moe_mlp_dim=128,
    num_experts=8,
    num_experts_per_tok=2,
    **DENSE_EXPERTS,
)

#: :data:`TINY_QWEN3` with MaxText's own mixture of experts: its sparse ``shard_map`` (tokens
#: sorted by expert, each device's experts' weights read whole, the weight gradients summed over
#: fsdp in its backward pass) with ``jax.lax.ragged_dot`` for the grouped matmuls, which runs on
#: CPU (``megablox=False``; megablox's Pallas kernels are TPU kernels).
TINY_QWEN3_SPARSE = dict(TINY_QWEN3, sparse_matmul=True, megablox=False)

#: :data:`TINY_QWEN3_SPARSE` with MaxText's ring of experts over 2 devices (fsdp 2, tensor 2):
#: every token gathered over the ring, each shard's experts computed in a buffer of 1.5 balanced
#: loads (``ragged_buffer_factor``), the outputs summed back, and MaxText's step-level dropless
#: fallback (a step that overflows the buffer returns the state unchanged, flagged). MaxText's
#: ragged sort and gathers run as their JAX reference code (their kernels are SparseCore's).
TINY_QWEN3_RING = dict(
    TINY_QWEN3_SPARSE,
    ici_fsdp_parallelism=2,
    ici_expert_parallelism=2,
    use_ring_of_experts=True,
    use_ragged_sort=True,
    ragged_buffer_factor=1.5,
    moe_dropless_fallback="step",
    ragged_gather_fallback=True,
    ragged_gather_reduce_fallback=True,
)

#: The tiny models :func:`build` makes, by name.
TINY = {"llama2": TINY_LLAMA, "deepseek3": TINY_DEEPSEEK, "qwen3": TINY_QWEN3,
        "qwen3sparse": TINY_QWEN3_SPARSE, "qwen3ring": TINY_QWEN3_RING}  # fmt: skip

#: Overrides that keep MaxText off the disk and the network.
QUIET = dict(
    run_name="tiny",
    enable_checkpointing=False,
    async_checkpointing=False,
    enable_tensorboard=False,
    enable_goodput_recording=False,
    monitor_goodput=False,
    enable_gcp_goodput_metrics=False,
    gcs_metrics=False,
    save_config_to_gcs=False,
    jax_cache_dir="",
    skip_jax_distributed_system=True,
    log_config=False,
)

MESH_AXES = ("maxtext", "2axis")


@dataclasses.dataclass(frozen=True)
class MaxTextStep:
    """MaxText's training step with its arguments, mesh, shardings and jit.

    ``step(state, batch) -> (state, metrics)`` (``metrics["scalar"]["learning/loss"]``, ...);
    ``state`` (an ``nnx.State``: parameters, AdamW moments, step counters and the model's typed
    PRNG keys) and ``batch`` are real arrays placed with ``state_shardings`` and
    ``batch_shardings`` (MaxText's layout); ``context()`` is the context (``jax.set_mesh`` and
    flax's logical axis rules) the step is traced and run under; ``authors_jit()`` is MaxText's
    own ``jax.jit`` of the step, which donates the state (pass a copy to keep ``state``:
    ``jax.tree.map(lambda x: x.copy(), state)``).

    Example:
        >>> with built.context():  # doctest: +SKIP
        ...     jaxpr = jax.make_jaxpr(built.step)(built.state, built.batch)
    """

    step: Callable[[Any, Any], tuple[Any, Any]]
    state: Any
    batch: dict[str, Any]
    mesh: Any
    state_shardings: Any
    batch_shardings: dict[str, Any]
    context: Callable[[], contextlib.AbstractContextManager]
    authors_jit: Callable[[], Callable[[Any, Any], tuple[Any, Any]]]


def _import_maxtext() -> Any:
    try:
        import maxtext  # noqa: F401
        from maxtext.trainers.pre_train import train
    except ImportError as e:
        raise ImportError(
            "experiments.libraries.maxtext_step needs Python >= 3.12 and MaxText: "
            f"pip install {' '.join(REQUIREMENTS)} ({e})"
        ) from e
    return train


def _two_axis_rules(rules: Any, kept: tuple[str, ...]) -> list[list[Any]]:
    """``rules`` (MaxText's logical axis rules) with every mesh axis not in ``kept`` dropped."""
    out = []
    for name, axes in rules:
        axes = [axes] if isinstance(axes, str) else list(axes)
        out.append([name, [a for a in axes if a in kept]])
    return out


def _config(dtype: str, mesh_axes: str, output_dir: str, tiny: str = "llama2") -> Any:
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    overrides: dict[str, Any] = {**TINY[tiny], **QUIET, "dtype": dtype}
    overrides["base_output_directory"] = output_dir
    if mesh_axes == "2axis":
        full = pyconfig.initialize(["", base], **overrides)
        kept = ("fsdp", "tensor")
        overrides.update(
            mesh_axes=list(kept),
            data_sharding=[list(kept)],
            logical_axis_rules=_two_axis_rules(full.logical_axis_rules, kept),
            override_logical_axis_rules=True,
        )
    return pyconfig.initialize(["", base], **overrides)


def _batch(config: Any, sharding: Any) -> dict[str, Any]:
    """Deterministic synthetic tokens (numpy seed 0) with the keys MaxText's ``train_step`` reads."""
    import jax
    import numpy as np

    batch, length = config.global_batch_size_to_load, config.max_target_length
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, length + 1))
    positions = np.broadcast_to(np.arange(length), (batch, length))
    ones = np.ones((batch, length))
    host = {
        "inputs": tokens[:, :-1],
        "inputs_position": positions,
        "inputs_segmentation": ones,
        "targets": tokens[:, 1:],
        "targets_position": positions,
        "targets_segmentation": ones,
    }
    return {k: jax.device_put(np.asarray(v, np.int32), sharding) for k, v in host.items()}


def build(dtype: str = "float32", mesh_axes: str = "maxtext", tiny: str = "llama2") -> MaxTextStep:
    """MaxText's tiny llama2 training step on 8 devices, as its ``train_loop`` builds it.

    ``dtype``: the activations' dtype (``"float32"`` or ``"bfloat16"``, MaxText's default); the
    weights stay ``float32`` (``weight_dtype``). ``mesh_axes``: ``"maxtext"`` (MaxText's 12-axis
    mesh, fsdp 4 and tensor 2, the rest of size 1) or ``"2axis"`` (a mesh of ``fsdp`` 4 and
    ``tensor`` 2 only: ``base.yml``'s logical axis rules with the other axes dropped). The
    learning rate follows MaxText's cosine schedule over ``steps=10`` without warmup (MaxText's
    warmup would make the first step's learning rate 0). ``tiny``: the model, a key of
    :data:`TINY` (``"llama2"``, ``"deepseek3"``, ``"qwen3"``, ``"qwen3sparse"``, ``"qwen3ring"``).

    Example:
        >>> built = build("bfloat16", "2axis")  # doctest: +SKIP
        >>> built.mesh.shape  # doctest: +SKIP
        {'fsdp': 4, 'tensor': 2}
    """
    if mesh_axes not in MESH_AXES:
        raise ValueError(f"mesh_axes: one of {MESH_AXES}, not {mesh_axes!r}")
    if tiny not in TINY:
        raise ValueError(f"tiny: one of {sorted(TINY)}, not {tiny!r}")
    train = _import_maxtext()
    import jax
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.common import train_state_nnx
    from maxtext.utils import maxtext_utils, model_creation_utils, sharding, train_utils

    with tempfile.TemporaryDirectory(prefix="maxtext_step_") as output_dir:  # left empty
        config = _config(dtype, mesh_axes, output_dir, tiny)
    # train_utils.setup_train_loop, without its checkpoint manager and data pipeline.
    mesh = maxtext_utils.get_mesh_from_config(config)
    create_model, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
    _, tx = train_utils.create_training_optimizer(config, model, mesh=mesh)

    def create_train_state() -> Any:
        model = create_model()
        return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

    state, _, state_shardings, _, _ = maxtext_utils.setup_training_state(
        None, config, mesh, None, create_train_state
    )
    with logical_axis_rules(config.logical_axis_rules):
        graphdef = nnx.graphdef(nnx.eval_shape(create_train_state))
    # train.train_loop
    graphdef, state = nnx.split(nnx.merge(graphdef, state))
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings
    )
    batch_shardings = sharding.get_input_data_sharding(
        config, mesh, rules=config.logical_axis_rules
    )
    step, in_shardings, out_shardings, static_argnums, donate_argnums = (
        maxtext_utils.get_functional_train_with_signature(
            train.train_step, batch_shardings, state_shardings, graphdef, config, params_shardings
        )
    )
    batch = _batch(config, batch_shardings)

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.set_mesh(mesh))
            stack.enter_context(logical_axis_rules(config.logical_axis_rules))
            yield

    authors_jit = functools.partial(
        jax.jit,
        step,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        static_argnums=static_argnums,
        donate_argnums=donate_argnums,
    )
    return MaxTextStep(
        step=step,
        state=state,
        batch=batch,
        mesh=mesh,
        state_shardings=state_shardings,
        batch_shardings={k: batch_shardings for k in batch},
        context=context,
        authors_jit=authors_jit,
    )


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no CUDA / TPU plugin probing
    import jax

    for dtype in ("float32", "bfloat16"):
        for mesh_axes in MESH_AXES:
            built = build(dtype, mesh_axes)
            losses = {}
            with built.context():
                for name, step in ("plain", jax.jit(built.step)), ("authors", built.authors_jit()):
                    state = jax.tree.map(lambda x: x.copy(), built.state)
                    for _ in range(2):
                        state, metrics = step(state, built.batch)
                    losses[name] = float(metrics["scalar"]["learning/loss"])
            print(dtype, mesh_axes, dict(built.mesh.shape), "loss after 2 steps", losses)
            assert abs(losses["plain"] - losses["authors"]) < 1e-4 * abs(losses["authors"])
