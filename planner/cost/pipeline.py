"""GPipe's arithmetic: the bubble, a pipelined step's time and what a stage keeps.

A scan's ``L`` layers cut into ``P`` stages and its batch into ``K`` microbatches run as
``K + P - 1`` ticks forward and as many backward (:mod:`planner.lowering.spmd.gpipe` runs it); a
stage is idle in ``(P - 1) / (K + P - 1)`` of them (:func:`bubble`). A circular pipeline of
``R`` repeats runs ``R K + P - 1`` ticks of ``1 / R`` a stage's layers each, idle in
``(P - 1) / (R K + P - 1)`` of them.

Example:
    >>> bubble(4, 12)
    0.2
"""

from __future__ import annotations


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The fraction of a GPipe step's ticks in which a stage is idle: ``(P - 1) / (R K + P - 1)``
    (``R`` the repeats of a circular pipeline, 1 for GPipe's).

    Example:
        >>> bubble(4, 12)
        0.2
        >>> round(bubble(4, 12, repeats=2), 3)
        0.111
    """
    if stages < 1 or microbatches < 1 or repeats < 1:
        raise ValueError(
            f"stages={stages}, microbatches={microbatches} and repeats={repeats} must be at least 1"
        )
    return (stages - 1) / (repeats * microbatches + stages - 1)


def gpipe_seconds(stage_s: float, stages: int, microbatches: int, transfer_s: float = 0.0,
                  repeats: int = 1) -> float:  # fmt: skip
    """A GPipe training step's time: ``R K + P - 1`` ticks forward and as many backward, each
    as long as one stage's work on one microbatch (``1 / R`` of it in a circular pipeline of
    ``R`` repeats) plus handing its activation (forward) or the activation's gradient (backward)
    to the neighbouring stage. ``stage_s``: a stage's forward and backward on one microbatch;
    ``transfer_s``: one such hand-over.

    Example:
        >>> gpipe_seconds(stage_s=4e-3, stages=4, microbatches=12, transfer_s=1e-4)  # 15 ticks
        0.063
        >>> round(gpipe_seconds(4e-3, 4, 12, 1e-4, repeats=2), 4)  # 27 ticks of half a stage
        0.0594
    """
    ticks = repeats * microbatches + stages - 1
    return ticks * stage_s / repeats + (2 * ticks * transfer_s if stages > 1 else 0.0)


def gpipe_activation_bytes(microbatch_bytes: int, microbatches: int) -> int:
    """What a stage keeps for its backward pass under GPipe: the residuals of every microbatch
    (all forward ticks run before the first backward one). ``microbatch_bytes``: the residuals
    of the stage's layers for one microbatch."""
    return microbatch_bytes * microbatches
