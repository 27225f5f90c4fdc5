"""One process of the two-process test: ``python multihost.py PORT PROCESS_ID``."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import redist  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4
mesh = jax.make_mesh((2, 4), ("x", "y"))
cases = [
    ((16, 8, 4), P("x", "y"), P("y", "x")),  # crosses the process boundary
    ((16, 8, 4), P(("x", "y")), P(None, None, "y")),
    ((8, 16), P("y", "x"), P(None, ("x", "y"))),
]
for shape, src, dst in cases:
    arr = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    x = jax.make_array_from_callback(shape, NamedSharding(mesh, src), lambda idx, a=arr: a[idx])
    y = redist.redistribute(x, dst)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, dst), len(shape))
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), arr[shard.index])
    jitted = jax.jit(lambda v, s=src, d=dst: redist.redistribute(v, s, d, mesh=mesh))(x)
    for shard in jitted.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), arr[shard.index])
# Another mesh over the same devices (training FSDP over 8 to serving dp x tp): planned, eager
# and inside jit.
train = jax.make_mesh((8,), ("fsdp",))
serve = jax.make_mesh((2, 4), ("dp", "tp"))
arr = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
x = jax.make_array_from_callback(arr.shape, NamedSharding(train, P("fsdp")), lambda idx: arr[idx])
dst = NamedSharding(serve, P(None, "tp"))
for y in (
    redist.redistribute(x, dst),
    jax.jit(lambda v: redist.redistribute(v, NamedSharding(train, P("fsdp")), dst))(x),
):
    assert y.sharding.is_equivalent_to(dst, 2)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), arr[shard.index])
print(f"process {pid} OK {len(cases) + 1}")
jax.distributed.shutdown()
