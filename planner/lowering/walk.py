"""The walk every explicit lowering shares: a scheduled program's steps in order, each region run
as its construct (``lax.scan``, ``while_loop``, ``switch``, a re-bound call) and a pipelined scan
as GPipe over its stage axis. What a backend does at each op, how it moves a value between
layouts and what it holds a result to, are the hooks a :class:`Walker` subclass fills
(:mod:`planner.lowering.backends`).

Example:
    >>> outs = Explicit(prog, sched, mesh, dataflow(prog, sched)).program(*arrays)  # doctest: +SKIP
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

from planner.layout.dataflow import OpStep
from planner.layout.staging import circular_passes, circular_rounds, deferred_sums
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
from planner.lowering.kernels import bind, spatially_split
from planner.program.ir import Program
from planner.program.jaxpr_params import scan_split, with_body
from planner.program.microbatch import microbatching
from planner.program.ops import Op, Region
from planner.program.schedule import Schedule, Spec, local_shape, stage_factors


@dataclasses.dataclass(frozen=True)
class Micro:
    """The state of a walk inside a pipelined scan's body, on one microbatch: each value's shape
    there (``shapes``), the stage axis' factors (``axes``: the body's moves stay within one
    stage's devices), and, under XLA, the values holding each device's partial sums on a leading
    axis of their own, by the axes they are partial over (``parts``, filled as the body runs)."""

    shapes: Mapping[str, tuple[int, ...]]
    axes: tuple[str, ...]
    parts: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


class Walker:
    """Runs ``prog`` under ``sched`` on ``mesh`` (its axes prime factors), op by op, in a trace:
    :meth:`program` takes the program's inputs and returns its outputs. Subclasses say how an op
    runs (:meth:`run_partitioned`, :meth:`run_microbatched`), how a value moves between layouts
    (:meth:`move`) and what a result is held to (:meth:`settle`)."""

    holds_tiles = False  # values are each device's tiles (inside one shard_map), not whole arrays
    stage_halos = True  # ops splitting a window may run inside a pipeline's stages

    def __init__(self, prog: Program, sched: Schedule, mesh, steps: list[OpStep]):
        self.prog, self.sched, self.mesh, self.steps = prog, sched, mesh, steps
        self.sizes = dict(mesh.shape)
        self.stages = {st.region: st for st in sched.stages}
        # stacked output -> (op, axes): partial sums a pipeline combines once, after its ticks
        self.later = deferred_sums(prog, sched, steps)
        self.deferred = frozenset(op for op, _ in self.later.values())
        self.passes = circular_passes(prog, sched, steps)

    # ----- the hooks -----
    def held(self, op: Op, mv=None) -> bool:
        """Whether ``op``'s layouts (and the layout the move ``mv`` of an operand starts from)
        are the schedule's: everywhere but where backend ``"xla"`` lets XLA propagate."""
        return True

    def move(self, x, mv, micro: Micro | None):
        """``x`` moved as ``mv`` (a :class:`planner.layout.dataflow.Move`) says."""
        raise NotImplementedError(f"{type(self).__name__} does not move values")

    def run_partitioned(self, op: Op, step: OpStep, args: list) -> tuple:
        """``op`` on ``args`` where ``step`` splits its loops."""
        raise NotImplementedError(f"{type(self).__name__} does not run split ops")

    def run_microbatched(self, op: Op, step: OpStep, args: list, micro: Micro) -> tuple:
        """``op`` inside a pipelined body, on one microbatch."""
        raise NotImplementedError(
            f"pipelined scans run under the 'explicit' and 'xla' backends, not {type(self).__name__}"
        )

    def settle(self, op: Op, step: OpStep, outs, micro: Micro | None):
        """``op``'s results as the backend holds them (under XLA: constrained)."""
        return outs

    def returned(self, outs: tuple) -> tuple:
        """The program's outputs as returned."""
        return outs

    def constrain(self, x, spec: Spec, micro: Micro | None):
        """``x`` held to ``spec`` (only where values are whole arrays: backend ``"xla"``)."""
        return x

    # ----- the walk -----
    def program(self, *flat):
        """The program's outputs from its inputs ``flat`` (to trace)."""
        env: dict[str, object] = {v.name: x for v, x in zip(self.prog.inputs, flat)}
        env.update({v.name: c for v, c in self.prog.consts})
        self._run_range(0, len(self.steps), env, ())
        return self.returned(tuple(env[v.name] for v in self.prog.outputs))

    def _run_range(self, lo: int, hi: int, env, inside: tuple[Region, ...],
                   micro: Micro | None = None) -> None:  # fmt: skip
        k = lo
        while k < hi:
            region = next((r for r in self.prog.regions
                           if r.start == k and r.stop <= hi and r not in inside), None)  # fmt: skip
            if region is None:
                self._run(self.steps[k], env, micro)
                k += 1
            elif region.start in self.stages and micro is None:
                self._run_pipelined(region, env, (*inside, region))
                k = region.stop
            else:
                run = {"scan": self._run_scan, "while": self._run_while, "cond": self._run_cond}
                run.get(region.kind, self._run_call)(region, env, (*inside, region), micro)
                k = region.stop

    def _enter(self, r: Region, env, micro: Micro | None = None) -> list[str]:
        """Run a region's entry ops (outside it) and return the names of the values they enter."""
        for step in self.steps[r.start : r.body]:
            self._run(step, env, micro)
        return [s.op.results[0].value.name for s in self.steps[r.start : r.body]]

    def _run_inside(self, lo: int, hi: int, env, bound: dict, inside,
                    micro: Micro | None = None) -> dict:  # fmt: skip
        """Run ops ``[lo, hi)`` in a copy of ``env`` with ``bound`` values; return that copy."""
        inner = {**env, **bound}
        self._run_range(lo, hi, inner, inside, micro)
        return inner

    def _exits(self, r: Region) -> list[str]:
        return [s.op.results[0].value.name for s in self.steps[r.stop - len(r.outputs) : r.stop]]

    def _run_scan(self, r: Region, env, inside, micro: Micro | None = None) -> None:
        p, split = r.eqn.params, scan_split(r.eqn)
        nc, nk = split.consts, split.carry
        entered, exits = self._enter(r, env, micro), self._exits(r)
        carry_in, xs_in = entered[nc : nc + nk], entered[nc + nk :]

        def body(carry, xs):
            bound = {**dict(zip(carry_in, carry)), **dict(zip(xs_in, xs))}
            inner = self._run_inside(r.body, r.stop, env, bound, inside, micro)
            return [inner[n] for n in exits[:nk]], [inner[n] for n in exits[nk:]]

        final, ys = lax.scan(body, [env[n] for n in carry_in], [env[n] for n in xs_in],
                             length=p["length"], reverse=p["reverse"], unroll=p["unroll"])  # fmt: skip
        env.update(zip(exits, [*final, *ys]))

    def _run_pipelined(self, r: Region, env, inside) -> None:
        """Run scan ``r`` as a GPipe pipeline (:class:`planner.program.schedule.Stages`): stage
        ``s`` of the stage axis runs layers ``[s L/P, (s+1) L/P)`` on microbatch ``t - s`` at tick
        ``t`` and hands its carry to stage ``s + 1`` (``s - 1`` for a reversed scan, such as the
        backward pass of a pipelined forward one) with ``ppermute``; stacked outputs are kept
        per stage (split over the stage axis), weight gradients summed over microbatches.

        A circular pipeline (``repeats`` ``R > 1``) puts the stacked inputs in circular order
        (:func:`to_circular`), runs ``R K + P - 1`` ticks, item ``i = t - s`` being microbatch
        ``i mod K`` in round ``i // K`` on the stage's chunk of that round, hands the carry round
        a ring (the first stage keeps what comes back for the next round) and puts the stacked
        outputs back in layer order (:func:`from_circular`)."""
        st, p = self.stages[r.start], r.eqn.params
        split, length, reverse = scan_split(r.eqn), p["length"], p["reverse"]
        nc, nk = split.consts, split.carry
        axes = stage_factors(st.axis, self.sizes)
        stages, k_mb = math.prod(self.sizes[a] for a in axes), st.microbatches
        mb = microbatching(self.prog, r)
        self._check_stages(r, st, axes, mb)
        later = {e: axes for e, (_, axes) in self.later.items()}
        entered, exits = self._enter(r, env), self._exits(r)
        n_ys = len(exits) - nk
        parted = {} if self.holds_tiles else {  # stacked output -> axes its partial sums are over
            k: later[e.name] for k, e in enumerate(self.prog.ops[r.stop - n_ys : r.stop])
            if e.name in later
        }  # fmt: skip
        shapes = {
            v.value.name: mb.shape(v.value.name, v.value.shape, k_mb)
            for o in self.prog.ops[r.start : r.stop]
            for v in (*o.operands, *o.results)
        }
        consts_env = {v.name: c for v, c in self.prog.consts}
        dims = [mb.dim.get(n) for n in entered]
        rows = [mb.per_row.get(n, 1) for n in entered]
        per = length // stages
        reps = st.repeats
        chunk, items = per // reps, reps * k_mb
        rounds = circular_rounds(stages, reps)
        passes = self.passes  # stacked values that stay in circular order between pipelines
        ordered_in = [o.operands[0].value.name in passes for o in self.prog.ops[r.start : r.body]]
        ordered_out = [e.results[0].value.name in passes
                       for e in self.prog.ops[r.stop - n_ys : r.stop]]  # fmt: skip

        def stage_index():
            index = 0
            for a in axes:
                index = index * self.sizes[a] + lax.axis_index(a)
            return index

        def run_stage(values, s):
            """This device's stage ``s`` on every tick; ``values`` as ``entered``, ``xs``
            holding this stage's layers."""
            pos = stages - 1 - s if reverse else s
            consts, carry0, xs = values[:nc], values[nc : nc + nk], values[nc + nk :]
            if reps > 1:  # this stage's chunk of each round, in order
                xs = [x if done else to_circular(x, 0, s, axes, rounds, reps)
                      for x, done in zip(xs, ordered_in[nc + nk :])]  # fmt: skip

            def layers(carry, consts_m, bufs, mc, valid, micro_of, first):
                """The stage's layers on microbatch ``mc``: each layer's stacked inputs taken,
                and its stacked outputs written into their slots of the pipeline's buffers, as
                it runs (in place; stacking a tick's outputs first would hold them twice)."""
                micro = Micro(shapes, axes)

                def body(state, layer):
                    c, bs = state
                    x = [micro_of(lax.dynamic_index_in_dim(x, layer, 0, keepdims=False), d, n)
                         for x, d, n in zip(xs, dims[nc + nk :], rows[nc + nk :])]  # fmt: skip
                    bound = {**dict(zip(entered[:nc], consts_m)),
                             **dict(zip(entered[nc : nc + nk], c)),
                             **dict(zip(entered[nc + nk :], x))}  # fmt: skip
                    inner = self._run_inside(r.body, r.stop, consts_env, bound, inside, micro)
                    ys = [inner[n] for n in exits[nk:]]
                    bs = [put_microbatch(b, y, exit_dim(k), mc, where=valid, layer=layer)
                          if mb.exits[k] == "batch" else
                          jax.vmap(lambda b, y: put_layer(b, y, layer, where=valid, add=True))(b, y)
                          if k in parted else
                          put_layer(b, y, layer, where=valid, add=mb.exits[k] == "sum")
                          for k, (b, y) in enumerate(zip(bs, ys))]  # fmt: skip
                    return ([inner[n] for n in exits[:nk]], bs), None

                (final, bufs), _ = lax.scan(body, (carry, bufs), first + jnp.arange(chunk),
                                            reverse=reverse)  # fmt: skip
                return final, bufs

            def exit_dim(k):  # the batch dimension of stacked output k (layer axis first)
                d = mb.dim.get(self.prog.ops[r.stop - n_ys + k].operands[0].value.name)
                return None if d is None else d + 1

            def exit_rows(k):
                return mb.per_row.get(self.prog.ops[r.stop - n_ys + k].operands[0].value.name, 1)

            def tick(state, t):
                handed, looped, bufs, outs = state
                i = t - pos  # the item in front of this stage: microbatch i % K, round i // K
                valid = (i >= 0) & (i < items)
                rnd, mc = jnp.clip(i, 0, items - 1) // k_mb, jnp.clip(i, 0, items - 1) % k_mb

                def micro_of(x, d, n):
                    return x if d is None else take_microbatch(x, d, n, k_mb, mc)

                fresh = [micro_of(x, 0, 1) for x in carry0]
                if reps > 1:  # the first stage keeps what the last hands back for its next round
                    back = t - stages  # the item the last stage finished at tick t - 1
                    keep = (pos == 0) & (back >= 0) & (back < items - k_mb)
                    looped = [put_microbatch(b, h, 0, jnp.maximum(back, 0) % k_mb, where=keep)
                              for b, h in zip(looped, handed)]  # fmt: skip
                    fresh = [jnp.where(rnd == 0, f, get_microbatch(b, 0, mc))
                             for f, b in zip(fresh, looped)]  # fmt: skip
                inp = [jnp.where(pos == 0, f, h) for f, h in zip(fresh, handed)]
                consts_m = [micro_of(x, d, n) for x, d, n in zip(consts, dims[:nc], rows[:nc])]
                first = (reps - 1 - rnd if reverse else rnd) * chunk  # its chunk's local layers
                final, bufs = layers(inp, consts_m, bufs, mc, valid, micro_of, first)
                last = valid & (pos == stages - 1) & (rnd == reps - 1)
                outs = [put_microbatch(o, f, 0, mc, where=last) for o, f in zip(outs, final)]
                pairs = [(i + 1, i) if reverse else (i, i + 1) for i in range(stages - 1)]
                if reps > 1:  # round the ring
                    pairs.append((0, stages - 1) if reverse else (stages - 1, 0))
                handed = [lax.ppermute(f, axes, pairs) for f in final]
                return (handed, looped, bufs, outs), None

            handed0 = [jnp.zeros_like(take_microbatch(x, 0, 1, k_mb, 0)) for x in carry0]
            outs0 = [microbatch_buffer(x.shape, x.dtype, 0, 1, k_mb) for x in carry0]
            looped0 = outs0 if reps > 1 else []
            bufs0 = []
            for k, e in enumerate(self.prog.ops[r.stop - n_ys : r.stop]):
                v = e.results[0].value
                local = (per, *self._tile(v.shape[1:], e))
                if mb.exits[k] == "batch":
                    bufs0.append(microbatch_buffer(local, v.dtype, exit_dim(k), exit_rows(k), k_mb))
                elif k in parted:  # each device's partial sums, on a leading axis of parts
                    parts = math.prod(self.sizes[a] for a in parted[k])
                    bufs0.append(self.constrain(jnp.zeros((parts, *local), v.dtype),
                                                (parted[k],), None))  # fmt: skip
                else:
                    bufs0.append(jnp.zeros(local, v.dtype))
            (_, _, bufs, outs), _ = lax.scan(
                tick, (handed0, looped0, bufs0, outs0), jnp.arange(items + stages - 1)
            )
            carry_out = [lax.psum(merge_microbatches(o, 0), axes) for o in outs]
            ys_out = [merge_microbatches(b, exit_dim(k)) if mb.exits[k] == "batch" else b
                      for k, b in enumerate(bufs)]  # fmt: skip
            for k, e in enumerate(self.prog.ops[r.stop - n_ys : r.stop]):
                if k in parted:  # the microbatches' partial sums, combined once (by XLA)
                    ys_out[k] = jnp.sum(ys_out[k], axis=0)
                elif e.name in later:  # the same on this device's tiles
                    ys_out[k] = lax.psum(ys_out[k], later[e.name])
                if reps > 1 and not ordered_out[k]:
                    ys_out[k] = from_circular(ys_out[k], 0, s, axes, rounds, reps)
            return carry_out, ys_out

        values = [env[n] for n in entered]
        if self.holds_tiles:  # inside the program's shard_map, stacked tiles are the stage's layers
            carry_out, ys = run_stage(values, stage_index())
        else:  # the stage index enters as data: axis_index in a shard_map manual over some
            split = PartitionSpec(axes)  # axes lowers on the mesh jax.set_mesh sets (jax 0.10)
            specs = [PartitionSpec()] * (nc + nk) + [split] * (len(values) - nc - nk + 1)
            carry_out, ys = jax.shard_map(
                lambda *v: run_stage(list(v[:-1]), v[-1][0]), mesh=self.mesh,
                in_specs=tuple(specs), out_specs=([PartitionSpec()] * nk, [split] * n_ys),
                axis_names=set(axes), check_vma=False,
            )(*values, jnp.arange(stages, dtype=jnp.int32))  # fmt: skip
        env.update(zip(exits, [*carry_out, *ys]))

    def _tile(self, shape, exit_op: Op) -> tuple[int, ...]:
        """The shape a stage holds of a stacked output's layer (``shape``): its tile inside the
        program's ``shard_map``, the whole layer under XLA."""
        if not self.holds_tiles:
            return tuple(shape)
        spec = self.sched.spec(exit_op, exit_op.results[0])
        return local_shape(tuple(shape), spec[1:], self.sizes)

    def _check_stages(self, r: Region, st, axes, mb) -> None:
        for step in self.steps[r.body : r.stop]:
            op = step.op
            used = [a for ax in self.sched.assign.get(op.name, {}).values() for a in ax
                    if a in axes]  # fmt: skip
            if used and op.how != "region":
                raise ValueError(
                    f"op {op.name} inside the pipelined scan uses the stage axis {st.axis!r}; "
                    "a stage's layers may split over the other mesh axes only"
                )
            if not self.stage_halos and spatially_split(step):
                raise NotImplementedError(
                    f"op {op.name} splits a window inside a pipelined scan; halo exchanges "
                    "within pipeline stages are not supported"
                )
            for acc, spec in [*zip(op.operands, step.in_specs), *zip(op.results, step.out_specs)]:
                d = mb.dim.get(acc.value.name)
                if d is None:
                    continue
                parts = math.prod(self.sizes[a] for a in spec[d])
                if mb.batch % (parts * st.microbatches):
                    raise ValueError(
                        f"{acc.value.name}'s batch of {mb.batch} is split into {parts} parts; "
                        f"{st.microbatches} microbatches need each part to hold a multiple of "
                        f"{st.microbatches} rows"
                    )

    def _run_while(self, r: Region, env, inside, micro: Micro | None = None) -> None:
        p = r.eqn.params
        carry_in = self._enter(r, env, micro)[p["cond_nconsts"] + p["body_nconsts"] :]
        exits = self._exits(r)

        def run(lo: int, hi: int, carry) -> dict:
            return self._run_inside(lo, hi, env, dict(zip(carry_in, carry)), inside, micro)

        final = lax.while_loop(
            lambda c: run(r.body, r.parts[0], c)[r.predicate.name],
            lambda c: [run(r.parts[0], r.stop, c)[n] for n in exits],
            [env[n] for n in carry_in],
        )
        env.update(zip(exits, final))

    def _run_cond(self, r: Region, env, inside, micro: Micro | None = None) -> None:
        self._enter(r, env, micro)
        merges = self.steps[r.parts[-1] : r.stop]

        def branch(b: int):
            inner = self._run_inside(r.parts[b], r.parts[b + 1], env, {}, inside, micro)
            outs = []
            for m in merges:  # this branch's value, moved to the layout every branch agrees on
                v = m.op.operands[b].value
                for mv in m.moves:
                    if mv.value == v:
                        inner[v.name] = self.move(inner[v.name], mv, micro)
                outs.append(inner[v.name])
            return outs

        index = env[r.inputs[0].name]
        outs = lax.switch(index, [functools.partial(branch, b) for b in range(len(r.parts) - 1)])
        env.update((m.op.results[0].value.name, x) for m, x in zip(merges, outs))

    def _run_call(self, r: Region, env, inside, micro: Micro | None = None) -> None:
        """Re-bind the call's primitive around its planned body (as ``jax.core.eval_jaxpr``
        binds any equation), so that its remat policy or custom rules still apply."""
        names = [v.name for v in r.inputs]

        def body(*args):
            inner = self._run_inside(r.start, r.stop, env, dict(zip(names, args)), inside, micro)
            return [inner[v.name] for v in r.outputs]

        args = [env[n] for n in names]
        eqn = r.eqn
        params, consts = with_body(eqn, jax.make_jaxpr(body)(*args))
        args = [*consts, *args]
        bind_params = eqn.primitive.get_bind_params(params)
        subfuns = ()
        if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
            subfuns, bind_params = bind_params
        outs = eqn.primitive.bind(*subfuns, *args, **bind_params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update((v.name, x) for v, x in zip(r.outputs, outs))

    def _run(self, step: OpStep, env, micro: Micro | None) -> None:
        op = step.op
        # Every consumer moves a value from the layout its producer left (the data flow's
        # view): a moved tile serves this op only.
        moves = list(step.moves) if self.held(op) else []
        args = []
        for acc, want in zip(op.operands, step.in_specs):
            mv = next((m for m in moves if m.value == acc.value and m.dst == want), None)
            x = env[acc.value.name]
            args.append(x if mv is None else self.move(x, mv, micro))
        if op.how == "region":  # a boundary op: the value passes into or out of a region
            outs = args
        elif micro is not None:  # a pipelined layer on one microbatch
            outs = self.run_microbatched(op, step, args, micro)
        elif not step.partitioned:
            outs = bind(op, *args)
        else:
            outs = self.run_partitioned(op, step, args)
        outs = self.settle(op, step, outs, micro)
        for r, x in zip(op.results, outs):
            env[r.value.name] = x
