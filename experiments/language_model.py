"""A decoder-only language model training step written as a JAX user writes one: flax nnx layers,
optax adamw, integer labels.

Token and learned position embeddings (``nnx.Embed``), pre-norm blocks (``nnx.LayerNorm``,
causal ``nnx.MultiHeadAttention``, an MLP of two ``nnx.Linear`` with gelu, both residual), a
final norm and a tied unembedding (``Embed.attend``); loss
``optax.softmax_cross_entropy_with_integer_labels``. The blocks run as a Python loop, or stacked
(``nnx.vmap`` at construction) and run with ``jax.lax.scan`` (``scan=True``), as flax's
``nn.scan`` and MaxText's ``scan_layers`` do.

Example:
    >>> step, args = lm_step(batch=8, seq=16, d=32, heads=4, layers=2, vocab=64, scan=True,
    ...                      rng=np.random.default_rng(0))          # doctest: +SKIP
    >>> params, opt_state, loss = jax.jit(step)(*args)
"""

from __future__ import annotations

from collections.abc import Callable


def _layer(body: Callable, remat: bool) -> Callable:
    """The scanned layer ``body``, under ``jax.checkpoint`` when ``remat`` (``prevent_cse=False``:
    inside a scan the loop already keeps XLA from merging the recomputation away)."""
    import jax

    return jax.checkpoint(body, prevent_cse=False) if remat else body


def lm_step(
    batch: int,
    seq: int,
    d: int,
    heads: int,
    layers: int,
    vocab: int,
    scan: bool,
    rng=None,
    seed=0,
    unroll: int | bool = 1,
    shapes_only: bool = False,
    remat: bool = False,
) -> tuple[Callable, tuple]:
    """``(step, (params, opt_state, tokens, labels))``; ``step`` returns the new parameters,
    optimizer state and the loss. Parameters are an ``nnx.State`` pytree. ``unroll`` goes to
    ``jax.lax.scan`` (``True``: the compiled program has no loop, the same ops and names
    otherwise). ``shapes_only``: the arguments as ``jax.ShapeDtypeStruct``s (nothing is
    allocated). ``remat``: each scanned layer under ``jax.checkpoint`` (the backward pass
    recomputes a layer's activations from its input, as MaxText's ``remat_policy="full"``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm1 = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=heads, in_features=d, decode=False, rngs=rngs
            )
            self.norm2 = nnx.LayerNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, h, mask):
            h = h + self.attn(self.norm1(h), mask=mask)
            return h + self.down(jax.nn.gelu(self.up(self.norm2(h))))

    class LanguageModel(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.pos = nnx.Embed(seq, d, rngs=rngs)
            if scan:

                @nnx.split_rngs(splits=layers)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def stacked(r: nnx.Rngs) -> Block:
                    return Block(r)

                self.blocks = stacked(rngs)
            else:
                self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.norm = nnx.LayerNorm(d, rngs=rngs)

        def __call__(self, tokens):
            h = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
            mask = nnx.make_causal_mask(tokens)
            if scan:
                graph, state = nnx.split(self.blocks)

                def body(h, layer):
                    return nnx.merge(graph, layer)(h, mask), None

                h, _ = jax.lax.scan(_layer(body, remat), h, state, unroll=unroll)
            else:
                for block in self.blocks:
                    h = block(h, mask)
            return self.embed.attend(self.norm(h))

    make = lambda: nnx.split(LanguageModel(nnx.Rngs(seed)), nnx.Param, ...)  # noqa: E731
    graph, params, rest = nnx.eval_shape(make) if shapes_only else make()
    tx = optax.adamw(1e-3)

    def step(params, opt_state, tokens, labels):
        def loss_fn(p):
            logits = nnx.merge(graph, p, rest)(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if shapes_only:
        structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        return step, (structs, jax.eval_shape(tx.init, structs), ids, ids)
    rng = rng if rng is not None else np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    labels = np.roll(tokens, -1, axis=1)
    return step, (params, tx.init(params), tokens, labels)


def llama_step(
    batch: int,
    seq: int,
    d: int,
    heads: int,
    layers: int,
    vocab: int,
    ffn: int,
    *,
    rng=None,
    param_dtype: str = "bfloat16",
    shapes_only: bool = False,
    seed: int = 0,
    unroll: int | bool = 1,
    remat: bool = False,
) -> tuple[Callable, tuple]:
    """A Llama-like training step: ``(step, (params, opt_state, tokens, labels))``.

    RMSNorm, rotary position embeddings on queries and keys, causal attention without biases,
    a SwiGLU MLP of hidden size ``ffn``, untied embedding and unembedding; the blocks stacked
    (``nnx.vmap``) and run with ``jax.lax.scan``. Parameters in ``param_dtype`` (bf16 by
    default), attention softmax and the loss in fp32, and AdamW on fp32 copies of the
    parameters and gradients (fp32 moments), cast back after the update, as mixed-precision
    training does. ``shapes_only``: the arguments as ``jax.ShapeDtypeStruct``s (nothing is
    allocated: plan a model of billions of parameters from its shapes). ``unroll`` goes to
    ``jax.lax.scan``; ``remat`` puts each layer under ``jax.checkpoint``, as :func:`lm_step`.

    Example:
        >>> step, args = llama_step(8, 16, 32, 4, 2, 64, 96, rng=np.random.default_rng(0))
        ...                                                                  # doctest: +SKIP
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    dtype = jnp.dtype(param_dtype)
    head = d // heads
    if head * heads != d or head % 2:
        raise ValueError(f"d={d} must split into {heads} heads of an even size")
    linear = lambda i, o, r: nnx.Linear(i, o, use_bias=False, param_dtype=dtype, dtype=dtype,
                                        rngs=r)  # noqa: E731  # fmt: skip

    def rope(x):  # (batch, seq, heads, head)
        inv = 1.0 / 10000 ** (jnp.arange(0, head, 2, dtype=jnp.float32) / head)
        angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv[None, :]
        cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm1 = nnx.RMSNorm(d, param_dtype=dtype, dtype=dtype, rngs=rngs)
            self.q, self.k, self.v = (linear(d, d, rngs) for _ in range(3))
            self.o = linear(d, d, rngs)
            self.norm2 = nnx.RMSNorm(d, param_dtype=dtype, dtype=dtype, rngs=rngs)
            self.gate, self.up = linear(d, ffn, rngs), linear(d, ffn, rngs)
            self.down = linear(ffn, d, rngs)

        def __call__(self, h):
            b, s, _ = h.shape
            x = self.norm1(h)
            q, k, v = (f(x).reshape(b, s, heads, head) for f in (self.q, self.k, self.v))
            q, k = rope(q), rope(k)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(head)
            causal = jnp.tril(jnp.ones((s, s), bool))
            weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(h.dtype)
            h = h + self.o(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d))
            x = self.norm2(h)
            return h + self.down(jax.nn.silu(self.gate(x)) * self.up(x))

    class Llama(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(vocab, d, param_dtype=dtype, dtype=dtype, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(r: nnx.Rngs) -> Block:
                return Block(r)

            self.blocks = stacked(rngs)
            self.norm = nnx.RMSNorm(d, param_dtype=dtype, dtype=dtype, rngs=rngs)
            self.unembed = linear(d, vocab, rngs)

        def __call__(self, tokens):
            graph, state = nnx.split(self.blocks)

            def body(h, layer):
                return nnx.merge(graph, layer)(h), None

            h, _ = jax.lax.scan(_layer(body, remat), self.embed(tokens), state, unroll=unroll)
            return self.unembed(self.norm(h)).astype(jnp.float32)

    make = lambda: nnx.split(Llama(nnx.Rngs(seed)), nnx.Param, ...)  # noqa: E731
    graph, params, rest = nnx.eval_shape(make) if shapes_only else make()
    tx = optax.adamw(1e-3)
    f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)  # noqa: E731

    def step(params, opt_state, tokens, labels):
        def loss_fn(p):
            logits = nnx.merge(graph, p, rest)(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        master = f32(params)
        updates, opt_state = tx.update(f32(grads), opt_state, master)
        new = jax.tree.map(
            lambda p, m: m.astype(p.dtype), params, optax.apply_updates(master, updates)
        )
        return new, opt_state, loss

    if shapes_only:
        structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        opt = jax.eval_shape(lambda p: tx.init(f32(p)), structs)
        ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        return step, (structs, opt, ids, ids)
    rng = rng if rng is not None else np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    return step, (params, tx.init(f32(params)), tokens, np.roll(tokens, -1, axis=1))
