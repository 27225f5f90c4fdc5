"""redistribute(tree, ..., memory_budget=...): the leaves move in buckets whose bytes in flight
per device stay within the budget, eagerly and inside jit, exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import redist
from redist import api
from redist.buckets import buckets, in_flight_bytes


@given(st.lists(st.integers(0, 100), max_size=30), st.integers(100, 300))
def test_buckets_cover_every_move_once_in_order_within_the_budget(sizes, budget):
    got = buckets(sizes, budget, [f"x{k}" for k in range(len(sizes))])
    assert [k for b in got for k in b] == list(range(len(sizes)))
    assert all(b and sum(sizes[k] for k in b) <= budget for b in got)
    for b, after in zip(got, got[1:]):  # a bucket closes only where the next move does not fit
        assert sum(sizes[k] for k in b) + sizes[after[0]] > budget


def test_a_move_over_the_budget_is_named():
    with pytest.raises(ValueError, match=r"memory_budget 50 B .* moving x\['w'\] .* 80 B"):
        buckets([10, 80], 50, ["x['v']", "x['w']"])
    assert in_flight_bytes(None, 4096) == 4096


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)


def _tree(mesh):
    """A small model's weights stored FSDP (rows over fsdp), to be served tensor-parallel."""
    rng = np.random.default_rng(0)
    shapes = {"embed": (64, 32), "q": (32, 32), "up": (32, 64), "down": (64, 32), "norm": (32,)}
    host = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    train = {k: P("fsdp") for k in shapes}
    serve = {"embed": P("tp"), "q": P(None, "tp"), "up": P(None, "tp"), "down": P("tp"),
             "norm": P()}  # fmt: skip
    train = {k: NamedSharding(mesh, s) for k, s in train.items()}
    return host, jax.device_put(host, train), {k: NamedSharding(mesh, s) for k, s in serve.items()}


def _spy(monkeypatch) -> list:
    made = []

    def recording(sizes, budget, names):
        made.append((list(sizes), budget, buckets(sizes, budget, names)))
        return made[-1][2]

    monkeypatch.setattr(api, "buckets", recording)
    return made


@pytest.mark.parametrize("donate", [False, True])
def test_eager_buckets_move_every_leaf_exactly(mesh, monkeypatch, donate):
    host, placed, serve = _tree(mesh)
    made = _spy(monkeypatch)
    budget = 12288  # two of the largest moves (6144 B per device: 2 KiB in, 4 KiB out)
    out = redist.redistribute(placed, serve, memory_budget=budget, donate=donate)
    ((sizes, half, groups),) = made
    # two buckets in flight (half the budget holds the largest move), each within half of it
    assert 2 * max(sizes) <= budget and half == budget // 2
    assert len(groups) > 1 and all(sum(sizes[k] for k in g) <= half for g in groups)
    for k in host:
        assert out[k].sharding.is_equivalent_to(serve[k], host[k].ndim)
        np.testing.assert_array_equal(np.asarray(out[k]), host[k])
        assert donate or not placed[k].is_deleted()


def test_a_budget_of_less_than_two_moves_runs_one_bucket_at_a_time(mesh, monkeypatch):
    host, placed, serve = _tree(mesh)
    made = _spy(monkeypatch)
    out = redist.redistribute(placed, serve, memory_budget=9000)  # 1.5 of the largest move
    ((sizes, budget, groups),) = made
    assert budget == 9000 and 2 * max(sizes) > budget
    assert all(sum(sizes[k] for k in g) <= budget for g in groups)
    for k in host:
        np.testing.assert_array_equal(np.asarray(out[k]), host[k])


def test_inside_jit_the_budget_is_checked_and_the_moves_are_exact(mesh, monkeypatch):
    """Inside jit every leaf is checked against the budget, the compiler schedules the moves
    (no barriers between buckets), and the result and its gradient are exact."""
    host, placed, serve = _tree(mesh)
    train = {k: v.sharding for k, v in placed.items()}
    made = _spy(monkeypatch)

    def sync(p, budget=12288):  # inside jit on Auto axes the source layout is given
        return redist.redistribute(p, train, serve, memory_budget=budget)

    lowered = jax.jit(sync).lower(placed)
    assert len(made) == 1 and "optimization_barrier" not in lowered.as_text()
    out = jax.jit(sync)(placed)
    for k in host:
        np.testing.assert_array_equal(np.asarray(out[k]), host[k])
    grads = jax.grad(lambda p: sum(jnp.sum(v**2) for v in sync(p).values()))(placed)
    for k in host:
        np.testing.assert_allclose(np.asarray(grads[k]), 2 * host[k], rtol=1e-6)
    with pytest.raises(ValueError, match=r"memory_budget 100 B"):
        jax.jit(lambda p: sync(p, 100))(placed)


def test_a_budget_below_a_leafs_tiles_names_the_leaf(mesh):
    _, placed, serve = _tree(mesh)
    with pytest.raises(ValueError, match=r"memory_budget 100 B .* x\['down'\]|x\['embed'\]"):
        redist.redistribute(placed, serve, memory_budget=100)
    with pytest.raises(TypeError, match="memory_budget must be a number"):
        redist.redistribute(placed, serve, memory_budget="1 GiB")
    with pytest.raises(ValueError, match="memory_budget must be positive"):
        redist.redistribute(placed, serve, memory_budget=0)


def test_a_leaf_over_the_budget_moves_in_slices_along_a_dimension_neither_layout_splits(
    mesh, monkeypatch
):
    """A stacked weight (layers first, unsplit in both layouts) whose move alone holds more than
    the budget moves a few layers at a time into its destination, exactly; one split in every
    dimension still names itself."""
    made = _spy(monkeypatch)
    rng = np.random.default_rng(1)
    host = {"experts": rng.standard_normal((6, 8, 16)).astype(np.float32),
            "dense": rng.standard_normal((16, 8)).astype(np.float32)}  # fmt: skip
    train = {"experts": NamedSharding(mesh, P(None, "fsdp", "tp")),
             "dense": NamedSharding(mesh, P("fsdp", "tp"))}  # fmt: skip
    serve = {"experts": NamedSharding(mesh, P(None, "tp", "fsdp")),
             "dense": NamedSharding(mesh, P("tp", "fsdp"))}  # fmt: skip
    placed = jax.device_put(host, train)
    whole = 2 * 8 * 16 * 6 // 8 * 4  # the experts' move: its input and output tiles
    out = redist.redistribute(placed, serve, memory_budget=whole // 2)
    ((sizes, budget, _),) = made
    assert max(sizes) <= budget < whole
    for k in host:
        assert out[k].sharding.is_equivalent_to(serve[k], host[k].ndim)
        np.testing.assert_array_equal(np.asarray(out[k]), host[k])
    with pytest.raises(ValueError, match=r"x\['dense'\]"):
        redist.redistribute(placed, serve, memory_budget=60)
