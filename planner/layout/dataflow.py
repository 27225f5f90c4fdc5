"""The data flow a schedule implies: per op, which operands change layout, the layouts the kernel
runs on, and how partial sums are resolved. Pure (no JAX): lowering executes it, the simulator
prices it.

Example:
    >>> for step in dataflow(prog, sched): print(step.op.name, step.moves, step.pending)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from planner.program.ir import Program
from planner.program.ops import Op, Value
from planner.program.schedule import Axes, Schedule, Spec, even_layout


@dataclasses.dataclass(frozen=True)
class Move:
    """``value`` must go from layout ``src`` to ``dst`` before the op that reads it runs: a
    redist plan, or XLA's partitioner where that is cheaper (:mod:`planner.lowering.xla_moves`)."""

    value: Value
    src: Spec
    dst: Spec


@dataclasses.dataclass(frozen=True)
class OpStep:
    """One op's kernel: operand moves, kernel layouts, and partial-sum resolution.

    ``combine`` is how partial results over ``pending`` are combined (``"sum"``: ``psum``;
    ``"max"`` / ``"min"``: ``pmax`` / ``pmin``; ``"and"`` / ``"or"`` on booleans likewise).
    ``scatter[k]`` is the result dimension a ``psum_scatter`` splits over ``pending`` (the next
    consumer wants it split so), or ``None`` for an all-reduce.
    """

    op: Op
    moves: tuple[Move, ...]
    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    pending: Axes
    scatter: tuple[int | None, ...]
    combine: str = "sum"

    @property
    def partitioned(self) -> bool:
        return bool(self.pending) or any(any(s) for s in self.in_specs + self.out_specs)


def input_spec(prog: Program, sched: Schedule, v: Value) -> Spec:
    """An input's layout: its stored one if given, else what its first consumer requires (held
    evenly: :func:`planner.program.schedule.even_layout`)."""
    if v.name in sched.stored:
        return sched.stored[v.name]
    uses = prog.uses.get(v.name)
    if not uses:
        return ((),) * len(v.shape)
    return even_layout(v.shape, sched.spec(*uses[0]), sched.mesh)


def made_specs(prog: Program, sched: Schedule, steps) -> tuple[Spec, ...]:
    """The layout each output of ``prog`` is made in by ``steps`` (its producer's, after any
    reduce-scatter; an input returned as it is keeps its stored layout)."""
    layout = {v.name: input_spec(prog, sched, v) for v in prog.inputs}
    layout.update((r.value.name, s) for st in steps for r, s in zip(st.op.results, st.out_specs))
    return tuple(layout.get(v.name, ((),) * len(v.shape)) for v in prog.outputs)


def output_specs(prog: Program, sched: Schedule, steps, made=None) -> tuple[Spec, ...]:
    """The layout each output of ``prog`` is returned in: as :func:`made_specs` (``made``, where
    the caller has them), held evenly (:func:`planner.program.schedule.even_layout`: JAX returns
    no uneven layout from ``jit``)."""
    made = made_specs(prog, sched, steps) if made is None else made
    return tuple(even_layout(v.shape, s, sched.mesh) for v, s in zip(prog.outputs, made))


def _next_requirement(prog: Program, sched: Schedule, value: Value) -> Spec | None:
    uses = prog.uses.get(value.name)
    return sched.spec(*uses[0]) if uses else None


def _outputs(prog: Program, sched: Schedule, op: Op):
    """The layouts ``op`` leaves its results in, its pending axes, their combination, and which
    result dimension a reduce-scatter splits (see :class:`OpStep`)."""
    out_specs = [sched.spec(op, r) for r in op.results]
    if not op.reductions:  # no partial results (most ops)
        return tuple(out_specs), (), "sum", (None,) * len(out_specs)
    pending = sched.pending(op)
    combine = sched.combine(op)
    scatter: list[int | None] = [None] * len(op.results)
    if pending and combine == "sum":
        for k, r in enumerate(op.results):
            want = _next_requirement(prog, sched, r.value)
            for d, axes in enumerate(want or ()):
                if axes == pending and not out_specs[k][d]:
                    scatter[k] = d
                    out_specs[k] = out_specs[k][:d] + (pending,) + out_specs[k][d + 1 :]
                    break
    return tuple(out_specs), pending, combine, tuple(scatter)


def _step(sched: Schedule, op: Op, layout, outputs) -> OpStep:
    moves, in_specs = [], []
    for acc in op.operands:
        cur, want = layout(acc.value.name), sched.spec(op, acc)
        if cur != want:
            moves.append(Move(acc.value, cur, want))
        in_specs.append(want)
    out_specs, pending, combine, scatter = outputs
    return OpStep(op, tuple(moves), tuple(in_specs), out_specs, pending, scatter, combine)


def dataflow(
    prog: Program, sched: Schedule, only: Collection[str] | None = None
) -> tuple[OpStep, ...]:
    """The steps of ``prog`` under ``sched``, in program order; with ``only``, the steps of the
    ops so named alone (the layouts they read are derived from their producers, not by a walk
    of the whole program)."""
    if only is not None:
        producer = prog.producer
        inputs = {v.name: v for v in prog.inputs}
        consts = {v.name: ((),) * len(v.shape) for v, _ in prog.consts}
        made: dict[str, tuple] = {}

        def outputs(o: Op) -> tuple:
            if o.name not in made:
                made[o.name] = _outputs(prog, sched, o)
            return made[o.name]

        def layout(name: str) -> Spec:
            o = producer.get(name)
            if o is not None:
                return outputs(o)[0][[r.value.name for r in o.results].index(name)]
            if name in inputs:
                return input_spec(prog, sched, inputs[name])
            return consts[name]

        return tuple(_step(sched, o, layout, outputs(o)) for o in prog.ops if o.name in only)
    current: dict[str, Spec] = {v.name: input_spec(prog, sched, v) for v in prog.inputs}
    for v, _ in prog.consts:
        current[v.name] = ((),) * len(v.shape)
    steps = []
    for op in prog.ops:
        step = _step(sched, op, current.__getitem__, _outputs(prog, sched, op))
        for r, s in zip(op.results, step.out_specs):
            current[r.value.name] = s
        steps.append(step)
    return tuple(steps)
