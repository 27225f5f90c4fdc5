"""What a plan is compared with, priced once: full replication, the experts' strategies and the
layout the program asks for. ``explain()`` and the reports read these rows; none of them prices.

Example:
    >>> rows = compare(prog, {"a": 2}, cal, {"data parallelism over a": dp}, None)  # doctest: +SKIP
    >>> rows.experts[0][1].time_s
    0.0123
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from planner.cost.simulator import Prediction, replicated, simulate
from planner.program.ir import Program
from planner.program.schedule import Schedule
from redist.calibration import Calibration


@dataclasses.dataclass(frozen=True)
class Comparisons:
    """The rows a plan is compared with, each predicted on the plan's calibration and mesh:
    ``replicated`` (the whole step on every device), ``experts`` (label -> prediction, or why the
    strategy does not apply to the program) and ``asked`` (the program's own layout: its sharding
    constraints and its inputs' shardings; ``None`` where it asks for none)."""

    replicated: Prediction
    experts: tuple[tuple[str, Prediction | str], ...]
    asked: Prediction | None = None


def compare(prog: Program, sizes: Mapping[str, int], calibration: Calibration,
            experts: Mapping[str, Schedule | str], asked: Schedule | None,
            whole: Prediction | None = None) -> Comparisons:  # fmt: skip
    """The :class:`Comparisons` of a plan of ``prog`` on a mesh of ``sizes``: ``experts`` are the
    strategies' schedules by label, or a reason in place of one
    (:func:`planner.solver.strategies.experts`, the schedules the search seeds with); ``whole``:
    full replication's prediction where the caller has it."""
    rows = tuple((label, s if isinstance(s, str) else simulate(prog, s, calibration))
                 for label, s in experts.items())  # fmt: skip
    return Comparisons(
        whole or replicated(prog, dict(sizes), calibration),
        rows,
        None if asked is None else simulate(prog, asked, calibration),
    )
