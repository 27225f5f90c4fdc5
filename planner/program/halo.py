"""Spatial partitioning of windowed ops: the halo each device needs from its neighbours.

A convolution's spatial dimension split into ``P`` equal tiles over a mesh axis: device ``k``
computes its tile of the output (or, for a kernel's gradient, its part of the window) and reads
its tile of the input plus the borders its windows reach into (the *halo*), which its neighbours
send (``ppermute``); the first and last devices get zeros there, which is the convolution's zero
padding. Every device then runs the same convolution on its extended tile with its own padding.

Index arithmetic (one spatial dimension; ``s`` window stride, ``d`` window (rhs) dilation,
``ld`` input (lhs) dilation, ``lo`` low padding): output ``o`` at window position ``w`` reads
dilated input position ``r = o s + w d - lo``, an input element where ``ld`` divides ``r``. The
tiles line up (every device needs the same halo, at the same offset) when the owner loop's tile
covers exactly an input tile: ``(O / P) s == (I / P) ld`` when the output is split,
``(W / P) d == (I / P) ld`` when the window is (a kernel's gradient, whose window is the output
gradient). "SAME" padding lines up; "VALID" padding, whose output is shorter than its input,
does not (such splits are refused).

Example:
    >>> w = Window(dim=2, owner="s0", by_output=True, size=512, out=512, window=3, stride=1,
    ...            lhs_dilation=1, rhs_dilation=1, pad=(1, 1))
    >>> split(w, 4)   # 1 row from each neighbour; no padding left to do on the extended tile
    Split(left=1, right=1, pad=(0, 0), source=(0, 0))
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Window:
    """One spatial dimension of a convolution: which input dimension, the loop that splits it
    (``owner``: the output loop, or the window loop for a kernel's gradient), its sizes and the
    convolution's stride, dilations and padding along it."""

    dim: int  # the input (lhs) dimension
    owner: str  # the loop whose split splits it
    by_output: bool  # owner is the output's loop (else the window's)
    size: int  # input extent (undilated)
    out: int  # output extent
    window: int  # window (rhs) extent
    stride: int
    lhs_dilation: int
    rhs_dilation: int
    pad: tuple[int, int]
    scatters: bool = False  # a max-pool's gradient (select_and_scatter_add), see scatter_split

    @property
    def input(self) -> int:
        """The operand whose dimension ``dim`` is extended by the halo."""
        return 1 if self.scatters else 0


@dataclasses.dataclass(frozen=True)
class Split:
    """A window split in equal parts: input elements each device takes from its left and right
    neighbours, and the padding (in dilated positions; negative: cropped) of its convolution;
    for a ``select_and_scatter_add``, also the windows of its source from each neighbour."""

    left: int
    right: int
    pad: tuple[int, int]
    source: tuple[int, int] = (0, 0)


def split(w: Window, parts: int) -> Split | None:
    """The halo and local padding of ``w`` split in ``parts``; None where the tiles do not line
    up, do not divide, or a halo is wider than a neighbour's tile."""
    if parts == 1:
        return Split(0, 0, w.pad)
    if w.scatters:
        return scatter_split(w, parts)
    if w.size % parts or (w.out if w.by_output else w.window) % parts:
        return None
    tile = w.size // parts
    t_out, t_win = (w.out // parts, w.window) if w.by_output else (w.out, w.window // parts)
    step = t_out * w.stride if w.by_output else t_win * w.rhs_dilation
    if step != tile * w.lhs_dilation:
        return None
    ld = w.lhs_dilation
    left = max(0, -(-w.pad[0] // ld))
    lo = w.pad[0] - left * ld
    needed = (t_out - 1) * w.stride + (t_win - 1) * w.rhs_dilation + 1  # local padded length
    last = (needed - 1 - lo) // ld  # the last element a window reads, from the extended start
    right = max(0, last + 1 - left - tile)
    if left > tile or right > tile:
        return None
    extended = left + tile + right
    return Split(left, right, (lo, needed - lo - ((extended - 1) * ld + 1)))


def scatter_split(w: Window, parts: int) -> Split | None:
    """A max-pool's gradient, ``select_and_scatter_add(source, operand)``, with its operand
    (and result) split in ``parts`` along ``w.dim``: each device owns rows ``[kT, (k+1)T)`` and
    needs every window ``j`` that covers one of them (``j s - lo <= i < j s - lo + w``): its own
    ``T / s`` windows, ``a`` before and ``b`` after (``Split.source``), and the operand rows
    those windows read (``left``, ``right``). Run on the extended tiles without padding, the op
    selects in every window exactly what the whole one does (at the ends the neighbours' part is
    the padding: source 0, operand -inf), and its rows ``[left, left + T)`` are the device's.

    Example:
        >>> w = Window(1, "i1", True, 16, 8, 3, 2, 1, 1, (0, 1), scatters=True)
        >>> scatter_split(w, 2)   # 3x3 windows, stride 2, 'SAME' (padding (0, 1))
        Split(left=2, right=1, pad=(0, 0), source=(1, 0))
    """
    if w.size % parts or w.out % parts or (w.lhs_dilation, w.rhs_dilation) != (1, 1):
        return None
    tile, windows, s, lo, k = w.size // parts, w.out // parts, w.stride, w.pad[0], w.window
    if windows * s != tile:
        return None
    a = (k - 1 - lo) // s
    b = (tile - 1 + lo) // s - (windows - 1)
    left, right = a * s + lo, (b - 1) * s - lo + k
    if min(a, b, left, right) < 0 or max(a, b) > windows or max(left, right) > tile:
        return None
    return Split(left, right, (0, 0), (a, b))


def halo_bytes(w: Window, parts: int, tile_bytes: int) -> tuple[int, int]:
    """Bytes a device receives from its left and right neighbours when ``w`` is split in
    ``parts`` and its input tile (operand ``w.input``) holds ``tile_bytes``; ``(0, 0)`` unsplit or unsplittable."""
    cut = split(w, parts)
    if parts == 1 or cut is None:
        return 0, 0
    per_element = tile_bytes // (w.size // parts)  # one slice of the tile along w.dim
    left, right = cut.source  # a max-pool gradient's source windows: about a row's bytes each
    return (cut.left + left) * per_element, (cut.right + right) * per_element
