"""Small programs, one per construct, and random valid schedules: the planner's differential oracle;
and the programs (with their arguments) that several planner test modules share.

``random_schedule`` draws an assignment for *every* op of a program, built generically from the IR
(no knowledge of primitives): each prime factor of the mesh goes to a random loop the op allows
(or to none), as :func:`planner.program.schedule.check_assignment` validates it. Every schedule it
draws is one the planner could produce, so lowering it must reproduce the unsharded program.

Example:
    >>> fn, make = PROGRAMS["max_of_product"]           # doctest: +SKIP
    >>> assign = random_schedule(planner.analyze(fn, *make(rng)), {"a": 2, "b": 3}, random.Random(0))
"""

from __future__ import annotations

import random
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from planner.program.ir import Program
from planner.program.schedule import check_assignment
from redist.types import MeshShape


def random_schedule(
    prog: Program, mesh: dict[str, int], rng: random.Random, xla: bool = False
) -> dict:
    """A random valid assignment (op -> loop -> factors) for every op of ``prog``; with
    ``xla``, loops may be split into parts that do not divide them (as the search may)."""
    shape = MeshShape.of(mesh)
    out = {}
    for op in prog.ops:
        loops: dict[str, tuple[str, ...]] = {}
        factors = list(shape.factor_names)
        rng.shuffle(factors)
        for f in factors:
            options = [None, *(lp.name for lp in op.loops if lp.partitionable)]
            rng.shuffle(options)
            for loop in options:
                if loop is None:
                    break
                trial = {**loops, loop: loops.get(loop, ()) + (f,)}
                try:
                    check_assignment(shape, op, trial, xla)
                except ValueError:
                    continue
                loops = trial
                break
        out[op.name] = loops
    return out


def _f(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _i(rng, high, *shape):
    return rng.integers(0, high, shape).astype(np.int32)


def _layers(x, ws):
    return lax.scan(lambda c, w: (jnp.tanh(c @ w), jnp.max(c, axis=1)), x, ws)


def _attention(x, wq, wk):
    q, k = x @ wq, x @ wk
    s = jnp.einsum("bqd,bkd->bqk", q, k) / 4.0
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    return jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1) @ x


def _mlp_step(ws, x, y):
    def loss(ws):
        h = jax.nn.relu(x @ ws[0])
        return jnp.mean((h @ ws[1] - y) ** 2)

    return jax.tree.map(lambda w, g: w - 0.1 * g, ws, jax.grad(loss)(ws))


def _xent(z, y):
    z = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)
    return -jnp.mean(jnp.take_along_axis(z, y[:, None], axis=-1))


@jax.custom_vjp
def _doubled(x):
    return 2.0 * x


_doubled.defvjp(lambda x: (2.0 * x, None), lambda _, g: (2.0 * g,))


def _constrained(x, w):
    """What MaxText, flax and Keras put in their models: layouts asked for with
    ``with_sharding_constraint`` (on a mesh of its own: the plan's layouts replace it), names for
    remat policies, an optimization barrier, and the gradient of a ``stack`` (``unstack``)."""
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("a",))
    policy = jax.checkpoint_policies.save_only_these_names("hidden")

    def layer(x):
        h = lax.with_sharding_constraint(x @ w, NamedSharding(mesh, PartitionSpec("a", None)))
        return jnp.tanh(checkpoint_name(h, "hidden"))

    def loss(x):
        y, z = lax.optimization_barrier((jax.checkpoint(layer, policy=policy)(x), x))
        a, b = jnp.split(y, 2, axis=1)
        return jnp.sum(jnp.stack([a, b]) ** 2) + jnp.sum(z)

    return jax.value_and_grad(loss)(x)


def _convpool(k, dw, x):
    """A convolution, a depthwise one, a 3x3 max pool and a 2x2 average pool, squared."""
    dn = ("NHWC", "HWIO", "NHWC")
    y = jax.nn.relu(lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn))
    y = lax.conv_general_dilated(y, dw, (1, 1), "SAME", dimension_numbers=dn,
                                 feature_group_count=y.shape[-1])  # fmt: skip
    y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
    return jnp.sum(lax.reduce_window(y, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") ** 2)


Make = Callable[[np.random.Generator], tuple]
PROGRAMS: dict[str, tuple[Callable, Make]] = {
    "matmul_tanh": (lambda x, w: jnp.tanh(x @ w), lambda r: (_f(r, 12, 24), _f(r, 24, 12))),
    "max_of_product": (lambda x, w: jnp.max(jnp.tanh(x @ w), axis=1),
                       lambda r: (_f(r, 12, 24), _f(r, 24, 24))),
    "min_prod_argmax": (lambda x: (jnp.min(x, 0), jnp.prod(x, 1), jnp.argmax(x, 1), jnp.argmin(x, 0)),
                        lambda r: (_f(r, 12, 12),)),
    "any_all": (lambda x: (jnp.any(x > 1.0, axis=1), jnp.all(x > -1.0, axis=0)),
                lambda r: (_f(r, 12, 24),)),
    "int_sum_max": (lambda x: (jnp.sum(x, axis=1), jnp.max(x * 3, axis=0)),
                    lambda r: (_i(r, 9, 12, 24),)),
    "softmax_mean_lse": (lambda x: (jax.nn.softmax(x, -1), jnp.mean(x, 0), jax.nn.logsumexp(x, 1)),
                         lambda r: (_f(r, 12, 24),)),
    "broadcast_transpose_reshape": (lambda x, b: (x + b).T.reshape(6, 2, 24).sum(1).reshape(12, 12),
                                    lambda r: (_f(r, 24, 12), _f(r, 12))),
    "concatenate_split_slice": (lambda x: jnp.concatenate(jnp.split(x, 3, axis=1)[::-1], 0)[2:20],
                                lambda r: (_f(r, 12, 36),)),
    "embedding": (lambda e, i: jnp.take(e, i, axis=0) * 2.0,
                  lambda r: (_f(r, 30, 12), _i(r, 30, 12, 6))),
    "embedding_grad": (jax.grad(lambda e, i: jnp.sum(jnp.take(e, i, axis=0) ** 2)),
                       lambda r: (_f(r, 30, 12), _i(r, 30, 12, 6))),
    "scatter_add_onto_values": (lambda t, i, u: t.at[i].add(u),  # the operand must be added once
                                lambda r: (_f(r, 30, 12), _i(r, 30, 24), _f(r, 24, 12))),
    "cross_entropy_and_grad": (lambda z, y: (_xent(z, y), jax.grad(_xent)(z, y)),
                               lambda r: (_f(r, 12, 24), _i(r, 24, 12))),
    "pad_cumsum_flip_sort_topk": (
        lambda x: (jnp.pad(x, ((0, 0), (1, 2))), jnp.cumsum(x, 1), jnp.flip(x, 1),
                   jnp.sort(x, 1), lax.top_k(x, 3)[1]),
        lambda r: (_f(r, 12, 12),)),
    "dynamic_slices": (lambda x, i: (lax.dynamic_slice_in_dim(x, i, 4, 1),
                                     lax.dynamic_update_slice_in_dim(x, -x[:, :4], i, 1)),
                       lambda r: (_f(r, 12, 12), np.int32(3))),
    "iota_where_clip": (lambda x: jnp.clip(jnp.where(x > 0, x, jnp.arange(12.0)), -0.5, 0.5),
                        lambda r: (_f(r, 24, 12),)),
    "bool_and_int_inputs": (lambda m, n, x: jnp.where(m, x * n, -x).sum(0),
                            lambda r: (_f(r, 12, 12) > 0, _i(r, 5, 12, 12), _f(r, 12, 12))),
    "nested_jit_literals": (lambda x: jax.jit(lambda y, s: (y * s, 2.0))(x, 3.0),
                            lambda r: (_f(r, 12, 12),)),
    "custom_rules": (lambda x: jax.nn.relu(_doubled(x)) @ x.T, lambda r: (_f(r, 12, 24),)),
    "checkpoint_grad": (jax.grad(lambda x: jnp.sum(jax.checkpoint(lambda y: jnp.sin(y) @ y.T)(x))),
                        lambda r: (_f(r, 12, 12),)),
    "dropout": (lambda k, x: jnp.where(jax.random.bernoulli(k, 0.5, x.shape), x / 0.5, 0.0),
                lambda r: (jax.random.key(int(r.integers(99))), _f(r, 12, 24))),
    "dropout_raw_key": (lambda k, x: x * jax.random.uniform(k, x.shape),
                        lambda r: (jax.random.PRNGKey(int(r.integers(99))), _f(r, 12, 24))),
    "scan_layers": (_layers, lambda r: (_f(r, 12, 24), _f(r, 3, 24, 24) / 4)),
    "scan_layers_grad": (jax.grad(lambda ws, x: jnp.sum(_layers(x, ws)[0] ** 2)),
                         lambda r: (_f(r, 3, 24, 24) / 4, _f(r, 12, 24))),
    "fori_static_and_traced": (
        lambda x, w, n: (lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c @ w), x),
                         lax.fori_loop(0, n, lambda i, c: c * 0.5 + 1.0, x)),
        lambda r: (_f(r, 12, 24), _f(r, 24, 24) / 4, np.int32(3))),
    "cond": (lambda p, x, w: lax.cond(p, lambda x: jnp.tanh(x @ w), lambda x: x + 1.0, x),
             lambda r: (np.bool_(r.integers(2)), _f(r, 12, 24), _f(r, 24, 24))),
    "mlp_training_step": (_mlp_step, lambda r: ([_f(r, 24, 12), _f(r, 12, 24)], _f(r, 12, 24),
                                                _f(r, 12, 24))),
    "causal_attention": (_attention, lambda r: (_f(r, 2, 12, 24), _f(r, 24, 24), _f(r, 24, 24))),
    "constrained_grad": (_constrained, lambda r: (_f(r, 12, 24), _f(r, 24, 24) / 4)),
    "convpool_grad": (jax.value_and_grad(_convpool, argnums=(0, 1, 2)),
                      lambda r: (_f(r, 3, 3, 4, 6) / 3, _f(r, 3, 3, 1, 6) / 3, _f(r, 2, 12, 12, 4))),
}  # fmt: skip


# Programs several test modules share: a matmul, multi-head attention, an MLP training step, a
# two-layer chain and scanned residual MLP layers, with the arrays they are tested on.

ALL = ("a", "b", "c")
"""The axis names of the tests' 2x2x2 mesh: ``{"m": ALL}`` splits a loop over all 8 devices."""

RNG = np.random.default_rng(0)
"""The generator behind :func:`rand`: one for every module that calls it, seeded once."""


def rand(*shape):
    """A standard-normal float32 array of ``shape``, drawn from :data:`RNG`."""
    return RNG.standard_normal(shape).astype(np.float32)


def dots(prog: Program) -> list[str]:
    """The names of ``prog``'s ``dot_general`` ops, in program order."""
    return [o.name for o in prog.ops if o.primitive == "dot_general"]


def matmul(x, w):
    """``tanh(x @ w)``: one product whose loops are ``m``, ``n`` and ``k``."""
    return jnp.tanh(x @ w)


def attention(x, wq, wk, wv, wo):
    """Multi-head attention: q, k and v projections, softmax of the scores, output projection."""
    q = jnp.einsum("bsd,dhe->bshe", x, wq)
    k = jnp.einsum("bsd,dhe->bshe", x, wk)
    v = jnp.einsum("bsd,dhe->bshe", x, wv)
    p = jax.nn.softmax(jnp.einsum("bqhe,bkhe->bhqk", q, k) / 2.0, axis=-1)
    o = jnp.einsum("bhqk,bkhe->bqhe", p, v)
    return jnp.einsum("bqhe,hed->bqd", o, wo)


def mlp_loss(params, x, y):
    """A two-layer ReLU MLP's squared error."""
    w1, w2 = params
    h = jax.nn.relu(x @ w1)
    return jnp.mean((h @ w2 - y) ** 2)


def sgd_step(params, x, y):
    """One SGD step (learning rate 0.1) of :func:`mlp_loss`."""
    grads = jax.grad(mlp_loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def mlp_args():
    """``(params, x, y)`` for :func:`sgd_step`: weights 16x32 and 32x8, a batch of 64."""
    return (rand(16, 32), rand(32, 8)), rand(64, 16), rand(64, 8)


def chain(x, w1, w2):
    """Two products in a chain, ``tanh(x @ w1) @ w2``: small enough to search exhaustively."""
    return jnp.tanh(x @ w1) @ w2


def residual_layers_loss(ws, x, y):
    """Four scanned residual MLP layers and a squared error."""

    def layer(h, w):
        return jnp.tanh(h @ w[0] + w[2]) @ w[1] + h, None

    h, _ = lax.scan(layer, x, ws)
    return jnp.mean((h - y) ** 2)


def residual_layers_args(seed=0, layers=4, batch=16, d=8, hidden=16):
    """``(ws, x, y)`` for :func:`residual_layers_loss`, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    f = np.float32
    ws = ((rng.standard_normal((layers, d, hidden)) / np.sqrt(d)).astype(f),
          (rng.standard_normal((layers, hidden, d)) / np.sqrt(hidden)).astype(f),
          rng.standard_normal((layers, hidden)).astype(f))  # fmt: skip
    return ws, rng.standard_normal((batch, d)).astype(f), rng.standard_normal((batch, d)).astype(f)
