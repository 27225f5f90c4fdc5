"""The paper's data-transfer cost model (Fig. 11, App. B), in bytes per device.

| step       | cost                                   |
|------------|----------------------------------------|
| dynslice   | 0 (local)                              |
| allgather  | localsize after the step               |
| alltoall   | localsize (unchanged by the step)      |
| allpermute | localsize (unchanged by the step)      |

Example:
    >>> step_cost("allgather", before=4, after=8, itemsize=4)
    32
"""

from __future__ import annotations

COMMUNICATING = ("alltoall", "allgather", "allpermute")
KINDS = ("dynslice",) + COMMUNICATING


def step_cost(kind: str, *, before: int, after: int, itemsize: int) -> int:
    """Bytes per device moved by one step from a tile of ``before`` to ``after`` elements."""
    if kind == "dynslice":
        return 0
    if kind == "allgather":
        return after * itemsize
    if kind in ("alltoall", "allpermute"):
        return before * itemsize
    raise ValueError(f"unknown step kind {kind!r}; expected one of {KINDS}")
