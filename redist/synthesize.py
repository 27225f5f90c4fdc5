"""``synthesize``: the pure entry point from two types to a cached :class:`Plan` (no JAX)."""

from __future__ import annotations

import functools

from redist.lower import make_plan
from redist.plan import Plan
from redist.search import weak_paths
from redist.types import DistType, MeshShape


@functools.lru_cache(maxsize=4096)
def synthesize(mesh: MeshShape, src: DistType, dst: DistType, dtype: str, itemsize: int) -> Plan:
    """The memory-bounded, near-optimal plan from ``src`` to ``dst`` (cached on its inputs).

    Raises:
        ValueError: if the global shapes differ.
    """
    if src.global_shape != dst.global_shape:
        raise ValueError(
            f"source global shape {src.global_shape} differs from destination {dst.global_shape}"
        )
    paths = weak_paths(src.global_shape, src.local_shape, dst.local_shape, mesh.primes, itemsize)
    return make_plan(mesh, src, dst, paths, dtype, itemsize)
