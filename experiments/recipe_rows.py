"""What the recipes runners (:mod:`experiments.recipes` on the step written here,
:mod:`experiments.maxtext_code` on MaxText's own) share: a compiled row's figures and the cells
of their tables.

Example:
    >>> gb(96.7e9), gb(None)
    ('96.7', 'n/a')
"""

from __future__ import annotations


def row_of(compiled, report, cal, n: int, optimal_s: float | None) -> dict:
    """The compiled figures of a row; ``recomputed``: the instructions the compiler computes again
    to fit (:func:`redist.hlo.recomputed`); ``compiled_bytes_accessed``: its kernels' bytes, as
    the compiler counts them (loop bodies once)."""
    from planner.target.compiled_time import compiled_time
    from redist.hlo import recomputed

    row = {"fits": report.fits, "compiled_bytes": report.total_bytes,
           "hbm_bytes": report.hbm_bytes, "temp_bytes": report.temp_bytes}  # fmt: skip
    if compiled is not None:
        ct = compiled_time(compiled, cal, n)
        row.update(compiled_collective_s=ct.collective_s, collectives=ct.collectives,
                   recomputed=recomputed(compiled.as_text()),
                   compiled_bytes_accessed=ct.bytes_accessed)  # fmt: skip
        if optimal_s is not None:
            row["estimate_s"] = optimal_s + ct.collective_s
    return row


def gb(x) -> str:
    return "n/a" if x is None else f"{x / 1e9:.3g}"


def seconds(row) -> str:
    """The search seconds (``121.3 (replayed; 337.7 measured)`` for a search replayed on a later
    planner); for a plan refused after compiling, ``(164 s planning)``."""
    if "search_s_measured" in row:
        return f"{row['search_s']:.1f} (replayed; {row['search_s_measured']:.1f} measured)"
    if "search_s" in row:
        return f"{row['search_s']:.1f}"
    return f"({row['planning_s']:.0f} s planning)" if "planning_s" in row else "n/a"


def checks(rounds) -> str:
    """``2 (over, within; 310 s)``: the plan's compile rounds (:mod:`planner.target.confirm`)."""
    if not rounds:
        return ""
    limit = rounds[0]["searched_limit"]
    verdicts = ", ".join(
        "over" if (r["compiled_bytes"] or 0) > (r.get("compiled_limit") or limit) else "within"
        for r in rounds
    )
    return f"{len(rounds)} ({verdicts}; {sum(r['compile_s'] for r in rounds):.0f} s)"
