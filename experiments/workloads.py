"""Workloads for the planner benchmark: functions and example arguments, built from a spec.

| kind        | sizes                                   | what                                        |
|-------------|-----------------------------------------|---------------------------------------------|
| mlp         | batch x hidden x layers                 | L-layer ReLU MLP training step (grad + SGD) |
| transformer | batch x seq x heads x head_dim x layers | pre-norm blocks (attention + 4x MLP, both   |
|             |                                         | residual) training step (grad + SGD)        |
| moe         | tokens x d x experts x hidden           | top-1 mixture of experts (GShard-style      |
|             |                                         | dense dispatch, capacity 2 tokens/experts), |
|             |                                         | training step (grad + SGD)                  |
| matmul      | m x k x n                               | ``tanh(x @ w)`` (the thesis' matmul)        |
| attention   | batch x seq x heads x head_dim          | multi-head attention forward                |
| lm, lm_scan | batch x seq x d x heads x layers x vocab| flax nnx decoder LM training step (adamw,  |
|             |                                         | integer labels); lm_scan: layers scanned    |
| convnet     | batch x image size x channels x layers  | 3x3 "SAME" ReLU convolutions on NHWC images |
|             |                                         | training step (grad + SGD)                  |
| convpool    | batch x image size x channels x layers  | per layer: 3x3 convolution, ReLU, 3x3       |
|             |                                         | depthwise convolution, 3x3 max pool (stride |
|             |                                         | 1), 2x2 average pool (stride 2); training   |
|             |                                         | step (grad + SGD)                           |

Example:
    >>> fn, args = workload("mlp", [64, 16, 2], np.random.default_rng(0))   # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def parse_workload(text: str) -> tuple[str, str, list[int]]:
    """``"name=kind:4x64x2"`` -> ``("name", "kind", [4, 64, 2])``."""
    name, _, rest = text.strip().partition("=")
    kind, _, sizes = rest.partition(":")
    if not name or not kind or not sizes:
        raise ValueError(f"a workload looks like 'mlp_big=mlp:1024x64x2', got {text!r}")
    return name, kind, [int(n) for n in sizes.split("x")]


_SIZES = {"mlp": 3, "transformer": 5, "moe": 4, "matmul": 3, "attention": 4, "lm": 6, "lm_scan": 6,
          "convnet": 4, "convpool": 4}  # fmt: skip
_LAYERS_AT = {
    "mlp": 2,
    "transformer": 4,
    "lm": 4,
    "lm_scan": 4,
    "convnet": 3,
    "convpool": 3,
}  # where the depth goes


def with_depth(kind: str, sizes: list[int], depth: int) -> list[int]:
    """The sizes of ``kind`` without its number of layers, with ``depth`` put in its place.

    Example:
        >>> with_depth("lm", [8, 16, 32, 4, 64], 2)
        [8, 16, 32, 4, 2, 64]
    """
    if kind not in _LAYERS_AT:
        raise ValueError(
            f"workload {kind!r} has no layers; those with layers: {sorted(_LAYERS_AT)}"
        )
    k = _LAYERS_AT[kind]
    return [*sizes[:k], depth, *sizes[k:]]


def _sgd(loss):
    import jax

    def step(params, *batch):
        grads = jax.grad(loss)(params, *batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def _attention(x, wq, wk, wv, wo):
    import jax
    import jax.numpy as jnp

    e = wq.shape[-1]
    q = jnp.einsum("bsd,dhe->bshe", x, wq)
    k = jnp.einsum("bsd,dhe->bshe", x, wk)
    v = jnp.einsum("bsd,dhe->bshe", x, wv)
    p = jax.nn.softmax(jnp.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(e), axis=-1)
    return jnp.einsum("bqhe,hed->bqd", jnp.einsum("bhqk,bkhe->bqhe", p, v), wo)


def _rms_norm(x):
    import jax.numpy as jnp

    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _convpool_loss(kernels, x, y):
    """Per layer: convolution, ReLU, depthwise convolution, max pool, average pool (halving)."""
    import jax
    import jax.numpy as jnp

    dn = ("NHWC", "HWIO", "NHWC")
    for k, depthwise in kernels:
        x = jax.nn.relu(jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn))
        x = jax.lax.conv_general_dilated(x, depthwise, (1, 1), "SAME", dimension_numbers=dn,
                                         feature_group_count=x.shape[-1])  # fmt: skip
        x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
        x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
    return jnp.mean((x - y) ** 2)


def _moe_loss(params, x, y):
    """Top-1 routing with capacity ``2 t / e`` per expert; dispatch and combine are dense one-hot
    tensors (tokens x experts x slots), so every step is an einsum the planner can split."""
    import jax
    import jax.numpy as jnp

    t, e = x.shape[0], params["wg"].shape[1]
    capacity = 2 * t // e
    logits = x @ params["wg"]
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), e, dtype=x.dtype)
    position = jnp.cumsum(onehot, axis=0) * onehot - 1.0
    keep = onehot * (position < capacity)
    slot = jnp.sum(position * keep, axis=-1).astype(jnp.int32)
    dispatch = jax.lax.stop_gradient(
        keep[:, :, None] * jax.nn.one_hot(slot, capacity, dtype=x.dtype)[:, None, :]
    )
    gate = jnp.sum(jax.nn.softmax(logits, axis=-1) * keep, axis=-1)
    expert_in = jnp.einsum("tec,td->ecd", dispatch, x)
    h = jax.nn.relu(jnp.einsum("ecd,edh->ech", expert_in, params["w1"]))
    expert_out = jnp.einsum("ech,ehd->ecd", h, params["w2"])
    y_hat = jnp.einsum("tec,ecd->td", dispatch * gate[:, None, None], expert_out)
    return jnp.mean((y_hat - y) ** 2)


def workload(kind: str, sizes: list[int], rng, shapes_only: bool = False):
    """``(fn, args)`` of a workload (see the table above); weights scaled by 1/sqrt(fan-in);
    ``shapes_only``: the arguments as ``jax.ShapeDtypeStruct``s, nothing drawn from ``rng``
    (to plan or compile a workload at full size without making its arrays).

    Example:
        >>> fn, args = workload("matmul", [8192, 8192, 8192], rng, shapes_only=True)  # doctest: +SKIP
    """
    import jax
    import numpy as np

    if kind not in _SIZES:
        raise ValueError(f"unknown workload kind {kind!r}; expected one of {sorted(_SIZES)}")
    if len(sizes) != _SIZES[kind]:
        raise ValueError(f"workload {kind!r} takes {_SIZES[kind]} sizes, got {sizes}")
    if kind in ("lm", "lm_scan"):
        from experiments.language_model import lm_step

        return lm_step(*sizes, scan=kind == "lm_scan", rng=rng, shapes_only=shapes_only)
    if not shapes_only:
        return _workload(
            kind, sizes, lambda *s: (rng.standard_normal(s) / math.sqrt(s[0])).astype(np.float32)
        )
    # zeros of no memory (every stride 0): reshaped and scaled as the drawn arrays are
    fn, args = _workload(kind, sizes, lambda *s: np.broadcast_to(np.float32(0), s))
    return fn, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)


def _workload(kind: str, sizes: list[int], r: Callable[..., Any]):
    """``(fn, args)`` of :func:`workload`, each array of shape ``s`` made by ``r(*s)``."""
    import jax
    import jax.numpy as jnp

    if kind == "mlp":
        batch, hidden, layers = sizes
        params = [r(hidden, hidden) for _ in range(layers)]

        def loss(ps, x, y):
            for w in ps[:-1]:
                x = jax.nn.relu(x @ w)
            return jnp.mean((x @ ps[-1] - y) ** 2)

        return _sgd(loss), (params, r(batch, hidden), r(batch, hidden))
    if kind == "transformer":
        b, s, h, e, layers = sizes
        d = h * e
        params = [
            {"wq": r(d, h, e), "wk": r(d, h, e), "wv": r(d, h, e), "wo": r(h, e, d),
             "w1": r(d, 4 * d), "w2": r(4 * d, d)}
            for _ in range(layers)
        ]  # fmt: skip

        def loss(ps, x, y):
            for p in ps:
                x = x + _attention(_rms_norm(x), p["wq"], p["wk"], p["wv"], p["wo"])
                x = x + jax.nn.relu(_rms_norm(x) @ p["w1"]) @ p["w2"]
            return jnp.mean((x - y) ** 2)

        return _sgd(loss), (params, r(b, s, d), r(b, s, d))
    if kind == "moe":
        t, d, e, h = sizes
        params = {
            "wg": r(d, e),
            "w1": r(e, d, h) * math.sqrt(e / d),
            "w2": r(e, h, d) * math.sqrt(e / h),
        }
        return _sgd(_moe_loss), (params, r(t, d), r(t, d))
    if kind == "convnet":
        b, size, c, layers = sizes
        kernels = [r(3 * 3 * c, c).reshape(3, 3, c, c) for _ in range(layers)]

        def loss(ks, x, y):
            for k in ks:
                x = jax.nn.relu(jax.lax.conv_general_dilated(
                    x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))  # fmt: skip
            return jnp.mean((x - y) ** 2)

        return _sgd(loss), (kernels, r(b, size, size, c), r(b, size, size, c))
    if kind == "convpool":
        b, size, c, layers = sizes
        kernels = [(r(3 * 3 * c, c).reshape(3, 3, c, c), r(3 * 3, c).reshape(3, 3, 1, c) / 3)
                   for _ in range(layers)]  # fmt: skip
        small = size >> layers
        return _sgd(_convpool_loss), (kernels, r(b, size, size, c), r(b, small, small, c))
    if kind == "matmul":
        m, k, n = sizes
        return (lambda x, w: jnp.tanh(x @ w)), (r(m, k), r(k, n))
    b, s, h, e = sizes
    d = h * e
    return _attention, (r(b, s, d), r(d, h, e), r(d, h, e), r(d, h, e), r(h, e, d))
