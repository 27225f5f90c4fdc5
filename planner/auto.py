"""``plan``, ``auto_shard`` and ``load``: the functions that make
:class:`planner.autoplan.AutoPlan`s.

``plan`` analyses a function, searches a schedule (within a memory limit, pipelined over
``pipeline_axis`` where that is faster) and returns the plan; ``auto_shard`` plans on each new
signature and runs; ``load`` restores a saved plan without searching.

Example:
    >>> p = planner.plan(step_fn, params, batch, mesh=mesh)        # doctest: +SKIP
    >>> print(p.explain()); p.in_specs; p.to_json()
    >>> fast = planner.auto_shard(step_fn, mesh=mesh)              # plans once per input shapes
    >>> q = planner.load("step.plan.json", step_fn, params, batch, mesh=mesh)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import warnings
from collections.abc import Callable, Sequence

import jax

from planner.autoplan import AutoPlan, mesh_devices
from planner.calls import Signature, differences
from planner.cost.memory import (
    AUTO,
    MEMORY_RESERVE,
    MemoryLimitError,
    default_calibration,
    resolve_memory_limit,
)
from planner.cost.simulator import replicated, simulate
from planner.given_layouts import given_specs
from planner.persistence import (
    FORMAT,
    VERSION,
    fingerprint,
    mesh_differences,
    prediction_record,
    program_differences,
    saved_remat,
    saved_schedule,
)
from planner.program.analysis import analyze
from planner.program.constraints import requested_assignment, where
from planner.program.ir import Program
from planner.program.manual import check_mesh
from planner.program.remat import RematDecision, candidate_names, choices_in, choosing
from planner.report.leaves import state_pairs
from planner.solver.requested import Requested
from planner.solver.schedule_search import Evaluations, search_within
from planner.solver.staged import search_staged
from planner.solver.ties import TIME_TIE
from planner.target.compiled import keep_compiled, on_context_devices
from planner.target.confirm import MARGIN, checks_compiled, confirmed
from planner.target.ranked import check_rank, ranked
from redist.calibration import Calibration
from redist.specs import mesh_shape
from redist.types import MeshShape


def plan(
    fn: Callable,
    *args,
    mesh,
    memory_limit_bytes: int | float | str | None = AUTO,
    calibration: Calibration | None = None,
    donate_argnums: int | Sequence[int] = (),
    pipeline_axis: str | None = None,
    microbatches: int | Sequence[int] | None = None,
    pipeline_repeats: int | Sequence[int] | None = None,
    check_memory: str = "auto",
    xla_only_splits: bool = True,
    constraints: str = "hint",
    compare="auto",
    rank_by: str = "model",
    **kwargs,
) -> AutoPlan:
    """Analyse ``fn(*args, **kwargs)`` (pytrees of arrays or ``jax.ShapeDtypeStruct``s; arguments
    without arrays are static, see :mod:`planner.calls`), search the best schedule on ``mesh`` (a
    ``Mesh``, an ``AbstractMesh`` or ``{name: size}``), return the plan.

    ``calibration`` prices time: by default the shipped one for the mesh's devices (a mesh from
    :func:`planner.topology_mesh` is priced as its TPU) or else for ``jax.default_backend()``;
    plan for another machine with e.g. ``Calibration.named("tpu_v5p")`` (see
    :mod:`redist.calibration`).

    ``memory_limit_bytes``: peak bytes per device no plan may be predicted over. ``"auto"`` (the
    default): the calibration's memory per device less :data:`planner.cost.memory.MEMORY_RESERVE`
    (10%); a number: that; ``None`` or ``float("inf")``: no limit. When nothing fits,
    :class:`planner.cost.memory.MemoryLimitError` names the smallest peak found and its largest
    buffers, and holds the plan of that peak (``e.leanest``, to read or run anyway).

    ``donate_argnums``: the arguments whose buffers each call donates, as ``jax.jit``'s (e.g. the
    parameters and optimizer state of a training step): outputs of the same shape, dtype and
    layout are written into them, which the predicted peak counts on, and :meth:`AutoPlan.jit`
    donates them.

    ``pipeline_axis``: a mesh axis the plan may run the program's scanned layers over as GPipe
    stages (:mod:`planner.layout.staging`): the layers split into as many stages as the axis has
    devices, the batch into ``microbatches`` (a count, counts to try, or by default P, 2P, 4P
    and 8P), the layers searched on the other axes; the plan is pipelined where that is
    predicted faster than the best plan without a pipeline (or where only it fits).
    ``pipeline_repeats``: the rounds of a circular pipeline to try (a count or counts; by
    default 1, 2 and 4 where the layers allow): each stage runs ``1 / R`` of its layers per tick
    and every microbatch goes round the stages ``R`` times, the bubble ``R`` times smaller for
    the stacked values put in circular order each step (:class:`planner.program.schedule.Stages`).

    ``check_memory``: ``"compiled"`` compiles the plan for ``mesh`` and, where its compiled
    memory is over the limit, searches again (:mod:`planner.target.confirm`); ``"predicted"`` trusts the
    memory model; ``"auto"`` (the default): compiled where the mesh's devices are TPUs (attached,
    or :func:`planner.topology_mesh`'s), whose compiler can count more than the model predicts,
    and the plan is predicted over half the limit.

    A ``jax.checkpoint`` whose policy is :func:`planner.remat_policy` is planned once per
    candidate policy, and the fastest plan that fits is kept (:mod:`planner.program.remat`).

    ``xla_only_splits``: the plan may split work in ways only XLA's partitioner runs, which
    :meth:`AutoPlan.jit` (and calling the plan) uses: loops the mesh does not divide (a vocabulary
    of 50,257 over 8 devices, as padded tiles) and the dimension a gather or scatter looks up (an
    embedding's vocabulary: each device its own rows, the rest masked). ``False``: every split
    also runs under ``plan.lowered``, the explicit lowering.

    ``constraints``: what to do with the program's sharding constraints
    (``with_sharding_constraint``, ``reshard``, flax's and Keras's logical constraints):
    ``"hint"`` (the default) prices the layout they and ``compare`` ask for as a whole-program
    strategy beside the experts' and starts the search from it, which departs from it where it
    predicts better; ``"keep"``: every constraint holds in the plan; ``"drop"``: they are
    ignored. ``compare``: the inputs' layouts to price that strategy with: ``in_shardings`` (a
    pytree of ``NamedSharding`` / ``PartitionSpec`` / ``None`` over the arguments, or a prefix
    of it), ``"auto"`` (the default: each ``jax.Array`` argument's own ``NamedSharding``) or
    ``None``. ``plan.explain()`` has its row ("your layout") and says which constraints the plan
    departs from; :func:`price` prices it alone (:mod:`planner.solver.requested`).

    ``rank_by``: ``"model"`` (the default) returns the plan the cost model prices best;
    ``"compiled"`` then compiles it, the expert strategies and the layout the program asks for
    (the :data:`planner.target.ranked.CANDIDATES` fastest predicted within the memory limit) and
    returns the fastest compiled program as the calibration prices it, which ranks plans closer
    to how they run (:mod:`planner.target.ranked`; ``plan.compiled_ranking``, and
    ``explain()``, say how each compiled). It costs a compile per candidate.
    """
    check_rank(rank_by)
    mesh = on_context_devices(mesh)  # the context's device objects, where they are the same
    sig = Signature.of(args, kwargs)
    traced, values = sig.traced(fn, args, kwargs)
    positional = [() if a.static else x for a, x in zip(sig.args, args)]  # static: no inputs
    out_tree = jax.tree.structure(jax.eval_shape(traced, *values))

    def analyzed() -> Program:
        return _program(traced, values, positional, donate_argnums, sig.in_tree, out_tree)

    prog = analyzed()
    shape = mesh_shape(mesh)
    check_mesh(prog.ops, shape.sizes, where)
    sizes = shape.sizes
    requested = _requested(prog, values, positional, compare, constraints, shape, xla_only_splits)
    calibration = calibration or default_calibration(mesh)
    limit = resolve_memory_limit(memory_limit_bytes, calibration, shape.num_devices)
    choices, searching = choices_in(prog.jaxpr), [0.0]
    traces: dict[str, Program] = {}
    searches: dict[str | None, list] = {}  # candidate -> [(limit, result or MemoryLimitError)]
    made: dict[str | None, Evaluations] = {}  # candidate -> the schedules its searches made

    def traced_as(name):
        if name not in traces:
            with choosing(name):
                traces[name] = analyzed()
        return traces[name]

    def search_under(limit_bytes):
        """``(program, schedule, prediction, remat decision)`` of the best plan under
        ``limit_bytes`` (the user's ``memory_limit_bytes`` where it is that limit)."""
        bound = math.inf if limit_bytes is None else limit_bytes
        given = memory_limit_bytes if limit_bytes == limit else limit_bytes
        start = time.perf_counter()

        def search_for(name, p):
            tried = searches.setdefault(name, [])
            fastest = next((r for b, r in tried if b == math.inf and isinstance(r, tuple)), None)
            return _remembered(tried, bound, lambda: _search(
                p, shape, calibration, given, pipeline_axis, (microbatches, pipeline_repeats),
                fastest, xla_only_splits, requested, made.setdefault(name, Evaluations())))  # fmt: skip

        def free_for(name, p):
            return _remembered(searches.setdefault(name, []), math.inf, lambda: _search(
                p, shape, calibration, None, pipeline_axis, (microbatches, pipeline_repeats),
                None, xla_only_splits, requested, made.setdefault(name, Evaluations())))  # fmt: skip

        try:
            if choices:
                return _choose_remat(candidate_names(choices), traced_as, search_for,
                                     free_for if bound < math.inf else None)  # fmt: skip
            try:
                return (prog, *search_for(None, prog), None)
            except MemoryLimitError as e:
                raise _leanest_found(e, prog, None) from None
        finally:
            searching[0] += time.perf_counter() - start

    def plan_of(found) -> AutoPlan:
        prog, sched, pred, remat = found
        own = next((o for m in made.values() if (o := m.own_best(sched)) is not None), None)
        return AutoPlan.of(prog, sched, mesh, prediction=pred, calibration=calibration,
                           signature=sig, out_tree=out_tree, search_s=searching[0],
                           replicated=replicated(prog, sizes, calibration),
                           donate_argnums=_argnums(donate_argnums, len(args)), remat=remat,
                           asked=requested.asked(prog, shape, xla_only_splits, calibration),
                           on_its_own=own)  # fmt: skip

    if checks_compiled(check_memory, mesh_devices(mesh), limit):
        margin = MARGIN if check_memory == "auto" else None
        # the reserve is for what the model does not see; the compiler's peak sees it all, so
        # under the default limit a compiled plan may use the device's whole memory
        capacity = limit / (1 - MEMORY_RESERVE) if memory_limit_bytes == AUTO else limit

        def yours() -> AutoPlan | None:
            """The layout the program asks for (constraints, inputs) as a plan, or None."""
            sched = requested.asked(prog, shape, xla_only_splits, calibration)
            return (
                None
                if sched is None
                else plan_of((prog, sched, simulate(prog, sched, calibration), None))
            )

        try:
            p, checks = confirmed(search_under, plan_of, limit, margin, capacity, yours)
        except MemoryLimitError as e:
            raise _leanest_planned(e, plan_of) from None
        checked = dataclasses.replace(p, memory_checks=checks)
        keep_compiled(p, checked)  # the check's compile is the plan's
        return ranked(checked, limit, capacity) if rank_by == "compiled" else checked
    try:
        found = plan_of(search_under(limit))
    except MemoryLimitError as e:
        raise _leanest_planned(e, plan_of) from None
    return ranked(found, limit, None) if rank_by == "compiled" else found


def _leanest_found(e: MemoryLimitError, prog: Program, remat) -> MemoryLimitError:
    """``e`` (a search's) with its leanest ``(schedule, prediction)`` as ``plan``'s search
    finds plans: ``(program, schedule, prediction, remat decision)``."""
    return e.replaced(leanest=None if e.leanest is None else (prog, *e.leanest, remat))


def _leanest_planned(e: MemoryLimitError, plan_of: Callable) -> MemoryLimitError:
    """``e`` with its leanest plan found made an :class:`AutoPlan` (by ``plan_of``)."""
    return e.replaced(leanest=None if e.leanest is None else plan_of(e.leanest))


def _remembered(tried: list, bound: float, search: Callable):
    """``search()`` under the limit ``bound``, or what an earlier search under a larger limit
    ``tried`` (``[(limit, result or MemoryLimitError)]``) implies: nothing fits where nothing
    fitted under more; the best plan under more is the best where it still fits."""
    for earlier, result in tried:
        if isinstance(result, MemoryLimitError):
            if bound <= earlier:
                raise result
        elif result[1].peak_bytes <= bound <= earlier:
            return result
    try:
        result = search()
    except MemoryLimitError as e:
        tried.append((bound, e))
        raise
    tried.append((bound, result))
    return result


def _choose_remat(names: list[str], traced_as: Callable, search_for: Callable,
                  free_for: Callable | None = None):  # fmt: skip
    """``(program, schedule, prediction, RematDecision)`` of the fastest plan that fits among the
    program traced with each remat candidate (:mod:`planner.program.remat`); where none fits, the
    error of the one whose smallest peak is lowest.

    With ``free_for`` (the search without a memory limit, fast: no memory to trade), every
    candidate's fastest plan comes first; candidates are then searched under the limit fastest
    first, and one whose fastest plan is no faster than the best plan that fits is not searched
    under the limit (no plan of it could be faster): its cost is recorded as ``(that bound,
    None)``. Only candidates whose fastest plans do not fit and might win need the slow search.
    """
    best, costs, errors = None, {}, []  # errors: (MemoryLimitError, candidate, its program)
    bound: dict[str, float] = {}
    if free_for is not None:
        for name in names:
            bound[name] = free_for(name, traced_as(name))[1].time_s
        names = sorted(names, key=bound.__getitem__)  # stable: ties keep the user's order
    for name in names:
        if best is not None and name in bound and bound[name] >= best[2].time_s:
            costs[name] = (bound[name], None)
            continue
        prog = traced_as(name)
        try:
            sched, pred = search_for(name, prog)
        except MemoryLimitError as e:
            costs[name] = None
            errors.append((e, name, prog))
            continue
        costs[name] = (pred.time_s, pred.peak_bytes)
        if best is None or _faster(pred, best[2]):
            best = (prog, sched, pred, name)
    if best is None:
        e, name, prog = min(errors, key=lambda x: _least_peak(x[0]))
        raise _leanest_found(e, prog, RematDecision(name, costs))
    prog, sched, pred, name = best
    return prog, sched, pred, RematDecision(name, costs)


def _least_peak(e: MemoryLimitError) -> float:
    """The smallest peak ``e`` names, bytes (infinite where it names none)."""
    return math.inf if e.peak is None else e.peak.bytes


def _faster(a, b, tie: float = TIME_TIE) -> bool:
    """``a`` predicted faster than ``b``; as fast (within ``tie``, relative, as the search weighs
    them: :data:`planner.solver.schedule_search.TIME_TIE`): with a lower peak."""
    if abs(a.time_s - b.time_s) <= tie * max(a.time_s, b.time_s):
        return a.peak_bytes < b.peak_bytes
    return a.time_s < b.time_s


def _search(prog, shape: MeshShape, calibration, memory_limit_bytes, pipeline_axis, pipelining,
            fastest=None, xla=True, requested=None, memo=None):  # fmt: skip
    """The best schedule, with a pipeline over ``pipeline_axis`` where that is better
    (``pipelining``: the microbatch and repeat counts to try); ``fastest``: the search's result
    without a memory limit, where it was made already; ``xla``: splits only XLA's partitioner
    runs are allowed (:func:`planner.solver.search`); ``requested``: the layout the program asks
    for (:mod:`planner.solver.requested`); ``memo``: the schedules earlier searches of ``prog``
    made (:class:`planner.solver.schedule_search.Evaluations`)."""
    microbatches, repeats = pipelining
    if pipeline_axis is None:
        if microbatches is not None:
            raise ValueError("microbatches needs a pipeline_axis to pipeline over")
        if repeats is not None:
            raise ValueError("pipeline_repeats needs a pipeline_axis to pipeline over")
        return search_within(prog, shape, calibration, memory_limit_bytes, fastest, xla, requested,
                             memo)  # fmt: skip

    limit = resolve_memory_limit(memory_limit_bytes, calibration, shape.num_devices)
    flat, error = None, None
    try:
        flat = search_within(prog, shape, calibration, memory_limit_bytes, xla=xla,
                             requested=requested, memo=memo)  # fmt: skip
    except MemoryLimitError as e:
        error = e
    piped = search_staged(prog, shape, calibration, limit, pipeline_axis, microbatches, repeats)
    if flat is None and piped is None:
        raise error
    if piped is None or (flat is not None and flat[1].time_s <= piped[1].time_s):
        return flat
    return piped


def _requested(prog: Program, values, positional, compare, constraints: str, shape: MeshShape,
               xla: bool) -> Requested:  # fmt: skip
    """What the program asks for (:class:`planner.solver.requested.Requested`); warns naming the
    constraints that cannot hold on ``shape`` (they are then ignored)."""
    requested = Requested(constraints)  # checks the mode first
    if compare is None:
        stored = ()
    elif isinstance(compare, str):  # "auto": the arrays' own, of every non-static argument
        stored = given_specs(tuple(values), compare, shape)
    else:  # in_shardings, over the positional arguments
        stored = given_specs(tuple(positional), compare, shape)
    if constraints != "drop":
        problems = requested_assignment(prog, shape, xla)[1]
        if problems:
            warnings.warn("planner: these sharding constraints cannot hold on the mesh "
                          f"{dict(shape.sizes)} and are ignored: " + "; ".join(problems),
                          stacklevel=3)  # fmt: skip
    return dataclasses.replace(requested, stored=stored)


def _argnums(donate_argnums, n: int) -> tuple[int, ...]:
    nums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    for k in nums:
        if not isinstance(k, int) or not -n <= k < n:
            raise ValueError(f"donate_argnums={donate_argnums!r}: the function takes {n} "
                             "positional arguments; give their positions")  # fmt: skip
    return tuple(sorted({k % n for k in nums}))


def donating(prog: Program, args: tuple, donate_argnums) -> Program:
    """``prog`` with the inputs of the positional ``args`` numbered ``donate_argnums`` donated
    (:attr:`planner.program.ir.Program.donated`): ``prog.inputs`` are the leaves of ``args`` in
    order."""
    nums = _argnums(donate_argnums, len(args))
    if not nums:
        return prog
    names, k = [], 0
    for i, arg in enumerate(args):
        n = len(jax.tree.leaves(arg))
        if i in nums:
            names += [v.name for v in prog.inputs[k : k + n]]
        k += n
    return dataclasses.replace(prog, donated=frozenset(names))


def returning(prog: Program, in_tree, out_tree) -> Program:
    """``prog`` with the state it returns in place of an argument
    (:attr:`planner.program.ir.Program.returned`: the arguments' leaves against the outputs' of
    their tree position, shapes and dtypes, :func:`planner.report.leaves.state_pairs`), which
    every plan returns in the layout it takes it in."""
    pairs = state_pairs(prog, in_tree, out_tree)
    named = tuple((prog.inputs[i].name, prog.outputs[o].name) for i, o in pairs)
    return dataclasses.replace(prog, returned=named)


def _program(traced, values, positional, donate_argnums, in_tree, out_tree) -> Program:
    """The program of ``traced`` on ``values``, its donated inputs (:func:`donating`) and the
    state it returns (:func:`returning`) marked."""
    prog = donating(analyze(traced, *values), positional, donate_argnums)
    return returning(prog, in_tree, out_tree)


def price(
    fn: Callable,
    *args,
    mesh,
    in_shardings="auto",
    constraints: str = "keep",
    calibration: Calibration | None = None,
    donate_argnums: int | Sequence[int] = (),
    xla_only_splits: bool = True,
    **kwargs,
) -> AutoPlan:
    """The layout the program already asks for, as a plan (nothing searched), predicted on the
    same model as :func:`plan`'s plans and the experts': its inputs laid out as
    ``in_shardings`` (as :func:`plan`'s ``compare``: a pytree of ``NamedSharding`` /
    ``PartitionSpec`` / ``None`` over the positional arguments, or ``"auto"``, each array's own
    sharding), its sharding constraints kept (``constraints="keep"``, or ``"drop"``), every other
    op laid out by propagation from them, as XLA's partitioner does. The result runs
    (``p.jit()``), explains itself and compiles like any plan: the user's own layout, priced.

    Example:
        >>> mine = planner.price(step, state, batch, mesh=mesh,
        ...                      in_shardings=(state_shardings, batch_shardings))  # doctest: +SKIP
        >>> mine.prediction.time_s, planner.plan(step, state, batch, mesh=mesh).prediction.time_s
    """
    if constraints not in ("keep", "drop"):
        raise ValueError(f"price: constraints must be 'keep' or 'drop', got {constraints!r}")
    mesh = on_context_devices(mesh)
    sig = Signature.of(args, kwargs)
    traced, values = sig.traced(fn, args, kwargs)
    positional = [() if a.static else x for a, x in zip(sig.args, args)]
    out_tree = jax.tree.structure(jax.eval_shape(traced, *values))
    prog = _program(traced, values, positional, donate_argnums, sig.in_tree, out_tree)
    shape = mesh_shape(mesh)
    check_mesh(prog.ops, shape.sizes, where)
    calibration = calibration or default_calibration(mesh)
    requested = _requested(prog, values, positional, in_shardings, constraints, shape,
                           xla_only_splits)  # fmt: skip
    sched = requested.schedule(prog, shape, xla_only_splits, calibration)
    return AutoPlan.of(prog, sched, mesh, prediction=simulate(prog, sched, calibration),
                       calibration=calibration, signature=sig, out_tree=out_tree,
                       replicated=replicated(prog, shape.sizes, calibration),
                       donate_argnums=_argnums(donate_argnums, len(args)), asked=sched)  # fmt: skip


def auto_shard(
    fn: Callable, *, mesh, memory_limit_bytes: int | float | str | None = AUTO
) -> Callable:
    """``fn`` planned on its first call for each signature (input structure, shapes, dtypes and
    static arguments, see :mod:`planner.calls`), then run."""
    plans: dict = {}

    def wrapped(*args, **kwargs):
        key = Signature.of(args, kwargs).key
        if key not in plans:
            plans[key] = plan(fn, *args, mesh=mesh, memory_limit_bytes=memory_limit_bytes,
                              **kwargs)  # fmt: skip
        return plans[key](*args, **kwargs)

    wrapped.plans = plans
    return wrapped


def load(path: str, fn: Callable, *args, mesh, **kwargs) -> AutoPlan:
    """The plan saved at ``path`` for ``fn(*args, **kwargs)`` on ``mesh`` (a ``Mesh``, an
    ``AbstractMesh`` or ``{name: size}`` of the axis names and sizes it was made for), without
    searching. Raises ``ValueError`` saying what differs when the program, the arguments' structure,
    shapes, dtypes or static values, or the mesh's axes are not those of the plan."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(
            f"{path} is not a saved plan of format {FORMAT!r} version {VERSION} (it says "
            f"{doc.get('format')!r} version {doc.get('version')!r})"
        )
    sig = Signature.of(args, kwargs)
    problems = differences(doc["arguments"], sig.describe())
    if problems:
        raise ValueError(f"{path} was made for other arguments: " + "; ".join(problems))
    shape, saved_shape = mesh_shape(mesh), MeshShape(tuple((n, s) for n, s in doc["mesh"]))
    problems = mesh_differences(saved_shape, shape)
    if problems:
        raise ValueError(f"{path} was made for the mesh {saved_shape}: " + "; ".join(problems))
    traced, values = sig.traced(fn, args, kwargs)
    remat = saved_remat(doc)
    with contextlib.nullcontext() if remat is None else choosing(remat.chosen):
        prog = analyze(traced, *values)
    if fingerprint(prog) != doc["program"]["fingerprint"]:
        raise ValueError(
            f"{path} was made for another program: this one " + program_differences(doc, prog)
        )
    out_tree = jax.tree.structure(jax.eval_shape(traced, *values))
    if str(out_tree) != doc["outputs"]:
        raise ValueError(
            f"{path} was made for a function returning {doc['outputs']}; this one returns "
            f"{out_tree}"
        )
    sched = saved_schedule(doc, prog, shape)
    cal = Calibration.from_json(json.dumps(doc["calibration"]["figures"]))
    pred = simulate(prog, sched, cal)
    if prediction_record(pred) != doc["prediction"]:
        warnings.warn(
            f"{path}: the simulator now predicts {pred} for this plan; the file says "
            f"{doc['prediction']}",
            stacklevel=2,
        )
    return AutoPlan.of(prog, sched, mesh, prediction=pred, calibration=cal, signature=sig,
                       out_tree=out_tree, search_s=doc["search_s"],
                       replicated=replicated(prog, shape.sizes, cal), remat=remat)  # fmt: skip
