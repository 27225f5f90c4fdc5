"""Redistribution onto another mesh: same devices reshaped or reordered, and other devices."""

import random

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import redist
from redist.meshes import translate
from redist.problems import random_spec
from redist.types import DistType, MeshShape

DEVICES = np.array(jax.devices()[:8])
SHAPES = {(8,): ("fsdp",), (2, 4): ("dp", "tp"), (4, 2): ("x", "y"), (2, 2, 2): ("a", "b", "c")}


def test_translate_between_reshaped_meshes():
    fsdp, serve = MeshShape.of({"fsdp": 8}), MeshShape.of({"dp": 2, "tp": 4})
    t = DistType.from_spec((("dp", "tp"), None), (16, 4), serve)
    assert translate(t, serve, fsdp) == DistType.from_spec(("fsdp",), (16, 4), fsdp)
    back = translate(DistType.from_spec(("fsdp",), (16, 4), fsdp), fsdp, serve)
    assert back.base_offsets(serve).tolist() == t.base_offsets(serve).tolist()
    # {x:2, y:3} and {u:3, v:2}: the 2-digit has stride 3 on one and 1 on the other.
    a, b = MeshShape.of({"x": 2, "y": 3}), MeshShape.of({"u": 3, "v": 2})
    assert translate(DistType.from_spec(("x",), (6,), a), a, b) is None
    with pytest.raises(ValueError, match="devices"):
        translate(t, serve, MeshShape.of({"a": 4}))


def _mesh(shape, order, kind):
    names = SHAPES[shape]
    return Mesh(DEVICES[list(order)].reshape(shape), names, axis_types=(kind,) * len(names))


def _check(y, arr, dst):
    assert y.sharding.is_equivalent_to(dst, arr.ndim)
    # Inside jit on Auto axes, jit writes an inferred output sharding on a mesh of its choice
    # (out_shardings names one); the placement is dst's all the same.
    if any(str(t).endswith("Explicit") for t in dst.mesh.axis_types):
        assert y.sharding.mesh == dst.mesh
    for sh in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(sh.data), arr[sh.index])


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_random_moves_between_meshes_over_the_same_devices(kind):
    """Reshaped meshes run a planned program (inside jit too); reordered ones a direct transfer."""
    rng = random.Random(str(kind))
    shapes = list(SHAPES)
    for k in range(12):
        a, b = rng.choice(shapes), rng.choice(shapes)
        order = list(range(8))
        if k % 3 == 2:
            rng.shuffle(order)
        m1, m2 = _mesh(a, range(8), kind), _mesh(b, order, kind)
        full = (16, 8, 8)
        s = random_spec(rng, dict(m1.shape), 3)
        d = random_spec(rng, dict(m2.shape), 3)
        arr = np.arange(np.prod(full), dtype=np.int32).reshape(full)
        x = jax.device_put(arr, NamedSharding(m1, P(*s)))
        dst = NamedSharding(m2, P(*d))
        _check(redist.redistribute(x, dst), arr, dst)
        if order == list(range(8)):
            f = jax.jit(lambda v, s=s, dst=dst, m1=m1: redist.redistribute(
                v, NamedSharding(m1, P(*s)), dst))  # fmt: skip
            _check(f(x), arr, dst)


def test_training_to_serving_mesh_is_one_all_to_all():
    """FSDP over 8 devices to (dp 2, tp 4) rows-by-tp: one all-to-all, no gather of the array."""
    m1, m2 = _mesh((8,), range(8), AxisType.Explicit), _mesh((2, 4), range(8), AxisType.Explicit)
    arr = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    x = jax.device_put(arr, NamedSharding(m1, P("fsdp")))
    dst = NamedSharding(m2, P("dp", "tp"))
    f = jax.jit(lambda v: redist.redistribute(v, NamedSharding(m1, P("fsdp")), dst))
    text = f.lower(x).compile().as_text()
    assert text.count("all-to-all(") == 1 and "all-gather(" not in text
    _check(f(x), arr, dst)


def test_other_devices_and_errors():
    arr = np.arange(32 * 8, dtype=np.float32).reshape(32, 8)
    first = Mesh(DEVICES[:4], ("i",))
    last = Mesh(DEVICES[4:].reshape(2, 2), ("p", "q"))
    x = jax.device_put(arr, NamedSharding(first, P("i")))
    for spec in (P(None, ("q", "p")), P("p"), P()):
        dst = NamedSharding(last, spec)
        _check(redist.redistribute(x, dst), arr, dst)
        # an eager jax.grad runs the transfer and its reverse eagerly
        g = jax.grad(lambda v, dst=dst: (redist.redistribute(v, dst) ** 2).sum())(x)
        _check(g, 2 * arr, NamedSharding(first, P("i")))
    # 4 devices to 3: no staging (neither count divides the other), pieces sent to each device
    three = NamedSharding(Mesh(DEVICES[5:], ("t",)), P(None, None))
    _check(redist.redistribute(x, three), arr, three)
    reordered = NamedSharding(Mesh(DEVICES[[1, 0, 3, 2]], ("i",)), P("i"))
    with pytest.raises(ValueError, match="same order"):
        jax.jit(lambda v: redist.redistribute(v, NamedSharding(first, P("i")), reordered))(x)


def test_donation_frees_the_input_and_keeps_the_result_exact():
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    arr = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    for dst in (P("b", "a"), NamedSharding(_mesh((2, 4), range(8), AxisType.Explicit), P("tp")),
                NamedSharding(Mesh(DEVICES[::-1], ("r",)), P(None, "r"))):  # fmt: skip
        x = jax.device_put(arr, NamedSharding(mesh, P("a", "b")))
        y = redist.redistribute(x, dst, donate=True)
        assert x.is_deleted()
        np.testing.assert_array_equal(np.asarray(y), arr)


def test_donation_lowers_compiled_memory():
    from redist.execute import shard_mapped

    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    src, dst = P(("a", "b"), "c"), P(None, "a", ("c", "b"))
    x = jax.device_put(np.ones((256, 256, 8), np.float32), NamedSharding(mesh, src))
    p = redist.plan(x.shape, src, dst, mesh)
    held = []
    for donate in ((), (0,)):
        m = jax.jit(shard_mapped(p, mesh, src, dst), donate_argnums=donate).lower(x)
        m = m.compile().memory_analysis()
        held.append(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                    - m.alias_size_in_bytes)  # fmt: skip
    assert held[1] <= held[0] - p.src.local_size * 4


def test_explicit_axes_to_a_mesh_of_auto_axes():
    """The README's example: a jax.make_mesh (Explicit) array onto a plain Mesh (Auto axes)."""
    arr = np.arange(16 * 16 * 8, dtype=np.float32).reshape(16, 16, 8)
    m1 = _mesh((2, 2, 2), range(8), AxisType.Explicit)
    serving = NamedSharding(_mesh((2, 4), range(8), AxisType.Auto), P(None, "tp"))
    x = jax.device_put(arr, NamedSharding(m1, P(("a", "b"), "c")))
    _check(redist.redistribute(x, serving), arr, serving)
    with pytest.raises(ValueError, match="both have Explicit axes or both Auto"):
        jax.jit(lambda v: redist.redistribute(v, serving))(x)
