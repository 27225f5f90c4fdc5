"""When two plans count as equally fast, and which of them wins: the leaner.

Example:
    >>> best_of([(1.00, 900, "a", None), (1.02, 500, "b", None)])[2]
    'b'
"""

from __future__ import annotations

import math

TIME_TIE = 0.03
"""Plans predicted within this fraction of the fastest count as equally fast, and of those the one
with the smallest predicted peak wins: memory a plan leaves free is batch, KV cache or sequence
length for the user, while 3 % is within the cost model's error (and well within the 0.75-1.05x
a program measures against itself on a shared host)."""

MEMORY_TIE = 0.01
"""A departure from the user's own layout (their sharding constraints and inputs' layouts) that
is no faster must save more than this fraction of its peak: less is within the memory model's
error (measured within 10 % on MaxText's steps at pod scale). MaxText's Llama 3.1 405B on two
v6e-256 slices: a plan departing from its layout at one transpose, predicted as fast in 0.2 MB
less of 30.2 GB, made XLA propagate otherwise, with 1,654 more collectives and 1.08x the
layout's estimated step."""


def best_of(scores: list) -> tuple:
    """The best of ``(time, peak, schedule, prediction)`` scores: the smallest peak among those
    within :data:`TIME_TIE` of the fastest that fits (the fastest first where peaks tie).

    Example:
        >>> best_of([(1.00, 900, None, None), (1.02, 500, None, None), (1.2, 100, None, None)])
        (1.02, 500, None, None)
    """
    fitting = [s for s in scores if not math.isinf(s[0])]
    if not fitting:
        return min(scores, key=lambda r: r[:2])
    fastest = min(s[0] for s in fitting)
    return min((s for s in fitting if s[0] <= fastest * (1 + TIME_TIE)), key=lambda r: (r[1], r[0]))
