"""Moving an array onto devices in another order, or onto other devices: piece by piece.

JAX runs one compiled program on one device order, so a move between meshes that list their
devices differently (or list different devices) cannot be one collective program. Here every
destination device receives, straight from a source device, the pieces of its tile it does not
hold: the intersections of its tile with the source tiles (one copy of each, from the first
source device that holds it). Every element travels at most once to each device that needs it and
never through the host's copy of the whole array.

Memory: a destination device holds its tile, built up in place, plus the piece in flight; a source
device holds its tile plus the slice it sends. So per device at most ``src tile + dst tile``, and
``max(src tile, dst tile)`` plus one piece where a device is only a source or only a destination.

Example:
    >>> y = transfer(x, NamedSharding(serving_mesh, P(None, "tp")))  # doctest: +SKIP
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _overlap(a, b):
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


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
    pieces = []
    for device, index in dst.addressable_devices_indices_map(shape).items():
        want = _bounds(index, shape)
        local = next((data for b, dev, data in sources if b == want and dev == device), None)
        if local is not None:  # the device already holds its tile
            pieces.append(local)
            continue
        exact = next((data for b, _, data in sources if b == want), None)
        if exact is not None:
            pieces.append(jax.device_put(exact, device))
            continue
        tile = jnp.zeros(tuple(hi - lo for lo, hi in want), x.dtype, device=device)
        for held, _, data in sources:
            part = _overlap(held, want)
            if part is None:
                continue
            piece = data[tuple(slice(lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(part, held))]
            start = tuple(lo - w0 for (lo, _), (w0, _) in zip(part, want))
            tile = jax.lax.dynamic_update_slice(tile, jax.device_put(piece, device), start)
        pieces.append(tile)
    out = jax.make_array_from_single_device_arrays(shape, dst, pieces)
    if donate:
        kept = {id(p) for p in pieces}
        for _, _, data in shards:
            if id(data) not in kept:
                data.delete()
    return out
