"""Mixed-radix numbers, first digit fastest: device ranks in groups, offsets of tiles, blocks of an
all-to-all. The one place this arithmetic lives.

Example:
    >>> number([1, 2], [2, 3]), digits(5, [2, 3])
    (5, [1, 2])
"""

from __future__ import annotations

from collections.abc import Sequence


def number(digits: Sequence, radices: Sequence[int]):
    """The value of ``digits`` (ints or numpy arrays) in radices ``radices``, first fastest."""
    out, stride = 0, 1
    for d, n in zip(digits, radices):
        out = out + stride * d
        stride *= n
    return out


def digits(value: int, radices: Sequence[int]) -> list[int]:
    """The digits of ``value`` in radices ``radices``, first fastest (inverse of :func:`number`)."""
    out = []
    for n in radices:
        out.append(value % n)
        value //= n
    return out


def move_blocks(moves: Sequence[tuple[int, int, int]], rank: int, side: int) -> dict[int, int]:
    """Per dimension, the block a member of ``rank`` names in an all-to-all of ``moves``
    (``(from, to, n)``): ``side`` 0 the gathered dimensions, 1 the split ones. The rank's digits
    follow the moves (first fastest); those of moves sharing a dimension form one number there."""
    ds = digits(rank, [n for _, _, n in moves])
    out = {}
    for dim in dict.fromkeys(m[side] for m in moves):
        ks = [k for k, m in enumerate(moves) if m[side] == dim]
        out[dim] = number([ds[k] for k in ks], [moves[k][2] for k in ks])
    return out
