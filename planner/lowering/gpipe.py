"""Pipeline parallelism for a stack of layers run with ``lax.scan``: GPipe, in SPMD.

The layers are cut into ``P`` stages of consecutive layers, stage ``s`` held by the devices at
position ``s`` of a mesh axis (its stacked weights split over that axis along the layer
dimension, as MaxText's pipeline does), and the batch into ``K`` microbatches. At tick ``t``
every stage runs its layers on the microbatch in front of it (stage ``s`` on microbatch
``t - s``) and hands the result to the next stage with ``ppermute``; after ``K + P - 1`` ticks the
last stage has every microbatch's output. The gradient is the same schedule run backwards
(``jax.grad`` of it: the transpose of a ``ppermute`` sends back), so a training step under
``jax.grad`` is GPipe: all forward ticks, then all backward ones, the bubble being the
``(P - 1) / (K + P - 1)`` of the ticks where a stage has no microbatch
(:func:`planner.cost.pipeline.bubble`).

Example:
    >>> def layer(h, w):                       # one layer: carry in, carry out
    ...     return jnp.tanh(h @ w)
    >>> run = gpipe(layer, mesh, "stage", microbatches=4)            # doctest: +SKIP
    >>> out = run(h, ws)     # == lax.scan(lambda h, w: (layer(h, w), None), h, ws)[0]
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


def take_microbatch(x, dim: int, per_row: int, microbatches: int, m):
    """Microbatch ``m`` of ``x`` along dimension ``dim``: the batch rows ``b`` with
    ``b % microbatches == m`` (``per_row`` elements each; more than one where the batch is the
    major part of a merged dimension). Interleaved rows keep every device's microbatch inside
    its own tile under any block split of the batch whose tiles hold a multiple of
    ``microbatches`` rows.

    Example:
        >>> take_microbatch(jnp.arange(6), 0, 1, 2, 1)              # doctest: +SKIP
        Array([1, 3, 5], dtype=int32)
    """
    n = x.shape[dim]
    rows = n // per_row
    y = x.reshape(*x.shape[:dim], rows // microbatches, microbatches, per_row, *x.shape[dim + 1 :])
    y = lax.dynamic_index_in_dim(y, m, dim + 1, keepdims=False)
    return y.reshape(*x.shape[:dim], n // microbatches, *x.shape[dim + 1 :])


def microbatch_buffer(shape, dtype, dim: int, per_row: int, microbatches: int):
    """Zeros to collect ``microbatches`` microbatches of an array of ``shape`` into with
    :func:`put_microbatch` (batch dimension ``dim`` kept split; :func:`merge_microbatches`
    gives the array back)."""
    rows = shape[dim] // per_row
    return jnp.zeros(
        (*shape[:dim], rows // microbatches, microbatches, per_row, *shape[dim + 1 :]), dtype
    )


def put_microbatch(buffer, x, dim: int, m, where=None, layer=None):
    """``buffer`` with microbatch ``m`` (an array shaped like :func:`take_microbatch`'s) in;
    given ``layer``, into that index of the buffer's leading (layer) dimension, which ``x``
    lacks (``dim`` counts the buffer's dimensions); given ``where`` (a boolean scalar), only
    where it holds. One slot is updated, which the compiler does in place."""
    lead = () if layer is None else (1,)
    rows, per_row, d = buffer.shape[dim], buffer.shape[dim + 2], dim - len(lead)
    x = x.reshape(*lead, *x.shape[:d], rows, 1, per_row, *x.shape[d + 1 :]).astype(buffer.dtype)
    starts = [0] * buffer.ndim
    starts[dim + 1] = m
    if layer is not None:
        starts[0] = layer
    return _put(buffer, x, starts, where)


def put_layer(buffer, x, layer, where=None, add: bool = False):
    """``buffer`` (stacked over layers) with ``x`` at index ``layer``, or added to it (``add``),
    only where ``where`` holds if given; in place, like :func:`put_microbatch`."""
    slot = x.reshape(1, *x.shape).astype(buffer.dtype)
    starts = [layer] + [0] * (buffer.ndim - 1)
    if add:
        slot = slot + lax.dynamic_slice(buffer, starts, slot.shape)
    return _put(buffer, slot, starts, where)


def _put(buffer, slot, starts, where):

    starts = [jnp.asarray(s, jnp.int32) for s in starts]
    if where is not None:
        slot = lax.select(jnp.broadcast_to(where, slot.shape), slot,
                          lax.dynamic_slice(buffer, starts, slot.shape))  # fmt: skip
    return lax.dynamic_update_slice(buffer, slot, starts)


def merge_microbatches(buffer, dim: int):
    """The array a :func:`microbatch_buffer` holds."""
    s = buffer.shape
    return buffer.reshape(*s[:dim], s[dim] * s[dim + 1] * s[dim + 2], *s[dim + 3 :])


def get_microbatch(buffer, dim: int, m):
    """Microbatch ``m`` of a :func:`microbatch_buffer` (the array :func:`take_microbatch` took)."""
    y = lax.dynamic_index_in_dim(buffer, m, dim + 1, keepdims=False)
    s = y.shape
    return y.reshape(*s[:dim], s[dim] * s[dim + 1], *s[dim + 2 :])


def to_circular(x, dim: int, stage, axes, rounds, repeats: int):
    """This stage's tile ``x`` of a stacked value split by blocks of layers over mesh ``axes``
    (its layer dimension ``dim``) in circular order: the chunks of layers the stage runs in a
    circular pipeline of ``repeats`` rounds, one per round (``rounds``:
    :func:`planner.layout.staging.circular_rounds`; ``stage``: this device's index along
    ``axes``). One ``ppermute`` per round, each of one chunk.

    Example:
        >>> to_circular(x, 0, s, ("pipe",), circular_rounds(2, 2), 2)   # doctest: +SKIP
    """
    return _reorder(x, dim, stage, axes, rounds, repeats, back=False)


def from_circular(x, dim: int, stage, axes, rounds, repeats: int):
    """The inverse of :func:`to_circular`: a stacked tile in circular order back in blocks of
    layers (what leaves a circular pipeline)."""
    return _reorder(x, dim, stage, axes, rounds, repeats, back=True)


def _reorder(x, dim: int, stage, axes, rounds, repeats: int, back: bool):
    """Round ``(j, k, pairs)`` moves block chunk ``k`` of stage ``s`` to circular slot ``j`` of
    stage ``d`` for each ``(s, d)`` of ``pairs`` (``back``: the other way); each piece received
    is selected where this stage's piece is the one that round carries."""
    stages = max(d for _, _, pairs in rounds for _, d in pairs) + 1
    pieces = _chunks(x, dim, repeats)
    out = []
    for n in range(repeats):
        got = None
        for j, k, pairs in rounds:
            sent, kept = (j, k) if back else (k, j)
            if kept != n:
                continue
            moved = lax.ppermute(pieces[sent], axes, [(d, s) if back else (s, d) for s, d in pairs])
            # this stage's block chunk n was in slot j / its slot n is block chunk k
            mine = (
                (stage * repeats + n) // stages == j
                if back
                else (n * stages + stage) % repeats == k
            )
            got = moved if got is None else jnp.where(mine, moved, got)
        out.append(got)
    return jnp.concatenate(out, axis=dim)


def _chunks(x, dim: int, repeats: int) -> list:
    n = x.shape[dim] // repeats
    return [lax.slice_in_dim(x, k * n, (k + 1) * n, axis=dim) for k in range(repeats)]


def _check(layers: int, batch: int, stages: int, microbatches: int, axis: str) -> None:
    if layers % stages:
        raise ValueError(
            f"{layers} layers do not split into {stages} pipeline stages (mesh axis {axis!r} of "
            f"size {stages}); use an axis whose size divides {layers}"
        )
    if microbatches < 1 or batch % microbatches:
        raise ValueError(
            f"a batch of {batch} does not split into microbatches={microbatches}; choose a "
            f"divisor of {batch}"
        )


def gpipe(layer: Callable, mesh, axis: str, microbatches: int) -> Callable:
    """``run(h, stacked)``: ``lax.scan`` of ``layer(h, one layer's weights) -> h`` over the
    leading (layer) dimension of every leaf of ``stacked``, as a GPipe pipeline over mesh axis
    ``axis`` (its size the number of stages) with ``h``'s leading (batch) dimension cut into
    ``microbatches``. ``h`` and the result are whole on ``axis``; the stacked weights come in
    split over it along their layer dimension (or are moved so). Other mesh axes stay as the
    caller's shardings leave them (the pipeline is manual over ``axis`` only).

    Raises:
        ValueError: the layers do not split into the axis' size of stages, or the batch into
            ``microbatches``.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not a mesh axis; the mesh has {mesh.axis_names}")
    stages = dict(mesh.shape)[axis]

    def run(h, stacked):
        leaves = jax.tree.leaves(stacked)
        if not leaves:
            raise ValueError("stacked has no arrays: nothing to run the layers with")
        layers, batch = leaves[0].shape[0], h.shape[0]
        _check(layers, batch, stages, microbatches, axis)
        per_stage = jax.tree.map(lambda w: w.reshape(stages, layers // stages, *w.shape[1:]),
                                 stacked)  # fmt: skip
        chunk = batch // microbatches

        def stage_body(h, ws):
            ws = jax.tree.map(lambda w: w[0], ws)  # this device's stage
            s = lax.axis_index(axis)
            mbs = h.reshape(microbatches, chunk, *h.shape[1:])

            def run_stage(x):
                return lax.scan(lambda c, w: (layer(c, w), None), x, ws)[0]

            def tick(state, t):
                fresh = lax.dynamic_index_in_dim(mbs, jnp.minimum(t, microbatches - 1), 0, False)
                out = run_stage(jnp.where(s == 0, fresh, state))
                return lax.ppermute(out, axis, [(i, i + 1) for i in range(stages - 1)]), out

            zeros = jnp.zeros((chunk, *h.shape[1:]), h.dtype)
            _, outs = lax.scan(tick, zeros, jnp.arange(microbatches + stages - 1))
            # microbatch k leaves the last stage at tick k + P - 1; only that stage keeps them
            outs = jnp.where(
                s == stages - 1, outs[stages - 1 :], jnp.zeros_like(outs[:microbatches])
            )
            outs = lax.psum(outs, axis)
            return outs.reshape(h.shape)

        specs = jax.tree.map(lambda w: P(axis), per_stage)
        return jax.shard_map(stage_body, mesh=mesh, in_specs=(P(), specs), out_specs=P(),
                             axis_names={axis}, check_vma=False)(h, per_stage)  # fmt: skip

    return run
