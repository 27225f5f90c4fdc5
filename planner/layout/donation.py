"""State keeps its layout: a training step's parameters and optimizer state come back in the
layout they went in, so the next step takes them as they are (a training loop feeds them back
without a reshard) and, where they are donated, their buffers are reused.

``jax.jit(donate_argnums=...)`` writes an output into a donated input's buffer when both have the
same shape, dtype and sharding, pairing them in order (the first donated input of a shape and
dtype with the first output of that shape and dtype, and so on). A plan whose update leaves a
parameter in another layout than the one it was stored in would lose that reuse and hand the
caller a state that must be moved before the next step. :func:`keep_state_layouts` stores each
donated input in the layout its paired output is made in (the ops are unchanged; the data flow
moves the input to what its first consumer needs, and the simulator prices that move). State
that is not donated keeps its layout the same way: the arguments the step returns by tree
position (:attr:`planner.program.ir.Program.returned`) pair with their outputs
(:func:`kept_pairs`).

Example:
    >>> sched = keep_state_layouts(prog, sched)  # doctest: +SKIP
    >>> # every donated input with a paired output: stored as that output leaves the step
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque

from planner.layout.dataflow import dataflow, input_spec
from planner.program.ir import Program
from planner.program.memo import PerObject
from planner.program.ops import Value
from planner.program.schedule import Schedule, even_layout


def donated_pairs(prog: Program) -> list[tuple[Value, Value]]:
    """``(donated input, output)`` pairs as ``jax.jit`` aliases them: in order, per shape and dtype;
    an output that is an input returned as it is pairs with nothing."""
    free: dict[tuple, deque] = defaultdict(deque)
    for v in prog.inputs:
        if v.name in prog.donated:
            free[(tuple(v.shape), v.dtype)].append(v)
    inputs = {v.name for v in prog.inputs}
    pairs = []
    for v in prog.outputs:
        if v.name in inputs or v.name not in prog.producer:
            continue
        donors = free.get((tuple(v.shape), v.dtype))
        if donors:
            pairs.append((donors.popleft(), v))
    return pairs


def kept_pairs(prog: Program) -> list[tuple[Value, Value]]:
    """``(input, output)`` pairs of the state that comes back in the layout it went in: the donated
    pairs (:func:`donated_pairs`), then those of the state the step returns in place of an
    argument (:attr:`planner.program.ir.Program.returned`) that donation does not pair.

    Example:
        >>> [(i.name, o.name) for i, o in kept_pairs(prog)]  # doctest: +SKIP
        [('state[0][0]', 'add_41'), ('state[0][1]', 'add_44')]
    """
    return KEPT.get(prog, lambda: _kept_pairs(prog))


KEPT: PerObject[list] = PerObject("state pairs")


def _kept_pairs(prog: Program) -> list[tuple[Value, Value]]:
    pairs = donated_pairs(prog)
    taken = {v.name for pair in pairs for v in pair}
    values = {v.name: v for v in prog.inputs} | {v.name: v for v in prog.outputs}
    inputs = {v.name for v in prog.inputs}
    for inp, out in prog.returned:
        if {inp, out} & taken or out in inputs or out not in prog.producer:
            continue
        taken |= {inp, out}
        pairs.append((values[inp], values[out]))
    return pairs


def keep_state_layouts(prog: Program, sched: Schedule) -> Schedule:
    """``sched`` with every state input stored in the layout its paired output is left in
    (:func:`kept_pairs`); ``sched`` itself when they already agree."""
    pairs = kept_pairs(prog)
    if not pairs:
        return sched
    producers = {prog.producer[out.name].name for _, out in pairs}
    steps = dataflow(prog, sched, only=producers)
    made = dict(zip((r.value.name for st in steps for r in st.op.results),
                    (s for st in steps for s in st.out_specs)))  # fmt: skip
    kept = {out.name: even_layout(out.shape, made[out.name], sched.mesh) for _, out in pairs}
    moved = {inp.name: kept[out.name] for inp, out in pairs
             if kept[out.name] != input_spec(prog, sched, inp)}  # fmt: skip
    if not moved:
        return sched
    return dataclasses.replace(sched, program=prog, stored={**sched.stored, **moved})
