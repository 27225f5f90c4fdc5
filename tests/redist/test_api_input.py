"""redistribute() refuses bad input by name, before JAX sees it (no crash, no hang)."""

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import redist

MESH = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
ARR = np.arange(64, dtype=np.float32).reshape(8, 8)


def _x():
    return jax.device_put(ARR, NamedSharding(MESH, P("a", "b")))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: redist.redistribute(_x(), "a"), TypeError, r"dst must be .* got 'a'.*P\('a'\)"),
        (lambda: redist.redistribute(_x(), 3, P()), TypeError, "src must be"),
        (lambda: redist.redistribute(_x(), P("b"), fold_min_bytes="x"), TypeError, "fold_min"),
        (lambda: redist.redistribute(_x(), P("b"), cost_model="fast"), ValueError, "cost_model"),
        (lambda: redist.redistribute(_x(), P(None, unreduced={"a"})), NotImplementedError,
         "does not create them"),
        (lambda: redist.redistribute(jax.device_put(ARR.astype(ml_dtypes.int2),
                                                    NamedSharding(MESH, P("a", "b"))), P("b")),
         TypeError, "int2 is a sub-byte type"),
        (lambda: redist.redistribute(ARR, NamedSharding(MESH, P("b"))), ValueError,
         "ndarray, which has no layout"),
        (lambda: redist.redistribute(jax.device_put(ARR, jax.devices()[3]),
                                     NamedSharding(MESH, P("b"))), ValueError, "lives on one device"),
    ],
    ids=["str-dst", "int-src", "fold", "cost-model", "unreduced-dst", "int2", "numpy-2-arg",
         "single-device"],
)  # fmt: skip
def test_bad_input_is_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_numpy_input_is_placed_as_src():
    y = redist.redistribute(ARR, P("a", "b"), P("b"), mesh=MESH)
    np.testing.assert_array_equal(np.asarray(y), ARR)
    assert y.sharding.is_equivalent_to(NamedSharding(MESH, P("b")), 2)


def test_donated_buffers_are_never_given_twice():
    x = _x()
    y = redist.redistribute(x, P("b", "a"), donate=True)  # same tile shape: XLA reuses it
    assert x.is_deleted()
    with pytest.raises(ValueError, match="x was deleted"):
        redist.redistribute(x, P("b", "a"), donate=True)
    with pytest.raises(ValueError, match="x was deleted"):
        redist.redistribute(x, P("b", "a"))
    z = _x()
    with pytest.raises(ValueError, match=r"x\[1\] and x\[0\] are the same array"):
        redist.redistribute([z, z], P("b"), donate=True)
    assert not z.is_deleted()
    np.testing.assert_array_equal(np.asarray(y), ARR)
