"""The walk every explicit lowering shares: a scheduled program's steps in order, each region run
as its construct (``lax.scan``, ``while_loop``, ``switch``, a re-bound call) and a pipelined scan
as GPipe over its stage axis. What a backend does at each op, how it moves a value between
layouts and what it holds a result to, are the hooks a :class:`Walker` subclass fills
(:mod:`planner.lowering.backends`).

Example:
    >>> outs = Explicit(prog, sched, mesh, dataflow(prog, sched)).program(*arrays)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax

from planner.layout.dataflow import OpStep
from planner.layout.staging import circular_passes, deferred_sums
from planner.lowering.kernels import bind, spatially_split
from planner.lowering.pipelined import Micro, PipelinedScan
from planner.program.ir import Program
from planner.program.jaxpr_params import scan_split, with_body
from planner.program.ops import Op, Region
from planner.program.schedule import Schedule, Spec, local_shape


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

    def run_manual(self, op: Op, step: OpStep, args: list, micro: Micro | None) -> tuple:
        """The user's ``shard_map`` (:mod:`planner.program.manual`) on whole arrays laid out as
        its ``in_specs`` say: bound as it is, it runs its body on each device's tiles."""
        if micro is not None:
            raise NotImplementedError(
                f"{op.name}: a shard_map inside a pipelined scan (its mesh axes would include "
                "the stage axis the pipeline runs over manually)"
            )
        mesh = op.eqn.params["mesh"]
        with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)):
            return bind(op, *args)  # under its own mesh, whatever mesh the plan runs under

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
        """Run scan ``r`` as a GPipe pipeline (:mod:`planner.lowering.pipelined`)."""
        PipelinedScan(self, r, env, inside).run(env)

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
        elif op.how == "manual":  # the user's shard_map, its operands in its own layouts
            outs = self.run_manual(op, step, args, micro)
        elif micro is not None:  # a pipelined layer on one microbatch
            outs = self.run_microbatched(op, step, args, micro)
        elif not step.partitioned:
            outs = bind(op, *args)
        else:
            outs = self.run_partitioned(op, step, args)
        outs = self.settle(op, step, outs, micro)
        for r, x in zip(op.results, outs):
            env[r.value.name] = x
