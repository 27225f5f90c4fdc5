"""Dynamic programming over the coarsened graph: one choice per layer group, priced locally.

The program is cut into *segments*, one per group of dense ops (see
:func:`planner.solver.schedule_search.groups`): every other op joins the group nearest to it in the
data-flow graph (breadth-first from all groups at once; ties go to the earlier group). A segment's
layouts follow from its anchor's choice alone: the anchor and its :func:`siblings` take it, the
inputs the anchor reads are assumed laid out as it needs them, and the rest of the segment
propagates from these inside the segment. Every op's loops are then a function of its own segment's
choice, and since the simulator's cost is a sum over ops of terms that depend on an op's own
layout and its producers', the predicted time splits exactly into

    total(c) = sum_g U_g(c_g) + sum_{(g, h) adjacent} E_gh(c_g, c_h)

where ``U_g(a)`` is the predicted time of segment ``g`` simulated alone with choice ``a`` and
``E_gh(a, b)`` is what simulating ``g`` and ``h`` together adds to ``U_g(a) + U_h(b)``: the layout
changes and partial-sum resolutions across their border. (The only interactions left out are
three-way ones, e.g. a reduce-scatter decided by the next of several consumers.) Sub-programs
with the same structure (the layers of a deep network) are priced once, so building the tables
does not grow with depth.

Segments are ordered by their anchors' program order. When every adjacency joins consecutive
segments (a chain: an MLP, forward and backward ops grouped per layer), Viterbi's recursion
over that order finds the exact minimum. For general DAGs (residual connections join segments
several positions apart) the same recursion runs with an edge reaching back past the previous
segment priced by the choice the best path into the previous state made for the earlier
segment (its back-pointer path); then rounds of iterated conditional modes, every edge priced
exactly, improve it. That is a heuristic, documented as such; the search simulates the whole
program under the result (and under global propagation from the same anchors) and keeps the
better, so the prediction it reports is never the decomposition's.

Example:
    >>> dp = ChainDP(prog, groups(prog), mesh_sizes, calibration)            # doctest: +SKIP
    >>> picks = dp.solve(candidates)      # per segment, the index of its chosen assignment
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

from planner.cost.costs import FUSION_MODELS, KERNELS, fusion, fusion_model
from planner.cost.simulator import PRICES, op_seconds, op_steps, seconds, window_steps
from planner.program.ir import Program
from planner.program.ops import Op, Value
from planner.program.schedule import Schedule, make_schedule
from redist.calibration import Calibration
from redist.types import MeshShape


def flow_edges(prog: Program) -> list[tuple[str, str]]:
    """``(producer, consumer)`` op names for every operand produced by an op."""
    producer = prog.producer
    return [(producer[a.value.name].name, o.name)
            for o in prog.ops for a in o.operands if a.value.name in producer]  # fmt: skip


def segments(prog: Program, groups: Sequence[Sequence[Op]]) -> list[list[Op]]:
    """Every op of ``prog`` in exactly one segment, one segment per group (program order)."""
    if not groups:
        return []
    neighbours: dict[str, list[str]] = {o.name: [] for o in prog.ops}
    for p, c in flow_edges(prog):
        neighbours[c].append(p)
        neighbours[p].append(c)
    owner: dict[str, int] = {}
    queue: collections.deque = collections.deque()
    for g, members in enumerate(groups):
        for o in members:
            owner[o.name] = g
            queue.append(o.name)
    while queue:
        name = queue.popleft()
        for n in neighbours[name]:
            if n not in owner:
                owner[n] = owner[name]
                queue.append(n)
    out: list[list[Op]] = [[] for _ in groups]
    last = 0
    for o in prog.ops:  # ops connected to no group (constants, iotas) join the previous segment
        last = owner.get(o.name, last)
        out[last].append(o)
    return out


def siblings(group: Sequence[Op]) -> list[Op]:
    """The group's products that share the anchor's loop nest and read one of its operands in the
    same position through the same access (the q, k and v projections of one input): they take
    the anchor's split verbatim."""
    head = group[0]
    reads = {(k, a.value.name, a.dims) for k, a in enumerate(head.operands)}
    return [
        o for o in group[1:]
        if o.primitive == head.primitive and o.loops == head.loops
        and any((k, a.value.name, a.dims) in reads for k, a in enumerate(o.operands))
    ]  # fmt: skip


def with_siblings(anchor_assign: dict, groups: Sequence[Sequence[Op]]) -> dict:
    """An assignment of anchors (op name -> loops) extended to their :func:`siblings`."""
    out = dict(anchor_assign)
    for g in groups:
        loops = anchor_assign.get(g[0].name)
        if loops:
            for o in siblings(g):
                out.setdefault(o.name, loops)
    return out


def subprogram(
    prog: Program, ops: Sequence[Op], backends: Sequence[str] = FUSION_MODELS
) -> Program:
    """The program of ``ops`` alone: values they read but do not produce become its inputs, and
    values read after it (or returned) its outputs; ties between its own ops are kept. Its
    kernels under ``backends`` are the whole program's (only those a calibration prices with need
    be made)."""
    inside = {o.name for o in ops}
    produced = {r.value.name for o in ops for r in o.results}
    returned = {v.name for v in prog.outputs}
    uses = prog.uses
    read_outside = {v for v in produced
                    if v in returned or any(o.name not in inside for o, _ in uses.get(v, ()))}  # fmt: skip
    inputs: dict[str, Value] = {}
    for o in ops:
        for a in o.operands:
            if a.value.name not in produced:
                inputs.setdefault(a.value.name, a.value)
    outputs = [r.value for o in ops for r in o.results if r.value.name in read_outside]
    ties = tuple(t for t in prog.ties if t[0] in inside and t[1] in inside)
    sub = Program(tuple(ops), tuple(inputs.values()), tuple(outputs), ties=ties)
    # An op's price depends on its own layouts and moves only, all in the memo's key, and on
    # where the compiler's kernels end, which the whole program decides: windows share the
    # whole program's memo and fusion.
    PRICES.put(sub, PRICES.get(prog, dict))
    KERNELS.put(sub, {fusion_model(b): fusion(prog, b) for b in backends})
    return sub


def _frozen(assign: dict) -> tuple:
    """An assignment (loop -> axes) as a hashable key."""
    return tuple(sorted(assign.items()))


def structure(prog: Program, backends: Sequence[str] = FUSION_MODELS) -> tuple:
    """A key equal for programs that differ only in names (and so cost the same): their ops'
    kernels under the fusion models of ``backends`` included, last in each op's entry
    (:func:`planner.cost.costs.fusion`; a calibration prices with its own backend's alone)."""
    ids: dict[str, int] = {}

    def vid(v: Value) -> tuple:
        return (ids.setdefault(v.name, len(ids)), v.shape, v.dtype)

    ins = tuple(vid(v) for v in prog.inputs)
    fused = [fusion(prog, b) for b in backends]
    ops = tuple(
        (o.primitive, o.loops, o.reductions, o.how, o.trips,
         tuple((vid(a.value), a.dims, a.halo) for a in o.operands),
         tuple((vid(r.value), r.dims, r.halo) for r in o.results), o.windows, o.manual,
         tuple((b.signature_id, b.trips) for b in o.body), tuple(f.key(o) for f in fused))
        for o in prog.ops
    )  # fmt: skip
    return ins, ops, tuple(vid(v) for v in prog.outputs)


class ChainDP:
    """Tables of segment and border costs, and the Viterbi recursion over them."""

    def __init__(self, prog: Program, groups: Sequence[Sequence[Op]], mesh, cal: Calibration,
                 xla: bool = False):  # fmt: skip
        self.prog, self.mesh, self.cal, self.xla = prog, dict(mesh), cal, xla
        self.factor_size = MeshShape.of(self.mesh).factor_size  # the schedules' mesh, made once
        self._index = prog.index
        self.anchors = [g[0] for g in groups]
        self.siblings = [siblings(g) for g in groups]
        self.segments = segments(prog, groups)
        seg_of = {o.name: k for k, s in enumerate(self.segments) for o in s}
        self.edges = sorted({tuple(sorted((seg_of[p], seg_of[c])))
                             for p, c in flow_edges(prog) if seg_of[p] != seg_of[c]})  # fmt: skip
        self.is_chain = all(j == i + 1 for i, j in self.edges)
        self._programs: dict[tuple[int, ...], tuple[Program, int]] = {}
        self._grids: dict = {}
        self._ids: dict = {}
        self._costs: dict = {}
        self._op_times: dict = {}
        self._borders: dict = {}
        self._border_ops: dict = {}
        self._layouts: dict[tuple[int, ...], int] = {}
        self._layout_ids: dict = {}
        self._steps: dict = {}
        self._alone_times: dict = {}
        self._named: dict = {}
        self._schedules: dict = {}
        self._window_steps: dict = {}
        self.evaluations = 0

    def _window(self, segs: tuple[int, ...]) -> tuple[Program, int]:
        """The window's program and an integer naming its structure (with where its segments'
        anchors and siblings sit): windows with equal integers cost the same. Its layouts are
        named by :meth:`_layout`."""
        if segs not in self._programs:
            ops = sorted((o for s in segs for o in self.segments[s]),
                         key=lambda o: self._index[o.name])  # fmt: skip
            sub = subprogram(self.prog, ops, (self.cal.backend,))
            position = {o.name: k for k, o in enumerate(sub.ops)}
            heads = tuple(
                tuple(position[o.name] for o in [self.anchors[g], *self.siblings[g]]) for g in segs
            )
            ins, ops, outs = structure(sub, (self.cal.backend,))
            key = self._ids.setdefault(((ins, ops, outs), heads), len(self._ids))
            self._programs[segs] = (sub, key)
            seg = {o.name: k for k, g in enumerate(segs) for o in self.segments[g]}
            ties = tuple((position[a], position[b]) for a, b in sub.ties)
            bare = (ins, tuple(o[:-1] for o in ops), outs)  # without the kernels
            shape = (bare, heads, tuple(seg[o.name] for o in sub.ops), ties)
            self._layouts[segs] = self._layout_ids.setdefault(shape, len(self._layout_ids))
        return self._programs[segs]

    def _layout(self, segs: tuple[int, ...]) -> int:
        """An integer naming the window's structure without its kernels (with which segment each
        op is in, and its ties): windows with equal integers are laid out alike under equal
        choices (the windows of the layers of a deep network, whose kernels may differ)."""
        self._window(segs)
        return self._layouts[segs]

    def grids(self, g: int, anchor: dict) -> dict[str, dict] | None:
        """The loops of every op of segment ``g`` when its anchor is assigned ``anchor``:
        propagated inside the segment only, so that a segment's layouts do not depend on its
        neighbours' choices and the cost decomposes."""
        return self._grid(g, anchor, _frozen(anchor))

    def _grid(self, g: int, anchor: dict, frozen: tuple) -> dict[str, dict] | None:
        """:meth:`grids`, the anchor's choice ``frozen`` already (:func:`_frozen`)."""
        mine = (g, frozen)
        if mine in self._named:
            return self._named[mine]
        sub, _ = self._window((g,))
        laid = (self._layout((g,)), frozen)
        if laid not in self._grids:
            try:
                named = (
                    {o.name: anchor for o in [self.anchors[g], *self.siblings[g]]} if anchor else {}
                )
                # Inputs the anchor reads are assumed laid out as it needs them, so that the
                # group's other products (which share such an input) propagate from them too.
                head = make_schedule(sub, named, self.mesh, default="replicate", xla=self.xla)
                op = self.anchors[g]
                given = {v.name for v in sub.inputs}
                seeds = {
                    a.value.name: head.spec(op, a) for a in op.operands if a.value.name in given
                }
                sched = make_schedule(sub, named, self.mesh, stored=seeds, xla=self.xla)
                self._grids[laid] = tuple(sched.assign.get(o.name, {}) for o in sub.ops)
            except ValueError:
                self._grids[laid] = None
        per_position = self._grids[laid]
        named = None
        if per_position is not None:
            named = {o.name: loops for o, loops in zip(sub.ops, per_position) if loops}
        self._named[mine] = named
        return named

    def assignment(self, anchors: Sequence[dict]) -> dict[str, dict] | None:
        """Every op's loops for the given anchor assignments (one per segment), or ``None``."""
        out: dict[str, dict] = {}
        for g, a in enumerate(anchors):
            grid = self.grids(g, a)
            if grid is None:
                return None
            out.update(grid)
        return out

    def cost(self, segs: tuple[int, ...], assigns: tuple[dict, ...]) -> float:
        """Predicted time of the segments ``segs`` alone, their anchors assigned ``assigns``."""
        sub, key = self._window(segs)
        full = (key, tuple(_frozen(a) for a in assigns))
        if full not in self._costs:
            self.evaluations += 1
            named: dict[str, dict] | None = {}
            for g, a in zip(segs, assigns):
                grid = self.grids(g, a)
                named = None if grid is None or named is None else {**named, **grid}
            if named is None:
                self._costs[full] = math.inf
            else:
                sched = self._schedule(segs, full[1], named)
                laid = (self._layout(segs), full[1])  # layouts walked once for windows alike
                if laid not in self._window_steps:
                    self._window_steps[laid] = window_steps(sub, sched, self.cal)
                steps = self._window_steps[laid]
                time_s, self._op_times[full] = seconds(sub, sched, self.cal, steps)
                # the program's call is priced once, in total(), not once per window
                self._costs[full] = time_s - self.cal.step_s
        return self._costs[full]

    def _schedule(self, segs: tuple[int, ...], choices: tuple, named: dict) -> Schedule:
        """The window's schedule of the ops ``named`` (the anchors' ``choices`` made), made once
        for all the windows laid out alike (:meth:`_layout`)."""
        sub, _ = self._window(segs)
        laid = (self._layout(segs), choices)
        if laid not in self._schedules:
            sched = make_schedule(sub, named, self.mesh, default="replicate", xla=self.xla)
            position = {o.name: k for k, o in enumerate(sub.ops)}
            self._schedules[laid] = tuple((position[n], loops) for n, loops in sched.assign.items())
            return sched
        assign = {sub.ops[k].name: loops for k, loops in self._schedules[laid]}
        return Schedule(sub, self.factor_size, assign)

    def _alone(self, g: int, assign: dict, frozen: tuple) -> tuple[float, dict[str, float]]:
        """Segment ``g`` simulated alone, its anchor assigned ``assign`` (``frozen``): its
        :meth:`cost` and each op's predicted seconds."""
        mine = (g, frozen)
        if mine not in self._alone_times:
            cost, times = self.cost((g,), (assign,)), {}
            if math.isfinite(cost):
                sub, key = self._window((g,))
                times = dict(zip((o.name for o in sub.ops), self._op_times[(key, (frozen,))]))
            self._alone_times[mine] = (cost, times)
        return self._alone_times[mine]

    def crossing(self, i: int, j: int) -> frozenset[str] | None:
        """The ops of segments ``i`` and ``j`` whose price can change when the two are simulated
        together: producers of values the other segment reads (their reduce-scatter follows the
        next consumer) with all consumers of those values, and all readers of an input both
        segments read (it is stored as its first reader needs). ``None`` when a scan's carry ties
        the two segments (then the pair is simulated whole)."""
        if (i, j) not in self._border_ops:
            sub, _ = self._window((i, j))
            seg = {o.name: k for k in (i, j) for o in self.segments[k]}
            names: set[str] = set()
            for o in sub.ops:
                for r in o.results:
                    readers = sub.uses.get(r.value.name, ())
                    if any(seg[c.name] != seg[o.name] for c, _ in readers):
                        names.add(o.name)
                        names.update(c.name for c, _ in readers)
            for v in sub.inputs:
                readers = sub.uses.get(v.name, ())
                if len({seg[c.name] for c, _ in readers}) > 1:
                    names.update(c.name for c, _ in readers)
            tied = any(seg[a] != seg[b] for a, b in sub.ties)
            self._border_ops[(i, j)] = None if tied else frozenset(names)
        return self._border_ops[(i, j)]

    def border(self, i: int, j: int, a: dict, b: dict) -> float:
        """What simulating segments ``i`` and ``j`` together (anchors assigned ``a`` and ``b``)
        adds to simulating each alone: only the ops at their border are priced again
        (:meth:`crossing`), from the per-op prices of the two simulations alone."""
        frozen_a, frozen_b = _frozen(a), _frozen(b)
        cost_i, before_i = self._alone(i, a, frozen_a)
        cost_j, before_j = self._alone(j, b, frozen_b)
        alone = cost_i + cost_j
        if not math.isfinite(alone):
            return math.inf
        sub, key = self._window((i, j))
        full = (key, frozen_a, frozen_b)
        if full not in self._borders:
            names = self.crossing(i, j)
            if names is None:
                both = self.cost((i, j), (a, b))
                self._borders[full] = both - alone if math.isfinite(both) else math.inf
            else:
                named = {**self._grid(i, a, frozen_a), **self._grid(j, b, frozen_b)}
                sched = Schedule(sub, self.factor_size, named)
                # the border ops' layouts, walked once for all the windows laid out alike
                laid = (self._layout((i, j)), *full[1:])
                if laid not in self._steps:
                    self._steps[laid] = op_steps(sub, sched, names)
                together = op_seconds(sub, sched, names, self.cal, self._steps[laid])
                before = (before_i[n] if n in before_i else before_j[n] for n in together)
                self._borders[full] = sum(together.values()) - sum(before)
        return self._borders[full]

    def solve(self, candidates: Sequence[Sequence[dict]]) -> list[int]:
        """Per segment, the index of its chosen candidate assignment (``candidates[g]`` lists the
        anchor's possible assignments): Viterbi over the segment order, then, on DAGs, rounds of
        per-segment improvement of the decomposed cost with every edge priced exactly."""
        n = len(self.segments)
        unary = [[self.cost((g,), (a,)) for a in candidates[g]] for g in range(n)]

        borders: dict[tuple[int, int, int, int], float] = {}

        def border(i: int, j: int, a: int, b: int) -> float:
            if (i, j, a, b) not in borders:
                borders[i, j, a, b] = self.border(i, j, candidates[i][a], candidates[j][b])
            return borders[i, j, a, b]

        back_edges: dict[int, list[int]] = collections.defaultdict(list)
        for i, j in self.edges:
            if j != i + 1:
                back_edges[j].append(i)
        adjacent = {(i, j) for i, j in self.edges if j == i + 1}
        best = [list(unary[0])]
        paths: list[list[list[int]]] = [[[a] for a in range(len(candidates[0]))]]
        for j in range(1, n):
            row, row_paths = [], []
            for b in range(len(candidates[j])):
                options = []
                for a in range(len(candidates[j - 1])):
                    path = paths[j - 1][a]
                    total = best[j - 1][a] + unary[j][b]
                    if (j - 1, j) in adjacent:
                        total += border(j - 1, j, a, b)
                    for i in back_edges[j]:
                        total += border(i, j, path[i], b)
                    options.append((total, a))
                total, a = min(options)
                row.append(total)
                row_paths.append(paths[j - 1][a] + [b])
            best.append(row)
            paths.append(row_paths)
        k = min(range(len(best[-1])), key=best[-1].__getitem__)
        picks = paths[-1][k]
        if not self.is_chain:
            picks = self._improve(picks, unary, border)
        return picks

    def _improve(self, picks: list[int], unary, border, rounds: int = 3) -> list[int]:
        """Iterated conditional modes on the decomposed cost: each segment in turn takes the
        choice that is cheapest given its neighbours' (deterministic; stops when none moves)."""
        around: dict[int, list[int]] = collections.defaultdict(list)
        for i, j in self.edges:
            around[i].append(j)
            around[j].append(i)
        picks = list(picks)

        def local(g: int, a: int) -> float:
            total = unary[g][a]
            for h in around[g]:
                total += border(g, h, a, picks[h]) if g < h else border(h, g, picks[h], a)
            return total

        for _ in range(rounds):
            moved = False
            for g in range(len(picks)):
                a = min(range(len(unary[g])), key=lambda a, g=g: local(g, a))
                if local(g, a) < local(g, picks[g]) - 1e-12:
                    picks[g], moved = a, True
            if not moved:
                break
        return picks

    def total(self, candidates: Sequence[Sequence[dict]], picks: Sequence[int]) -> float:
        """The decomposed cost of ``picks`` (for checking it against a full simulation)."""
        out = self.cal.step_s
        out += sum(self.cost((g,), (candidates[g][a],)) for g, a in enumerate(picks))
        for i, j in self.edges:
            out += self.border(i, j, candidates[i][picks[i]], candidates[j][picks[j]])
        return out
