"""A numpy reference simulator: runs a plan on per-device tiles and checks every step.

It reads only what execution reads (groups, slice offsets, permutation pairs) and, after each step,
compares every device's tile with the tile the step's type and device map promise (Fig. 7a).

Example:
    >>> tiles = run_reference(plan, np.arange(64).reshape(8, 8))   # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np

from redist.radix import move_blocks
from redist.steps import Plan, Step
from redist.types import DistType, MeshShape


def tiles_of(t: DistType, mesh: MeshShape, array: np.ndarray, device_map=None) -> list[np.ndarray]:
    """The tile every physical device holds for type ``t`` under ``device_map`` (identity default)."""
    if array.shape != t.global_shape:  # an uneven layout: its padding rows are zeros
        array = np.pad(array, [(0, g - n) for g, n in zip(t.global_shape, array.shape)])
    offsets = t.base_offsets(mesh)
    phys = np.empty_like(offsets)
    phys[np.arange(mesh.num_devices) if device_map is None else np.asarray(device_map)] = offsets
    local = t.local_shape
    return [array[tuple(slice(o, o + n) for o, n in zip(off, local))] for off in phys]


def partials(t: DistType, mesh: MeshShape, tiles: list[np.ndarray], seed: int = 0):
    """Per-device partial tiles whose sums over ``t.pending`` are ``tiles``: small random
    integers everywhere but on the first device of each summed group, which holds the rest."""
    rng = np.random.default_rng(seed)
    summed = [mesh.factor_index[a] for a in t.pending]
    coords = mesh.factor_coords
    out = [tile.copy() for tile in tiles]
    first = {}
    for d in range(mesh.num_devices):
        key = tuple(np.delete(coords[d], summed))
        if coords[d, summed].any():
            out[d] = rng.integers(-3, 4, tiles[d].shape).astype(tiles[d].dtype)
            first.setdefault(key, []).append(d)
    for d in range(mesh.num_devices):
        if not coords[d, summed].any():
            for e in first.get(tuple(np.delete(coords[d], summed)), []):
                out[d] = out[d] - out[e]
    return out


def apply_step(step: Step, tiles: list[np.ndarray]) -> list[np.ndarray]:
    """The tiles after ``step``, computed from its groups / offsets / pairs alone."""
    out = list(tiles)
    if step.kind == "dynslice":
        shape = step.after.local_shape
        for d, start in enumerate(step.offsets):
            out[d] = tiles[d][tuple(slice(o, o + n) for o, n in zip(start, shape))]
    elif step.kind == "allgather":
        for group in step.groups:
            whole = np.concatenate([tiles[d] for d in group], axis=step.dim)
            for d in group:
                out[d] = whole
    elif step.kind == "alltoall":
        dest = dict(step.perm)
        moves = step.moves or ((step.dim, step.to_dim, step.group_size),)
        for group in step.groups:
            for rank, d in enumerate(group):
                whole = _alltoall_receive(moves, [tiles[s] for s in group], rank)
                out[dest.get(d, d)] = whole
    elif step.kind == "allpermute":
        for s, d in step.perm:
            out[d] = tiles[s]
    elif step.kind == "reblock":
        out = _reblock(step, tiles)
    elif step.kind in ("reducescatter", "allreduce"):
        for group in step.groups:
            total = sum(tiles[d] for d in group)
            parts = np.split(total, len(group), axis=step.dim) if step.dim is not None else None
            for rank, d in enumerate(group):
                out[d] = total if parts is None else parts[rank]
    else:
        raise ValueError(f"unknown step kind {step.kind!r}")
    return out


def _reblock(step: Step, tiles: list[np.ndarray]) -> list[np.ndarray]:
    """Every device's new tile after a reblock, from its rounds' pairs and tables alone; rows
    no piece writes stay zero (padding)."""
    i = step.dim
    shape = list(tiles[0].shape)
    shape[i] = step.after.local_shape[i]
    out = [np.zeros(shape, dtype=tiles[0].dtype) for _ in tiles]
    for pairs, table in step.rounds:
        for s, d in pairs:
            start, length, put, got = table[s][0], table[s][1], table[d][2], table[d][3]
            if length != got:
                raise AssertionError(f"device {s} sends {length} rows, device {d} expects {got}")
            piece = np.take(tiles[s], range(start, start + length), axis=i)
            index = [slice(None)] * len(shape)
            index[i] = slice(put, put + length)
            out[d][tuple(index)] = piece
    return out


def _alltoall_receive(moves, tiles: list[np.ndarray], rank: int) -> np.ndarray:
    """What the member of ``rank`` holds after an all-to-all of ``moves`` over ``tiles``.

    Digits of a rank follow the moves (first fastest). From every sender the receiver takes, in
    each split dimension, the piece its own digits name; it places the piece, in each gathered
    dimension, at the block its sender's digits name.
    """
    shape = list(tiles[0].shape)
    out_shape = list(shape)
    for i, j, n in moves:
        out_shape[i] *= n
        out_shape[j] //= n
    out = np.empty(out_shape, dtype=tiles[0].dtype)

    def block(blocks: dict[int, int], size_of) -> tuple[slice, ...]:
        index = [slice(None)] * len(shape)
        for dim, b in blocks.items():
            index[dim] = slice(b * size_of[dim], (b + 1) * size_of[dim])
        return tuple(index)

    take = block(move_blocks(moves, rank, 1), out_shape)
    for sender, tile in enumerate(tiles):
        out[block(move_blocks(moves, sender, 0), shape)] = tile[take]
    return out


def run_reference(plan: Plan, array: np.ndarray) -> list[np.ndarray]:
    """Run ``plan`` on ``array`` tile by tile; raise ``AssertionError`` if any step goes wrong.

    A zero-size array has nothing to move: its (empty) plan is right when every device ends with
    an empty tile, and the destination's empty tiles are returned.

    Returns:
        The final tiles per physical device, equal to the destination's tiles.

    Raises:
        TypeError: if ``plan`` is no :class:`Plan`.
        ValueError: if ``array``'s shape is not the plan's.
        AssertionError: if a step leaves some device with the wrong tile.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a redist.Plan, got {type(plan).__name__}")
    array = np.asarray(array)
    if array.shape != plan.global_shape:
        raise ValueError(f"array shape {array.shape} differs from the plan's {plan.global_shape}")
    tiles = tiles_of(plan.src, plan.mesh, array)
    if plan.src.pending:
        tiles = partials(plan.src, plan.mesh, tiles)
    for k, step in enumerate(plan.steps):
        tiles = apply_step(step, tiles)
        expected = tiles_of(step.after, plan.mesh, array, step.device_map)
        for d, (got, want) in enumerate(zip(tiles, expected)):
            if got.shape != want.shape or not np.array_equal(got, want):
                raise AssertionError(f"step {k} ({step}) leaves device {d} with the wrong tile")
    final = tiles_of(plan.dst, plan.mesh, array)
    for d, (got, want) in enumerate(zip(tiles, final)):
        if not (np.array_equal(got, want) or got.size == want.size == 0):
            raise AssertionError(f"device {d} ends with the wrong tile")
    return [want if want.size == 0 else got for got, want in zip(tiles, final)]
