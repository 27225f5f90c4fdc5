"""What plans accept as inputs: generated mesh axis names that do not collide with the user's,
and numpy inputs to the explicit lowering on meshes of Explicit axes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import planner

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_spec_mesh_names_do_not_collide_with_the_users_axes():
    from planner.autoplan import _spec_mesh
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


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)


def matmul(x, w):
    return x @ w


def test_a_plan_refuses_arguments_unlike_those_it_was_made_for(mesh):
    x, w = rand(64, 32), rand(32, 16)
    p = planner.plan(matmul, x, w, mesh=mesh)
    xi, wi = x.astype(np.int32), w.astype(np.int32)
    assert jax.jit(matmul)(xi, wi).dtype == np.int32  # what the plan must not silently change
    for f in (p, p.jit()):
        with pytest.raises(TypeError, match=r"args\[0\] has dtype int32, the plan's is float32"):
            f(xi, wi)
        with pytest.raises(ValueError, match=r"args\[1\] has shape \(32, 8\), the plan's is"):
            f(x, w[:, :8])
    with pytest.raises(ValueError, match=r"3 positional argument\(s\), the plan takes 2"):
        p(x, w, w)
    close(p(x, w), x @ w)  # and the plan still runs what it was made for

    params = {"w": w, "b": rand(16)}
    q = planner.plan(lambda x, p: x @ p["w"] + p["b"], x, params, mesh=mesh)
    with pytest.raises(ValueError, match=r"args\[1\]\['b'\] has shape \(8,\)"):
        q(x, {"w": w, "b": rand(8)})
    with pytest.raises(ValueError, match=r"args\[1\] has structure"):
        q(x, {"w": w})


def test_auto_shard_plans_again_for_new_dtypes(mesh):
    x, w = rand(64, 32), rand(32, 16)
    f = planner.auto_shard(matmul, mesh=mesh)
    assert f(x, w).dtype == np.float32
    xi, wi = (RNG.integers(-3, 3, s).astype(np.int32) for s in ((64, 32), (32, 16)))
    got = f(xi, wi)
    assert got.dtype == np.int32 and len(f.plans) == 2
    np.testing.assert_array_equal(np.asarray(got), xi @ wi)


def test_arguments_without_arrays_are_static(mesh):
    x = rand(64, 32)
    f = planner.auto_shard(lambda x, n: x * n, mesh=mesh)
    close(f(x, 3), x * 3)
    close(f(x, 4), x * 4)
    assert len(f.plans) == 2

    def act(x, name, axes=(0,)):
        return jnp.sum(getattr(jnp, name)(x), axis=axes)

    p = planner.plan(act, x, "tanh", (1,), mesh=mesh)
    assert p.in_specs[1:] == (None, None) and len(p.program.inputs) == 1
    close(p(x, "tanh", (1,)), act(x, "tanh", (1,)))
    with pytest.raises(ValueError, match=r"args\[1\] is the static value 'exp', the plan's is"):
        p(x, "exp", (1,))
    with pytest.raises(TypeError, match="must be hashable"):
        planner.plan(act, x, "tanh", [1], mesh=mesh)
    with pytest.raises(TypeError, match=r"args\[0\]\['name'\] is a str inside an argument"):
        planner.plan(lambda p: p["x"], {"x": x, "name": "tanh"}, mesh=mesh)


def test_keyword_arguments_are_pytrees_of_arrays_or_static(mesh):
    x, w = rand(64, 32), rand(32, 16)

    def layer(x, *, w, scale=1.0):
        return jnp.tanh(x @ w) * scale, w - 0.1 * scale

    p = planner.plan(layer, x, w=w, scale=2.0, mesh=mesh)
    specs = p.in_specs
    assert (
        isinstance(specs, tuple) and set(specs[1]) == {"scale", "w"} and specs[1]["scale"] is None
    )
    close(p(x, w=w, scale=2.0), layer(x, w=w, scale=2.0))
    with pytest.raises(ValueError, match=r"keyword arguments \['w'\], the plan takes"):
        p(x, w=w)
    f = p.jit(donate_argnames="w")
    assert f.lower(x, w=w, scale=2.0).compile()
    w_on = jax.device_put(w, p.in_shardings[1]["w"])
    close(f(x, w=w_on, scale=2.0), layer(x, w=w, scale=2.0))
    assert w_on.is_deleted()

    g = planner.auto_shard(layer, mesh=mesh)
    close(g(x, w=w), layer(x, w=w))
    close(g(x, w=w, scale=3.0), layer(x, w=w, scale=3.0))
    assert len(g.plans) == 2


def test_static_arguments_are_static_everywhere(mesh, tmp_path):
    """A string and an integer used as a shape, through every way of running a plan."""
    x = rand(16, 8)

    def f(x, act, reps):
        return jnp.tile(getattr(jnp, act)(x), reps)

    want = f(x, "tanh", 2)
    p = planner.plan(f, x, "tanh", 2, mesh=mesh)
    close(p(x, "tanh", 2), want)
    close(p.lowered(x, "tanh", 2), want)  # the explicit lowering takes the user's arguments
    close(p.jit()(x, "tanh", 2), want)
    close(planner.auto_shard(f, mesh=mesh)(x, "tanh", 2), want)
    assert p.compiled_report().fits  # compiled on the static values the plan was made for
    p.save(str(tmp_path / "plan.json"))
    close(planner.load(str(tmp_path / "plan.json"), f, x, "tanh", 2, mesh=mesh)(x, "tanh", 2), want)
    with pytest.raises(ValueError, match=r"args\[2\] is the static value 3"):
        p.lowered(x, "tanh", 3)


def test_a_typed_prng_key_is_an_argument_like_any_other(mesh, tmp_path):
    """``jax.random.key`` (what equinox, haiku and nnx pass to a step) as a plan argument."""
    x, w = rand(16, 16), rand(16, 16)

    def step(w, x, key):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.sum(jnp.where(keep, jnp.tanh(x @ w), 0.0) ** 2)

    g, key = jax.grad(step), jax.random.key(0)
    want = g(w, x, key)
    p = planner.plan(g, w, x, key, mesh=mesh)
    close(p(w, x, key), want)
    close(p.lowered(w, x, key), want)
    close(planner.auto_shard(g, mesh=mesh)(w, x, key), want)
    p.save(str(tmp_path / "plan.json"))
    close(planner.load(str(tmp_path / "plan.json"), g, w, x, key, mesh=mesh)(w, x, key), want)
    with pytest.raises(ValueError, match=r"args\[2\] has dtype key<rbg>, the plan.s is key<fry>"):
        p(w, x, jax.random.key(0, impl="rbg"))


@pytest.mark.parametrize(
    "fn", [lambda x: x, lambda x: None, lambda x: 1.0], ids=["identity", "none", "scalar"]
)
def test_a_program_without_work_is_explained(mesh, fn):
    x = rand(16, 8)
    p = planner.plan(fn, x, mesh=mesh)
    text = p.explain()
    assert "this plan 1.00x as fast, 1.00x the memory" in text
    close(p(x), fn(x))
