"""A numpy reference simulator: runs a plan on per-device tiles and checks every step.

It reads only what execution reads (groups, slice offsets, permutation pairs) and, after each step,
compares every device's tile with the tile the step's type and device map promise (Fig. 7a).

Example:
    >>> tiles = simulate(plan, np.arange(64).reshape(8, 8))   # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np

from redist.plan import Plan, Step
from redist.types import DistType, MeshShape


def tiles_of(t: DistType, mesh: MeshShape, array: np.ndarray, device_map=None) -> list[np.ndarray]:
    """The tile every physical device holds for type ``t`` under ``device_map`` (identity default)."""
    offsets = t.base_offsets(mesh)
    phys = np.empty_like(offsets)
    phys[np.arange(mesh.num_devices) if device_map is None else np.asarray(device_map)] = offsets
    local = t.local_shape
    return [array[tuple(slice(o, o + n) for o, n in zip(off, local))] for off in phys]


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
        for group in step.groups:
            n = len(group)
            chunks = [np.split(tiles[d], n, axis=step.to_dim) for d in group]
            for rank, d in enumerate(group):
                whole = np.concatenate([chunks[s][rank] for s in range(n)], axis=step.dim)
                out[dest.get(d, d)] = whole
    elif step.kind == "allpermute":
        for s, d in step.perm:
            out[d] = tiles[s]
    else:
        raise ValueError(f"unknown step kind {step.kind!r}")
    return out


def simulate(plan: Plan, array: np.ndarray) -> list[np.ndarray]:
    """Run ``plan`` on ``array`` tile by tile; raise ``AssertionError`` if any step goes wrong.

    Returns:
        The final tiles per physical device, equal to the destination's tiles.
    """
    if array.shape != plan.global_shape:
        raise ValueError(f"array shape {array.shape} differs from the plan's {plan.global_shape}")
    tiles = tiles_of(plan.src, plan.mesh, array)
    for k, step in enumerate(plan.steps):
        tiles = apply_step(step, tiles)
        expected = tiles_of(step.after, plan.mesh, array, step.device_map)
        for d, (got, want) in enumerate(zip(tiles, expected)):
            if got.shape != want.shape or not np.array_equal(got, want):
                raise AssertionError(f"step {k} ({step}) leaves device {d} with the wrong tile")
    for d, (got, want) in enumerate(zip(tiles, tiles_of(plan.dst, plan.mesh, array))):
        if not np.array_equal(got, want):
            raise AssertionError(f"device {d} ends with the wrong tile")
    return tiles
