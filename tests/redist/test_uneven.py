"""Uneven layouts (a dimension its mesh axes do not divide, the last tiles padded as XLA pads
them): every plan checked by the numpy simulator, moves inside ``jit`` checked against numpy and
under ``grad`` / ``vmap`` / ``set_mesh``, and clear errors where JAX holds no such array."""

import dataclasses
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MESHES
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import redist
from redist import problems
from redist.synthesis import synthesize_uneven
from redist.types import DistType, MeshShape
from redist.uneven import moved_rows, pieces, working_extent


def _uneven_problem(rng: random.Random, mesh: dict[str, int]):
    """A random problem whose extents are cut below the divisible ones (most become uneven)."""
    p = problems.cut_uneven(problems.random_problem(rng, mesh, max_rank=4, max_elems=2048), rng)
    return p.shape, p.src, p.dst


def _elements(shape) -> np.ndarray:
    return np.arange(1, math.prod(shape) + 1, dtype=np.int32).reshape(shape)


@pytest.mark.parametrize("mesh", MESHES + ({"a": 2, "b": 3, "c": 2}, {"a": 6}), ids=str)
def test_random_uneven_plans_are_exact_within_the_bound(mesh):
    rng = random.Random(f"uneven{mesh}")
    uneven = 0
    for _ in range(80):
        shape, src, dst = _uneven_problem(rng, mesh)
        p = redist.plan(shape, P(*src), P(*dst), mesh, "int32")
        uneven += p.uneven
        assert p.global_shape == shape and p.peak_bytes <= p.bound_bytes, p
        reblocked = [s.dim for s in p.steps if s.kind == "reblock"]
        most = 1 if all(n & (n - 1) == 0 for n in mesh.values()) else 2
        assert all(reblocked.count(i) <= most for i in range(len(shape))), p
        tiles = redist.run_reference(p, _elements(shape))
        assert all(t.shape == p.dst.local_shape for t in tiles)
    assert uneven >= 40  # the generator does make uneven problems


@pytest.mark.parametrize("mesh", ({"a": 2, "b": 2, "c": 2}, {"a": 2, "b": 3}), ids=str)
def test_uneven_pending_sums_are_reduced_exactly(mesh):
    rng = random.Random(f"pending-uneven{mesh}")
    ms = MeshShape.of(mesh)
    checked = 0
    for _ in range(60):
        shape, src, dst = _uneven_problem(rng, mesh)
        used = {n for e in src if e for n in ((e,) if isinstance(e, str) else e)}
        free = [n for n in mesh if n not in used]
        if not free:
            continue
        s = DistType.from_spec(src, shape, ms, rng.sample(free, 1), padded=True)
        d = DistType.from_spec(dst, shape, ms, padded=True)
        p = synthesize_uneven(ms, s, d, shape, "int32", 4)
        assert p.peak_bytes <= p.bound_bytes, p
        redist.run_reference(p, _elements(shape))
        checked += 1
    assert checked >= 30


def test_the_simulator_catches_a_wrong_reblock():
    p = redist.plan((12,), P(("a", "b")), P("a"), {"a": 4, "b": 2})
    assert p.kinds == ("allgather", "reblock")
    step = p.steps[-1]
    pairs, table = step.rounds[-1]
    wrong = tuple((a, (b + 2) % 8) for a, b in pairs)  # rows sent one group too far
    bad = dataclasses.replace(step, rounds=(*step.rounds[:-1], (wrong, table)))
    with pytest.raises(AssertionError):
        redist.run_reference(dataclasses.replace(p, steps=(p.steps[0], bad)), np.arange(12))


def test_rows_that_change_hands():
    # 12 rows, 4 ranks, tiles of 4 becoming tiles of 3: rank 1 needs row 3 from rank 0
    assert pieces(12, 4, 4, 3) == [
        (0, 0, 0, 3), (0, 1, 3, 4), (1, 1, 4, 6), (1, 2, 6, 8), (2, 2, 8, 9), (2, 3, 9, 12),
    ]  # fmt: skip
    assert moved_rows(12, 4, 4, 3) == 3
    assert moved_rows(50257, 1, 50264, 50257) == 0  # replicated: padding dropped in place
    assert working_extent(12, 16, 8, 12, 4) == 16  # src's padded extent; dst's is no multiple of 8
    assert working_extent(12, 12, 4, 16, 8) == 16  # dst's padded extent
    assert working_extent(5, 6, 3, 6, 2) == 6  # both agree: no reblock at all
    assert working_extent(10, 12, 3, 12, 4) == 12  # src 12 (tiles 4), dst 12 (tiles 3)
    assert working_extent(1081, 1084, 4, 1086, 6) == 1092  # neither: lcm 12, both reblock
    p = redist.plan((5,), P("b"), P("a"), {"a": 2, "b": 3})
    assert "reblock" not in p.kinds


# Cases in the spirit of the peers' suites, in our own words: vocabularies, batches and heads
# that the mesh does not divide, and the edge where some devices hold only padding.
JIT_CASES = [
    ((50, 64), P(("a", "b")), P(None, "a")),  # vocabulary rows -> columns
    ((12, 16), P("a"), P(("a", "b"))),  # a batch of 12: 4 ways (even) -> 8 ways
    ((3, 24), P(("a", "b")), P()),  # only 3 of 8 devices hold rows
    ((12, 10, 8), P(None, "a", "b"), P("b", None, "a")),  # 12 heads on 4? 10 on 4, 12 on 2
    ((13, 7), P("a", "b"), P("b", "a")),  # both dimensions uneven on both sides
    ((9, 8), P(None, ("a", "b")), P(("b", "a"))),  # an all-to-all into an uneven dimension
]


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)


def _moved_in_jit(mesh, shape, src, dst, x):
    """``x`` placed as ``src`` (uneven) inside ``jit``, moved to ``dst``, returned padded (a
    ``jit`` result cannot be uneven); also the compiled text."""
    padded = redist.plan(shape, src, dst, mesh).dst.global_shape

    def f(v):
        v = jax.lax.with_sharding_constraint(v, NamedSharding(mesh, src))
        y = redist.redistribute(v, src, dst, mesh=mesh)
        y = jnp.pad(y, [(0, p - n) for p, n in zip(padded, shape)])
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, dst))

    g = jax.jit(f, in_shardings=NamedSharding(mesh, P()))
    out = np.asarray(g(x))[tuple(slice(0, n) for n in shape)]
    return out, g.lower(x).compile().as_text()


@pytest.mark.parametrize("shape, src, dst", JIT_CASES, ids=str)
def test_uneven_moves_inside_jit_are_exact_and_use_the_plans_collectives(mesh, shape, src, dst):
    x = _elements(shape).astype(np.float32)
    out, hlo = _moved_in_jit(mesh, shape, src, dst, x)
    np.testing.assert_array_equal(out, x)
    ops = ("all-gather(", "all-to-all(", "collective-permute(", "all-reduce(")
    collectives = [line for line in hlo.splitlines() if any(op in line for op in ops)]
    assert collectives and all("shard_map/" in line for line in collectives), collectives
    # ... every collective is the plan's: padding the last tiles and dropping it moved nothing


def test_an_uneven_tile_permutation_is_xlas_collective_permute():
    """Whole padded tiles changing devices: XLA's own collective-permute of the padded layout,
    with no masked pass over the tile to pad it for a ``shard_map``."""
    m = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
    shape, src, dst = (13, 7), P("a", "b"), P("b", "a")
    assert redist.plan(shape, src, dst, m).kinds == ("allpermute",)
    x = _elements(shape).astype(np.float32)
    out, hlo = _moved_in_jit(m, shape, src, dst, x)
    np.testing.assert_array_equal(out, x)
    collectives = [line for line in hlo.splitlines() if "collective-permute(" in line]
    assert len(collectives) == 1 and "shard_map/" not in collectives[0], collectives
    assert not [line for line in hlo.splitlines() if "all-gather(" in line or "all-to-all(" in line]
    # not a permutation of tiles (the padded extents change): the plan runs in a shard_map
    assert redist.plan((13, 7), P("a", "b"), P("b", "a"), mesh_of(4, 2)).kinds != ("allpermute",)


def mesh_of(*sizes):
    return jax.make_mesh(
        sizes, ("a", "b", "c")[: len(sizes)], axis_types=(AxisType.Auto,) * len(sizes)
    )


@pytest.mark.parametrize("sizes", [(4, 2), (2, 2, 2)], ids=str)
def test_random_uneven_moves_inside_one_jit_are_exact(sizes):
    """Sixteen random uneven moves compiled as one program (one compile), each checked."""
    names = ("a", "b", "c")[: len(sizes)]
    m = jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))
    rng = random.Random(f"jit-uneven{sizes}")
    cases = [_uneven_problem(rng, dict(zip(names, sizes))) for _ in range(16)]
    plans = [redist.plan(shape, P(*s), P(*d), m) for shape, s, d in cases]
    assert sum("reblock" in p.kinds for p in plans) >= 8

    def f(*xs):
        out = []
        for x, (shape, s, d), p in zip(xs, cases, plans):
            v = jax.lax.with_sharding_constraint(x, NamedSharding(m, P(*s)))
            y = redist.redistribute(v, P(*s), P(*d), mesh=m)
            y = jnp.pad(y, [(0, a - b) for a, b in zip(p.dst.global_shape, shape)])
            out.append(jax.lax.with_sharding_constraint(y, NamedSharding(m, P(*d))))
        return out

    xs = [_elements(shape).astype(np.float32) for shape, _, _ in cases]
    outs = jax.jit(f, in_shardings=NamedSharding(m, P()))(*xs)
    for x, y, case in zip(xs, outs, cases):
        np.testing.assert_array_equal(np.asarray(y)[tuple(map(slice, x.shape))], x, str(case))


def test_uneven_moves_under_grad_vmap_and_set_mesh(mesh):
    shape, src, dst = (13, 7), P("a", "b"), P("b", "a")
    x = _elements(shape).astype(np.float32)
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32)

    def loss(v):
        v = jax.lax.with_sharding_constraint(v, NamedSharding(mesh, src))
        return (redist.redistribute(v, src, dst, mesh=mesh) * w).sum()

    g = jax.jit(jax.grad(loss), in_shardings=NamedSharding(mesh, P()))(x)
    np.testing.assert_array_equal(np.asarray(g), w)

    def stacked(v):  # vmap over a leading dimension of 3 (split by nothing)
        move = jax.vmap(lambda t: redist.redistribute(t, src, dst, mesh=mesh) * 2)
        return move(v).sum(0)

    xs = np.stack([x, x + 1, -x])
    got = jax.jit(stacked, in_shardings=NamedSharding(mesh, P()))(xs)
    np.testing.assert_array_equal(np.asarray(got), 2 * xs.sum(0))
    with jax.set_mesh(mesh):
        in_jit = jax.jit(lambda v: redist.redistribute(
            jax.lax.with_sharding_constraint(v, src), src, dst).sum(0))(x)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(in_jit), x.sum(0))


def test_where_jax_holds_no_uneven_array_the_error_says_so(mesh):
    x = jax.device_put(np.zeros((13, 8), np.float32), NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match=r"size 13 .* padded to 16 rows.*outside jax.jit"):
        redist.redistribute(x, P(), P(("a", "b")))
    explicit = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit):
        y = jax.device_put(np.zeros((13, 8), np.float32), NamedSharding(explicit, P()))
        with pytest.raises(ValueError, match=r"on a mesh with Explicit axes"):
            jax.jit(lambda v: redist.redistribute(v, P(), P("a")))(y)


def test_uneven_move_to_another_mesh_over_the_same_devices_inside_jit(mesh):
    flat = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,), devices=mesh.devices.flat)
    shape, src, dst = (13, 6), P("b", "a"), NamedSharding(flat, P("x"))
    x = _elements(shape).astype(np.float32)

    def f(v):
        v = jax.lax.with_sharding_constraint(v, NamedSharding(mesh, src))
        y = redist.redistribute(v, src, dst, mesh=mesh)
        return jax.lax.with_sharding_constraint(jnp.pad(y, [(0, 3), (0, 0)]), dst)

    out = jax.jit(f, in_shardings=NamedSharding(mesh, P()))(x)
    np.testing.assert_array_equal(np.asarray(out)[:13], x)
    assert out.sharding.is_equivalent_to(dst, 2)
