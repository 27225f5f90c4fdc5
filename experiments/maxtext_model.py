"""MaxText's decoder-only training step, written from its public configs in plain JAX + optax.

What MaxText's ``base.yml`` and model files say, as a step a user could write: weights stored in
``weight_dtype`` (float32) and cast to ``dtype`` (bfloat16) where each layer uses them; RMSNorm
computed in float32; rotary embeddings; grouped-query attention (``kv_heads`` key / value heads
shared by ``heads // kv_heads`` query heads each), dense or blockwise over key blocks as
MaxText's TPU ``flash`` kernel is (:func:`blockwise_attention`); a SwiGLU MLP, or for a mixture
of experts (Mixtral) MaxText's dropping ``RoutedMoE``; the decoder layers stacked and
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
    experts: int = 0  # > 0: a mixture of experts in place of the MLP (MaxText's RoutedMoE)
    top_k: int = 2  # experts per token
    capacity_factor: float = 1.25  # tokens an expert takes, over an even share (dropped beyond)
    rope_theta: float = 10_000.0


MODELS = {
    "llama2-7b": Model(emb=4096, heads=32, kv_heads=32, head_dim=128, mlp=11008, layers=32,
                       vocab=32000),
    "llama2-70b": Model(emb=8192, heads=64, kv_heads=8, head_dim=128, mlp=28672, layers=80,
                        vocab=32000),
    "llama3.1-8b": Model(emb=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32,
                         vocab=128256, rope_theta=500_000.0),
    "mixtral-8x7b": Model(emb=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32,
                          vocab=32000, experts=8, top_k=2, rope_theta=1_000_000.0),
}  # fmt: skip

SAVED_NAMES = {
    "save_dot_except_mlpwi": ("query_proj", "value_proj", "key_proj", "qkv_proj", "out_proj",
                              "mlpwo"),
    "save_dot_except_mlp": ("query_proj", "value_proj", "key_proj", "qkv_proj", "out_proj"),
    "save_qkv_proj": ("query_proj", "value_proj", "key_proj", "qkv_proj"),
    "save_out_proj": ("out_proj",),
}  # fmt: skip
"""MaxText's remat policies that save named values (``layers/decoders.py``)."""
OFFLOADED_NAMES = {
    "offload_qkvo": ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj"),
}
"""``remat_policy: custom`` as MaxText's v6e Llama 3.1 8B and Mixtral (dropped) recipes set it:
these values offloaded to the host (``pinned_host``) for the backward pass, the rest recomputed."""
REMAT_POLICIES = ("none", "full", "minimal", *SAVED_NAMES, *OFFLOADED_NAMES)
ATTENTION = ("dense", "blockwise")
"""``dense``: the scores of every query and key materialized (MaxText's ``attention: dot_product``);
``blockwise``: flash-style, over blocks of keys (:func:`blockwise_attention`; MaxText's default on
TPU, ``autoselected`` -> its ``flash`` kernel)."""


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
    if name in OFFLOADED_NAMES:
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(OFFLOADED_NAMES[name]),
            offload_src="device", offload_dst="pinned_host")  # fmt: skip
    if name == "minimal":
        return policies.checkpoint_dots_with_no_batch_dims
    if name == "full":
        return policies.nothing_saveable
    raise ValueError(f"remat_policy={name!r}: choose one of {REMAT_POLICIES}")


def blockwise_attention(q, k, v, block: int):
    """Causal grouped-query attention over blocks of ``block`` keys, flash-style: a ``lax.scan``
    over key blocks keeps each query's running maximum, softmax denominator and weighted sum in
    float32 (the online softmax), and its body is rematerialized (``jax.checkpoint``), so neither
    pass holds more than one block's scores. ``q``: ``(batch, seq, kv_heads, group, head_dim)``,
    already scaled; ``k``, ``v``: ``(batch, seq, kv_heads, head_dim)``; returns ``q``'s shape in
    ``v``'s dtype.

    Example:
        >>> out = blockwise_attention(q, k, v, block=512)            # doctest: +SKIP
    """
    import jax
    import jax.numpy as jnp

    b, s, kvh, g, d = q.shape
    if s % block:
        raise ValueError(f"a sequence of {s} does not split into key blocks of {block}")
    nb = s // block
    blocks = [x.reshape(b, nb, block, kvh, d).swapaxes(0, 1) for x in (k, v)]
    rows = jnp.arange(s)

    @jax.checkpoint
    def step(carry, inputs):
        top, total, acc = carry
        kj, vj, j = inputs
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, kj).astype(jnp.float32)
        cols = j * block + jnp.arange(block)
        scores = jnp.where(rows[:, None] >= cols[None, :], scores, -1e30)
        new_top = jnp.maximum(top, scores.max(-1))
        probs = jnp.exp(scores - new_top[..., None])
        scale = jnp.exp(top - new_top)
        total = total * scale + probs.sum(-1)
        part = jnp.einsum("bkgqs,bskd->bkgqd", probs.astype(v.dtype), vj)
        acc = acc * scale[..., None] + part.astype(jnp.float32)
        return (new_top, total, acc), None

    init = (jnp.full((b, kvh, g, s), -1e30, jnp.float32), jnp.zeros((b, kvh, g, s), jnp.float32),
            jnp.zeros((b, kvh, g, s, d), jnp.float32))  # fmt: skip
    (_, total, acc), _ = jax.lax.scan(step, init, (*blocks, jnp.arange(nb)))
    return (acc / total[..., None]).transpose(0, 3, 1, 2, 4).astype(v.dtype)


def _unconstrained(x, logical_axes):
    return x


def maxtext_step(
    model: str | Model,
    batch: int,
    seq: int,
    *,
    remat: str | Callable = "full",
    weight_dtype: str = "float32",
    dtype: str = "bfloat16",
    constrain: Callable = _unconstrained,
    shapes_only: bool = False,
    seed: int = 0,
    unroll: int | bool = 1,
    attention: str = "dense",
    block: int = 512,
) -> tuple[Callable, tuple]:
    """MaxText's training step of ``model`` (a name of :data:`MODELS` or a :class:`Model`) on a
    global batch of ``batch`` sequences of ``seq`` tokens: ``(step, (params, opt_state, tokens,
    targets))``, ``step`` returning ``(params, opt_state, loss)``. ``remat``: a MaxText
    ``remat_policy`` (:data:`REMAT_POLICIES`) or a ``jax.checkpoint`` policy (e.g.
    ``planner.remat_policy(...)``, for the planner to choose); ``attention``: :data:`ATTENTION` (``blockwise``
    over key blocks of ``min(block, seq)``). ``shapes_only``: the arguments as
    ``jax.ShapeDtypeStruct``s (nothing allocated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.ad_checkpoint import checkpoint_name

    m = MODELS[model] if isinstance(model, str) else model
    if m.heads % m.kv_heads:
        raise ValueError(f"{m.heads} query heads do not share {m.kv_heads} key / value heads")
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: choose one of {ATTENTION}")
    wdt, adt = jnp.dtype(weight_dtype), jnp.dtype(dtype)
    group = m.heads // m.kv_heads

    def rms_norm(x, scale):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
        return y.astype(adt) * scale.astype(adt)

    def rope(x):  # (batch, seq, heads, head_dim)
        half = m.head_dim // 2
        inv = 1.0 / m.rope_theta ** (jnp.arange(half, dtype=jnp.float32) / half)
        angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv[None, :]
        cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(adt)

    def dense(x, kernel, spec: str, name: str):
        return checkpoint_name(jnp.einsum(spec, x, kernel.astype(adt)), name)

    def layer(h, w):
        b, s, _ = h.shape
        h = constrain(h, ("activation_batch", "activation_length", "activation_embed"))
        if callable(remat) or remat in OFFLOADED_NAMES:  # MaxText names it; only offloading
            # policies read the name (and a policy the planner chooses, which may be one)
            h = checkpoint_name(h, "decoder_layer_input")
        x = rms_norm(h, w["attention_norm"])
        q = dense(x, w["query"], "bse,ehd->bshd", "query_proj")
        k = dense(x, w["key"], "bse,ehd->bshd", "key_proj")
        v = dense(x, w["value"], "bse,ehd->bshd", "value_proj")
        q = rope(q) * jnp.asarray(m.head_dim**-0.5, adt)
        k = rope(k)
        q = q.reshape(b, s, m.kv_heads, group, m.head_dim)
        if attention == "blockwise":
            ctx = blockwise_attention(q, k, v, min(block, s)).reshape(b, s, m.heads, m.head_dim)
        else:
            scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32)
            causal = jnp.tril(jnp.ones((s, s), bool))
            probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(adt)
            ctx = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, m.heads, m.head_dim)
        ctx = checkpoint_name(constrain(ctx, ("activation_batch", "activation_length",
                                              "activation_heads", "activation_kv")), "context")  # fmt: skip
        h = h + dense(ctx, w["out"], "bshd,hde->bse", "out_proj")
        x = rms_norm(h, w["mlp_norm"])
        if m.experts:
            return h + routed_experts(x, w), None
        gate = dense(x, w["wi_0"], "bse,em->bsm", "mlpwi_0")
        up = dense(x, w["wi_1"], "bse,em->bsm", "mlpwi_1")
        hidden = constrain(jax.nn.silu(gate) * up, ("activation_batch", "activation_length",
                                                    "activation_mlp"))  # fmt: skip
        return h + dense(hidden, w["wo"], "bsm,me->bse", "mlpwo"), None

    def routed_experts(x, w):
        """MaxText's RoutedMoE with dropping (``megablox: False``): each token's ``top_k``
        experts by the gate's logits, weighted by the softmax of those logits; each expert takes
        at most ``capacity`` tokens of a sequence (in order, the rest dropped); tokens dispatched
        to ``(experts, batch, capacity)`` slots and combined back with one-hot einsums."""
        b, s, _ = x.shape
        logits = jnp.einsum("bse,ex->bsx", x, w["gate"].astype(adt)).astype(jnp.float32)
        top, chosen = jax.lax.top_k(logits, m.top_k)  # (b, s, k)
        weights = jax.nn.softmax(top, axis=-1)
        capacity = int(s * m.top_k / m.experts * m.capacity_factor)
        mask = jax.nn.one_hot(chosen, m.experts, dtype=jnp.int32)  # (b, s, k, x)
        position = jnp.cumsum(mask.reshape(b, s * m.top_k, m.experts), axis=1)
        position = position.reshape(mask.shape) * mask  # 1-based place in the expert's queue
        kept = mask * (position <= capacity)
        slot = jnp.sum(position * kept, axis=2)  # (b, s, x): 0 where not routed or dropped
        weight = jnp.sum(weights[..., None] * kept, axis=2)  # (b, s, x)
        dispatch = jax.nn.one_hot(slot, capacity + 1, dtype=adt)[..., 1:]  # (b, s, x, c)
        combine = dispatch * weight[..., None].astype(adt)
        tokens = checkpoint_name(jnp.einsum("bse,bsxc->xbce", x, dispatch), "dispatch")
        gate = jnp.einsum("xbce,xem->xbcm", tokens, w["moe_wi_0"].astype(adt))
        up = jnp.einsum("xbce,xem->xbcm", tokens, w["moe_wi_1"].astype(adt))
        out = jnp.einsum("xbcm,xme->xbce", jax.nn.silu(gate) * up, w["moe_wo"].astype(adt))
        return jnp.einsum("xbce,bsxc->bse", out, combine)

    policy = remat if callable(remat) else None if remat == "none" else remat_policy(remat)
    body = layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=False)

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
    if m.experts:
        x = m.experts
        mlp = {"gate": (L, e, x), "moe_wi_0": (L, x, e, m.mlp), "moe_wi_1": (L, x, e, m.mlp),
               "moe_wo": (L, x, m.mlp, e)}  # fmt: skip
    else:
        mlp = {"wi_0": (L, e, m.mlp), "wi_1": (L, e, m.mlp), "wo": (L, m.mlp, e)}
    shapes = {
        "embedding": (m.vocab, e),
        "layers": {
            "attention_norm": (L, e),
            "query": (L, e, m.heads, d),
            "key": (L, e, m.kv_heads, d),
            "value": (L, e, m.kv_heads, d),
            "out": (L, m.heads, d, e),
            "mlp_norm": (L, e),
            **mlp,
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
