"""``synthesize``: the pure entry point from two types to a cached :class:`Plan` (no JAX)."""

from __future__ import annotations

import functools

from redist.cost import COST_MODELS
from redist.lower import make_plan
from redist.plan import Plan
from redist.search import weak_paths
from redist.types import DistType, MeshShape

# Chunks below this many bytes keep the final permutation separate: rounds of small messages
# are latency-bound. Measured by experiments/fold_threshold.py on 8 CPU devices: folding is slower
# below 256 KiB chunks and on par or faster from 384-512 KiB, for groups of 2, 4 and 8.
FOLD_MIN_BYTES = 512 << 10


@functools.lru_cache(maxsize=4096)
def synthesize(
    mesh: MeshShape,
    src: DistType,
    dst: DistType,
    dtype: str,
    itemsize: int,
    cost_model: str = "bytes",
    fold_min_bytes: int = FOLD_MIN_BYTES,
) -> Plan:
    """The memory-bounded, near-optimal plan from ``src`` to ``dst`` (cached on its inputs).

    ``cost_model`` is what the search minimizes: ``"bytes"`` (the paper's Fig. 11) or
    ``"bytes+copies"`` (bytes plus local copies; see :mod:`redist.cost`). Either way the plan
    reports the paper's ``cost_bytes`` and stays within the memory bound.

    Raises:
        ValueError: if the global shapes differ.
    """
    if src.global_shape != dst.global_shape:
        raise ValueError(
            f"source global shape {src.global_shape} differs from destination {dst.global_shape}"
        )
    if cost_model not in COST_MODELS:
        raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")
    if src.global_size == 0:  # nothing to move: the destination layout is had for free
        return Plan(mesh, src, dst, dtype, itemsize, ())
    paths = weak_paths(
        src.global_shape, src.local_shape, dst.local_shape, mesh.primes, itemsize, cost_model
    )
    return make_plan(mesh, src, dst, paths, dtype, itemsize, fold_min_bytes)
