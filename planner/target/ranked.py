"""Let the compiler rank the few best candidates: ``planner.plan(..., rank_by="compiled")``.

The cost model ranks whole plans of MaxText's tiny step on 8 CPU devices at Spearman 0.84 (21
plans, ``results/ranking``); the same programs compiled and priced from their optimized HLO by
the same calibration (:func:`planner.target.compiled_time.compiled_time`: every kernel at the
roofline, every collective, loops by their trips) rank them at 0.96. So where compiling is
cheap (seconds on CPU, minutes for a pod topology), :func:`ranked` compiles the search's plan,
the expert strategies and the layout the program asks for, the ``candidates`` fastest predicted
of those within the memory limit, and keeps the fastest compiled (:func:`planner.solver.ties.best_of`
on the compiled price and memory: a slower one wins only where it frees a share of the peak that
matters). Every candidate is a plan :meth:`planner.AutoPlan.jit` runs exactly; the ranking is
kept on the plan (``plan.compiled_ranking``) and ``explain()`` prints it.

Example:
    >>> p = planner.plan(step, state, batch, mesh=mesh, rank_by="compiled")   # doctest: +SKIP
    >>> [(c.label, c.compiled_s) for c in p.compiled_ranking]             # doctest: +SKIP
    [('this plan', 0.131), ('FSDP over fsdp x tensor', 0.142), ...]
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

from planner.solver.strategies import experts
from planner.solver.ties import best_of
from planner.target.compiled import keep_compiled, plan_compile_and_report
from planner.target.compiled_time import compiled_time

CANDIDATES = 4
"""How many of the fastest predicted candidates :func:`ranked` compiles by default."""

RANKS = ("model", "compiled")


@dataclasses.dataclass(frozen=True)
class CompiledCandidate:
    """One candidate layout compiled: its prediction, the compiled program priced by the plan's
    calibration (``compiled_s``; ``inf`` where it did not compile or is over the memory) and the
    compiled bytes per device (``memory_analysis()``, :class:`~planner.target.compiled.CompiledReport`)."""

    label: str
    predicted_s: float
    predicted_bytes: float
    compiled_s: float
    compiled_bytes: float | None
    note: str = ""  # why compiled_s is inf
    chosen: bool = False

    def describe(self) -> str:
        if math.isinf(self.compiled_s):
            return f"{self.label} {self.note}"
        return (f"{self.label} {self.compiled_s * 1e3:.1f} ms, "
                f"{(self.compiled_bytes or 0) / 2**20:.2f} MiB")  # fmt: skip


def check_rank(rank: str) -> None:
    """A ``ValueError`` naming ``rank`` unless it is one of :data:`RANKS`."""
    if rank not in RANKS:
        raise ValueError(f"rank_by={rank!r}: expected one of {list(RANKS)}")


def _key(sched) -> str:
    """A schedule as text, the same for the same layout (a value stored whole, or not named)."""
    assign = sorted((op, sorted(loops.items())) for op, loops in sched.assign.items() if loops)
    stored = sorted((v, dims) for v, dims in sched.stored.items() if any(dims))
    return json.dumps([assign, stored], default=list)


def candidates_of(plan, limit: float | None) -> list[tuple[str, object, object]]:
    """``(label, schedule, prediction)`` of the plan, each applicable expert strategy and the
    layout the program asks for, the same schedule once (the plan's label first), fastest
    predicted first, those predicted over ``limit`` left out (the plan itself never)."""
    sizes = plan.mesh_shape.sizes
    compared = plan.comparisons
    rows = [("this plan", plan.schedule, plan.prediction)]
    schedules = experts(plan.program, sizes).rows
    for label, pred in compared.experts:
        if not isinstance(pred, str):
            rows.append((label, schedules[label], pred))
    if plan.asked is not None and compared.asked is not None:
        rows.append(("your layout", plan.asked, compared.asked))
    seen, out = set(), []
    for label, sched, pred in rows:
        key = _key(sched)
        fits = label == "this plan" or limit is None or pred.peak_bytes <= limit
        if key not in seen and fits:
            seen.add(key)
            out.append((label, sched, pred))
    return [out[0], *sorted(out[1:], key=lambda r: r[2].time_s)]


def ranked(plan, limit: float | None, capacity: float | None, candidates: int = CANDIDATES):
    """The fastest compiled of ``plan``'s ``candidates`` fastest predicted candidates
    (:func:`candidates_of`, the plan always among them), as a plan holding the ranking
    (``compiled_ranking``) and the chosen program's compile. ``capacity``: the compiled bytes
    per device over which a candidate does not count (None: the device's, where known). A
    candidate that does not compile is left out with a warning naming it.

    Example:
        >>> best = ranked(p, limit=None, capacity=None)                   # doctest: +SKIP
        >>> best.compiled_ranking[0].label                                 # doctest: +SKIP
        'this plan'
    """
    chosen = candidates_of(plan, limit)[: max(candidates, 1)]
    scores, rows, failed = [], [], []
    for label, sched, pred in chosen:
        candidate = (plan if label == "this plan" else dataclasses.replace(
            plan, schedule=sched, prediction=pred, memory_checks=()))  # fmt: skip
        try:
            compiled, report = plan_compile_and_report(candidate)
        except Exception as e:  # noqa: BLE001 - a candidate the compiler refuses is not chosen
            failed.append(f"{label} ({type(e).__name__}: {str(e)[:200]})")
            compiled, report = None, None
        if compiled is None or not report.fits:
            note = "did not compile" if report is None else "over the device's memory"
            seconds, nbytes = math.inf, None if report is None else report.total_bytes
        elif capacity is not None and report.total_bytes > capacity:
            seconds, nbytes, note = math.inf, report.total_bytes, "over the memory limit"
        else:
            seconds, nbytes, note = compiled_seconds(compiled, candidate), report.total_bytes, ""
        rows.append(CompiledCandidate(label, pred.time_s, pred.peak_bytes, seconds, nbytes, note))
        scores.append((seconds, nbytes if nbytes is not None else math.inf, len(scores), candidate))
    if failed:
        warnings.warn("rank_by='compiled': the compiler refused " + "; ".join(failed), stacklevel=3)
    best = best_of(scores)
    if math.isinf(best[0]):  # none compiled within the memory: the model's choice stands
        best = scores[0]
    rows[best[2]] = dataclasses.replace(rows[best[2]], chosen=True)
    out = dataclasses.replace(best[3], compiled_ranking=tuple(rows))
    keep_compiled(best[3], out)
    return out


def compiled_seconds(compiled, plan) -> float:
    """The step time of ``plan``'s ``compiled`` program at the plan's calibration."""
    return compiled_time(compiled, plan.calibration, plan.mesh_shape.num_devices).seconds


def describe_ranking(rows: tuple[CompiledCandidate, ...]) -> str:
    """The ranking in a line, as ``explain()`` prints it."""
    chosen = next((r.label for r in rows if r.chosen), "this plan")
    return (f"ranked by compiling {len(rows)} candidates (each compiled program priced): "
            + "; ".join(r.describe() for r in rows) + f"; chose {chosen}")  # fmt: skip
