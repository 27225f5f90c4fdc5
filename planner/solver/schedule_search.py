"""Automatic search over how the mesh's prime factors split the loops of the heavy ops.

Anchors are the dense ops (``dot_general``, convolutions), coarsened so that the products of one
layer (forward and backward) are chosen together (:func:`groups`); every other op follows by
propagation. The objective is the simulator's predicted time (ties: peak memory); plans over
``memory_limit_bytes`` are refused. Deterministic.

- Joint space (every factor of every anchor) of at most ``exhaustive_limit`` assignments, up to
  relabelling interchangeable factors (:func:`interchangeable`): all are simulated, which is
  optimal under the simulator; of equal plans, one splitting the fewest mesh axes is returned.
- Larger: dynamic programming over layer segments (:mod:`planner.solver.chain`: exact on chains
  such as MLPs, a documented heuristic on DAGs with residual connections), in passes: the whole mesh as
  one group of factors; one mesh axis at a time; and, on meshes of at most ``PER_FACTOR_MAX``
  prime factors where some axis has several, one prime factor at a time as in Tofu's recursion
  (splits by part of an axis). On programs of at most ``greedy_ops`` ops the same passes also
  run greedily (at each step all
  combinations of the anchors' choices when at most ``step_limit``, else coordinate descent).
  The best full simulation wins.
- Then the ops that follow by propagation and communicate most (an embedding's lookup and its
  gradient's scatter-add, which follow the batch split of their neighbours) are refined one at
  a time: each of their loops tried with the op's mesh factors (:func:`refine`).

Example:
    >>> sched, pred = search(prog, mesh)          # doctest: +SKIP

:func:`search_within` runs it under ``plan``'s ``memory_limit_bytes`` (see
:mod:`planner.cost.memory`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping

import networkx as nx

from planner.cost.memory import AUTO, MEMORY_RESERVE, MemoryLimitError, resolve_memory_limit
from planner.cost.simulator import Prediction, op_seconds, peak_buffers, simulate
from planner.layout.dataflow import dataflow, input_spec
from planner.layout.donation import keep_state_layouts
from planner.program.ir import Program
from planner.program.ops import Op
from planner.program.schedule import Schedule, check_assignment, make_schedule, splits
from planner.solver import strategies
from planner.solver.chain import ChainDP, with_siblings
from planner.solver.requested import Requested
from planner.solver.ties import MEMORY_TIE, TIME_TIE, best_of
from redist.calibration import Calibration
from redist.specs import mesh_shape
from redist.types import MeshShape

Assignment = dict[str, dict[str, tuple[str, ...]]]


def groups(prog: Program) -> list[list[Op]]:
    """Dense ops grouped by coarsening, each group in program order, groups by their first op.

    Dense ops that read a common value (a layer's forward product and the gradient products that
    reuse its weight or its input activation) form one group, found as connected components with
    ``networkx``; the group's first op is its anchor and the others follow by propagation, so a
    layer's forward and backward products are chosen together. Values are followed through the
    regions' boundaries (:attr:`Program.origin`; a scan's stacked outputs are their body's
    values): the forward and backward scans over stacked layers read one weight and one saved
    activation as different body values, and group as a Python loop of the layers does. Without
    dense ops, the first op with a partitionable loop is the only group.
    """
    dense = [o for o in prog.ops if o.dense]
    if not dense:
        return [[o] for o in prog.ops if any(lp.partitionable for lp in o.loops)][:1]
    origin = prog.origin

    def value(name: str) -> tuple[str, str]:
        return ("value", origin[name][0].name if name in origin else name)

    graph = nx.Graph()
    graph.add_nodes_from(o.name for o in dense)
    for o in dense:
        graph.add_edges_from((o.name, value(a.value.name)) for a in o.operands)
    for o in prog.ops:
        if o.primitive == "scan_ys" and o.how == "region":  # a body value, stacked out
            graph.add_edge(value(o.operands[0].value.name), value(o.results[0].value.name))
    order = prog.index
    by_name = {o.name: o for o in dense}
    out = [sorted((by_name[n] for n in c if n in by_name), key=lambda o: order[o.name])
           for c in nx.connected_components(graph)]  # fmt: skip
    return sorted((g for g in out if g), key=lambda g: order[g[0].name])


def anchors(prog: Program) -> list[Op]:
    """The ops the search chooses for: the first op of each of :func:`groups`."""
    return [g[0] for g in groups(prog)]


def _options(op: Op, current: Mapping[str, tuple[str, ...]], size: int, sizes,
             xla: bool = False) -> list[str | None]:  # fmt: skip
    out: list[str | None] = [None]
    for lp in op.loops:
        parts = math.prod(sizes[a] for a in current.get(lp.name, ())) * size
        if splits(op, lp.name, parts, xla):
            out.append(lp.name)
    return out


def _assign_key(assign: Assignment) -> tuple:
    """``assign`` as a hashable key (ops and loops sorted)."""
    return tuple(sorted((op, tuple(sorted(lp.items()))) for op, lp in assign.items()))


class Evaluations:
    """Schedules made and simulated for a program, kept across the searches of one plan: each
    search's memory limit only decides which of them fit, so a search under a tighter limit
    (:func:`leaner`'s rounds, the compile check's, the search after the one without a limit)
    makes and simulates each schedule once (MaxText's DeepSeek-V3 on v5p-1024: three searches
    under limits made the same 745 schedules each). A table per program, mesh, calibration,
    ``priced_as``, ``xla`` and pinned loops, as the evaluator that reads it has them.

    Example:
        >>> memo = Evaluations()
        >>> fast = search(prog, mesh, cal, None, memo=memo)   # doctest: +SKIP
        >>> lean = search(prog, mesh, cal, 60e9, memo=memo)   # doctest: +SKIP
    """

    def __init__(self):
        self._tables: dict[tuple, tuple[tuple, dict]] = {}
        # id of a user's layout a search returned -> (that schedule, the search's own best
        # score: what it would have returned without the user's layout; see :meth:`own_best`)
        self._instead: dict[int, tuple[Schedule, tuple]] = {}

    def own_best(self, sched: Schedule) -> Prediction | None:
        """Where a search of these returned ``sched`` as the user's own layout (their
        constraints and inputs, kept on a tie or predicted best), the prediction of what it
        would have returned without that layout; else ``None``.

        Example:
            >>> memo.own_best(plan.schedule).time_s                       # doctest: +SKIP
            0.1123
        """
        kept = self._instead.get(id(sched))
        return kept[1][3] if kept is not None and kept[0] is sched else None

    def keep_own_best(self, sched: Schedule, own: tuple) -> None:
        """Record ``own`` (a score) as the search's own best where it returned ``sched``."""
        self._instead[id(sched)] = (sched, own)

    def fastest_s(self, prog: Program) -> float:
        """The predicted seconds of the fastest schedule made for ``prog`` (inf: none)."""
        return min((made[2].time_s for (p, _, _), table in self._tables.values() if p is prog
                    for made in table.values() if made is not None), default=math.inf)  # fmt: skip

    def table(self, prog: Program, mesh: Mapping[str, int], cal: Calibration, priced_as, xla: bool,
              pinned: Assignment) -> dict:  # fmt: skip
        """The table of schedules made with these settings (kept with the objects it is keyed
        by, so that their ids are not reused while it lives)."""
        key = (id(prog), tuple(sorted(mesh.items())), id(cal), id(priced_as), xla,
               _assign_key(pinned))  # fmt: skip
        if key not in self._tables:
            self._tables[key] = ((prog, cal, priced_as), {})
        return self._tables[key][1]


class _Evaluator:
    def __init__(self, prog, mesh, cal, limit, groups, priced_as=None, xla=False, pinned=None,
                 memo: Evaluations | None = None):  # fmt: skip
        self.prog, self.mesh, self.cal, self.limit = prog, dict(mesh), cal, limit
        self.groups, self.priced_as, self.xla = groups, priced_as, xla
        self.pinned = pinned or {}  # op -> loops every schedule keeps (constraints="keep")
        self.memo = memo = Evaluations() if memo is None else memo
        # key -> (schedule, what it was priced as, prediction), or None (no valid schedule)
        self.made = memo.table(prog, self.mesh, cal, priced_as, xla, self.pinned)
        # what was made of the schedule of least predicted peak seen, the fastest at that peak:
        # (schedule, what it was priced as, prediction)
        self.least: tuple[Schedule, Schedule, Prediction] | None = None

    @property
    def best_peak(self) -> float:
        """The least predicted peak seen, bytes (infinite: none yet)."""
        return math.inf if self.least is None else self.least[2].peak_bytes

    @property
    def leanest(self) -> tuple[Schedule, Prediction] | None:
        """The schedule of that peak and its prediction, as a search returns one."""
        return None if self.least is None else (self.least[0], self.least[2])

    def __call__(
        self, assign: Assignment, default: str = "propagate", stored: dict | None = None
    ) -> tuple[float, int, Schedule | None, Prediction | None]:
        stored_key = tuple(sorted(stored.items())) if stored else ()
        key = ("made", default, _assign_key(assign), stored_key)
        if key not in self.made:
            try:
                named = {k: v for k, v in with_siblings(assign, self.groups).items() if v}
                named.update(self.pinned)
                sched = make_schedule(self.prog, named, self.mesh, default=default, stored=stored,
                                      xla=self.xla)  # fmt: skip
            except ValueError:
                self.made[key] = None
            else:
                self.made[key] = self._priced(sched)
        return self._score(self.made[key])

    def schedule(self, sched: Schedule) -> tuple[float, int, Schedule, Prediction]:
        """A complete schedule (one made elsewhere too, an expert strategy's), scored; its donated
        state stored as the step leaves it (:func:`planner.layout.donation.keep_state_layouts`)."""
        key = ("given", _assign_key(sched.assign), tuple(sorted(sched.stored.items())),
               sched.stages)  # fmt: skip
        if key not in self.made:
            self.made[key] = self._priced(sched)
        return self._score(self.made[key])

    def _priced(self, sched: Schedule) -> tuple[Schedule, Schedule, Prediction]:
        if any(sched.assign.get(op) != loops for op, loops in self.pinned.items()):
            sched = dataclasses.replace(sched, assign={**sched.assign, **self.pinned})
        sched = keep_state_layouts(self.prog, sched)
        priced = self.priced_as(sched) if self.priced_as else sched
        return sched, priced, simulate(self.prog, priced, self.cal)

    def _score(self, made) -> tuple[float, int, Schedule | None, Prediction | None]:
        """``(time, peak, schedule, prediction)`` of a schedule made (time infinite over the
        limit; all infinite where no schedule was valid)."""
        if made is None:
            return (math.inf, math.inf, None, None)
        sched, priced, pred = made
        least = self.least and self.least[2]
        if not least or (pred.peak_bytes, pred.time_s) < (least.peak_bytes, least.time_s):
            self.least = made
        if self.limit is not None and pred.peak_bytes > self.limit:
            return (math.inf, pred.peak_bytes, sched, pred)
        return (pred.time_s, pred.peak_bytes, sched, pred)


def interchangeable(shape: MeshShape, cal: Calibration) -> list[tuple[str, ...]]:
    """Classes of prime factors that no price tells apart: factors of one size, on a machine
    where no collective's group leaves the fast domain (swapping two such factors everywhere
    relabels devices and changes no cost). Every factor is its own class otherwise."""
    if cal.domain_devices and shape.num_devices > cal.domain_devices:
        return [(f,) for f in shape.factor_names]
    by_size: dict[int, list[str]] = {}
    for f in shape.factor_names:
        by_size.setdefault(shape.factor_size[f], []).append(f)
    return [tuple(fs) for fs in by_size.values()]


def _relabel(assign: Assignment, mapping: Mapping[str, str]) -> Assignment:
    return {op: {lp: tuple(mapping.get(f, f) for f in fs) for lp, fs in loops.items()}
            for op, loops in assign.items()}  # fmt: skip


def _whole_axes(assign: Assignment, shape: MeshShape, classes, limit: int = 720) -> Assignment:
    """Among the first ``limit`` relabellings of ``assign`` by interchangeable factors (equal in
    cost), one that splits the fewest mesh axes into parts, so that its specs are on the user's
    mesh when they can be (see ``AutoPlan.spec_mesh``)."""

    def broken(a: Assignment) -> int:
        where: dict[str, set] = {}
        for op, loops in a.items():
            for lp, fs in loops.items():
                for f in fs:
                    where.setdefault(shape.factor_axis[f], set()).add((op, lp))
        used = {f for loops in a.values() for fs in loops.values() for f in fs}
        partial = {shape.factor_axis[f] for f in shape.factor_names if f not in used}
        return sum(len(w) > 1 for w in where.values()) + len(partial & set(where))

    def relabellings(rest):  # lazily: a class of 12 factors has 479 million
        if not rest:
            yield {}
            return
        for p in itertools.permutations(rest[0]):
            for more in relabellings(rest[1:]):
                yield {**dict(zip(rest[0], p)), **more}

    mappings = itertools.islice(relabellings([c for c in classes if len(c) > 1]), limit)
    return min(itertools.chain([assign], (_relabel(assign, m) for m in mappings)), key=broken)


def _extend(loops: Mapping, loop: str | None, factors: tuple[str, ...]) -> dict:
    """One op's loops with ``factors`` added to ``loop`` (unchanged for ``None``)."""
    out = dict(loops)
    if loop is not None:
        out[loop] = out.get(loop, ()) + tuple(factors)
    return out


def _with(assign: Assignment, choices, ops, factors: tuple[str, ...]) -> Assignment:
    out = dict(assign)
    for op, loop in zip(ops, choices):
        out[op.name] = _extend(assign[op.name], loop, factors)
    return out


def search(
    prog: Program,
    mesh,
    calibration: Calibration | None = None,
    memory_limit_bytes: int | None = None,
    exhaustive_limit: int = 256,
    step_limit: int = 64,
    greedy_ops: int = 150,
    dp: bool = True,
    priced_as: Callable[[Schedule], Schedule] | None = None,
    xla: bool = True,
    requested: Requested | None = None,
    memo: Evaluations | None = None,
    greedy_fallback: bool = True,
) -> tuple[Schedule, Prediction]:
    """The best schedule found for ``prog`` on ``mesh`` and its prediction.

    ``xla``: loops may be split into parts that do not divide them (a vocabulary of 50,257 over
    8 devices: padded tiles, priced at their padded extent; the plan runs under
    :meth:`planner.AutoPlan.jit`, XLA's partitioner, not the ``"explicit"`` backend).

    ``priced_as``: each candidate is priced (and held to the memory limit) as the schedule this
    makes of it, e.g. :func:`planner.layout.staging.staged` pipelining its scans over another axis;
    the candidate itself is returned, with the prediction of what it was priced as.

    ``requested``: the layout the program asks for (:mod:`planner.solver.requested`): with
    ``"keep"`` every schedule priced keeps its constraints; otherwise it is one more starting
    point, so the plan is never predicted slower than the user's own layout.

    ``memo``: the schedules earlier searches of ``prog`` made and simulated (:class:`Evaluations`),
    read and added to.

    ``greedy_fallback``: on programs of more than ``greedy_ops`` ops, run the greedy passes
    where every other candidate breaks the memory limit (``False``: raise instead, as
    :func:`leaner` wants).

    Raises:
        planner.cost.memory.MemoryLimitError: a ``ValueError``, if no schedule fits
            ``memory_limit_bytes`` (the message gives the smallest peak seen and its largest
            buffers).
    """
    shape = mesh_shape(mesh)
    sizes = shape.factor_size
    cal = calibration or Calibration.default()
    grouped = groups(prog)
    ops = [g[0] for g in grouped]
    requested = requested or Requested()
    evaluate = _Evaluator(prog, shape.sizes, cal, memory_limit_bytes, grouped, priced_as, xla,
                          requested.pinned(prog, shape, xla), memo)  # fmt: skip
    asked = _asked(prog, shape, requested, evaluate)
    empty: Assignment = {o.name: {} for o in ops}

    classes = interchangeable(shape, cal)
    names = shape.factor_names

    def choices(c: tuple[str, ...]) -> list[list]:
        return [_options(o, {}, sizes[c[0]], sizes, xla) for o in ops]

    joint = math.prod(
        math.comb(math.prod(map(len, choices(c))) + len(c) - 1, len(c)) for c in classes
    )
    if joint <= exhaustive_limit:
        per_class = [list(itertools.product(*choices(c))) for c in classes]
        # Interchangeable factors: one assignment per multiset of their choices.
        best = None
        scores = []
        picks = [itertools.combinations_with_replacement(opts, len(c))
                 for c, opts in zip(classes, per_class)]  # fmt: skip
        for combo in itertools.product(*picks):
            assign = empty
            for c, chosen in zip(classes, combo):
                for f, choices in zip(c, chosen):
                    assign = _with(assign, choices, ops, (f,))
            score = evaluate(assign)
            scores.append(score)
            if best is None or score[:2] < best[0][:2]:
                best = (score, assign)
        relabelled = _whole_axes(best[1], shape, classes)
        if relabelled != best[1]:
            again = evaluate(relabelled)
            if again[0] <= best[0][0] * (1 + 1e-9) and again[1] <= best[0][1]:
                best = (again, relabelled)
        seeds = _seeds(prog, shape, evaluate)
        results = [best[0], *scores, *seeds, *asked]
        # the fastest few, whatever their memory, with ZeRO
        fastest = sorted((r for r in scores if r[3] is not None), key=lambda r: r[3].time_s)
        results += _zero_where_due(prog, shape, fastest[:8], results, evaluate, memory_limit_bytes)
        return _finish(results, asked, evaluate, shape, memory_limit_bytes, seeds)
    per_axis = [tuple(shape.axis_factors(a)) for a in shape.axis_names]
    passes = [[tuple(names)], per_axis]
    if len(per_axis) < len(names) <= PER_FACTOR_MAX:  # some axis splits into several factors
        passes.append([(f,) for f in names])
    # never worse than replication, the experts or the user's own layout
    seeds = _seeds(prog, shape, evaluate)
    results = [evaluate(empty), *seeds, *asked]
    if dp:
        tables = ChainDP(prog, grouped, shape.sizes, cal, xla)
        results += [_dynamic(empty, p, ops, sizes, evaluate, tables) for p in passes]
    # The DP prices time only: when its plans break the memory limit, the greedy passes run too.
    over = greedy_fallback and all(math.isinf(r[0]) for r in results)
    if len(prog.ops) <= greedy_ops or over:
        results += [_greedy(empty, p, ops, sizes, evaluate, step_limit) for p in passes]
    results += _zero_where_due(prog, shape, results, results, evaluate, memory_limit_bytes)
    return _finish(results, asked, evaluate, shape, memory_limit_bytes, seeds)


def _finish(results: list, asked: list, evaluate: _Evaluator, shape: MeshShape, limit,
            seeds: list = ()):  # fmt: skip
    """The search's answer from its scored candidates: the best of them, refined, or the user's
    own layout where that ties (:func:`users_on_a_tie`); raises where nothing fits. Where the
    answer is the user's layout as given, the memo keeps what the search would have answered
    without it (:meth:`Evaluations.own_best`: ``explain()`` says it)."""
    first = best_of(results)
    best = best_of(
        [_refined(first, evaluate, shape, asked)]
        + [refine_products(r, evaluate, shape) for r in _runners_up(first, seeds)[1:]]
    )
    chosen = users_on_a_tie(best, asked)
    if chosen[2] is not None and any(chosen is a for a in asked):  # the user's layout as given
        # and what the search would have chosen without it
        mine = best if not any(first is a for a in asked) else None
        own = [r for r in results if not any(r is a for a in asked)]
        if mine is None and own:
            mine = refine(best_of(own), evaluate, shape)
        if mine is not None and mine[2] is not None and not math.isinf(mine[0]):
            evaluate.memo.keep_own_best(chosen[2], mine)
    return _result(chosen, evaluate, limit)


def _refined(score, evaluate: _Evaluator, shape: MeshShape, asked: list):
    """``score`` refined (:func:`refine`), and its products too (:func:`refine_products`) unless
    it is the user's own layout (``asked``): the search departs from the user's products only
    for a layout of its own."""
    mine = any(score is a for a in asked)
    score = refine(score, evaluate, shape)
    return score if mine else refine_products(score, evaluate, shape)


RUNNERS_UP = 1.25  # the experts' strategies refined beside the search's best: those this near
RUNNERS = 2  # and at most this many of them, the fastest


def _runners_up(first: tuple, seeds, within: float = RUNNERS_UP, most: int = RUNNERS) -> list:
    """``first`` (the search's best) and the ``most`` fastest of the experts' strategies
    (``seeds``, scored) that fit and are predicted within ``within`` times its time, each
    schedule once: an expert splits every layer alike, and refined layer by layer
    (:func:`refine_products`) one may overtake the best (Llama 3.1 405B on two v6e-256 slices: FSDP over all 512 chips best, 62.4 s
    predicted; FSDP x tensor with the residual stream over ``tensor`` 62.5 s, and 56.8 s with
    its key and value projections split over their contraction, as MaxText's layout)."""
    out = [first]
    for r in sorted(seeds, key=lambda r: r[:2]):
        if len(out) > most:
            break
        if math.isinf(r[0]) or r[2] is None or math.isinf(first[0]) or r[0] > first[0] * within:
            continue
        if all(o[2] is None or r[2].assign != o[2].assign for o in out):
            out.append(r)
    return out


def users_on_a_tie(best: tuple, asked: list) -> tuple:
    """``best`` (a score: time, peak, schedule, prediction), or the user's own layout (``asked``:
    the scores of its completions, the fastest of which prices it, or nothing) where that is as
    fast (within :data:`TIME_TIE`) and as lean (within :data:`MEMORY_TIE`): a departure from
    the user's constraints must buy more than the cost model's error.

    Example:
        >>> users_on_a_tie((1.00, 500, "plan", None), [(1.02, 504, "yours", None)])[2]
        'yours'
    """
    if not asked:
        return best
    mine = min(asked, key=lambda r: r[:2])
    if math.isinf(mine[0]):
        return best
    if mine[0] <= best[0] * (1 + TIME_TIE) and mine[1] <= best[1] * (1 + MEMORY_TIE):
        return mine
    return best


REFINED_OPS = 8  # the propagated ops refine() tries, those communicating most


def refine(score, evaluate: _Evaluator, shape: MeshShape, ops: int = REFINED_OPS):
    """``score`` (the search's best: time, peak, schedule, prediction) improved op by op: of the
    ops the search does not choose for (not in a dense group: they follow their neighbours by
    propagation, nor a region or the program's ``shard_map``, whose layouts are fixed), the
    ``ops`` whose communication is predicted dearest each try the layouts their operands arrive
    in (:func:`arriving_layouts`) and their mesh factors moved to each other loop they may split
    (or dropped), and a change is kept where :func:`best_of` prefers it (faster beyond
    :data:`TIME_TIE`, or as fast with a lower peak). An embedding's lookup split over the batch
    like its neighbours gathers the whole table (and its gradient all-reduces it); split over
    the embedding dimension it moves only its output, as MaxText lays it out. A weight's
    gradient that a ``shard_map`` reduce-scatters and the transpose of MaxText's constraint
    asks whole stays split as it arrives (Qwen3-235B at tensor 4 on v5p-512: 23.63 s
    predicted, 21.80 s so).

    Example:
        >>> refine(best, evaluate, MeshShape.of({"fsdp": 256}))  # doctest: +SKIP
    """
    time_s, _, sched, pred = score
    if sched is None or math.isinf(time_s):
        return score
    best = score
    for op in _dear_ops(evaluate, sched, pred, ops):
        current = best[2].assign.get(op.name, {})
        factors = tuple(a for axes in current.values() for a in axes)
        (step,) = dataflow(evaluate.prog, best[2], only=(op.name,))
        options = [o for o in arriving_layouts(op, step.moves) if o != current]
        if factors:
            parts = math.prod(shape.factor_size[a] for a in factors)
            options += [o for o in [{}] + [{lp.name: factors} for lp in op.loops
                                           if splits(op, lp.name, parts, evaluate.xla)]
                        if o != current and o not in options]  # fmt: skip
        for loops in options:
            try:
                loops = check_assignment(shape, op, loops, evaluate.xla)
            except ValueError:
                continue
            best = _kept_if_preferred(best, op, loops, evaluate)
    return best


def _kept_if_preferred(best, op: Op, loops: dict, evaluate: _Evaluator):
    """``best`` (a score) with ``op`` laid out as ``loops`` where :func:`best_of` prefers that
    schedule (faster beyond :data:`TIME_TIE`, or as fast with a lower peak), else ``best``."""
    tried = evaluate.schedule(
        dataclasses.replace(best[2], assign={**best[2].assign, op.name: loops})
    )
    return tried if tried[:2] != best[:2] and best_of([best, tried]) is tried else best


REFINED_PRODUCTS = 24  # the products refine_products() tries, those communicating most


def refine_products(score, evaluate: _Evaluator, shape: MeshShape,
                    ops: int = REFINED_PRODUCTS):  # fmt: skip
    """``score`` (the search's best: time, peak, schedule, prediction) improved product by
    product: the ``ops`` products (dense ops) whose communication is predicted dearest each try
    every mesh axis they are split over dropped, or moved to a loop an operand that is moved
    for them arrives split on by that axis (:func:`axis_moves`, :func:`arriving_layouts`), the
    other axes kept; a move that makes the product and its users faster alone
    (:func:`planner.cost.simulator.op_seconds`) is priced whole, and kept where
    :func:`best_of` prefers it. The search chooses a product with the others of its group,
    and the experts' strategies split every layer alike; a layer of its own wants its own
    split. Llama 3.1 405B's key and value projections (8 heads) over ``tensor`` on two v6e-256 slices: split over their
    contraction, partial sums reduce-scattered, rather than the activation gathered (62.5 s
    predicted from FSDP x tensor with the residual stream over ``tensor``, 57.1 s so, as
    MaxText's layout).

    Example:
        >>> refine_products(best, evaluate, MeshShape.of({"fsdp": 4, "tensor": 2}))  # doctest: +SKIP
    """
    time_s, _, sched, pred = score
    if sched is None or math.isinf(time_s):
        return score
    by_op = {o.name: o for o in evaluate.prog.ops}
    dear = sorted((c for c in pred.ops if c.comm_s > 0 and c.op in by_op and by_op[c.op].dense
                   and by_op[c.op].how not in ("region", "manual")),
                  key=lambda c: -c.comm_s)[:ops]  # fmt: skip
    best = score
    for cost in dear:
        op = by_op[cost.op]
        current = best[2].assign.get(op.name, {})
        (step,) = dataflow(evaluate.prog, best[2], only=(op.name,))
        arriving = {(lp, shape.factor_axis[f]) for layout in arriving_layouts(op, step.moves)
                    for lp, fs in layout.items() for f in fs}  # fmt: skip
        near = (op.name, *evaluate.prog.neighbours[op.name][1])  # its moves in and out
        here = sum(op_seconds(evaluate.prog, best[2], near, evaluate.cal).values())
        for loops in axis_moves(op, current, shape, evaluate.xla):
            landed = {(lp, shape.factor_axis[f]) for lp, fs in loops.items() for f in fs
                      if f not in current.get(lp, ())}  # fmt: skip
            if not landed <= arriving:  # an axis moved where no operand arrives split by it
                continue
            trial = dataclasses.replace(best[2], assign={**best[2].assign, op.name: loops})
            if sum(op_seconds(evaluate.prog, trial, near, evaluate.cal).values()) < here:
                best = _kept_if_preferred(best, op, loops, evaluate)  # priced whole only then
    return best


def axis_moves(op: Op, current: Mapping[str, tuple[str, ...]], shape: MeshShape,
               xla: bool = False) -> list[dict]:  # fmt: skip
    """``op``'s assignments with one mesh axis of ``current`` (its factors there) moved to each
    other loop it may split, or dropped, the others kept; valid ones only, each once.

    Example:
        >>> axis_moves(dot, {"m": ("fsdp",), "n": ("tensor",)}, MeshShape.of({"fsdp": 2, "tensor": 2}))  # doctest: +SKIP
        [{'m': ('fsdp',)}, {'m': ('fsdp',), 'k': ('tensor',)}, {'m': ('fsdp', 'tensor')}]
    """
    out: list[dict] = []
    axes = dict.fromkeys(shape.factor_axis[f] for fs in current.values() for f in fs)
    for axis in axes:
        moved = tuple(f for fs in current.values() for f in fs if shape.factor_axis[f] == axis)
        rest = {lp: tuple(f for f in fs if f not in moved) for lp, fs in current.items()}
        rest = {lp: fs for lp, fs in rest.items() if fs}
        for target in [None, *(lp.name for lp in op.loops)]:
            loops = dict(rest)
            if target is not None:
                loops[target] = (*loops.get(target, ()), *moved)
            if loops == dict(current) or loops in out:
                continue
            try:
                out.append(check_assignment(shape, op, loops, xla))
            except ValueError:
                continue
    return out


def _dear_ops(evaluate: _Evaluator, sched: Schedule, pred: Prediction, ops: int) -> list[Op]:
    """The ``ops`` ops :func:`refine` tries, by their predicted communication, dearest first:
    those that follow by propagation (not in a dense group, not a region or a ``shard_map``);
    for a ``shard_map``, whose layouts are fixed, the producers of the operands moved into it.
    A weight MaxText's ``shard_map`` of experts reads whole, gathered once by the sharding
    constraint before it for the forward and backward kernels alike, is otherwise gathered
    once per kernel (Qwen3-235B on v5p-512: 31.7 s predicted, 27.6 s gathered once)."""
    prog = evaluate.prog
    grouped = {o.name for g in evaluate.groups for o in g}
    by_op = {o.name: o for o in prog.ops}
    out: list[Op] = []
    for cost in sorted((c for c in pred.ops if c.comm_s > 0 and c.op in by_op),
                       key=lambda c: -c.comm_s):  # fmt: skip
        op = by_op[cost.op]
        if op.how == "manual":
            (step,) = dataflow(prog, sched, only=(op.name,))
            moves = sorted(filter(_gathers, step.moves), key=lambda mv: -mv.value.nbytes)
            tried = [prog.producer.get(mv.value.name) for mv in moves]
        else:
            tried = [op]
        for o in tried:
            if (o is not None and o.name not in grouped and o.how not in ("region", "manual")
                    and o not in out):  # fmt: skip
                out.append(o)
        if len(out) >= ops:
            break
    return out[:ops]


def _gathers(mv) -> bool:
    """Whether move ``mv`` communicates: some dimension loses a mesh axis it is split over (a
    move that only splits further is a local slice)."""
    return any(set(src) - set(dst) for src, dst in zip(mv.src, mv.dst))


def arriving_layouts(op: Op, moves) -> list[dict]:
    """For each of ``op``'s operand ``moves``, the assignment that splits ``op``'s loops as the
    operand arrives (its ``src`` layout), so that it needs no move; where a split dimension is
    not one loop of ``op``, none. A sharding constraint asking a gradient whole that arrives
    reduce-scattered (:mod:`planner.program.scattered_sums`) may keep it split this way.

    Example:
        >>> arriving_layouts(op, step.moves)  # doctest: +SKIP
        [{'d1': ('fsdp#0', 'fsdp#1')}]
    """
    out = []
    for mv in moves:
        access = next((a for a in op.operands if a.value is mv.value), None)
        if access is None or not any(mv.src):
            continue
        loops = {}
        for axes, dims in zip(mv.src, access.dims):
            if axes and len(dims) != 1:
                break
            if axes:
                loops[dims[0]] = tuple(axes)
        else:
            if loops not in out:
                out.append(loops)
    return out


# One prime factor at a time (Tofu's recursion) finds splits by part of an axis, but costs a DP
# per factor: measured on the 2-layer transformer step it took 9 s of 13 on 64 devices and 150 s
# on 4096, and its plans were no faster than those of one mesh axis at a time.
PER_FACTOR_MAX = 4

ZERO_MIN_BYTES = 1 << 16  # inputs smaller than this stay as their consumers want them


def zero_layouts(prog: Program, shape: MeshShape, sched: Schedule) -> dict:
    """ZeRO-3 layouts at rest: every input of at least ``ZERO_MIN_BYTES`` that ``sched`` leaves
    whole on some mesh factors is stored split over those factors too, along its first dimension
    they divide (the data flow gathers it before use)."""
    out = {}
    for v in prog.inputs:
        if v.nbytes < ZERO_MIN_BYTES:
            continue
        spec = input_spec(prog, sched, v)
        used = {a for axes in spec for a in axes}
        free = [f for f in shape.factor_names if f not in used]
        for k in range(len(free), 0, -1):  # the most factors that divide some dimension
            extra = tuple(free[:k])
            parts = math.prod(shape.factor_size[f] for f in extra)
            dims = [d for d, n in enumerate(v.shape)
                    if n % (parts * math.prod(shape.factor_size[a] for a in spec[d])) == 0]  # fmt: skip
            if dims:
                d = dims[0]
                out[v.name] = spec[:d] + (spec[d] + extra,) + spec[d + 1 :]
                break
    return out


def _zero_where_due(prog: Program, shape: MeshShape, seeds: list, results: list,
                    evaluate: _Evaluator, limit) -> list:  # fmt: skip
    """The ZeRO candidates of ``seeds`` (:func:`_zero`) the search weighs beside ``results``: under
    a memory limit all of them; without one only those at least as fast as the fastest of
    ``results``. A leaner ZeRO plan a little slower would win there on a tie (:data:`TIME_TIE`)
    and, fitting the default limit, end the search that limit's search improves on: Qwen3-235B
    at expert parallelism 8 on v5p-512 took such a plan at 26.26 s where the search under the
    limit finds 25.79 s, faster and leaner.

    Example:
        >>> _zero_where_due(prog, shape, fastest, results, evaluate, None)  # doctest: +SKIP
        [(89.7, 86180000000, <Schedule>, <Prediction>)]
    """
    zero = _zero(prog, shape, seeds, evaluate)
    if limit is not None:
        return zero
    quickest = min((r[0] for r in results), default=math.inf)
    return [z for z in zero if z[0] <= quickest]


def _zero(prog: Program, shape: MeshShape, results: list, evaluate: _Evaluator) -> list:
    """Every candidate again with its large inputs stored ZeRO-style (:func:`zero_layouts`): a plan
    that keeps parameters and optimizer state split at rest and gathers them before use may fit
    where none of the others does, and may be faster (its update runs on each device's shard):
    MaxText's DeepSeek-V3 with its ring of experts on v5p-1024, 89.7 s predicted so, 91.1 s by
    the fastest candidate without (see :func:`_zero_where_due`)."""
    out = []
    for _, _, sched, _ in results:
        if sched is None:
            continue
        stored = zero_layouts(prog, shape, sched)
        if stored:
            full = {name: loops for name, loops in sched.assign.items() if loops}
            out.append(evaluate(full, default="replicate", stored=stored))
            # The ops the candidate left whole follow the split layouts at rest: the optimizer's
            # update runs on each device's shard, its gradient reduce-scattered (ZeRO).
            out.append(evaluate(full, default="propagate", stored=stored))
    return out


def _dynamic(assign, factor_groups, ops, sizes, evaluate, dp: ChainDP):
    """One DP per factor group (:mod:`planner.solver.chain`); the whole program is simulated under
    the result, propagated across segments and segment by segment, and the better is kept."""
    for group in factor_groups:
        size = math.prod(sizes[f] for f in group)
        opts = [_options(o, assign[o.name], size, sizes, evaluate.xla) for o in ops]
        candidates = [[_extend(assign[o.name], loop, group) for loop in opt]
                      for o, opt in zip(ops, opts)]  # fmt: skip
        picks = dp.solve(candidates)
        assign = _with(assign, [opt[k] for opt, k in zip(opts, picks)], ops, group)
    explicit = dp.assignment([assign[o.name] for o in ops])
    scores = [evaluate(assign)]
    if explicit is not None:
        scores.append(evaluate(explicit, default="replicate"))
    return min(scores, key=lambda r: r[:2])


def _greedy(assign, groups, ops, sizes, evaluate, step_limit):
    for group in groups:
        size = math.prod(sizes[f] for f in group)
        opts = [_options(o, assign[o.name], size, sizes, evaluate.xla) for o in ops]
        if math.prod(len(x) for x in opts) <= step_limit:
            candidates = [_with(assign, c, ops, group) for c in itertools.product(*opts)]
            assign = min(candidates, key=lambda a: evaluate(a)[:2])
        else:
            assign = _with(assign, _descend(assign, opts, ops, group, evaluate), ops, group)
    return evaluate(assign)


def _descend(assign: Assignment, opts, ops, factor: tuple[str, ...], evaluate) -> list[str | None]:
    """Coordinate descent over the anchors' choices for one factor."""
    choices: list[str | None] = [None] * len(ops)

    def score(k: int, loop: str | None):
        trial = list(choices)
        trial[k] = loop
        return evaluate(_with(assign, trial, ops, factor))[:2]

    improved = True
    while improved:
        improved = False
        for k in range(len(ops)):
            best_loop = min(opts[k], key=lambda loop, k=k: score(k, loop))
            if score(k, best_loop) < score(k, choices[k]):
                choices[k] = best_loop
                improved = True
    return choices


def _seeds(prog: Program, shape: MeshShape, evaluate: _Evaluator) -> list:
    """The hand-written strategies over the whole mesh, simulated as starting points that the
    searched plans must beat (Megatron's q/k/v-by-heads split, for one, is a joint choice of
    several groups that a per-segment search can miss), and the expert strategies of
    :func:`planner.solver.strategies.expert_schedules` (data parallelism and FSDP over every axis;
    FSDP over all but the last axis with tensor parallelism over the last), so that the plan is
    never predicted slower than what an expert writes, nor over the memory limit where theirs
    fits."""
    axes = tuple(a for a in shape.axis_names if shape.sizes[a] > 1)  # as explain()'s rows
    if not axes:
        return []
    makers = [
        lambda: strategies.data_parallel(prog, axes),
        lambda: strategies.megatron(prog, axes),
        lambda: strategies.data_and_model(prog, axes[:1], axes[1:]),
    ]
    out = []
    for make in makers:
        try:
            out.append(evaluate(make()))
        except ValueError:  # not applicable to this program
            continue
    out += [evaluate.schedule(sched) for sched in strategies.experts(prog, shape.sizes).seeds]
    return out


def _asked(prog: Program, shape: MeshShape, requested: Requested, evaluate: _Evaluator) -> list:
    """The user's own layout scored, where the program asks for one that fits the mesh: each
    way of completing it (:meth:`Requested.completions`) a candidate (MaxText's DeepSeek-V3
    tiny runs 1.09x as fast completed by the ops' loop order as by XLA's rule for products)."""
    if not requested.asks(prog, shape, evaluate.xla):
        return []
    try:
        return [evaluate.schedule(s) for s in requested.completions(prog, shape, evaluate.xla)]
    except ValueError:
        return []


def _result(score, evaluate: _Evaluator, limit):
    time_s, _, sched, pred = score
    if sched is None or time_s == math.inf:
        least = evaluate.least
        peak = None if least is None else peak_buffers(evaluate.prog, least[1], evaluate.cal)
        raise MemoryLimitError(limit, peak, leanest=evaluate.leanest)
    return sched, pred


LEANER = 0.75
"""A plan over :data:`LEANER_FROM` of the memory limit is searched for again under this fraction of
its peak (:func:`leaner`)."""
LEANER_FROM = 0.5


def leaner(prog, shape: MeshShape, calibration: Calibration, found: tuple, limit: float,
           xla: bool = True, requested: Requested | None = None, rounds: int = 2,
           memo: Evaluations | None = None) -> tuple:  # fmt: skip
    """``found`` (a ``(schedule, prediction)`` the search chose under the memory ``limit``), or
    where it takes over :data:`LEANER_FROM` of the limit, a plan as fast (within
    :data:`TIME_TIE`) in less memory: the search under :data:`LEANER` of its peak, up to
    ``rounds`` times. The search trades memory for time only until its fastest plan fits, and
    keeps what that plan holds (MaxText's Llama 2 7B on 64 v5p chips: 75.8 GiB at 2.501 s,
    where 47.2 GiB runs in 2.509 s); memory left free is batch or sequence for the user.
    The tighter searches run without the greedy fallback (``search``'s ``greedy_fallback``): a
    plan that fits only as the greedy passes trade time for memory is no plan as fast, and on
    MaxText's Qwen3-235B at tensor 4 with ``save_dot_with_context_except_mlp`` those passes
    took 221 s of the search's 244 to find none. ``memo``: as :func:`search`'s."""
    if found[1].peak_bytes <= LEANER_FROM * limit:
        return found
    for _ in range(rounds):
        try:
            tighter = search(prog, shape, calibration, found[1].peak_bytes * LEANER, xla=xla,
                             requested=requested, memo=memo, greedy_fallback=False)  # fmt: skip
        except MemoryLimitError:
            break
        if tighter[1].time_s > found[1].time_s * (1 + TIME_TIE):
            break
        found = tighter
    return found


def _tied_or_bounded(prog, shape: MeshShape, calibration: Calibration, found: tuple, limit: float,
                     xla: bool, requested, memo: Evaluations) -> tuple:  # fmt: skip
    """``found`` (the search without a limit chose it, fitting ``limit``, over a faster plan: a tie,
    :data:`TIME_TIE`), or the plan of the search under ``limit`` where :func:`best_of` prefers
    that: the search without a limit weighs the plans that do not fit too, and its tie took a
    leaner one that fits where the plans that fit have a faster, leaner one (MaxText's
    DeepSeek-V3 with its ring of experts on v5p-1024: 91.1 s taken, 89.7 s under the limit).

    Example:
        >>> _tied_or_bounded(prog, shape, cal, (sched, pred), 92e9, True, None, memo)  # doctest: +SKIP
        (<Schedule>, <Prediction 89.7 s>)
    """
    try:
        bounded = search(prog, shape, calibration, limit, xla=xla, requested=requested, memo=memo)
    except MemoryLimitError:
        return found
    best = best_of([(p.time_s, p.peak_bytes, s, p) for s, p in (found, bounded)])
    return best[2], best[3]


def search_within(prog, mesh: MeshShape | dict, calibration: Calibration, memory_limit_bytes=AUTO,
                  fastest: tuple | None = None, xla: bool = True,
                  requested: Requested | None = None, memo: Evaluations | None = None):  # fmt: skip
    """:func:`search` under ``plan``'s ``memory_limit_bytes`` (see :mod:`planner.cost.memory`);
    ``fastest``: the ``(schedule, prediction)`` of the search without a limit, where the caller
    has it already; ``xla``, ``requested``, ``memo``: as :func:`search`'s (one memo serves
    every search made here)."""
    memo = Evaluations() if memo is None else memo
    shape = mesh_shape(mesh)
    num_devices = shape.num_devices
    limit = resolve_memory_limit(memory_limit_bytes, calibration, num_devices)
    if memory_limit_bytes != AUTO or limit is None:
        found = search(prog, shape, calibration, limit, xla=xla, requested=requested, memo=memo)
        return found if limit is None else leaner(prog, shape, calibration, found, limit, xla,
                                                  requested, memo=memo)  # fmt: skip
    sched, pred = fastest or search(prog, shape, calibration, None, xla=xla,
                                    requested=requested, memo=memo)  # fmt: skip
    if pred.peak_bytes <= limit:
        found = (sched, pred)
        if pred.time_s > memo.fastest_s(prog) * (1 + 1e-9):
            found = _tied_or_bounded(prog, shape, calibration, found, limit, xla, requested, memo)
        return leaner(prog, shape, calibration, found, limit, xla, requested, memo=memo)
    try:
        found = search(prog, shape, calibration, limit, xla=xla, requested=requested, memo=memo)
        return leaner(prog, shape, calibration, found, limit, xla, requested, memo=memo)
    except MemoryLimitError as e:
        capacity = limit / (1 - MEMORY_RESERVE)
        note = (f"the default: {1 - MEMORY_RESERVE:.0%} of {capacity / 2**30:.2f} GiB per device "
                f"from the {calibration.backend} calibration; pass another calibration, a larger "
                "memory_limit_bytes or None for no limit")  # fmt: skip
        raise e.replaced(note=note) from None
