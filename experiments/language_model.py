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


def lm_step(
    batch: int,
    seq: int,
    d: int,
    heads: int,
    layers: int,
    vocab: int,
    scan: bool,
    rng,
    seed=0,
    unroll: int | bool = 1,
) -> tuple[Callable, tuple]:
    """``(step, (params, opt_state, tokens, labels))``; ``step`` returns the new parameters,
    optimizer state and the loss. Parameters are an ``nnx.State`` pytree. ``unroll`` goes to
    ``jax.lax.scan`` (``True``: the compiled program has no loop, the same ops and names
    otherwise)."""
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

                h, _ = jax.lax.scan(body, h, state, unroll=unroll)
            else:
                for block in self.blocks:
                    h = block(h, mask)
            return self.embed.attend(self.norm(h))

    graph, params, rest = nnx.split(LanguageModel(nnx.Rngs(seed)), nnx.Param, ...)
    tx = optax.adamw(1e-3)

    def step(params, opt_state, tokens, labels):
        def loss_fn(p):
            logits = nnx.merge(graph, p, rest)(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    labels = np.roll(tokens, -1, axis=1)
    return step, (params, tx.init(params), tokens, labels)
