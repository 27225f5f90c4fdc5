"""Lowering a scheduled program to one jitted SPMD program.

Backend ``"explicit"``: the whole program is one ``shard_map`` over the mesh; every op runs its
local kernel on the tiles of the layouts the schedule derives (an unpartitioned op on whole
arrays, on every device); between a producer's layout and a consumer's required layout a
memory-bounded ``redist`` plan moves the tile with collectives. Backend ``"per-op"`` is the
reference it grew from: one ``shard_map`` per partitioned op, unpartitioned ops left to XLA,
every move a ``redist.redistribute`` call. In both, a partitioned reduction loop leaves partial
results, combined right away by their own operation (``psum``, or ``psum_scatter`` when the first
consumer wants the sum split along the summed axes; ``pmax`` / ``pmin`` for max / min, and / or).
Regions keep their construct: a scan runs as ``lax.scan`` whose body runs on the split layouts
(collectives inside the body); ``checkpoint`` and ``custom_jvp`` / ``custom_vjp`` calls are
re-bound around their planned bodies, so rematerialisation and the user's differentiation rules
survive.

Backend ``"xla"`` (what ``AutoPlan.jit`` runs): the original ops with ``with_sharding_constraint``
on every value, regions included, run by XLA's SPMD partitioner, which makes the layout changes
except those where it would rematerialise or ``redist`` is predicted faster: ``redist`` makes
those (``moves``, see :mod:`planner.lowering.xla_moves`). Given the layout the program's own
constraints ask for (``asked``), only the values the plan lays out otherwise are constrained and
XLA propagates from the user's constraints elsewhere (:func:`anchored`). Backend
``"xla-inputs"``: only the inputs are placed as the schedule says and XLA's sharding
propagation decides the rest.

Example:
    >>> f = planner.lower(prog, sched, mesh)        # doctest: +SKIP
    >>> out = f(*args); print(f.explain())
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import redist
from planner.layout.dataflow import OpStep, dataflow, input_spec, output_specs
from planner.layout.explanation import COLLECTIVE, entries, events, explain_rows, render
from planner.layout.staging import check_stages, circular_passes, circular_rounds, deferred_sums
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
from planner.lowering.xla_moves import MoveChoice, choose
from planner.program.constraints import SHARDING_PARAM
from planner.program.halo import split
from planner.program.ir import Program
from planner.program.jaxpr_params import scan_split, with_body
from planner.program.microbatch import microbatching
from planner.program.ops import Op, Region
from planner.program.rules import OPERAND_SIZE_PARAMS, POOLS, SCATTER_ADD
from planner.program.schedule import Schedule, Spec, local_shape, stage_factors, xla_splits
from redist.calibration import Calibration
from redist.execute import tile_kernel

SHAPE_PARAMS = ("shape", "new_sizes")
BACKENDS = ("explicit", "per-op", "xla", "xla-inputs")
MOVES = ("auto", "xla", "redist")
SHARDING_PARAMS = ("sharding", "out_sharding")


def _pspec(spec: Spec) -> PartitionSpec:
    return PartitionSpec(*entries(spec))


class Lowered:
    """A scheduled program as a jitted function, with ``explain()`` and ``in_specs``.

    Called (or ``lower``-ed) on the program's input arrays (pytrees of them, flattened); given
    the ``signature`` of the user's function (:class:`planner.calls.Signature`, as
    :attr:`planner.AutoPlan.lowered` has), also on the user's own arguments, static ones
    included."""

    signature = None  # the user's arguments (planner.calls.Signature), when known

    def __init__(self, prog: Program, sched: Schedule, mesh, backend: str = "explicit",
                 moves: str = "auto", calibration: Calibration | None = None,
                 asked: Schedule | None = None):  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if moves not in MOVES:
            raise ValueError(f"moves must be one of {MOVES}, got {moves!r}")
        self.prog, self.sched, self.backend = prog, sched, backend
        self.explicit = AxisType.Explicit in tuple(getattr(mesh, "axis_types", ()))
        # XLA's partitioner keeps each value where its constraint says only on Auto axes: on
        # Explicit ones every op's result takes the layout its typing rule gives, and a
        # constraint then moves it (an FSDP step's activations held whole, then sliced).
        self.mesh = mesh = factored_mesh(mesh, auto=backend == "xla")
        self.sizes = dict(mesh.shape)
        check_stages(prog, sched)
        only_xla = xla_splits(sched)
        if only_xla and backend in ("explicit", "per-op"):
            raise NotImplementedError(
                f"the {backend!r} backend runs even splits of its own kernels only (shard_map "
                f"holds no padded tiles, and its gathers and scatters look up whole operands); "
                f"this schedule splits {'; '.join(only_xla)}: run it with backend='xla' (what "
                "plan.jit runs)"
            )
        self.steps = dataflow(prog, sched)
        self.out_even = bool(only_xla)
        self.in_specs = tuple(input_spec(prog, sched, v) for v in prog.inputs)
        self.events = events(self.steps, redist.MeshShape.of(self.sizes))
        self.in_shardings = in_shardings = tuple(NamedSharding(mesh, _pspec(s))
                                                 for s in self.in_specs)  # fmt: skip
        self.local = backend == "explicit"  # values are tiles inside one shard_map
        self.xla = backend == "xla"  # values are whole arrays with sharding constraints
        self.choices: dict[tuple, MoveChoice] = {}
        self.stages = {st.region: st for st in sched.stages}
        if self.stages and backend not in ("explicit", "xla", "xla-inputs"):
            raise NotImplementedError(
                f"pipelined scans run under the 'explicit' and 'xla' backends, not {backend!r}"
            )
        self.micro: dict[str, tuple[int, ...]] | None = None  # shapes inside a pipelined body
        self.micro_axes: tuple[str, ...] = ()  # its stage axis' factors
        # stacked output -> (op, axes): partial sums a pipeline combines once, after its ticks
        self.later = deferred_sums(prog, sched, self.steps) if self.local or self.xla else {}
        self.deferred = frozenset(op for op, _ in self.later.values())
        self.passes = circular_passes(prog, sched, self.steps)
        # under XLA: values inside a pipelined body that hold per-device partial sums on a
        # leading axis of their own, split over the axes they are partial over
        self.parts: dict[str, tuple[str, ...]] = {}
        # backend "xla" given the layout the program asks for: only the ops the plan lays out
        # otherwise are constrained (None: every op)
        self.anchors = anchored(prog, sched, asked, self.steps) if (
            self.xla and asked is not None and not self.stages) else None  # fmt: skip
        if self.xla and moves != "xla":
            cal = calibration or Calibration.default()
            for st in self.steps:
                for mv in st.moves:
                    key = (mv.value.name, mv.src, mv.dst)
                    if key not in self.choices and self._held(st.op, mv):
                        self.choices[key] = choose(mesh, mv, cal, probe=moves == "auto")
        bodies = {"explicit": self._one_region, "xla-inputs": self._xla}
        self._body = bodies.get(backend, self._walk)
        self._jitted = jax.jit(self.body, in_shardings=in_shardings)

    def _held(self, op: Op, mv=None) -> bool:
        """Whether backend ``"xla"`` constrains ``op``'s layouts (and, given the move ``mv`` of
        one of its operands, the layout that operand is made in: ``redist`` moves a tile from
        its layout only where XLA holds it there)."""
        if self.anchors is None:
            return True
        made = None if mv is None else self.prog.producer.get(mv.value.name)
        return op.name in self.anchors and (made is None or made.name in self.anchors)

    def body(self, *flat):
        """The program on its inputs (to trace), the factored mesh being the context: under
        ``jax.set_mesh(mesh)`` the context is the user's mesh, whose axes of non-prime sizes the
        ``shard_map``s over their prime factors would not match."""
        ambient = jax.sharding.get_abstract_mesh()
        if ambient.empty or ambient == self.mesh.abstract_mesh or self.backend == "xla-inputs":
            return self._body(*flat)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            return self._body(*flat)

    def __call__(self, *args, **kwargs):
        outs = self._jitted(*self._placed(args, kwargs))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*self._placed(args, kwargs))

    def _placed(self, args, kwargs) -> list:
        """The arrays of ``args``, those not yet on devices (numpy arrays, Python numbers) put
        where the schedule stores them, and on a mesh of Explicit axes every array laid out
        otherwise: ``jax.jit`` would trace them with their own sharding in their type, which the
        ``shard_map``'s ``in_specs`` refuse."""
        flat = jax.tree.leaves(args)
        arrays_only = all(hasattr(x, "shape") for x in flat) and len(flat) == len(self.prog.inputs)
        if self.signature is not None and (kwargs or not arrays_only):
            self.signature.check(args, kwargs)  # the user's arguments, static ones included
            flat = self.signature.arrays(args, kwargs)
        elif kwargs:
            raise TypeError(f"this lowering takes the program's arrays, flat; got keyword "
                            f"arguments {sorted(kwargs)}")  # fmt: skip
        if len(flat) != len(self.prog.inputs):
            raise ValueError(f"expected {len(self.prog.inputs)} arrays, got {len(flat)}")
        out = []
        for x, s in zip(flat, self.in_shardings):
            # an array laid out otherwise on Explicit axes: its type would not be in_specs'
            retyped = (self.explicit and isinstance(x, jax.Array)
                       and not x.sharding.is_equivalent_to(s, x.ndim))  # fmt: skip
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
                x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            elif retyped or not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
                x = jax.device_put(x, s)
            out.append(x)
        return out

    # ----- the explicit backends -----
    def _one_region(self, *flat):
        """The program as one ``shard_map``: inputs enter as the schedule stores them, outputs
        leave in the layout their producer left them in."""
        outs = tuple(map(_pspec, output_specs(self.prog, self.sched, self.steps)))
        return jax.shard_map(self._walk, mesh=self.mesh, in_specs=tuple(map(_pspec, self.in_specs)),
                             out_specs=outs, check_vma=False)(*flat)  # fmt: skip

    def _walk(self, *flat):
        env: dict[str, object] = {v.name: x for v, x in zip(self.prog.inputs, flat)}
        env.update({v.name: c for v, c in self.prog.consts})
        self._run_range(0, len(self.steps), env, ())
        outs = tuple(env[v.name] for v in self.prog.outputs)
        if self.xla and self.out_even:  # outputs made unevenly are returned evenly
            specs = output_specs(self.prog, self.sched, self.steps)
            outs = tuple(map(self._constrain, outs, specs))
        return outs

    def _run_range(self, lo: int, hi: int, env, inside: tuple[Region, ...]) -> None:
        k = lo
        while k < hi:
            region = next((r for r in self.prog.regions
                           if r.start == k and r.stop <= hi and r not in inside), None)  # fmt: skip
            if region is None:
                self._run(self.steps[k], env)
                k += 1
            elif region.start in self.stages and self.micro is None:
                self._run_pipelined(region, env, (*inside, region))
                k = region.stop
            else:
                run = {"scan": self._run_scan, "while": self._run_while, "cond": self._run_cond}
                run.get(region.kind, self._run_call)(region, env, (*inside, region))
                k = region.stop

    def _enter(self, r: Region, env) -> list[str]:
        """Run a region's entry ops (outside it) and return the names of the values they enter."""
        for step in self.steps[r.start : r.body]:
            self._run(step, env)
        return [s.op.results[0].value.name for s in self.steps[r.start : r.body]]

    def _run_inside(self, lo: int, hi: int, env, bound: dict, inside) -> dict:
        """Run ops ``[lo, hi)`` in a copy of ``env`` with ``bound`` values; return that copy."""
        inner = {**env, **bound}
        self._run_range(lo, hi, inner, inside)
        return inner

    def _exits(self, r: Region) -> list[str]:
        return [s.op.results[0].value.name for s in self.steps[r.stop - len(r.outputs) : r.stop]]

    def _run_scan(self, r: Region, env, inside) -> None:
        p, split = r.eqn.params, scan_split(r.eqn)
        nc, nk = split.consts, split.carry
        entered, exits = self._enter(r, env), self._exits(r)
        carry_in, xs_in = entered[nc : nc + nk], entered[nc + nk :]

        def body(carry, xs):
            bound = {**dict(zip(carry_in, carry)), **dict(zip(xs_in, xs))}
            inner = self._run_inside(r.body, r.stop, env, bound, inside)
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
        parted = {} if self.local else {  # stacked output -> axes its partial sums are over
            k: later[e.name] for k, e in enumerate(self.prog.ops[r.stop - n_ys : r.stop])
            if e.name in later
        }  # fmt: skip
        micro = {
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

                def body(state, layer):
                    c, bs = state
                    x = [micro_of(lax.dynamic_index_in_dim(x, layer, 0, keepdims=False), d, n)
                         for x, d, n in zip(xs, dims[nc + nk :], rows[nc + nk :])]  # fmt: skip
                    bound = {**dict(zip(entered[:nc], consts_m)),
                             **dict(zip(entered[nc : nc + nk], c)),
                             **dict(zip(entered[nc + nk :], x))}  # fmt: skip
                    inner = self._run_inside(r.body, r.stop, consts_env, bound, inside)
                    ys = [inner[n] for n in exits[nk:]]
                    bs = [put_microbatch(b, y, exit_dim(k), mc, where=valid, layer=layer)
                          if mb.exits[k] == "batch" else
                          jax.vmap(lambda b, y: put_layer(b, y, layer, where=valid, add=True))(b, y)
                          if k in parted else
                          put_layer(b, y, layer, where=valid, add=mb.exits[k] == "sum")
                          for k, (b, y) in enumerate(zip(bs, ys))]  # fmt: skip
                    return ([inner[n] for n in exits[:nk]], bs), None

                self.micro, self.micro_axes = micro, axes
                try:
                    (final, bufs), _ = lax.scan(body, (carry, bufs), first + jnp.arange(chunk),
                                                reverse=reverse)  # fmt: skip
                    return final, bufs
                finally:
                    self.micro = None

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
                    bufs0.append(self._constrain(jnp.zeros((parts, *local), v.dtype),
                                                 (parted[k],)))  # fmt: skip
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
        if self.local:  # inside the program's shard_map, stacked tiles are the stage's layers
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
        if not self.local:
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
            if self.xla and _spatially_split(step):
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

    def _run_while(self, r: Region, env, inside) -> None:
        p = r.eqn.params
        carry_in = self._enter(r, env)[p["cond_nconsts"] + p["body_nconsts"] :]
        exits = self._exits(r)

        def run(lo: int, hi: int, carry) -> dict:
            return self._run_inside(lo, hi, env, dict(zip(carry_in, carry)), inside)

        final = lax.while_loop(
            lambda c: run(r.body, r.parts[0], c)[r.predicate.name],
            lambda c: [run(r.parts[0], r.stop, c)[n] for n in exits],
            [env[n] for n in carry_in],
        )
        env.update(zip(exits, final))

    def _run_cond(self, r: Region, env, inside) -> None:
        self._enter(r, env)
        merges = self.steps[r.parts[-1] : r.stop]

        def branch(b: int):
            inner = self._run_inside(r.parts[b], r.parts[b + 1], env, {}, inside)
            outs = []
            for m in merges:  # this branch's value, moved to the layout every branch agrees on
                v = m.op.operands[b].value
                for mv in m.moves:
                    if mv.value == v:
                        inner[v.name] = self._move(inner[v.name], mv)
                outs.append(inner[v.name])
            return outs

        index = env[r.inputs[0].name]
        outs = lax.switch(index, [functools.partial(branch, b) for b in range(len(r.parts) - 1)])
        env.update((m.op.results[0].value.name, x) for m, x in zip(merges, outs))

    def _run_call(self, r: Region, env, inside) -> None:
        """Re-bind the call's primitive around its planned body (as ``jax.core.eval_jaxpr``
        binds any equation), so that its remat policy or custom rules still apply."""
        names = [v.name for v in r.inputs]

        def body(*args):
            inner = self._run_inside(r.start, r.stop, env, dict(zip(names, args)), inside)
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

    def _move(self, x, mv):
        if self.xla:  # XLA makes the change (asked by a constraint), unless redist is chosen
            choice = self.choices.get((mv.value.name, mv.src, mv.dst))
            if choice is None or not choice.use_redist or self.micro is not None:
                return self._constrain(x, mv.dst)
            try:
                return redist.redistribute(x, _pspec(mv.src), _pspec(mv.dst), mesh=self.mesh,
                                           cost_model="bytes")  # fmt: skip
            except ValueError:  # typed on the user's mesh of whole axes (auto_axes): XLA moves it
                return self._constrain(x, mv.dst)
        if not self.local:  # the plan the simulator priced (redist.plan's cost model)
            return redist.redistribute(x, _pspec(mv.src), _pspec(mv.dst), mesh=self.mesh,
                                       cost_model="bytes")  # fmt: skip
        v, sizes = mv.value, self.sizes
        if self.micro is not None:  # stages hold other data: move within one stage's devices
            shape = self.micro.get(v.name, v.shape)
            sizes = {a: n for a, n in sizes.items() if a not in self.micro_axes}
        plan = redist.plan(shape if self.micro is not None else v.shape, _pspec(mv.src),
                           _pspec(mv.dst), sizes, dtype=v.dtype)  # fmt: skip
        return tile_kernel(plan, tuple(sizes.items()))(x)

    def _run(self, step: OpStep, env) -> None:
        op, mesh = step.op, self.mesh
        # Every consumer moves a value from the layout its producer left (the data flow's
        # view): a moved tile serves this op only.
        moves = list(step.moves) if self._held(op) else []
        args = []
        for acc, want in zip(op.operands, step.in_specs):
            mv = next((m for m in moves if m.value == acc.value and m.dst == want), None)
            args.append(env[acc.value.name] if mv is None else self._move(env[acc.value.name], mv))
        if op.how == "region":  # a boundary op: the value passes into or out of a region
            outs = args
        elif self.micro is not None:  # a pipelined layer on one microbatch
            shapes = [self.micro.get(r.value.name, r.value.shape) for r in op.results]
            if self.local:
                shapes = [local_shape(sh, sp, self.sizes) for sh, sp in zip(shapes, step.out_specs)]
                if op.name in self.deferred:  # left partial: summed once after the ticks
                    step = dataclasses.replace(step, pending=())
                outs = _bind(op, *args, local_out=shapes, step=step)
            elif op.name in self.deferred:
                outs = self._partial(op, step, args, shapes)
            elif any(a.value.name in self.parts for a in op.operands):  # a view of partial sums
                outs = jax.vmap(functools.partial(_bind, op, local_out=shapes))(*args)
            else:
                outs = _bind(op, *args, local_out=shapes)
        elif not step.partitioned or (self.xla and not _spatially_split(step)):
            outs = _bind(op, *args)
        else:
            local_out = [
                local_shape(r.value.shape, s, self.sizes)
                for r, s in zip(op.results, step.out_specs)
            ]
            if self.local:
                outs = _bind(op, *args, local_out=local_out, step=step)
            else:
                outs = jax.shard_map(
                    functools.partial(_bind, op, local_out=local_out, step=step),
                    mesh=mesh,
                    in_specs=tuple(_pspec(s) for s in step.in_specs),
                    out_specs=tuple(_pspec(s) for s in step.out_specs),
                    check_vma=False,
                )(*args)
        parted = None  # under XLA in a pipelined body: the axes a partial result is over
        if self.xla and self.micro is not None:
            parted = step.pending if op.name in self.deferred else next(
                (self.parts[a.value.name] for a in op.operands if a.value.name in self.parts), None
            )  # fmt: skip
        # a boundary op keeps its operand's constraint; an op XLA lays out takes none
        if self.xla and op.how != "region" and self._held(op):
            outs = [self._constrain(x, sp if parted is None else (parted, *sp))
                    for x, sp in zip(outs, step.out_specs)]  # fmt: skip
        for r, x in zip(op.results, outs):
            env[r.value.name] = x
            if parted is not None:
                self.parts[r.value.name] = parted

    def _constrain(self, x, spec: Spec):
        """``x`` constrained to ``spec`` (backend ``"xla"``): on the mesh, or inside a pipeline's
        ``shard_map`` on the mesh it traces under, whose stage axes are manual (the transposes of
        ops, under ``jax.grad``, check their operands' meshes against it)."""
        mesh = jax.sharding.get_abstract_mesh() if self.micro is not None else self.mesh
        return lax.with_sharding_constraint(x, NamedSharding(mesh, _pspec(spec)))

    def _partial(self, op: Op, step: OpStep, args, shapes):
        """``op`` on one microbatch under XLA, its sums over ``step.pending`` left partial: a
        ``shard_map`` manual over those axes runs it on each device's part and returns the
        partial results on a new leading axis split over them (the pipeline adds them over its
        ticks and sums that axis once, after the last)."""
        pending = step.pending
        mesh = jax.sharding.get_abstract_mesh()
        in_specs = tuple(PartitionSpec(*[tuple(a for a in d if a in pending) or None for d in sp])
                         for sp in step.in_specs)  # fmt: skip

        def part(*local):
            return tuple(x[None] for x in _bind(op, *local, local_out=shapes))

        return jax.shard_map(part, mesh=mesh, in_specs=in_specs,
                             out_specs=tuple(PartitionSpec(pending) for _ in op.results),
                             axis_names=set(pending), check_vma=False)(*args)  # fmt: skip

    # ----- the baseline: XLA propagates from the inputs -----
    def _xla(self, *flat):
        """The original program; the inputs are placed as the schedule says."""
        return tuple(jcore.jaxpr_as_fun(self.prog.jaxpr)(*flat))

    # ----- introspection -----
    def explain_json(self) -> list[dict]:
        return explain_rows(self.prog, self.sched, redist.MeshShape.of(self.sizes), self.events)

    def explain(self) -> str:
        return render(self.explain_json())

    def to_json(self) -> str:
        return json.dumps(self.explain_json(), indent=2)


def anchored(prog: Program, sched: Schedule, asked: Schedule, steps) -> frozenset[str] | None:
    """The ops backend ``"xla"`` constrains as ``sched`` lays them out, where the program's own
    sharding constraints ask for a layout (``asked``: they and the inputs' layouts, propagated):
    the constraints, the ops ``sched`` lays out otherwise than ``asked`` with their producers
    and consumers (XLA would carry a departure on to them), and ops splitting a window (run on
    tiles). Elsewhere the plan is what the program asks, and XLA propagates from the
    constraints as it does for the user's own ``jax.jit`` (on MaxText's step, half the time of
    constraining every value). ``None`` (every op constrained) where no constraint splits
    anything: XLA's propagation from the inputs alone lays out worse than the plan (on Gemma's
    step, 1.5x the time).

    Example:
        >>> anchored(prog, sched, plan.asked, dataflow(prog, sched))  # doctest: +SKIP
        frozenset({'sharding_constraint_3', 'dot_general_7'})
    """
    constrained = {op.name for op in prog.ops if op.primitive in SHARDING_PARAM}
    if not any(any(asked.assign.get(name, {}).values()) for name in constrained):
        return None
    departs = {op.name for op in prog.ops if sched.grid(op) != asked.grid(op)}
    out = constrained | {st.op.name for st in steps if _spatially_split(st)}
    for op in prog.ops:
        producers = {prog.producer[a.value.name].name for a in op.operands
                     if a.value.name in prog.producer}  # fmt: skip
        if op.name in departs or producers & departs:
            out |= {op.name, *producers}
    return frozenset(out)


def factored_mesh(mesh, auto: bool = False):
    """The same devices with every mesh axis split into its prime factors (``a:4 -> a#0, a#1``),
    its axes Auto; the mesh itself where its axes are prime (and Auto, given ``auto``)."""
    shape = redist.MeshShape.of(dict(mesh.shape))
    types = tuple(getattr(mesh, "axis_types", ()))
    if shape.factor_names == tuple(mesh.axis_names) and not (auto and AxisType.Explicit in types):
        return mesh
    sizes = [f.size for f in shape.factors]
    return Mesh(mesh.devices.reshape(sizes), shape.factor_names,
                axis_types=(AxisType.Auto,) * len(sizes))  # fmt: skip


def _combine(x, kind: str, axes):
    """Combine partial results over ``axes`` by the reduction's own operation."""
    if kind == "sum":
        return lax.psum(x, axes)
    if kind in ("and", "or"):  # booleans: and = min, or = max
        return getattr(lax, COLLECTIVE[kind])(x.astype(jnp.int32), axes).astype(x.dtype)
    return getattr(lax, COLLECTIVE[kind])(x, axes)


def _first_device(axes):
    """True on the devices at index 0 along every one of ``axes`` (inside ``shard_map``)."""
    return functools.reduce(jnp.logical_and, [lax.axis_index(a) == 0 for a in axes])


def _bind(op: Op, *args, local_out=None, step: OpStep | None = None):
    """Run ``op``'s primitive on ``args`` (local blocks when ``local_out`` is given)."""
    eqn = op.eqn
    if eqn.primitive.name in SHARDING_PARAM:  # the plan lays the result out (program.constraints)
        it = iter(args)
        return tuple(jnp.asarray(v.val, v.aval.dtype) if isinstance(v, jcore.Literal) else next(it)
                     for v in eqn.invars)  # fmt: skip
    params = dict(eqn.params)
    pending = step.pending if step is not None else ()
    if local_out is not None:
        for key in SHAPE_PARAMS:
            if key in params and len(op.results) == 1:
                params[key] = tuple(local_out[0])
        key = OPERAND_SIZE_PARAMS.get(op.primitive)
        if key:
            whole, local = op.operands[0].value.shape, args[0].shape
            params[key] = tuple(m if k == n else k
                                for k, n, m in zip(params[key], whole, local))  # fmt: skip
    for key in SHARDING_PARAMS:
        if key in params:
            params[key] = None
    args = list(args)
    crops = []
    if local_out is not None and op.windows and step is not None:
        crops = _with_halos(op, args, params, step)
    if local_out is not None and op.primitive == "conv_general_dilated":
        _local_groups(params, args, local_out)
    if pending and op.primitive in SCATTER_ADD:  # the operand is added once, not once per part
        args[0] = jnp.where(_first_device(pending), args[0], jnp.zeros_like(args[0]))
    it = iter(args)
    full = [v.val if isinstance(v, jcore.Literal) else next(it) for v in eqn.invars]
    out = eqn.primitive.bind(*full, **params)
    outs = list(out) if eqn.primitive.multiple_results else [out]
    for dim, start, size in crops:  # a max-pool gradient's rows that are this device's
        outs[0] = lax.slice_in_dim(outs[0], start, start + size, axis=dim)
    if pending:
        for k, x in enumerate(outs):
            if step.scatter[k] is not None:
                outs[k] = lax.psum_scatter(
                    x, pending, scatter_dimension=step.scatter[k], tiled=True
                )
            else:
                outs[k] = _combine(x, step.combine, pending)
    return tuple(outs)


def _spatially_split(step: OpStep) -> bool:
    """Whether ``step`` splits a window of its op: such an op runs on local tiles with the halo
    exchange of :func:`_with_halos` under every backend (XLA's SPMD partitioner, as of jaxlib
    0.10, computes a kernel's gradient wrongly when its input and the output gradient are both
    split along a spatial dimension)."""
    return any(step.in_specs[w.input][w.dim] for w in step.op.windows)


def _to_neighbour(
    axes: tuple[str, ...], shift: int
) -> tuple[tuple[str, ...], list[tuple[int, int]]]:
    """``(axis names, pairs)`` for a ``ppermute`` sending each tile of a dimension split over
    ``axes`` (major first) to the tile ``shift`` further on. ``ppermute`` numbers the devices of
    several axes in the mesh's axis order (JAX 0.12 requires the names in that order too), so
    the names and pairs are written in that one."""
    mesh = jax.sharding.get_abstract_mesh()
    size = dict(zip(mesh.axis_names, mesh.axis_sizes))
    in_mesh_order = [a for a in mesh.axis_names if a in axes]
    coords = list(itertools.product(*(range(size[a]) for a in axes)))  # in tile order

    def device(c: tuple[int, ...]) -> int:
        at = dict(zip(axes, c))
        index = 0
        for a in in_mesh_order:
            index = index * size[a] + at[a]
        return index

    return tuple(in_mesh_order), [(device(coords[t]), device(coords[t + shift]))
                                  for t in range(len(coords)) if 0 <= t + shift < len(coords)]  # fmt: skip


def _with_halos(op: Op, args: list, params: dict, step: OpStep) -> list[tuple[int, int, int]]:
    """A convolution or pooling on local tiles: each split spatial dimension of its input
    extended by the halo its neighbours send (``ppermute``; at the ends, the padding value: 0,
    or a max-pool's -inf) and padded as :func:`planner.program.halo.split` says. A max-pool's
    gradient (``select_and_scatter_add``) gets its source's windows too; returns the ``(dimension,
    start, size)`` crops of its result to the device's own rows."""
    padding = list(params["padding"])
    fill = POOLS.get(op.primitive, 0.0)
    if op.primitive == "select_and_scatter_add":
        fill = float("-inf") if params["select_prim"] is lax.ge_p else float("inf")
    crops = []
    for k, w in enumerate(op.windows):
        tile = args[w.input].shape[w.dim]
        parts = w.size // tile
        if parts == 1:
            continue
        cut = split(w, parts)
        axes = step.in_specs[w.input][w.dim]
        args[w.input] = _extend(args[w.input], w.dim, cut.left, cut.right, axes, parts, fill)
        if w.scatters:
            args[0] = _extend(args[0], w.dim, *cut.source, axes, parts, 0.0)
            crops.append((w.dim, cut.left, tile))
        padding[w.dim if op.primitive in POOLS or w.scatters else k] = cut.pad
    params["padding"] = tuple(padding)
    return crops


def _local_groups(params: dict, args: list, local_out) -> None:
    """A grouped convolution's group count on local tiles: its input's local features over the
    kernel's features per group (``feature_group_count``), or its input's local batch over the
    output's (``batch_group_count``, a grouped convolution's kernel gradient)."""
    dn = params["dimension_numbers"]
    if params.get("feature_group_count", 1) > 1:
        per_group = args[1].shape[dn.rhs_spec[1]]
        params["feature_group_count"] = args[0].shape[dn.lhs_spec[1]] // per_group
    if params.get("batch_group_count", 1) > 1:
        per_group = local_out[0][dn.out_spec[0]]
        params["batch_group_count"] = args[0].shape[dn.lhs_spec[0]] // per_group


def _extend(x, dim: int, left: int, right: int, axes, parts: int, fill: float):
    """``x`` (a tile along ``dim``, split over ``axes`` in ``parts``) with the last ``left``
    elements of its left neighbour's tile before it and the first ``right`` of its right
    neighbour's after it (``fill`` at the ends)."""
    tile = x.shape[dim]
    pieces = [x]
    if left:
        border = lax.slice_in_dim(x, tile - left, tile, axis=dim)
        border = lax.ppermute(border, *_to_neighbour(axes, +1))
        pieces.insert(0, _at_the_end(border, axes, 0, fill))
    if right:
        border = lax.slice_in_dim(x, 0, right, axis=dim)
        border = lax.ppermute(border, *_to_neighbour(axes, -1))
        pieces.append(_at_the_end(border, axes, parts - 1, fill))
    return jnp.concatenate(pieces, axis=dim) if len(pieces) > 1 else x


def _at_the_end(border, axes: tuple[str, ...], end: int, fill: float):
    """``border`` as received, or ``fill`` on the tile at index ``end`` (which no one sends to)."""
    if fill == 0:
        return border  # what ppermute leaves there
    return jnp.where(lax.axis_index(axes) == end, jnp.full_like(border, fill), border)


def lower(prog: Program, sched: Schedule, mesh, backend: str = "explicit", moves: str = "auto",
          calibration: Calibration | None = None, asked: Schedule | None = None) -> Lowered:  # fmt: skip
    """One jitted SPMD program for ``prog`` under ``sched`` on ``mesh`` (see module docs).

    ``moves`` (backend ``"xla"``): who makes each change of layout: ``"auto"`` (``redist`` where
    XLA would rematerialise or ``redist`` is predicted faster, see
    :mod:`planner.lowering.xla_moves`), ``"xla"`` or ``"redist"`` (all of them). ``asked``
    (backend ``"xla"``): the layout the program's constraints ask for, as
    :attr:`planner.AutoPlan.asked` has it: where ``sched`` agrees with it, XLA propagates from
    the program's own constraints (:func:`anchored`)."""
    return Lowered(prog, sched, mesh, backend, moves, calibration, asked)
