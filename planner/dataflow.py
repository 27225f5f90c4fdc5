"""The data flow a schedule implies: per op, which operands change layout, the layouts the kernel
runs on, and how partial sums are resolved. Pure (no JAX): lowering executes it, the simulator
prices it.

Example:
    >>> for step in dataflow(prog, sched): print(step.op.name, step.moves, step.pending)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

from planner.ir import Op, Program, Value
from planner.schedule import Axes, Schedule, Spec


@dataclasses.dataclass(frozen=True)
class Move:
    """``value`` must go from layout ``src`` to ``dst`` before ``op`` runs (a redist plan)."""

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
    """An input's layout: its stored one if given, else what its first consumer requires."""
    if v.name in sched.stored:
        return sched.stored[v.name]
    uses = prog.uses.get(v.name)
    return sched.spec(*uses[0]) if uses else ((),) * len(v.shape)


def _next_requirement(prog: Program, sched: Schedule, value: Value) -> Spec | None:
    uses = prog.uses.get(value.name)
    return sched.spec(*uses[0]) if uses else None


def dataflow(prog: Program, sched: Schedule) -> tuple[OpStep, ...]:
    """The steps of ``prog`` under ``sched``, in program order."""
    layout: dict[str, Spec] = {v.name: input_spec(prog, sched, v) for v in prog.inputs}
    for v, _ in prog.consts:
        layout[v.name] = ((),) * len(v.shape)
    steps = []
    for op in prog.ops:
        moves, in_specs = [], []
        for acc in op.operands:
            cur, want = layout[acc.value.name], sched.spec(op, acc)
            if cur != want:
                moves.append(Move(acc.value, cur, want))
            in_specs.append(want)
        out_specs = [sched.spec(op, r) for r in op.results]
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
        for r, s in zip(op.results, out_specs):
            layout[r.value.name] = s
        steps.append(OpStep(op, tuple(moves), tuple(in_specs), tuple(out_specs), pending,
                            tuple(scatter), combine))  # fmt: skip
    return tuple(steps)
