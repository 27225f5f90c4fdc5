"""Google's ``gemma`` library's Gemma 3 transformer, built tiny, as one optax training step.

The model is ``gemma.gm.nn.Transformer`` with a custom ``gm.nn.config.TransformerConfig``
shaped like Gemma 3 (grouped-query attention, QK norm, pre and post norms, gated MLP with
``transpose_gating_einsum``, a local sliding-window layer then a global one, tied embeddings):
vocabulary 1024, embed 256, MLP hidden 512, 4 query heads and 2 key/value heads of 64, 2
layers, window 64, sequence 128, global batch 8. The step is ``jax.value_and_grad`` of a masked
next-token cross entropy over ``model.apply`` and ``optax.adamw``.

The gemma library ships no training layout of its own: its sharding example (``examples/
sharding.py``) uses kauldron's ``kd.sharding.FSDPSharding()`` for the parameters (each array's
largest dimension divisible by the device count over all devices, arrays under 4 MiB
replicated, so every weight of this tiny model) and the batch's first dimension over all
devices. ``authors_shardings`` is the layout chosen here instead, FSDP x tensor: each weight's
heads (attention), MLP hidden (MLP) or vocabulary (embedding) dimension over ``"tensor"``, its
largest other dimension over ``"fsdp"``, norms replicated, AdamW's moments as their parameter,
the batch over ``"fsdp"``. ``kauldron_fsdp_shardings`` is kauldron's rule without its 4 MiB
floor, over both mesh axes together.

Needs ``gemma`` (Python >= 3.12; it imports kauldron, which imports TensorFlow); see
:func:`build`. Importing this module does not import gemma.

Example (8 CPU devices)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -c '
    from experiments.libraries import gemma_step
    built = gemma_step.build()
    state, loss = built.authors_jit()(built.state, built.batch)
    print(float(loss))'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

VOCAB = 1024
EMBED = 256
MLP_HIDDEN = 512
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
WINDOW = 64
SEQ = 128
BATCH = 8
PAD = 0

State = tuple[Any, Any]  # (params, optax AdamW state)
Batch = dict[str, jax.Array]

_INSTALL = (
    "experiments.libraries.gemma_step needs Google's gemma library (Python >= 3.12): "
    "pip install 'gemma==4.0.1' 'kauldron==1.4.4' 'sentencepiece==0.2.1' "
    "(kauldron pulls tensorflow-cpu, which needs protobuf 6 and so sentencepiece < 0.2.3)"
)

# The dimension each weight splits over "tensor", by the name of the module that holds it.
_TENSOR_DIM = {
    "input_embedding": 0,  # (vocab, embed)
    "q_einsum": 0,  # (heads, embed, head_dim)
    "kv_einsum": 1,  # (2, kv_heads, embed, head_dim)
    "attn_vec_einsum": 0,  # (heads, head_dim, embed)
    "gating_einsum": 1,  # (2, mlp_hidden, embed)
    "linear": 0,  # (mlp_hidden, embed)
}


@dataclasses.dataclass(frozen=True)
class GemmaStep:
    """A gemma Transformer training step, its state, a batch, a mesh and layouts for it.

    ``step(state, batch) -> (state, loss)`` is pure; ``state`` is ``(params, opt_state)`` on
    the default device. Each ``*_shardings`` is ``(state_shardings, batch_shardings)``, pytrees
    of ``NamedSharding`` of the structure of ``(state, batch)``.
    """

    step: Callable[[State, Batch], tuple[State, jax.Array]]
    state: State
    batch: Batch
    mesh: Mesh
    authors_shardings: tuple[Any, Any]
    fsdp_tensor_shardings: tuple[Any, Any]
    kauldron_fsdp_shardings: tuple[Any, Any]
    model: Any  # the gm.nn.Transformer

    def authors_jit(self) -> Any:
        """``jax.jit(step)`` with :attr:`authors_shardings` for the inputs and the outputs."""
        return self._jit(self.authors_shardings)

    def fsdp_tensor_jit(self) -> Any:
        """The same as :meth:`authors_jit` (the chosen layout is FSDP x tensor)."""
        return self._jit(self.fsdp_tensor_shardings)

    def kauldron_fsdp_jit(self) -> Any:
        """``jax.jit(step)`` with :attr:`kauldron_fsdp_shardings`."""
        return self._jit(self.kauldron_fsdp_shardings)

    def _jit(self, shardings: tuple[Any, Any]) -> Any:
        state_shardings, batch_shardings = shardings
        return jax.jit(
            self.step,
            in_shardings=(state_shardings, batch_shardings),
            out_shardings=(state_shardings, NamedSharding(self.mesh, P())),
        )


def _import_gemma() -> Any:
    try:
        from gemma import gm
    except ImportError as error:
        raise ImportError(_INSTALL) from error
    return gm


def tiny_config(gm: Any) -> Any:
    """The tiny Gemma 3 shaped ``gm.nn.config.TransformerConfig`` (``gm``: ``gemma.gm``)."""
    attention = gm.nn.AttentionType
    return gm.nn.config.TransformerConfig(
        num_embed=VOCAB,
        embed_dim=EMBED,
        hidden_dim=MLP_HIDDEN,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        num_kv_heads=KV_HEADS,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        use_qk_norm=True,
        attention_types=(attention.LOCAL_SLIDING, attention.GLOBAL),
        sliding_window_size=WINDOW,
        transpose_gating_einsum=True,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
    )


def _make_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids right-padded with ``PAD``: inputs, next-token targets and their mask."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(BATCH, SEQ + 1), dtype=np.int32)
    lengths = rng.integers(SEQ // 2, SEQ + 2, size=(BATCH, 1))
    mask = np.arange(SEQ + 1)[None, :] < lengths
    tokens = np.where(mask, tokens, PAD).astype(np.int32)
    return {"input": tokens[:, :-1], "target": tokens[:, 1:], "loss_mask": mask[:, 1:]}


def _key_names(path: tuple[Any, ...]) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]


def _fsdp_tensor_spec(path: tuple[Any, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """Heads / MLP hidden / vocabulary over the second mesh axis, the largest other dim over
    the first; anything of one dimension (norms) or scalar (the step count) replicated."""
    fsdp, tensor = mesh.axis_names
    spec: list[str | None] = [None] * len(shape)
    if len(shape) < 2:
        return P(*spec)
    names = _key_names(path)
    tensor_dim = next((_TENSOR_DIM[n] for n in reversed(names) if n in _TENSOR_DIM), None)
    if tensor_dim is not None and shape[tensor_dim] % mesh.shape[tensor] == 0:
        spec[tensor_dim] = tensor
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if spec[dim] is None and shape[dim] % mesh.shape[fsdp] == 0 and shape[dim] > 2:
            spec[dim] = fsdp
            break
    return P(*spec)


def _kauldron_fsdp_spec(path: tuple[Any, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """kauldron's ``FSDPSharding`` rule (without its 4 MiB floor) over all mesh axes at once."""
    del path
    count = mesh.devices.size
    spec: list[Any] = [None] * len(shape)
    for dim in np.argsort(shape)[::-1]:
        if shape[dim] % count == 0:
            spec[dim] = tuple(mesh.axis_names)
            break
    return P(*spec)


def _shardings(tree: Any, mesh: Mesh, rule: Callable[..., P]) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, rule(path, tuple(x.shape), mesh)), tree
    )


def build(
    dtype: str = "float32",
    mesh_shape: tuple[int, int] = (4, 2),
    axis_names: tuple[str, str] = ("fsdp", "tensor"),
) -> GemmaStep:
    """Build the tiny gemma step on ``jax.devices()`` reshaped to ``mesh_shape``.

    ``axis_names`` are (FSDP axis, tensor axis); ``dtype`` is the parameters' (and the
    computation's) dtype, e.g. ``"bfloat16"``.

    >>> built = build()  # doctest: +SKIP
    >>> built.authors_jit()(built.state, built.batch)[1].shape  # doctest: +SKIP
    ()
    """
    gm = _import_gemma()
    devices = jax.devices()
    if int(np.prod(mesh_shape)) != len(devices):
        raise ValueError(
            f"mesh_shape {mesh_shape} needs {np.prod(mesh_shape)} devices, not {len(devices)}"
        )
    mesh = Mesh(np.asarray(devices).reshape(mesh_shape), axis_names)

    model = gm.nn.Transformer(config=tiny_config(gm), dtype=jnp.dtype(dtype))
    batch = {k: jnp.asarray(v) for k, v in _make_batch(0).items()}
    params = model.init(jax.random.key(0), batch["input"])["params"]
    optimizer = optax.adamw(learning_rate=1e-3, weight_decay=1e-4)
    state = (params, optimizer.init(params))

    def loss_fn(params: Any, batch: Batch) -> jax.Array:
        logits = model.apply({"params": params}, batch["input"]).logits
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["target"]
        )
        mask = batch["loss_mask"].astype(jnp.float32)
        return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    def step(state: State, batch: Batch) -> tuple[State, jax.Array]:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    fsdp = axis_names[0]
    batch_fsdp = {k: NamedSharding(mesh, P(fsdp)) for k in batch}
    fsdp_tensor = (_shardings(state, mesh, _fsdp_tensor_spec), batch_fsdp)
    batch_all = {k: NamedSharding(mesh, P(tuple(axis_names))) for k in batch}
    kauldron = (_shardings(state, mesh, _kauldron_fsdp_spec), batch_all)
    return GemmaStep(
        step=step,
        state=state,
        batch=batch,
        mesh=mesh,
        authors_shardings=fsdp_tensor,
        fsdp_tensor_shardings=fsdp_tensor,
        kauldron_fsdp_shardings=kauldron,
        model=model,
    )
