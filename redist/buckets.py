"""Buckets of moves whose bytes in flight per device stay within a budget.

A model's weight sync moves thousands of arrays. Moved all at once, every array's intermediate
tiles may be alive together; moved one by one, nothing overlaps. :func:`buckets` groups the
moves, in the pytree's order (a layer's arrays stay together), so that the bytes each bucket
holds in flight per device (:func:`in_flight_bytes` of each move, summed) never exceed the
budget; the buckets then run one after another, the moves within one together.

Example:
    >>> buckets([40, 30, 30, 50], 80, ["a", "b", "c", "d"])
    [[0, 1], [2, 3]]
"""

from __future__ import annotations

from collections.abc import Sequence

from redist.steps import Plan


def in_flight_bytes(plan: Plan | None, tile_bytes: int) -> int:
    """Bytes per device a move holds while it runs, beyond nothing: the most one of its steps
    holds at once (its input and output tiles, ``Plan.held_bytes``: a collective writes its
    result beside its operand, and stages at most that much), or for a move without collectives
    (a transfer between device sets, ``plan=None``) ``tile_bytes``, the destination tile it
    receives into.

    Example:
        >>> in_flight_bytes(None, 4096)
        4096
    """
    return tile_bytes if plan is None else max(plan.held_bytes, plan.peak_bytes)


def buckets(sizes: Sequence[int], budget: int, names: Sequence[str]) -> list[list[int]]:
    """Indices of ``sizes`` (bytes in flight per device of each move, :func:`in_flight_bytes`)
    grouped in order into buckets each summing to at most ``budget``: a bucket takes the next
    move while it fits, then the next bucket starts.

    Raises:
        ValueError: where one move alone exceeds ``budget``, naming it (``names``), its bytes
            and the budget.
    """
    if len(sizes) != len(names):
        raise ValueError(f"sizes ({len(sizes)}) and names ({len(names)}) differ in length")
    for size, name in zip(sizes, names):
        if size > budget:
            raise ValueError(
                f"memory_budget {budget} B per device is less than what moving {name} holds in "
                f"flight, {size} B per device (its tiles; a move cannot be split): give at "
                f"least {max(sizes)} B"
            )
    out: list[list[int]] = []
    held = budget + 1
    for k, size in enumerate(sizes):
        if held + size > budget:
            out.append([])
            held = 0
        out[-1].append(k)
        held += size
    return out


def slice_ranges(extent: int, size: int, budget: int) -> list[tuple[int, int]] | None:
    """``[start, stop)`` ranges cutting a dimension of ``extent`` that neither layout splits into
    slices whose moves each hold at most ``budget`` (a move holding ``size`` bytes moves each
    slice holding its share: its tiles shrink with it); ``None`` where one index alone holds more.

    Example:
        >>> slice_ranges(10, 1000, 300)
        [(0, 3), (3, 6), (6, 9), (9, 10)]
    """
    per_index = index_bytes(size, extent)
    step = budget // per_index if per_index else extent
    if step < 1:
        return None
    return [(a, min(a + step, extent)) for a in range(0, extent, step)]


def index_bytes(size: int, extent: int) -> int:
    """Bytes in flight per index of a dimension of ``extent`` that neither layout splits, of a
    move holding ``size`` (rounded up).

    Example:
        >>> index_bytes(1000, 3)
        334
    """
    return -(-size // extent)


def unsplit_dim(src: Sequence, dst: Sequence, shape: Sequence[int]) -> int | None:
    """The largest dimension of ``shape`` that neither layout (mesh axes per dimension) splits,
    of more than one index; ``None`` if there is none.

    Example:
        >>> unsplit_dim((None, "fsdp"), ("tp", None), (4, 8)) is None
        True
        >>> unsplit_dim((None, "fsdp", None), (None, None, "tp"), (61, 8, 8))
        0
    """
    free = [d for d, n in enumerate(shape) if n > 1
            and not (src[d] if d < len(src) else None)
            and not (dst[d] if d < len(dst) else None)]  # fmt: skip
    return max(free, key=lambda d: shape[d], default=None)


def cut(src: Sequence, dst: Sequence, shape: Sequence[int], size: int, budget: int):
    """``(dimension, ranges)`` cutting a move holding ``size`` into slices within ``budget``
    along the largest dimension neither layout splits (:func:`unsplit_dim`,
    :func:`slice_ranges`), or ``None`` where there is none or one index alone holds more.

    Example:
        >>> cut((None, "fsdp"), (None, "tp"), (10, 8), 1000, 300)
        (0, [(0, 3), (3, 6), (6, 9), (9, 10)])
    """
    dim = unsplit_dim(src, dst, shape)
    ranges = None if dim is None else slice_ranges(shape[dim], size, budget)
    return None if ranges is None else (dim, ranges)
