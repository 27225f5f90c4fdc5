"""Redistributions run on 8 (or 6) simulated CPU devices, compared element for element."""

import random

import jax
import numpy as np
import pytest
from helpers import random_problem
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redist
from redist.problems import PAPER_PROBLEMS

DTYPES = (np.float32, jax.numpy.bfloat16, np.int32, np.bool_)
DEVICE_MESHES = ({"a": 2, "b": 2, "c": 2}, {"a": 4, "b": 2}, {"a": 8}, {"a": 2, "b": 3})


def make_mesh(axes: dict[str, int]):
    n = int(np.prod(list(axes.values())))
    return jax.make_mesh(tuple(axes.values()), tuple(axes), devices=jax.devices()[:n])


def random_array(rng: np.random.Generator, shape, dtype):
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype == np.int32:
        return rng.integers(-(2**30), 2**30, size=shape, dtype=np.int32)
    return rng.standard_normal(shape).astype(dtype)


def check(mesh, arr, src, dst, **options):
    x = jax.device_put(arr, NamedSharding(mesh, P(*src)))
    y = redist.redistribute(x, P(*dst), **options)
    want = NamedSharding(mesh, P(*dst))
    assert y.sharding.is_equivalent_to(want, arr.ndim), (y.sharding, want)
    assert y.dtype == arr.dtype
    for shard in y.addressable_shards:  # every device holds exactly its tile
        np.testing.assert_array_equal(np.asarray(shard.data), arr[shard.index])
    np.testing.assert_array_equal(np.asarray(y), arr)
    return y


@pytest.mark.parametrize("axes", DEVICE_MESHES, ids=str)
def test_random_problems_exact_on_devices(axes):
    """75 problems per mesh, 300 in all, every dtype, ranks 1-6."""
    mesh = make_mesh(axes)
    rng = random.Random(f"exec{axes}")
    nrng = np.random.default_rng(0)
    for k in range(75):
        shape, src, dst = random_problem(rng, axes, max_rank=6, max_elems=2048)
        arr = random_array(nrng, shape, DTYPES[k % len(DTYPES)])
        fold = {"fold_min_bytes": 0} if k % 2 else {}  # odd: fold every final permutation
        p = redist.plan(shape, src, dst, axes, dtype=arr.dtype, **fold)
        assert p.peak_bytes <= p.bound_bytes
        check(mesh, arr, src, dst, **fold)


@pytest.mark.parametrize(
    "problem",
    [q for q in PAPER_PROBLEMS if np.prod(list(q.mesh.values())) <= 8],
    ids=lambda q: q.name,
)
def test_paper_problems_on_devices(problem):
    shape = tuple(n // 4 if n % 32 == 0 and n >= 64 else n for n in problem.shape)
    mesh = make_mesh(problem.mesh)
    arr = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    check(mesh, arr, problem.src, problem.dst)


def test_grouped_and_named_collectives_both_used():
    """Groups that are whole mesh axes use names; relabelled factor groups use axis_index_groups."""
    from redist.execute import _named_axes

    p = redist.plan((8, 8), ("a", None), (None, "a"), {"a": 8})
    assert _named_axes((("a", 8),), p.steps[0].groups) == ("a",)
    q = redist.plan((12, 12), ("x", "y"), ("y", "x"), {"x": 4, "y": 6})
    assert all(_named_axes((("x", 4), ("y", 6)), s.groups) is None for s in q.steps if s.groups)
    # On devices: the first random {a:4, b:2} problem whose plan needs grouped collectives.
    axes = {"a": 4, "b": 2}
    rng = random.Random(0)
    while True:
        shape, src, dst = random_problem(rng, axes, max_rank=3, max_elems=512)
        plan = redist.plan(shape, src, dst, axes)
        if any(s.groups and _named_axes(tuple(axes.items()), s.groups) is None for s in plan.steps):
            break
    arr = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    check(make_mesh(axes), arr, src, dst)


def test_multi_move_alltoall_on_devices():
    mesh = make_mesh({"a": 2, "b": 2, "c": 2})
    arr = np.arange(28 * 5 * 4 * 26 * 4, dtype=np.int32).reshape(28, 5, 4, 26, 4)
    check(mesh, arr, (("b", "c"), None, None, None, "a"), (None, None, ("b", "a"), "c"))


def test_folded_alltoalls_in_series_are_exact():
    """GPU plans run a folded all-to-all's rounds one after another, and a last all-gather after
    a split dimension as such rounds (``Step.serial``): exact on every mesh."""
    found, kinds = 0, set()
    for axes in DEVICE_MESHES:
        mesh = make_mesh(axes)
        rng = random.Random(f"serial{axes}")
        nrng = np.random.default_rng(1)
        for _ in range(40):
            shape, src, dst = random_problem(rng, axes, max_rank=4, max_elems=2048)
            options = {"cost_model": "calibrated:h100_sxm", "fold_min_bytes": 0}
            plan = redist.plan(shape, src, dst, axes, dtype=np.float32, **options)
            if not any(s.serial for s in plan.steps):
                continue
            for k, s in enumerate(plan.steps):
                last_gather = k == len(plan.steps) - 1 and s.kind == "allgather"
                assert s.serial == bool(s.kind == "alltoall" and s.perm or last_gather
                                        and any(n > 1 for n in s.after.local_shape[: s.dim]))  # fmt: skip
            assert "in series" in str(plan)
            found += 1
            kinds |= {s.kind for s in plan.steps if s.serial}
            check(mesh, random_array(nrng, shape, np.float32), src, dst, **options)
    assert found >= 8 and kinds == {"alltoall", "allgather"}, (found, kinds)
    cpu = redist.plan((16, 16), ("a", "b"), ("b", "a"), {"a": 4, "b": 2}, fold_min_bytes=0,
                      cost_model="calibrated:cpu")  # fmt: skip
    assert not any(s.serial for s in cpu.steps)
