"""The collectives, named once: as XLA's HLO and the calibrations spell them, with the name
reports print and the step kinds of a :class:`redist.steps.Plan` that run them.

A plan's steps have kinds of their own (``"allgather"``, ``"alltoall"``, ``"allpermute"``,
``"reducescatter"``, ``"allreduce"``, and the local ``"dynslice"`` and ``"reblock"``): a step
says what it does to a tile; a :class:`CollectiveKind` says what runs on the wire, priced by a
calibration and counted in compiled HLO. :func:`of_step` is the one translation between them.

Example:
    >>> from redist.collectives import CollectiveKind, of_step
    >>> of_step("alltoall"), CollectiveKind.PERMUTE.short
    (<CollectiveKind.ALL_TO_ALL: 'all-to-all'>, 'permute')
    >>> CollectiveKind.ALL_GATHER == "all-gather"
    True
"""

from __future__ import annotations

import enum


class CollectiveKind(enum.StrEnum):
    """A collective, its value the name XLA's HLO and the calibration files give it (a
    ``str``: it compares, hashes and prints as that name)."""

    ALL_GATHER = "all-gather"
    ALL_TO_ALL = "all-to-all"
    PERMUTE = "collective-permute"
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"

    @property
    def short(self) -> str:
        """The name reports print (``"permute"`` for a collective-permute)."""
        return "permute" if self is CollectiveKind.PERMUTE else self.value


STEP_COLLECTIVES = {
    "allgather": CollectiveKind.ALL_GATHER,
    "alltoall": CollectiveKind.ALL_TO_ALL,
    "allpermute": CollectiveKind.PERMUTE,
    "reducescatter": CollectiveKind.REDUCE_SCATTER,
    "allreduce": CollectiveKind.ALL_REDUCE,
}
"""Step kind -> the collective it runs (local steps, ``dynslice`` and ``reblock``, have none)."""


def kind_label(kind: str) -> str:
    """The name reports print for ``kind``: a collective's :attr:`CollectiveKind.short`, anything
    else (a local ``"copy"``) as it is.

    Example:
        >>> kind_label("collective-permute"), kind_label("copy")
        ('permute', 'copy')
    """
    return CollectiveKind(kind).short if kind in CollectiveKind._value2member_map_ else kind


def of_step(kind: str) -> CollectiveKind:
    """The collective a step of ``kind`` runs; ``ValueError`` for a step that runs none.

    Example:
        >>> of_step("reducescatter")
        <CollectiveKind.REDUCE_SCATTER: 'reduce-scatter'>
    """
    try:
        return STEP_COLLECTIVES[kind]
    except KeyError:
        raise ValueError(
            f"step kind {kind!r} runs no collective; those that do: {sorted(STEP_COLLECTIVES)}"
        ) from None
