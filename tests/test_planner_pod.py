"""Plans for meshes without devices (AbstractMesh, {name: size}) from shapes, and the shardings a
plan hands to the user's own jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import planner


def _loss(x, w1, w2):
    return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)


STEP = jax.grad(_loss, argnums=(1, 2))
SHAPES = ((256, 128), (128, 512), (512, 128))


def _names(specs) -> set[str]:
    out = set()
    for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)):
        for e in s:
            out |= {e} if isinstance(e, str) else set(e or ())
    return out


@pytest.mark.parametrize("mesh", [AbstractMesh((8, 8), ("data", "model")),
                                  {"data": 16, "fsdp": 16, "tensor": 16}],
                         ids=["abstract-64", "dict-4096"])  # fmt: skip
def test_plan_from_shapes_on_meshes_without_devices(mesh):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES]
    p = planner.plan(STEP, *args, mesh=mesh)
    text = p.explain()
    assert "replicated: predicted" in text and "dot_general" in text
    assert '"spec_mesh"' in p.to_json()
    names = _names(p.in_specs) | _names(p.out_specs)
    assert names <= {n for n, _ in p.spec_mesh.axes} and not any("#" in n for n in names)
    assert p.prediction.time_s < p.replicated.time_s
    with pytest.raises(ValueError, match="without devices"):
        p.in_shardings  # noqa: B018
    with pytest.raises(ValueError, match="without devices"):
        p(*[np.ones(s, np.float32) for s in SHAPES])


def test_shardings_in_a_plain_jit_compute_the_unsharded_result():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    p = planner.plan(STEP, *args, mesh=mesh)
    assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(p.in_shardings))
    f = jax.jit(STEP, in_shardings=p.in_shardings, out_shardings=p.out_shardings)
    got = f(*args)
    want = STEP(*args)
    for g, w, s in zip(got, want, jax.tree.leaves(p.out_shardings)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)
        assert g.sharding.is_equivalent_to(s, g.ndim)


def test_specs_split_by_part_of_an_axis_use_a_reshaped_mesh_and_say_so():
    from planner.auto import _spec_mesh
    from redist.types import DistType, MeshShape

    m = MeshShape.of({"c": 8, "d": 2})
    t = DistType.from_axes((16, 16), [(), ("c#2", "c#0")], m)
    spec_mesh = _spec_mesh([t], m)
    assert spec_mesh.axes == (("c_0", 2), ("c_1", 2), ("c_2", 2), ("d", 2))
    whole = DistType.from_spec(("c", "d"), (16, 16), m)
    assert _spec_mesh([whole], m) == m
