"""Pending sums (JAX's ``unreduced`` axes): reduced inside the plan, checked by the simulator,
against numpy and against ``jax.reshard``."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MESHES, random_problem
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redist
from redist.synthesis import synthesize
from redist.types import DistType, MeshShape


@pytest.mark.parametrize("mesh", MESHES + ({"a": 2, "b": 2, "c": 3},), ids=str)
def test_random_pending_sums_are_reduced_exactly_within_the_bound(mesh):
    rng = random.Random(f"pending{mesh}")
    ms = MeshShape.of(mesh)
    for _ in range(60):
        shape, src, dst = random_problem(rng, mesh, max_rank=4)
        used = {n for e in src if e for n in ((e,) if isinstance(e, str) else e)}
        free = [n for n in mesh if n not in used]
        if not free:
            continue
        pending = rng.sample(free, rng.randint(1, len(free)))
        s = DistType.from_spec(src, shape, ms, pending)
        d = DistType.from_spec(dst, shape, ms)
        p = synthesize(ms, s, d, "int32", 4)
        assert p.steps[0].kind in ("reducescatter", "allreduce"), p
        assert p.peak_bytes <= p.bound_bytes, p
        redist.run_reference(p, np.arange(int(np.prod(shape))).reshape(shape))


def test_reduce_scatter_goes_where_the_destination_splits():
    p = redist.plan((16, 8), P("a", None, unreduced={"c"}), P("a", "c"), {"a": 2, "b": 2, "c": 2})
    assert p.kinds == ("reducescatter",) and p.steps[0].dim == 1
    q = redist.plan((16, 8), P("a", None, unreduced={"c"}), P("a"), {"a": 2, "b": 2, "c": 2})
    assert q.kinds == ("allreduce",)
    assert "+ sum{c}" in str(p)


def test_simulator_catches_a_pending_sum_left_unreduced():
    import dataclasses

    p = redist.plan((16, 8), P("a", None, unreduced={"c"}), P("a"), {"a": 2, "b": 2, "c": 2})
    wrong = dataclasses.replace(p, steps=(dataclasses.replace(p.steps[0], groups=tuple(
        (d,) for g in p.steps[0].groups for d in g)),))  # fmt: skip
    with pytest.raises(AssertionError):
        redist.run_reference(wrong, np.arange(128).reshape(16, 8))


def test_errors_name_the_axis():
    mesh = {"a": 2, "b": 2}
    with pytest.raises(ValueError, match="both unreduced and splits"):
        DistType.from_spec(("a",), (8,), MeshShape.of(mesh), ("a",))
    with pytest.raises(ValueError, match="unreduced names mesh axis 'z'"):
        redist.plan((8,), P("a", unreduced={"z"}), P(), mesh)
    with pytest.raises(NotImplementedError, match="does not create them"):
        redist.plan((8,), P("a"), P(None, unreduced={"b"}), mesh)


@pytest.mark.parametrize("dst", [P("a", ("b", "c")), P(None, "a"), P("a"), P(), P(("c", "b"))],
                         ids=str)  # fmt: skip
def test_partial_matmul_reduced_like_jax_reshard(dst):
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    lhs = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    rhs = np.arange(8 * 8, dtype=np.float32).reshape(8, 8) % 5
    a = jax.device_put(lhs, NamedSharding(mesh, P("a", ("b", "c"))))
    b = jax.device_put(rhs, NamedSharding(mesh, P(("b", "c"), None)))
    partial = P("a", None, unreduced={"b", "c"})
    with jax.set_mesh(mesh):
        y = jax.jit(lambda a, b: jnp.einsum("ij,jk->ik", a, b, out_sharding=partial))(a, b)
        ref = jax.jit(lambda v: jax.sharding.reshard(v, dst))(y)
        inside = jax.jit(lambda a, b: redist.redistribute(
            jnp.einsum("ij,jk->ik", a, b, out_sharding=partial), dst))(a, b)  # fmt: skip
    z = redist.redistribute(y, dst)
    np.testing.assert_array_equal(np.asarray(z), lhs @ rhs)
    np.testing.assert_array_equal(np.asarray(z), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(inside), lhs @ rhs)
    assert z.sharding.is_equivalent_to(NamedSharding(mesh, dst), 2)
