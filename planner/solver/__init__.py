"""Stage 4a, search: the schedule with the best predicted time that fits the memory limit.

Takes a program, the mesh's sizes, a calibration and a memory limit; gives ``(Schedule,
Prediction)``. :mod:`.schedule_search` chooses the heavy ops' splits (exhaustively when few, else
by dynamic programming over layer segments, :mod:`.chain`, and greedy passes), starting from the
hand strategies of :mod:`.strategies`; :mod:`.staged` searches pipelined schedules.

Example:
    >>> sched, pred = search(prog, {"data": 4, "model": 2})          # doctest: +SKIP
"""

from planner.solver.schedule_search import search, search_within
from planner.solver.staged import search_staged

__all__ = ["search", "search_staged", "search_within"]
