"""A scan run as a GPipe pipeline over its stage axis, its state explicit: what is fixed for the
whole pipeline is a :class:`PipelinedScan`'s fields (made once from the region and the schedule),
what a device's stage holds is a :class:`Stage`, and what passes from tick to tick is the scan's
carry (the carries handed on, the looped-back carries of a circular pipeline, the stacked
outputs' buffers and the last stage's results).

Stage ``s`` of the stage axis runs layers ``[s L/P, (s+1) L/P)`` on microbatch ``t - s`` at tick
``t`` and hands its carry to stage ``s + 1`` (``s - 1`` for a reversed scan, such as the backward
pass of a pipelined forward one) with ``ppermute``; stacked outputs are kept per stage (split over
the stage axis), weight gradients summed over microbatches. A circular pipeline (``repeats``
``R > 1``) puts the stacked inputs in circular order (:func:`to_circular`), runs ``R K + P - 1``
ticks, item ``i = t - s`` being microbatch ``i mod K`` in round ``i // K`` on the stage's chunk of
that round, hands the carry round a ring (the first stage keeps what comes back for the next
round) and puts the stacked outputs back in layer order (:func:`from_circular`).

Example:
    >>> PipelinedScan(walker, region, env, inside).run(env)   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from planner.layout.staging import circular_rounds
from planner.lowering.gpipe import (
    from_circular,
    get_microbatch,
    merge_microbatches,
    microbatch_buffer,
    put_layer,
    put_microbatch,
    take_microbatch,
    to_circular,
)
from planner.program.jaxpr_params import scan_split
from planner.program.microbatch import microbatching
from planner.program.ops import Region
from planner.program.schedule import stage_factors


@dataclasses.dataclass(frozen=True)
class Micro:
    """The state of a walk inside a pipelined scan's body, on one microbatch: each value's shape
    there (``shapes``), the stage axis' factors (``axes``: the body's moves stay within one
    stage's devices), and, under XLA, the values holding each device's partial sums on a leading
    axis of their own, by the axes they are partial over (``parts``, filled as the body runs)."""

    shapes: Mapping[str, tuple[int, ...]]
    axes: tuple[str, ...]
    parts: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Stage:
    """A device's stage: its index ``s`` on the stage axis, its position in the pipeline's
    direction (``pos``), and the scan's constants, initial carry and this stage's stacked layers
    (in circular order for a circular pipeline)."""

    s: object  # an int, or a traced index
    pos: object
    consts: list
    carry: list
    xs: list


class PipelinedScan:
    """Scan region ``r`` of ``walker``'s program, run as a pipeline (see the module's docs);
    ``env`` holds the values it enters with, ``inside`` the regions around it."""

    def __init__(self, walker, r: Region, env, inside):
        self.walker, self.r, self.inside = walker, r, inside
        prog, sizes = walker.prog, walker.sizes
        st, p = walker.stages[r.start], r.eqn.params
        split = scan_split(r.eqn)
        self.reverse = p["reverse"]
        self.nc, self.nk = split.consts, split.carry
        self.axes = axes = stage_factors(st.axis, sizes)
        self.stages, self.k_mb = math.prod(sizes[a] for a in axes), st.microbatches
        self.mb = mb = microbatching(prog, r)
        walker._check_stages(r, st, axes, mb)
        self.later = later = {e: axes for e, (_, axes) in walker.later.items()}
        self.entered, self.exits = walker._enter(r, env), walker._exits(r)
        self.n_ys = len(self.exits) - self.nk
        self.exit_ops = prog.ops[r.stop - self.n_ys : r.stop]
        # stacked output -> axes its partial sums are over (under XLA)
        self.parted = {} if walker.holds_tiles else {
            k: later[e.name] for k, e in enumerate(self.exit_ops) if e.name in later
        }  # fmt: skip
        self.shapes = {
            v.value.name: mb.shape(v.value.name, v.value.shape, self.k_mb)
            for o in prog.ops[r.start : r.stop]
            for v in (*o.operands, *o.results)
        }
        self.consts_env = {v.name: c for v, c in prog.consts}
        self.dims = [mb.dim.get(n) for n in self.entered]
        self.rows = [mb.per_row.get(n, 1) for n in self.entered]
        self.per = p["length"] // self.stages
        self.reps = st.repeats
        self.chunk, self.items = self.per // self.reps, self.reps * self.k_mb
        self.rounds = circular_rounds(self.stages, self.reps)
        passes = walker.passes  # stacked values that stay in circular order between pipelines
        self.ordered_in = [o.operands[0].value.name in passes for o in prog.ops[r.start : r.body]]
        self.ordered_out = [e.results[0].value.name in passes for e in self.exit_ops]

    def run(self, env) -> None:
        """Run the pipeline on ``env``'s entered values; write its results into ``env``."""
        walker, nc, nk = self.walker, self.nc, self.nk
        values = [env[n] for n in self.entered]
        if walker.holds_tiles:  # inside the program's shard_map, stacked tiles are the layers
            carry_out, ys = self.run_stage(values, self.stage_index())
        else:  # the stage index enters as data: axis_index in a shard_map manual over some
            split = PartitionSpec(self.axes)  # axes lowers on the mesh set_mesh sets (jax 0.10)
            specs = [PartitionSpec()] * (nc + nk) + [split] * (len(values) - nc - nk + 1)
            carry_out, ys = jax.shard_map(
                lambda *v: self.run_stage(list(v[:-1]), v[-1][0]), mesh=walker.mesh,
                in_specs=tuple(specs), out_specs=([PartitionSpec()] * nk, [split] * self.n_ys),
                axis_names=set(self.axes), check_vma=False,
            )(*values, jnp.arange(self.stages, dtype=jnp.int32))  # fmt: skip
        env.update(zip(self.exits, [*carry_out, *ys]))

    def stage_index(self):
        """This device's index on the stage axis (inside a ``shard_map``)."""
        index = 0
        for a in self.axes:
            index = index * self.walker.sizes[a] + lax.axis_index(a)
        return index

    def exit_dim(self, k: int) -> int | None:
        """The batch dimension of stacked output ``k`` (layer axis first)."""
        d = self.mb.dim.get(self.exit_ops[k].operands[0].value.name)
        return None if d is None else d + 1

    def exit_rows(self, k: int) -> int:
        return self.mb.per_row.get(self.exit_ops[k].operands[0].value.name, 1)

    def run_stage(self, values: list, s) -> tuple[list, list]:
        """This device's stage ``s`` on every tick; ``values`` as entered, the stacked ones
        holding this stage's layers. Returns the final carry and the stacked outputs."""
        nc, nk, reps, axes = self.nc, self.nk, self.reps, self.axes
        xs = values[nc + nk :]
        if reps > 1:  # this stage's chunk of each round, in order
            xs = [x if done else to_circular(x, 0, s, axes, self.rounds, reps)
                  for x, done in zip(xs, self.ordered_in[nc + nk :])]  # fmt: skip
        pos = self.stages - 1 - s if self.reverse else s
        stage = Stage(s, pos, values[:nc], values[nc : nc + nk], xs)
        handed0 = [jnp.zeros_like(take_microbatch(x, 0, 1, self.k_mb, 0)) for x in stage.carry]
        outs0 = [microbatch_buffer(x.shape, x.dtype, 0, 1, self.k_mb) for x in stage.carry]
        looped0 = outs0 if reps > 1 else []
        (_, _, bufs, outs), _ = lax.scan(
            functools.partial(self.tick, stage),
            (handed0, looped0, self.buffers(), outs0),
            jnp.arange(self.items + self.stages - 1),
        )
        carry_out = [lax.psum(merge_microbatches(o, 0), axes) for o in outs]
        ys_out = [merge_microbatches(b, self.exit_dim(k)) if self.mb.exits[k] == "batch" else b
                  for k, b in enumerate(bufs)]  # fmt: skip
        for k, e in enumerate(self.exit_ops):
            if k in self.parted:  # the microbatches' partial sums, combined once (by XLA)
                ys_out[k] = jnp.sum(ys_out[k], axis=0)
            elif e.name in self.later:  # the same on this device's tiles
                ys_out[k] = lax.psum(ys_out[k], self.later[e.name])
            if reps > 1 and not self.ordered_out[k]:
                ys_out[k] = from_circular(ys_out[k], 0, s, axes, self.rounds, reps)
        return carry_out, ys_out

    def buffers(self) -> list:
        """The stacked outputs' buffers a stage fills, one layer slot per local layer."""
        walker, out = self.walker, []
        for k, e in enumerate(self.exit_ops):
            v = e.results[0].value
            local = (self.per, *walker._tile(v.shape[1:], e))
            if self.mb.exits[k] == "batch":
                out.append(microbatch_buffer(local, v.dtype, self.exit_dim(k), self.exit_rows(k),
                                             self.k_mb))  # fmt: skip
            elif k in self.parted:  # each device's partial sums, on a leading axis of parts
                parts = math.prod(walker.sizes[a] for a in self.parted[k])
                out.append(walker.constrain(jnp.zeros((parts, *local), v.dtype),
                                            (self.parted[k],), None))  # fmt: skip
            else:
                out.append(jnp.zeros(local, v.dtype))
        return out

    def tick(self, stage: Stage, state, t):
        """One tick of ``stage``: the item in front of it through its layers, the carry handed
        on. ``state``: the carries handed to it, the looped-back carries, the buffers, the
        results."""
        handed, looped, bufs, outs = state
        k_mb, items, stages, pos, reverse = (
            self.k_mb,
            self.items,
            self.stages,
            stage.pos,
            self.reverse,
        )
        i = t - pos  # the item in front of this stage: microbatch i % K, round i // K
        valid = (i >= 0) & (i < items)
        rnd, mc = jnp.clip(i, 0, items - 1) // k_mb, jnp.clip(i, 0, items - 1) % k_mb
        micro_of = functools.partial(self.microbatch_of, mc=mc)
        fresh = [micro_of(x, 0, 1) for x in stage.carry]
        if self.reps > 1:  # the first stage keeps what the last hands back for its next round
            back = t - stages  # the item the last stage finished at tick t - 1
            keep = (pos == 0) & (back >= 0) & (back < items - k_mb)
            looped = [put_microbatch(b, h, 0, jnp.maximum(back, 0) % k_mb, where=keep)
                      for b, h in zip(looped, handed)]  # fmt: skip
            fresh = [jnp.where(rnd == 0, f, get_microbatch(b, 0, mc))
                     for f, b in zip(fresh, looped)]  # fmt: skip
        inp = [jnp.where(pos == 0, f, h) for f, h in zip(fresh, handed)]
        consts = [micro_of(x, d, n)
                  for x, d, n in zip(stage.consts, self.dims[: self.nc], self.rows[: self.nc])]  # fmt: skip
        first = (self.reps - 1 - rnd if reverse else rnd) * self.chunk  # its chunk's layers
        final, bufs = self.layers(stage, inp, consts, bufs, mc, valid, first)
        last = valid & (pos == stages - 1) & (rnd == self.reps - 1)
        outs = [put_microbatch(o, f, 0, mc, where=last) for o, f in zip(outs, final)]
        pairs = [(i + 1, i) if reverse else (i, i + 1) for i in range(stages - 1)]
        if self.reps > 1:  # round the ring
            pairs.append((0, stages - 1) if reverse else (stages - 1, 0))
        handed = [lax.ppermute(f, self.axes, pairs) for f in final]
        return (handed, looped, bufs, outs), None

    def microbatch_of(self, x, d: int | None, n: int, mc):
        """Microbatch ``mc`` of ``x`` (batch dimension ``d``, ``n`` rows per example)."""
        return x if d is None else take_microbatch(x, d, n, self.k_mb, mc)

    def layers(self, stage: Stage, carry, consts, bufs, mc, valid, first):
        """The stage's layers on microbatch ``mc``: each layer's stacked inputs taken, and its
        stacked outputs written into their slots of the pipeline's buffers, as it runs (in place;
        stacking a tick's outputs first would hold them twice)."""
        nc, nk, mb, entered = self.nc, self.nk, self.mb, self.entered
        micro = Micro(self.shapes, self.axes)

        def body(state, layer):
            c, bs = state
            x = [self.microbatch_of(lax.dynamic_index_in_dim(x, layer, 0, keepdims=False), d, n, mc)
                 for x, d, n in zip(stage.xs, self.dims[nc + nk :], self.rows[nc + nk :])]  # fmt: skip
            bound = {**dict(zip(entered[:nc], consts)),
                     **dict(zip(entered[nc : nc + nk], c)),
                     **dict(zip(entered[nc + nk :], x))}  # fmt: skip
            inner = self.walker._run_inside(self.r.body, self.r.stop, self.consts_env, bound,
                                            self.inside, micro)  # fmt: skip
            ys = [inner[n] for n in self.exits[nk:]]
            bs = [put_microbatch(b, y, self.exit_dim(k), mc, where=valid, layer=layer)
                  if mb.exits[k] == "batch" else
                  jax.vmap(lambda b, y: put_layer(b, y, layer, where=valid, add=True))(b, y)
                  if k in self.parted else
                  put_layer(b, y, layer, where=valid, add=mb.exits[k] == "sum")
                  for k, (b, y) in enumerate(zip(bs, ys))]  # fmt: skip
            return ([inner[n] for n in self.exits[:nk]], bs), None

        (final, bufs), _ = lax.scan(body, (carry, bufs), first + jnp.arange(self.chunk),
                                    reverse=self.reverse)  # fmt: skip
        return final, bufs
