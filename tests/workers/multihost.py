"""One process of the two-process test: ``python multihost.py PORT PROCESS_ID [TRANSFER_PORT]``
(the transfer port: the socket of JAX's cross-host transfers, one per process)."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = sys.argv[1], int(sys.argv[2])
if len(sys.argv) > 3:
    jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{sys.argv[3]}")
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
# Disaggregated (a weight sync): the trainer's layout on process 0's devices to the server's on
# process 1's, leaf for leaf, in buckets, with and without donation.
checked = len(cases) + 1
if len(sys.argv) > 3:
    from jax.sharding import Mesh  # noqa: E402

    own = [np.array([d for d in jax.devices() if d.process_index == i]) for i in (0, 1)]
    trainer = Mesh(own[0].reshape(4), ("fsdp",))
    server = Mesh(own[1].reshape(2, 2), ("dp", "tp"))
    layouts = {
        "embed": ((64, 16), P("fsdp"), P(None, "tp")),
        "experts": ((4, 8, 16), P(None, "fsdp"), P("tp", None, "dp")),
        "norm": ((16,), P(), P()),
    }
    values = {k: np.arange(np.prod(s), dtype=np.float32).reshape(s) * (1 + i)
              for i, (k, (s, _, _)) in enumerate(layouts.items())}  # fmt: skip
    src = {k: NamedSharding(trainer, a) for k, (_, a, _) in layouts.items()}
    dst = {k: NamedSharding(server, b) for k, (_, _, b) in layouts.items()}
    for budget, donate in ((None, False), (4096, False), (4096, True)):
        tree = {k: jax.make_array_from_callback(v.shape, src[k], lambda i, v=v: v[i], dtype=v.dtype)
                for k, v in values.items()}  # fmt: skip
        out = redist.redistribute(tree, dst, memory_budget=budget, donate=donate)
        for k, y in out.items():
            assert y.sharding == dst[k], (k, y.sharding)
            assert len(y.addressable_shards) == (4 if pid == 1 else 0)
            for shard in y.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), values[k][shard.index])
        assert all(v.is_deleted() for v in tree.values()) == donate
    tree = {k: jax.make_array_from_callback(v.shape, src[k], lambda i, v=v: v[i], dtype=v.dtype)
            for k, v in values.items()}  # fmt: skip
    try:
        jax.jit(lambda t: redist.redistribute(t, src, dst))(tree)
    except ValueError as e:
        assert "inside jax.jit" in str(e), e
    else:
        raise AssertionError("a move across processes inside jit must be refused")
    # jax.grad through the move: the cotangent goes back to the trainer (the reverse move)
    w = jax.make_array_from_callback((64, 16), src["embed"], lambda i: values["embed"][i],
                                     dtype=np.float32)  # fmt: skip
    g = jax.grad(lambda v: (redist.redistribute(v, dst["embed"]) ** 2).sum())(w)
    assert g.sharding.is_equivalent_to(src["embed"], 2)
    for shard in g.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), 2 * values["embed"][shard.index])
    # A server on half as many devices: the tiles are made in two copies on the trainer's
    small = NamedSharding(Mesh(own[1][:2], ("tp",)), P("tp"))
    y = redist.redistribute(tree["embed"], small)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values["embed"][shard.index])
    assert len(y.addressable_shards) == (2 if pid == 1 else 0)
    # A server on twice the trainer's devices: each trainer device stages the two tiles of one
    # server position, handed over in two pieces (the tp axis, minor wherever it splits).
    few = Mesh(own[0][:2], ("fsdp",))
    spread = {
        "embed": ((64, 16), P("fsdp"), P(None, ("dp", "tp"))),
        "experts": ((4, 8, 16), P(None, "fsdp"), P("tp", None, "dp")),
        "norm": ((16,), P(), P()),
    }
    for budget in (None, 4096):
        tree = {k: jax.make_array_from_callback(s, NamedSharding(few, a),
                                                lambda i, v=values[k]: v[i], dtype=np.float32)
                for k, (s, a, _) in spread.items()}  # fmt: skip
        wide = {k: NamedSharding(server, b) for k, (_, _, b) in spread.items()}
        out = redist.redistribute(tree, wide, memory_budget=budget)
        for k, y in out.items():
            assert y.sharding == wide[k], (k, y.sharding)
            assert len(y.addressable_shards) == (4 if pid == 1 else 0)
            for shard in y.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), values[k][shard.index])
    # jax.grad through it: the cotangent comes back from 4 devices to 2 (staged in copies)
    g = jax.grad(lambda v: (redist.redistribute(v, wide["embed"]) ** 2).sum())(tree["embed"])
    assert g.sharding.is_equivalent_to(tree["embed"].sharding, 2)
    for shard in g.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), 2 * values["embed"][shard.index])
    three = Mesh(own[0][:3], ("fsdp",))
    x = jax.make_array_from_callback((6, 4), NamedSharding(three, P("fsdp")),
                                     lambda i: np.zeros((6, 4), np.float32)[i], dtype=np.float32)  # fmt: skip
    try:
        redist.redistribute(x, dst["embed"].update(spec=P(None, "tp")))
    except NotImplementedError as e:
        assert "divide" in str(e), e
    else:
        raise AssertionError("3 devices to 4 across processes must be refused")
    checked += 1
print(f"process {pid} OK {checked}")
jax.distributed.shutdown()
