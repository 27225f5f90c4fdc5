"""MaxText's decoder-only training step, written from its public configs in plain JAX + optax.

What MaxText's ``base.yml`` and model files say, as a step a user could write: weights stored in
``weight_dtype`` (float32) and cast to ``dtype`` (bfloat16) where each layer uses them; RMSNorm
computed in float32; rotary embeddings; grouped-query attention (``kv_heads`` key / value heads
shared by ``heads // kv_heads`` query heads each); a SwiGLU MLP; the decoder layers stacked and
run with ``jax.lax.scan`` under ``jax.checkpoint`` with a named remat policy (the projections
tagged with ``checkpoint_name`` as MaxText tags them: ``query_proj``, ``key_proj``,
``value_proj``, ``context``, ``out_proj``, ``mlpwi_0``, ``mlpwi_1``, ``mlpwo``); logits cast to
float32 and a one-hot cross entropy; AdamW (b2 0.95, weight decay 0.1) after clipping the
gradients' global norm to 1.0.

``constrain(x, logical_axes)`` is called on every activation MaxText constrains (its logical
axis names); the default leaves them to whoever lays the step out (the planner), a recipe passes
``jax.lax.with_sharding_constraint`` by its logical axis rules.

Example:
    >>> step, args = maxtext_step("llama2-7b", batch=256, seq=4096, shapes_only=True)
    ...                                                                  # doctest: +SKIP
    >>> planner.plan(step, *args, mesh=mesh, donate_argnums=(0, 1))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder's sizes, as MaxText's ``configs/models/*.yml`` give them."""

    emb: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    layers: int
    vocab: int


MODELS = {
    "llama2-7b": Model(emb=4096, heads=32, kv_heads=32, head_dim=128, mlp=11008, layers=32,
                       vocab=32000),
    "llama2-70b": Model(emb=8192, heads=64, kv_heads=8, head_dim=128, mlp=28672, layers=80,
                        vocab=32000),
    "llama3.1-8b": Model(emb=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32,
                         vocab=128256),
}  # fmt: skip

SAVED_NAMES = {
    "save_dot_except_mlpwi": ("query_proj", "value_proj", "key_proj", "qkv_proj", "out_proj",
                              "mlpwo"),
    "save_dot_except_mlp": ("query_proj", "value_proj", "key_proj", "qkv_proj", "out_proj"),
    "save_qkv_proj": ("query_proj", "value_proj", "key_proj", "qkv_proj"),
    "save_out_proj": ("out_proj",),
}  # fmt: skip
"""MaxText's remat policies that save named values (``layers/decoders.py``)."""
REMAT_POLICIES = ("none", "full", "minimal", *SAVED_NAMES)


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy MaxText's ``remat_policy`` names (``"none"``: no remat).

    Example:
        >>> remat_policy("full") is jax.checkpoint_policies.nothing_saveable   # doctest: +SKIP
        True
    """
    import jax

    policies = jax.checkpoint_policies
    if name in SAVED_NAMES:
        return policies.save_only_these_names(*SAVED_NAMES[name])
    if name == "minimal":
        return policies.checkpoint_dots_with_no_batch_dims
    if name == "full":
        return policies.nothing_saveable
    raise ValueError(f"remat_policy={name!r}: choose one of {REMAT_POLICIES}")


def _unconstrained(x, logical_axes):
    return x


def maxtext_step(
    model: str | Model,
    batch: int,
    seq: int,
    *,
    remat: str = "full",
    weight_dtype: str = "float32",
    dtype: str = "bfloat16",
    constrain: Callable = _unconstrained,
    shapes_only: bool = False,
    seed: int = 0,
    unroll: int | bool = 1,
) -> tuple[Callable, tuple]:
    """MaxText's training step of ``model`` (a name of :data:`MODELS` or a :class:`Model`) on a
    global batch of ``batch`` sequences of ``seq`` tokens: ``(step, (params, opt_state, tokens,
    targets))``, ``step`` returning ``(params, opt_state, loss)``. ``remat``: a MaxText
    ``remat_policy`` (:data:`REMAT_POLICIES`). ``shapes_only``: the arguments as
    ``jax.ShapeDtypeStruct``s (nothing allocated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.ad_checkpoint import checkpoint_name

    m = MODELS[model] if isinstance(model, str) else model
    if m.heads % m.kv_heads:
        raise ValueError(f"{m.heads} query heads do not share {m.kv_heads} key / value heads")
    wdt, adt = jnp.dtype(weight_dtype), jnp.dtype(dtype)
    group = m.heads // m.kv_heads

    def rms_norm(x, scale):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
        return y.astype(adt) * scale.astype(adt)

    def rope(x):  # (batch, seq, heads, head_dim)
        half = m.head_dim // 2
        inv = 1.0 / 10000 ** (jnp.arange(half, dtype=jnp.float32) / half)
        angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv[None, :]
        cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(adt)

    def dense(x, kernel, spec: str, name: str):
        return checkpoint_name(jnp.einsum(spec, x, kernel.astype(adt)), name)

    def layer(h, w):
        b, s, _ = h.shape
        h = constrain(h, ("activation_batch", "activation_length", "activation_embed"))
        x = rms_norm(h, w["attention_norm"])
        q = dense(x, w["query"], "bse,ehd->bshd", "query_proj")
        k = dense(x, w["key"], "bse,ehd->bshd", "key_proj")
        v = dense(x, w["value"], "bse,ehd->bshd", "value_proj")
        q = rope(q) * jnp.asarray(m.head_dim**-0.5, adt)
        k = rope(k)
        q = q.reshape(b, s, m.kv_heads, group, m.head_dim)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32)
        causal = jnp.tril(jnp.ones((s, s), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(adt)
        ctx = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, m.heads, m.head_dim)
        ctx = checkpoint_name(constrain(ctx, ("activation_batch", "activation_length",
                                              "activation_heads", "activation_kv")), "context")  # fmt: skip
        h = h + dense(ctx, w["out"], "bshd,hde->bse", "out_proj")
        x = rms_norm(h, w["mlp_norm"])
        gate = dense(x, w["wi_0"], "bse,em->bsm", "mlpwi_0")
        up = dense(x, w["wi_1"], "bse,em->bsm", "mlpwi_1")
        hidden = constrain(jax.nn.silu(gate) * up, ("activation_batch", "activation_length",
                                                    "activation_mlp"))  # fmt: skip
        return h + dense(hidden, w["wo"], "bsm,me->bse", "mlpwo"), None

    body = layer if remat == "none" else jax.checkpoint(layer, policy=remat_policy(remat),
                                                         prevent_cse=False)  # fmt: skip

    def loss_fn(params, tokens, targets):
        h = params["embedding"].astype(adt)[tokens]
        h, _ = jax.lax.scan(body, h, params["layers"], unroll=unroll)
        x = rms_norm(h, params["final_norm"])
        logits = jnp.einsum("bse,ev->bsv", x, params["logits"].astype(adt)).astype(jnp.float32)
        logits = constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))
        one_hot = jax.nn.one_hot(targets, m.vocab, dtype=jnp.float32)
        return -jnp.mean(jnp.sum(one_hot * jax.nn.log_softmax(logits, axis=-1), axis=-1))

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1),
    )

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    L, e, d = m.layers, m.emb, m.head_dim
    shapes = {
        "embedding": (m.vocab, e),
        "layers": {
            "attention_norm": (L, e),
            "query": (L, e, m.heads, d),
            "key": (L, e, m.kv_heads, d),
            "value": (L, e, m.kv_heads, d),
            "out": (L, m.heads, d, e),
            "mlp_norm": (L, e),
            "wi_0": (L, e, m.mlp),
            "wi_1": (L, e, m.mlp),
            "wo": (L, m.mlp, e),
        },
        "final_norm": (e,),
        "logits": (e, m.vocab),
    }
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    if shapes_only:
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, wdt), shapes, is_leaf=is_shape)
        return step, (params, jax.eval_shape(tx.init, params), ids, ids)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.02, s), wdt), shapes,
                          is_leaf=is_shape)  # fmt: skip
    params["final_norm"] = jnp.ones(shapes["final_norm"], wdt)
    params["layers"]["attention_norm"] = jnp.ones(shapes["layers"]["attention_norm"], wdt)
    params["layers"]["mlp_norm"] = jnp.ones(shapes["layers"]["mlp_norm"], wdt)
    tokens = rng.integers(0, m.vocab, (batch, seq)).astype(np.int32)
    return step, (params, tx.init(params), tokens, np.roll(tokens, -1, axis=1))
