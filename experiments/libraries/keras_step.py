"""keras-hub's Llama, built tiny, as one pure JAX training step on a device mesh.

The step is the one Keras documents for custom JAX training loops: ``model.stateless_call``
inside ``jax.value_and_grad`` and ``optimizer.stateless_apply`` (``keras.optimizers.AdamW``), on
a ``keras_hub.models.LlamaCausalLM`` over a ``LlamaBackbone`` of vocabulary 1024, 2 layers, 4
query and 4 key/value heads (head dim 64), hidden 256, intermediate 512, sequence 128, global
batch 8. ``authors_shardings`` is the layout keras-hub ships: ``LlamaBackbone.get_layout_map``
under ``keras.distribution.ModelParallel(batch_dim_name="batch")``, read off the variables Keras
creates under that distribution (the optimizer's slots take their parameter's layout, as Keras
gives them), with the batch split over ``"batch"``.

Needs ``keras-hub`` (Keras 3); see :func:`build`. Importing this module does not import Keras;
:func:`build` sets ``KERAS_BACKEND=jax`` unless it is set, and calls
``keras.utils.set_random_seed(0)`` (which seeds Python's and NumPy's global generators too).

Example (8 CPU devices)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -c '
    from experiments.libraries import keras_step
    built = keras_step.build()
    state, loss = built.authors_jit()(built.state, built.batch)
    print(float(loss))'
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

VOCAB = 1024
LAYERS = 2
QUERY_HEADS = 4
KV_HEADS = 4  # keras-hub's layout splits the key/value heads over "batch" (4 on a 4 x 2 mesh)
HIDDEN = 256
INTERMEDIATE = 512
SEQ = 128
BATCH = 8

State = tuple[list[jax.Array], list[jax.Array], list[jax.Array]]
Batch = dict[str, jax.Array]
StateShardings = tuple[list[NamedSharding], list[NamedSharding], list[NamedSharding]]
BatchShardings = dict[str, NamedSharding]

_INSTALL = (
    "experiments.libraries.keras_step needs keras-hub with Keras 3 (Python >= 3.11): "
    "pip install 'keras==3.15.1' 'keras-hub==0.32.0' (keras-hub also pulls tensorflow-text; "
    "without it: pip install --no-deps 'keras-hub==0.32.0' plus keras, kagglehub, "
    "'kagglesdk==0.1.28', sentencepiece, tokenizers, regex, rich)"
)


@dataclasses.dataclass(frozen=True)
class KerasStep:
    """A keras-hub Llama training step, its state, a batch, a mesh and the authors' layout.

    ``step(state, batch) -> (state, loss)`` is pure. ``state`` is ``(trainable, non_trainable,
    optimizer_variables)``, lists of arrays in Keras's variable order (``paths`` names them), on
    the default device. ``authors_shardings`` and ``fsdp_tensor_shardings`` are
    ``(state_shardings, batch_shardings)`` of the same structure as ``(state, batch)``.
    """

    step: Callable[[State, Batch], tuple[State, jax.Array]]
    state: State
    batch: Batch
    mesh: Mesh
    authors_shardings: tuple[StateShardings, BatchShardings]
    fsdp_tensor_shardings: tuple[StateShardings, BatchShardings]
    paths: tuple[list[str], list[str], list[str]]
    activation_layout: bool

    def authors_jit(self) -> Any:
        """``jax.jit(step)`` with keras-hub's layout for the inputs and the outputs."""
        return self._jit(self.authors_shardings)

    def fsdp_tensor_jit(self) -> Any:
        """``jax.jit(step)`` with :attr:`fsdp_tensor_shardings` (a hand FSDP x tensor layout)."""
        return self._jit(self.fsdp_tensor_shardings)

    def _jit(self, shardings: tuple[StateShardings, BatchShardings]) -> Any:
        state_shardings, batch_shardings = shardings
        loss_sharding = NamedSharding(self.mesh, P())
        return jax.jit(
            self.step,
            in_shardings=(state_shardings, batch_shardings),
            out_shardings=(state_shardings, loss_sharding),
        )


def _import_keras() -> tuple[Any, Any]:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    try:
        import keras
        import keras_hub
    except ImportError as error:
        raise ImportError(_INSTALL) from error
    if keras.backend.backend() != "jax":
        raise ImportError(
            f"Keras was imported with the {keras.backend.backend()!r} backend; set "
            "KERAS_BACKEND=jax before importing keras"
        )
    return keras, keras_hub


def _make_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids with some right padding, split as keras-hub's CausalLM preprocessor does."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(BATCH, SEQ + 1), dtype=np.int32)
    lengths = rng.integers(SEQ // 2, SEQ + 2, size=(BATCH, 1))
    mask = np.arange(SEQ + 1)[None, :] < lengths
    tokens = np.where(mask, tokens, 0).astype(np.int32)
    return {
        "token_ids": tokens[:, :-1],
        "padding_mask": mask[:, :-1],
        "targets": tokens[:, 1:],
        "target_mask": mask[:, 1:],
    }


# FSDP ("batch" axis) x tensor ("model" axis), Megatron's orientation: the heads and the MLP
# hidden dimension over "model", the model dimension over "batch"; norms replicated.
def _fsdp_tensor_spec(path: str, ndim: int, batch: str, model: str) -> P:
    rules = [
        (r".*token_embedding.embeddings.*", (model, batch)),
        (r".*token_embedding.reverse_embeddings.*", (batch, model)),
        (r".*self_attention.(query|key|value).kernel.*", (batch, model, None)),
        (r".*attention_output.kernel.*", (model, None, batch)),
        (r".*feedforward_(intermediate|gate)_dense.kernel.*", (batch, model)),
        (r".*feedforward_output_dense.kernel.*", (model, batch)),
    ]
    for pattern, spec in rules:
        if re.fullmatch(pattern, path.replace("/", "_")) and len(spec) == ndim:
            return P(*spec)
    return P()


def build(
    dtype: str = "float32",
    mesh_shape: tuple[int, int] = (4, 2),
    axis_names: tuple[str, str] = ("batch", "model"),
    activation_layout: bool = False,
) -> KerasStep:
    """Build the tiny keras-hub Llama step on ``jax.devices()`` reshaped to ``mesh_shape``.

    ``axis_names`` are (data axis, model axis), as ``LlamaBackbone.get_layout_map`` names them.
    ``dtype`` is the backbone's Keras dtype policy name. ``"mixed_bfloat16"`` (float32
    variables, bfloat16 compute) trains; ``"bfloat16"`` makes every variable bfloat16, and then
    Keras's AdamW leaves the weights unchanged (it casts ``beta_2 = 0.999`` to bfloat16, where
    it is 1, so its bias correction ``1 - beta_2 ** t`` is 0): a valid program, not a trainer. With
    ``activation_layout``, the layout map also holds ``transformer_layer_0/output`` =
    ``(batch, None, model)`` and the step is traced under the distribution, so Keras puts a
    ``jax.lax.with_sharding_constraint`` on the first decoder block's output.

    >>> built = build()  # doctest: +SKIP
    >>> built.authors_jit()(built.state, built.batch)[1].shape  # doctest: +SKIP
    ()
    """
    keras, keras_hub = _import_keras()
    batch_axis, model_axis = axis_names
    devices = jax.devices()
    if int(np.prod(mesh_shape)) != len(devices):
        raise ValueError(
            f"mesh_shape {mesh_shape} needs {np.prod(mesh_shape)} devices, not {len(devices)}"
        )
    device_mesh = keras.distribution.DeviceMesh(mesh_shape, axis_names, devices=devices)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(
        device_mesh, model_parallel_dim_name=model_axis, data_parallel_dim_name=batch_axis
    )
    if activation_layout:
        layout_map["transformer_layer_0/output"] = (batch_axis, None, model_axis)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=batch_axis
    )
    mesh = device_mesh.backend_mesh

    keras.utils.set_random_seed(0)
    with distribution.scope():
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCAB,
            num_layers=LAYERS,
            num_query_heads=QUERY_HEADS,
            num_key_value_heads=KV_HEADS,
            hidden_dim=HIDDEN,
            intermediate_dim=INTERMEDIATE,
            dtype=dtype,
        )
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
        optimizer = keras.optimizers.AdamW(learning_rate=1e-3)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    groups = (model.trainable_variables, model.non_trainable_variables, optimizer.variables)
    # Keras placed each variable where the distribution says: read the layout off the values.
    state_shardings = tuple([v.value.sharding for v in group] for group in groups)
    # The step's inputs live on the default device, unsharded, like any user's arrays.
    state = tuple([jnp.asarray(np.asarray(v.value)) for v in group] for group in groups)
    paths = tuple([v.path for v in group] for group in groups)

    def loss_and_updates(trainable, non_trainable, batch):
        inputs = {"token_ids": batch["token_ids"], "padding_mask": batch["padding_mask"]}
        logits, non_trainable = model.stateless_call(
            trainable, non_trainable, inputs, training=True
        )
        loss = loss_fn(batch["targets"], logits, sample_weight=batch["target_mask"])
        return loss, non_trainable

    grad_fn = jax.value_and_grad(loss_and_updates, has_aux=True)

    def step(state: State, batch: Batch) -> tuple[State, jax.Array]:
        trainable, non_trainable, optimizer_variables = state
        # Keras traces its own train step under the distribution (``with distribution.scope():
        # model.fit(...)``); that is what applies the layout map's "<layer>/output" entries.
        with distribution.scope():
            (loss, non_trainable), grads = grad_fn(trainable, non_trainable, batch)
            trainable, optimizer_variables = optimizer.stateless_apply(
                optimizer_variables, grads, trainable
            )
        return (list(trainable), list(non_trainable), list(optimizer_variables)), loss

    batch = {k: jnp.asarray(v) for k, v in _make_batch(0).items()}
    batch_sharding = {k: NamedSharding(mesh, P(batch_axis)) for k in batch}

    def fsdp_tensor(group_paths: list[str], group: list[jax.Array]) -> list[NamedSharding]:
        return [
            NamedSharding(mesh, _fsdp_tensor_spec(p, x.ndim, batch_axis, model_axis))
            for p, x in zip(group_paths, group)
        ]

    fsdp_state = tuple(fsdp_tensor(p, g) for p, g in zip(paths, state))
    return KerasStep(
        step=step,
        state=state,
        batch=batch,
        mesh=mesh,
        authors_shardings=(state_shardings, batch_sharding),
        fsdp_tensor_shardings=(fsdp_state, batch_sharding),
        paths=paths,
        activation_layout=activation_layout,
    )
