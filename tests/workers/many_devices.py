"""Run paper / random problems that need more than 8 devices: ``python many_devices.py N``."""

import os
import random
import sys

N = int(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# helpers from tests/, redist from the repository: with the repository on the path its package
# is found before the folder tests/redist/, which would otherwise be imported as a namespace redist
sys.path[:0] = [os.path.dirname(TESTS), TESTS]
from helpers import random_problem  # noqa: E402

import redist  # noqa: E402
from redist.problems import PAPER_PROBLEMS  # noqa: E402


def check(axes, shape, src, dst, arr):
    mesh = jax.make_mesh(
        tuple(axes.values()), tuple(axes), devices=jax.devices()[: np.prod(list(axes.values()))]
    )
    x = jax.device_put(arr, NamedSharding(mesh, P(*src)))
    y = redist.redistribute(x, P(*dst))
    if not y.sharding.is_equivalent_to(NamedSharding(mesh, P(*dst)), arr.ndim):
        raise SystemExit(f"wrong sharding {y.sharding} for {src} -> {dst}")
    for shard in y.addressable_shards:
        if not np.array_equal(np.asarray(shard.data), arr[shard.index]):
            raise SystemExit(f"wrong values for {axes} {shape} {src} -> {dst}")


count = 0
for q in PAPER_PROBLEMS:
    if np.prod(list(q.mesh.values())) == N:
        check(
            q.mesh,
            q.shape,
            q.src,
            q.dst,
            np.arange(np.prod(q.shape), dtype=np.int32).reshape(q.shape),
        )
        count += 1
if N == 12:
    rng = random.Random(12)
    axes = {"a": 2, "b": 2, "c": 3}
    for _ in range(40):
        shape, src, dst = random_problem(rng, axes, max_rank=5, max_elems=4096)
        check(axes, shape, src, dst, np.arange(np.prod(shape), dtype=np.int32).reshape(shape))
        count += 1
print(f"OK {count}")
