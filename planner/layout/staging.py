"""Schedules whose scans run as pipelines: which scans can, and the layer axis split around them.

:func:`staged` turns a schedule that leaves one mesh axis unused into one that runs every
top-level scan it can (:func:`planner.program.microbatch.microbatching`) as a GPipe pipeline over
that axis (:class:`planner.program.schedule.Stages`). The scans' stacked inputs and outputs then
rest with their layer axis split over the stages, and so does what the program does with them
outside the loops: every op that indexes a stacked value's layer axis with a loop of its own (the
optimizer's update of stacked weights and moments, a cast before the loop) gets the stage axis on
that loop, so each stage holds and updates only its layers.

Example:
    >>> sched = staged(prog, sched, "pipe", microbatches=8)     # doctest: +SKIP
    >>> sched.stages
    (Stages(region=37, axis='pipe', microbatches=8), Stages(region=326, ...))
"""

from __future__ import annotations

import collections
import dataclasses
import math

from planner.program.ir import Program
from planner.program.microbatch import NotPipelinable, microbatching
from planner.program.ops import Region
from planner.program.schedule import Schedule, Stages, check_assignment, stage_factors


def region_of(prog: Program, st: Stages) -> Region:
    """The scan a :class:`Stages` names; ``ValueError`` if there is none."""
    for r in prog.regions:
        if r.start == st.region and r.kind == "scan":
            return r
    starts = [r.start for r in prog.regions if r.kind == "scan"]
    raise ValueError(f"no scan starts at op {st.region}; scans start at {starts}")


def check_stages(prog: Program, sched: Schedule) -> None:
    """Raise ``ValueError`` naming the scan, axis and sizes unless every pipeline of ``sched``
    splits its layers into the stage axis' size and its batch into its microbatches."""
    for st in sched.stages:
        r = region_of(prog, st)
        stages = math.prod(sched.mesh[a] for a in stage_factors(st.axis, sched.mesh))
        length = r.eqn.params["length"]
        if length % stages:
            raise ValueError(
                f"{length} layers do not split into {stages} pipeline stages (mesh axis "
                f"{st.axis!r}); use an axis whose size divides {length}"
            )
        microbatching(prog, r).check(st.microbatches)
        check_repeats(length, stages, st.microbatches, st.repeats)


def check_repeats(layers: int, stages: int, microbatches: int, repeats: int) -> None:
    """Raise ``ValueError`` unless a circular pipeline of ``repeats`` rounds can run ``layers``
    layers on ``stages`` stages: ``repeats`` a positive integer dividing ``layers / stages``
    and, above 1, ``microbatches >= stages`` (a microbatch back at the first stage waits there
    for its next round; with fewer microbatches it would arrive before the stage is free).

    Example:
        >>> check_repeats(8, 2, 4, 2)
        >>> check_repeats(8, 4, 2, 2)
        Traceback (most recent call last):
        ...
        ValueError: a circular pipeline (repeats=2) needs at least as many microbatches as stages (4); got microbatches=2
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if (layers // stages) % repeats:
        raise ValueError(
            f"{layers // stages} layers per stage do not split into repeats={repeats} chunks; "
            f"choose a divisor of {layers // stages}"
        )
    if repeats > 1 and microbatches < stages:
        raise ValueError(
            f"a circular pipeline (repeats={repeats}) needs at least as many microbatches as "
            f"stages ({stages}); got microbatches={microbatches}"
        )


def circular_rounds(stages: int, repeats: int) -> tuple[tuple[int, int, tuple], ...]:
    """How a stacked value split over ``stages`` stages by blocks of layers (stage ``s`` holding
    chunks ``s R .. s R + R - 1`` of ``R P``) is put in circular order (stage ``d`` holding
    chunks ``d, d + P, ..``, chunk ``j P + d`` in its slot ``j``): rounds ``(j, k, pairs)``, in
    each of which every stage ``s`` of ``pairs`` ``(s, d)`` sends its chunk ``k`` to stage ``d``
    as that stage's slot ``j``. Each round is one ``ppermute``; every chunk is in one round.

    Example:
        >>> circular_rounds(2, 2)   # chunks 0 1 | 2 3  ->  0 2 | 1 3
        ((0, 0, ((0, 0),)), (0, 1, ((0, 1),)), (1, 0, ((1, 0),)), (1, 1, ((1, 1),)))
    """
    out = []
    for j in range(repeats):
        for k in range(repeats):
            pairs = tuple((s, s * repeats - j * stages + k) for s in range(stages)
                          if 0 <= s * repeats - j * stages + k < stages)  # fmt: skip
            if pairs:
                out.append((j, k, pairs))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Runs:
    """How often a pipelined body op runs, as GPipe runs it: each device runs its ``L / P``
    layers on ``K + P - 1`` ticks, one microbatch (``1 / K`` of the batch) each: ``(K + P - 1) /
    P`` times the op's trips over the whole loop (``op.trips``, ``L``), on values whose batch
    dimension is ``1 / K`` as large (others, such as a layer's weights or their gradient, are
    whole every time). A circular pipeline of ``R`` repeats runs ``L / (R P)`` layers on each
    of ``R K + P - 1`` ticks."""

    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def ticks(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def calls(self) -> float:
        """Runs per device relative to the unpipelined loop's trips."""
        return self.ticks / (self.stages * self.repeats)

    @property
    def share(self) -> float:
        """The part of the unpipelined loop's work a device does, bubble included."""
        return self.calls / self.microbatches


def pipeline_runs(prog: Program, sched: Schedule) -> tuple[dict[str, Runs], dict[str, int]]:
    """The ops of ``sched``'s pipelined scan bodies with their :class:`Runs`, and the values
    those bodies hold one microbatch of at a time (their batch-carrying values) with the
    microbatch count."""
    ops: dict[str, Runs] = {}
    values: dict[str, int] = {}
    for st in sched.stages:
        r = region_of(prog, st)
        stages = math.prod(sched.mesh[a] for a in stage_factors(st.axis, sched.mesh))
        runs = Runs(stages, st.microbatches, st.repeats)
        ops.update((o.name, runs) for o in prog.ops[r.body : r.stop])
        values.update(dict.fromkeys(microbatching(prog, r).dim, st.microbatches))
    return ops, values


def pipelinable(prog: Program, stages: int, microbatches: int, repeats: int = 1) -> list[Region]:
    """The top-level scans (in no other region) whose layers split into ``stages`` (and
    ``repeats`` rounds) and whose bodies split into ``microbatches``."""
    out = []
    for r in prog.regions:
        if r.kind != "scan" or r.eqn.params["length"] % stages:
            continue
        if any(o is not r and o.start <= r.start and r.stop <= o.stop for o in prog.regions):
            continue
        try:
            mb = microbatching(prog, r)
            mb.check(microbatches)
            check_repeats(r.eqn.params["length"], stages, microbatches, repeats)
        except (NotPipelinable, ValueError):
            continue
        out.append(r)
    return out


def staged(prog: Program, sched: Schedule, axis: str, microbatches: int,
           repeats: int = 1) -> Schedule | None:  # fmt: skip
    """``sched`` with every top-level scan it can pipeline run as a pipeline over ``axis`` (which
    ``sched`` must leave unused) in ``microbatches`` (circular, of ``repeats`` rounds, where
    its layers allow: :func:`check_repeats`), and the stage axis on the layer loops of the ops
    around them; ``None`` if no scan can be."""
    factors = stage_factors(axis, sched.mesh)
    stages = math.prod(sched.mesh[a] for a in factors)
    regions = pipelinable(prog, stages, microbatches, repeats)
    if not regions:
        return None
    inside = {k for r in regions for k in range(r.start, r.stop)}
    shape = sched.factors
    assign = {name: dict(loops) for name, loops in sched.assign.items()}
    layer_dims: collections.deque = collections.deque()
    for r in regions:
        for o in prog.ops[r.start : r.body]:
            if o.primitive == "scan_xs":
                layer_dims.append((o.operands[0].value.name, 0))
        for o in prog.ops[r.stop - len(r.outputs) : r.stop]:
            if o.primitive == "scan_ys":
                layer_dims.append((o.results[0].value.name, 0))
    seen = set(layer_dims)
    readers = collections.defaultdict(list)
    for k, o in enumerate(prog.ops):
        if k not in inside:
            for acc in (*o.operands, *o.results):
                readers[acc.value.name].append(o)
    while layer_dims:
        name, d = layer_dims.popleft()
        for o in readers[name]:
            loop = _layer_loop(o, name, d)
            mine = assign.get(o.name, {})
            if (
                loop is None
                or mine.get(loop)
                or any(a in factors for ax in mine.values() for a in ax)
            ):
                continue
            try:
                assign[o.name] = check_assignment(shape, o, {**mine, loop: factors})
            except ValueError:
                continue
            for acc in (*o.operands, *o.results):
                for d2, loops in enumerate(acc.dims):
                    key = (acc.value.name, d2)
                    if loops and loops[0] == loop and key not in seen:
                        seen.add(key)
                        layer_dims.append(key)
    stages_ = tuple(Stages(r.start, axis, microbatches, repeats) for r in regions)
    return dataclasses.replace(sched, assign=assign, stages=stages_)


def _layer_loop(op, name: str, d: int) -> str | None:
    """The loop of ``op`` that indexes dimension ``d`` of value ``name`` (the major one)."""
    for acc in (*op.operands, *op.results):
        if acc.value.name == name and d < len(acc.dims) and acc.dims[d]:
            return acc.dims[d][0]
    return None


def microbatch_choices(stages: int, given=None) -> tuple[int, ...]:
    """The microbatch counts to try for ``stages`` stages: ``given`` (an int or ints), else
    ``P, 2P, 4P, 8P`` (a GPipe bubble of 50%, 33%, 20%, 11% for large P)."""
    if given is None:
        return tuple(stages * m for m in (1, 2, 4, 8))
    out = (given,) if isinstance(given, int) else tuple(given)
    if not out or any(not isinstance(k, int) or k < 1 for k in out):
        raise ValueError(f"microbatches must be positive integers, got {given!r}")
    return out


def circular_passes(prog: Program, sched: Schedule, steps) -> frozenset[str]:
    """The stacked outputs of ``sched``'s circular pipelines that pass into circular pipelines
    of the same stages and repeats in circular order, not put back in layer order in between:
    values every reader of which is such a pipeline's stacked input (``scan_xs``) taking it as
    it is (no move, the same layout) and that the program does not return (a forward scan's
    residuals, read by its backward scan). ``steps``: the data flow's :class:`OpStep`\\ s.

    Example:
        >>> circular_passes(prog, sched, dataflow(prog, sched))  # doctest: +SKIP
        frozenset({'scan_ys_37'})
    """
    circular = {}
    for st in sched.stages:
        if st.repeats > 1:
            r = region_of(prog, st)
            circular[r.start] = (r, stage_factors(st.axis, sched.mesh), st.repeats)
    entries = {}  # entry op name -> its pipeline's (axes, repeats)
    for r, axes, reps in circular.values():
        entries.update((o.name, (axes, reps)) for o in prog.ops[r.start : r.body])
    returned = {v.name for v in prog.outputs}
    out = set()
    for r, axes, reps in circular.values():
        for k in range(r.stop - len(r.outputs), r.stop):
            exit_op = prog.ops[k]
            v = exit_op.results[0].value
            readers = prog.uses.get(v.name, ())
            if exit_op.primitive != "scan_ys" or v.name in returned or not readers:
                continue
            spec = steps[k].out_specs[0]
            if all(o.primitive == "scan_xs" and entries.get(o.name) == (axes, reps)
                   and not steps[prog.index[o.name]].moves
                   and steps[prog.index[o.name]].in_specs[0] == spec
                   for o, _ in readers):  # fmt: skip
                out.add(v.name)
    return frozenset(out)


def repeat_choices(given=None) -> tuple[int, ...]:
    """The circular pipeline repeat counts to try: ``given`` (an int or ints), else ``1, 2, 4``
    (GPipe, and circular pipelines of 2 and 4 rounds where the layers allow them)."""
    if given is None:
        return (1, 2, 4)
    out = (given,) if isinstance(given, int) else tuple(given)
    if not out or any(not isinstance(r, int) or r < 1 for r in out):
        raise ValueError(f"pipeline_repeats must be positive integers, got {given!r}")
    return out


PASS_THROUGH = frozenset("reshape squeeze expand_dims transpose copy copy_p "
                         "convert_element_type".split())  # fmt: skip
"""Ops a partial sum may pass through on its way out of a pipelined layer: linear, one operand."""


def deferred_sums(prog: Program, sched: Schedule, steps) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The weight gradients of ``sched``'s pipelined scans summed once, after the last tick,
    instead of once per layer and microbatch: stacked output (exit op name) -> ``(op name,
    axes)``, where the op inside the layer adds partial results over mesh axes ``axes`` (not the
    stage axis; a ``psum``, not a ``psum_scatter``) into a value that only passes (through views
    and casts, each value read once) into that output, which sums over microbatches. The op then
    leaves its result partial; the pipeline adds the microbatches' partial results and combines
    them over ``axes`` once. ``steps``: the data flow's :class:`OpStep` of every op, in order.

    Example:
        >>> deferred_sums(prog, sched, dataflow(prog, sched))  # doctest: +SKIP
        {'scan_ys_412': ('dot_general_398', ('data',))}
    """
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    uses, producer = prog.uses, prog.producer
    for st in sched.stages:
        r = region_of(prog, st)
        stage = set(stage_factors(st.axis, sched.mesh))
        kinds = microbatching(prog, r).exits
        for exit_op, kind in zip(prog.ops[r.stop - len(kinds) : r.stop], kinds):
            if kind != "sum":
                continue
            v = exit_op.operands[0].value
            op, chain = producer.get(v.name), [exit_op]
            while op is not None and op.primitive in PASS_THROUGH and len(uses[v.name]) == 1:
                chain.append(op)
                v = op.operands[0].value
                op = producer.get(v.name)
            if op is None or not r.body <= prog.index[op.name] < r.stop or len(uses[v.name]) != 1:
                continue
            step = steps[prog.index[op.name]]
            pending = set(step.pending)
            # the partial value is neither moved nor laid out over the axes it is partial over
            # on its way (a slice of each device's own part would not sum to the result's)
            on_way = [steps[prog.index[o.name]] for o in chain]
            kept = all(not w.moves and not pending & {a for sp in (*w.in_specs, *w.out_specs)
                                                      for d in sp for a in d}
                       for w in on_way)  # fmt: skip
            if (pending and kept and step.combine == "sum" and len(op.results) == 1
                    and all(s is None for s in step.scatter)
                    and not stage & pending):  # fmt: skip
                out[exit_op.name] = (op.name, tuple(step.pending))
    return out
