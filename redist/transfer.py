"""Moving an array onto devices in another order, or onto other devices: piece by piece.

JAX runs one compiled program on one device order, so a move between meshes that list their
devices differently (or list different devices) cannot be one collective program. Here every
destination device receives, straight from a source device, the pieces of its tile it does not
hold: the intersections of its tile with the source tiles (one copy of each, from the first
source device that holds it). Every element travels at most once to each device that needs it and
never through the host's copy of the whole array.

Each source device cuts the pieces it sends in one program, every piece crosses in one batched
``jax.device_put`` (device to device), and each destination device writes its pieces into its
tile in one program: three dispatches per device set rather than three per piece (4 to 4 CPU
devices, tunix's Qwen3 tree of 29 MiB: 90 ms, 116 one piece at a time). ``redistribute`` sends
here only moves it cannot stage (neither device count divides the other): the others it makes
on the source devices and copies tile by tile (:func:`redist.linear.hand_over`; 23 ms there).

Memory: a source device holds its tile plus the pieces cut from it (a piece that is its whole
tile is sent as it is), at most one tile more where each piece goes to one device; a destination
device holds the pieces it received plus the tile they are written into, at most twice its tile.

Example:
    >>> y = transfer(x, NamedSharding(serving_mesh, P(None, "tp")))  # doctest: +SKIP
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _overlap(a, b):
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


# Every program below takes its bounds as static arguments (compiled in): eagerly, a slice or an
# update with Python ints sends the ints from the host, which tunix's sync on CPU forbids.


@functools.partial(jax.jit, static_argnums=1)
def _cut(data: jax.Array, bounds: tuple) -> tuple[jax.Array, ...]:
    """The pieces ``data[lo:hi, ...]`` for each ``((lo, hi), ...)`` of ``bounds``, in one program
    on ``data``'s device."""
    return tuple(jax.lax.slice(data, tuple(lo for lo, _ in b), tuple(hi for _, hi in b))
                 for b in bounds)  # fmt: skip


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _assembled(pieces: tuple, starts: tuple, shape: tuple[int, ...], dtype) -> jax.Array:
    """A tile of ``shape`` from ``pieces`` written at ``starts``, in one program on their device."""
    tile = jnp.zeros(shape, dtype)
    for piece, start in zip(pieces, starts):
        tile = jax.lax.dynamic_update_slice(tile, piece, start)
    return tile


def transfer(x: jax.Array, dst: NamedSharding, *, donate: bool = False) -> jax.Array:
    """``x`` laid out as ``dst`` (any mesh), moved piece by piece between devices (eager only).

    With ``donate``, ``x``'s shards are freed once sent (those kept in place become the result's).

    Raises:
        ValueError: if ``x`` is not fully addressable from this process.
    """
    if not x.is_fully_addressable:
        raise ValueError(
            "a transfer between meshes with different device orders needs every shard of x in "
            "this process; across processes, use meshes that list the same devices in one order"
        )
    shape = tuple(x.shape)
    shards = [(_bounds(sh.index, shape), sh.device, sh.data) for sh in x.addressable_shards]
    seen: set = set()
    sources = [s for s in shards if not (s[0] in seen or seen.add(s[0]))]  # one holder per tile
    tiles: list = []  # per destination device: its array, or (indices into sends, starts, shape)
    cuts: dict[int, list] = {}  # source index -> bounds of the pieces it sends, in order
    sends: list[tuple] = []  # (source index, index of its piece or None: whole, device)
    for device, index in dst.addressable_devices_indices_map(shape).items():
        want = _bounds(index, shape)
        local = next((data for b, dev, data in shards if b == want and dev == device), None)
        if local is not None:  # the device already holds its tile
            tiles.append(local)
            continue
        parts, starts = [], []
        for k, (held, _, _) in enumerate(sources):
            part = _overlap(held, want)
            if part is None:
                continue
            if part == held:  # the whole source tile: sent as it is
                sends.append((k, None, device))
            else:
                bounds = tuple((lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(part, held))
                cuts.setdefault(k, []).append(bounds)
                sends.append((k, len(cuts[k]) - 1, device))
            parts.append(len(sends) - 1)
            starts.append(tuple(lo - w0 for (lo, _), (w0, _) in zip(part, want)))
        tiles.append((parts, tuple(starts), tuple(hi - lo for lo, hi in want)))
    cut = {k: _cut(sources[k][2], tuple(b)) for k, b in cuts.items()}  # each on its device
    sent = jax.device_put(
        [sources[k][2] if i is None else cut[k][i] for k, i, _ in sends], [d for _, _, d in sends]
    )  # one batched call, device to device
    pieces = []
    for tile in tiles:
        if not isinstance(tile, tuple):
            pieces.append(tile)
            continue
        parts, starts, tile_shape = tile
        if len(parts) == 1 and tile_shape == tuple(sent[parts[0]].shape):
            pieces.append(sent[parts[0]])  # a whole source tile, copied
        else:
            pieces.append(_assembled(tuple(sent[i] for i in parts), starts, tile_shape, x.dtype))
    out = jax.make_array_from_single_device_arrays(shape, dst, pieces)
    if donate:
        kept = {id(p) for p in pieces}
        for _, _, data in shards:
            if id(data) not in kept:
                data.delete()
    return out
