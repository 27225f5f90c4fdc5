"""``redistribute`` under JAX's transformations: the differential harness of
``experiments.transformations`` on every mesh and axis kind, and the cases users reported."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import redist
from experiments import transformations
from redist import linear

DEVICES = np.array(jax.devices()[:8])


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("sizes", transformations.MESHES, ids=str)
def test_every_composition_is_exact(sizes, explicit):
    rng = random.Random(f"{sizes}{explicit}")
    case = transformations.random_case(
        rng, sizes, explicit, other_mesh=explicit == (len(sizes) > 1)
    )
    results = transformations.check(case)
    assert len(results) >= 10
    assert {n: r for n, r in results.items() if r != "ok"} == {}


def test_the_harness_catches_a_doubled_gradient(monkeypatch):
    case = transformations.random_case(random.Random(3), {"a": 4, "b": 2}, False, False)
    doubled = lambda ct, x, *, move: [2 * linear.redistribute_p.bind(ct, move=move.reverse)]
    monkeypatch.setitem(jax.interpreters.ad.primitive_transposes, linear.redistribute_p,
                        lambda ct, *args, **kw: doubled(ct, *args, **kw))  # fmt: skip
    results = transformations.check(case)
    assert results["eager 3-arg"] == "ok"
    assert "values differ" in results["grad 3-arg"] and "values differ" in results["vjp"]


def _explicit(shape, names):
    n = int(np.prod(shape))
    return Mesh(DEVICES[:n].reshape(shape), names, axis_types=(AxisType.Explicit,) * len(shape))


@pytest.mark.parametrize("shape", [(4,), (4, 2), (2, 2, 2)], ids=str)
def test_gradient_through_a_pending_sum_is_reshard_s(shape):
    """The cotangent of a reduced pending sum goes to every partial unchanged (it was the group
    size times too large)."""
    names = ("m0", "m1", "m2")[: len(shape)]
    m = _explicit(shape, names)
    lhs = jax.device_put(np.arange(4 * 4 * 8, dtype=np.float32).reshape(4, 4, 8) / 7,
                         NamedSharding(m, P(None, None, "m0")))  # fmt: skip
    ones = jax.device_put(np.ones(8, np.float32), NamedSharding(m, P("m0")))
    w = np.arange(16, dtype=np.float32).reshape(4, 4) / 3
    make = lambda a: jnp.einsum("abz,z->ab", a, ones, out_sharding=P(unreduced={"m0"}))
    with jax.set_mesh(m):
        for dst in (P(), P("m0"), P(None, names[-1])):
            move = lambda v, dst=dst: redist.redistribute(v, dst)
            ref = lambda v, dst=dst: jax.sharding.reshard(v, dst)
            g = jax.jit(jax.grad(lambda a, f=move: jnp.sum(f(make(a)) * w)))(lhs)
            want = jax.jit(jax.grad(lambda a, f=ref: jnp.sum(f(make(a)) * w)))(lhs)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
            np.testing.assert_array_equal(np.asarray(g)[:, :, 0], w)
            value = jax.jit(lambda a, f=move: f(make(a)))(lhs)
            np.testing.assert_allclose(np.asarray(value), np.asarray(lhs).sum(-1), rtol=1e-6)


def test_gradient_on_an_axis_of_size_3_is_bit_exact():
    m = Mesh(DEVICES[:6].reshape(2, 3), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    x = jax.device_put(np.arange(144, dtype=np.float32).reshape(12, 12) / 7,
                       NamedSharding(m, P("y")))  # fmt: skip
    w = np.arange(144, dtype=np.float32).reshape(12, 12) / 3
    g = jax.grad(lambda v: jnp.sum(redist.redistribute(v, P("y"), P("x"), mesh=m) * w))(x)
    np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.parametrize("dst", [P(("a", "b", "c")), P("c", None), P(None, ("c", "a"))], ids=str)
def test_two_argument_form_under_grad_on_auto_axes_outside_set_mesh(dst):
    """The source read from ``x.sharding``; the cotangent of a sum (ones JAX makes on one device)
    and of a product come back exact, on ``x``'s layout."""
    m = Mesh(DEVICES.reshape(2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
    src = NamedSharding(m, P("a", "b"))
    x = jax.device_put(np.arange(256, dtype=np.float32).reshape(16, 16) / 7, src)
    w = np.arange(256, dtype=np.float32).reshape(16, 16) / 3
    g = jax.grad(lambda v: jnp.sum(redist.redistribute(v, dst)))(x)
    np.testing.assert_array_equal(np.asarray(g), np.ones((16, 16), np.float32))
    g = jax.grad(lambda v: jnp.sum(redist.redistribute(v, dst) * w))(x)
    np.testing.assert_array_equal(np.asarray(g), w)
    assert g.sharding.is_equivalent_to(src, 2)


def test_two_argument_form_in_jit_under_set_mesh_on_a_non_prime_axis():
    m = _explicit((4,), ("m0",))
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(m, P("m0")))
    with jax.set_mesh(m):
        y = jax.jit(lambda v: redist.redistribute(v, P(None, "m0")))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(m, P(None, "m0")), 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_grad_to_another_mesh_over_the_same_devices_inside_jit():
    m1 = Mesh(DEVICES.reshape(2, 4), ("a", "b"))
    m2 = Mesh(DEVICES.reshape(4, 2), ("c", "d"))
    x = jax.device_put(
        np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(m1, P("a", "b"))
    )
    dst = NamedSharding(m2, P("c", "d"))
    f = lambda v: jnp.sum(redist.redistribute(v, P("a", "b"), dst, mesh=m1) ** 2)
    for g in (jax.grad(f)(x), jax.jit(jax.grad(f))(x)):
        np.testing.assert_array_equal(np.asarray(g), 2 * np.asarray(x))


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_eager_vmap_over_a_sharded_dimension(kind):
    """JAX's ``test_reshard_api``: rows of a ``P('x', 'y')`` array moved ``P('y') -> P(None)``;
    the batch dimension keeps its split."""
    m = Mesh(DEVICES.reshape(2, 4), ("x", "y"), axis_types=(kind,) * 2)
    arr = np.arange(64, dtype=np.float32).reshape(8, 8)
    x = jax.device_put(arr, NamedSharding(m, P("x", "y")))
    for ctx in (jax.set_mesh(m), None):
        if ctx is None:
            y = jax.vmap(lambda r: redist.redistribute(r, P("y"), P(None), mesh=m))(x)
        else:
            with ctx:
                y = jax.vmap(lambda r: redist.redistribute(r, P("y"), P(None)))(x)
        np.testing.assert_array_equal(np.asarray(y), arr)
        assert y.sharding.is_equivalent_to(NamedSharding(m, P("x", None)), 2)
