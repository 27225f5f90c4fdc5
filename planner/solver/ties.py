"""When two plans count as equally fast, and which of them wins: the leaner, where it frees a
share of the peak that matters.

Example:
    >>> best_of([(1.00, 900, "a", None), (1.02, 500, "b", None)])[2]
    'b'
    >>> best_of([(1.00, 900, "a", None), (1.02, 890, "b", None)])[2]  # 1 % less: not worth 2 %
    'a'
"""

from __future__ import annotations

import math

TIME_TIE = 0.03
"""Plans predicted within this fraction of the fastest count as equally fast, and of those the one
with the smallest predicted peak wins: memory a plan leaves free is batch, KV cache or sequence
length for the user, while 3 % is within the cost model's error (and well within the 0.75-1.05x
a program measures against itself on a shared host)."""

MEMORY_SHARE = 0.05
"""A plan slower than the fastest (within :data:`TIME_TIE`) wins only where it frees at least this
share of the fastest's peak: a plain MLP step on 8 CPU devices had FSDP win over data
parallelism for 0.2 % less memory at 3 % more predicted time, and ran 1.32x slower."""

MEMORY_TIE = 0.01
"""A departure from the user's own layout (their sharding constraints and inputs' layouts) that
is no faster must save more than this fraction of its peak: less is within the memory model's
error (measured within 10 % on MaxText's steps at pod scale). MaxText's Llama 3.1 405B on two
v6e-256 slices: a plan departing from its layout at one transpose, predicted as fast in 0.2 MB
less of 30.2 GB, made XLA propagate otherwise, with 1,654 more collectives and 1.08x the
layout's estimated step."""


def best_of(scores: list) -> tuple:
    """The best of ``(time, peak, schedule, prediction)`` scores: of those within
    :data:`TIME_TIE` of the fastest that fits, the one of the smallest peak where it frees at
    least :data:`MEMORY_SHARE` of the fastest's (the fastest first where peaks tie); else the
    fastest (the leanest of those as fast).

    Example:
        >>> best_of([(1.00, 900, None, None), (1.02, 500, None, None), (1.2, 100, None, None)])
        (1.02, 500, None, None)
    """
    fitting = [s for s in scores if not math.isinf(s[0])]
    if not fitting:
        return min(scores, key=lambda r: r[:2])
    fastest = min(fitting, key=lambda r: r[:2])
    leanest = min((s for s in fitting if s[0] <= fastest[0] * (1 + TIME_TIE)),
                  key=lambda r: (r[1], r[0]))  # fmt: skip
    return leanest if wins_on_memory(leanest[:2], fastest[:2]) else fastest


def wins_on_memory(slower: tuple[float, float], fastest: tuple[float, float]) -> bool:
    """Whether a plan of ``(time, peak)`` ``slower`` beats the ``fastest`` one on a tie: within
    :data:`TIME_TIE` of its time, freeing at least :data:`MEMORY_SHARE` of its peak.

    Example:
        >>> wins_on_memory((1.02, 80), (1.0, 100)), wins_on_memory((1.05, 50), (1.0, 100))
        (True, False)
    """
    return slower[0] <= fastest[0] * (1 + TIME_TIE) and frees_enough(slower[1], fastest[1])


def frees_enough(peak: float, fastest_peak: float) -> bool:
    """Whether ``peak`` frees at least :data:`MEMORY_SHARE` of ``fastest_peak`` (and any at all).

    Example:
        >>> frees_enough(94, 100), frees_enough(99.8, 100)
        (True, False)
    """
    return peak < fastest_peak and peak <= fastest_peak * (1 - MEMORY_SHARE)
