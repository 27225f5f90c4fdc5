"""What plans accept as inputs: generated mesh axis names that do not collide with the user's,
and numpy inputs to the explicit lowering on meshes of Explicit axes."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

import planner

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_spec_mesh_names_do_not_collide_with_the_users_axes():
    from planner.auto import _spec_mesh
    from redist.types import DistType, MeshShape

    m = MeshShape.of({"c": 8, "c_1": 1})
    t = DistType.from_axes((16, 16), [(), ("c#2", "c#0")], m)
    assert _spec_mesh([t], m).axes == (("c__0", 2), ("c__1", 2), ("c__2", 2), ("c_1", 1))

    devs = np.array(jax.devices())
    mesh = Mesh(devs.reshape(8, 1), ("c", "c_1"), axis_types=(AxisType.Auto,) * 2)
    x, w = rand(4, 6), rand(6, 16)
    p = planner.plan(lambda x, w: jnp.tanh(x @ w), x, w, mesh=mesh)
    names = [n for n, _ in p.spec_mesh.axes]
    assert len(set(names)) == len(names) and "c" not in names  # the plan splits part of c
    assert jax.tree.leaves(p.in_shardings)[0].mesh.axis_names == tuple(names)
    close(p(x, w), jnp.tanh(x @ w))


def test_explicit_lowering_places_numpy_inputs_on_a_mesh_of_explicit_axes():
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Explicit,) * 3)
    x, w = rand(64, 32), rand(32, 16)
    p = planner.plan(lambda x, w: jnp.tanh(x @ w), x, w, mesh=mesh)
    assert any(jax.tree.leaves(p.in_specs))  # the inputs rest split
    want = jnp.tanh(x @ w)
    close(p.lowered(x, w), want)
    close(p(x, w), want)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w)]
    assert p.lowered.lower(*specs).compile()
