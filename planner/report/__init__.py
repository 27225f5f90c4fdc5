"""Reporting a plan: ``explain()``'s one screen (:mod:`.summary`), the roles of its arguments
(:mod:`.leaves`) and the words it is written in (:mod:`.words`). It reads what the cost stage
predicted; it prices nothing.

Example:
    >>> print(summarize(plan).text())          # doctest: +SKIP
"""

from planner.report.summary import Summary, summarize

__all__ = ["Summary", "summarize"]
