import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redist.types import DistType, MeshShape, prime_factors

MESHES = [{"a": 2, "b": 2, "c": 2}, {"a": 4, "b": 2}, {"a": 8}, {"a": 2, "b": 3}, {"x": 4, "y": 6}]


def test_prime_decomposition():
    assert prime_factors(12) == (2, 2, 3)
    assert prime_factors(97) == (97,)
    assert prime_factors(1) == ()
    mesh = MeshShape.of({"a": 4, "b": 6, "c": 1, "d": 5})
    assert [(f.name, f.size) for f in mesh.factors] == [
        ("a#0", 2), ("a#1", 2), ("b#0", 2), ("b#1", 3), ("d", 5)
    ]  # fmt: skip
    assert mesh.num_devices == 120


def test_notation_is_minor_to_major():
    mesh = MeshShape.of({"x": 4, "y": 6})
    t = DistType.from_spec(("x", "y"), (12, 12), mesh)
    assert str(t) == "[3{x#1,x#0}12, 2{y#1,y#0}12]"
    assert t.local_shape == (3, 2) and t.global_shape == (12, 12) and t.local_size == 6
    t2 = DistType.from_spec((("a", "b"),), (8,), MeshShape.of({"a": 2, "b": 2}))
    assert str(t2) == "[2{b,a}8]"


def test_repr_is_pasteable():
    mesh = MeshShape.of({"a": 4, "b": 2})
    t = DistType.from_spec((("b", "a"), None), (16, 3), mesh)
    assert eval(repr(t), {"DistType": DistType, "mesh": mesh}) == t


def test_base_offsets_jax_convention():
    # P(("a", "b")): device (a, b) holds block a * 2 + b (a major), as in JAX.
    mesh = MeshShape.of({"a": 2, "b": 2})
    t = DistType.from_spec((("a", "b"),), (8,), mesh)
    assert t.base_offsets(mesh)[:, 0].tolist() == [0, 2, 4, 6]
    t = DistType.from_spec((("b", "a"),), (8,), mesh)
    assert t.base_offsets(mesh)[:, 0].tolist() == [0, 4, 2, 6]


@st.composite
def typed(draw):
    mesh = MeshShape.of(draw(st.sampled_from(MESHES)))
    rank = draw(st.integers(1, 4))
    spec = [[] for _ in range(rank)]
    for name in mesh.axis_names:
        k = draw(st.integers(-1, rank - 1))
        if k >= 0:
            spec[k].append(name)
    spec = tuple(None if not e else tuple(draw(st.permutations(e))) for e in spec)
    shape = []
    for e in spec:
        parts = int(np.prod([mesh.sizes[n] for n in e or ()]))
        shape.append(parts * draw(st.integers(1, 3)))
    return mesh, tuple(shape), spec


@settings(max_examples=200, deadline=None)
@given(typed())
def test_spec_round_trip(case):
    mesh, shape, spec = case
    t = DistType.from_spec(spec, shape, mesh)
    back = DistType.from_spec(t.to_spec(mesh), shape, mesh)
    assert back == t


@settings(max_examples=200, deadline=None)
@given(typed())
def test_tiles_cover_the_array_evenly(case):
    """Lemma 4.2: base offsets are exactly the tile grid, each tile held equally often."""
    mesh, shape, spec = case
    t = DistType.from_spec(spec, shape, mesh)
    offsets = t.base_offsets(mesh)
    grid = {tuple(o) for o in np.indices([g // loc for g, loc in zip(shape, t.local_shape)])
            .reshape(len(shape), -1).T * np.array(t.local_shape)}  # fmt: skip
    seen, counts = np.unique(offsets, axis=0, return_counts=True)
    assert {tuple(o) for o in seen} == grid
    assert len(set(counts.tolist())) == 1
    assert counts[0] * len(grid) == mesh.num_devices


@pytest.mark.parametrize(
    "spec, shape, match",
    [
        (("z",), (8,), r"dimension 0 of the spec names mesh axis 'z'.*valid axes: \('a', 'b'\)"),
        (("a", "a"), (8, 8), r"mesh axis 'a' is used twice \(dimensions 0 and 1\)"),
        (("b",), (7,), r"dimension 0 of size 7 .* 2 parts.*padded=True"),
        (("a", None, None), (8, 8), r"3 entries but the array has rank 2"),
        ((3,), (8,), r"dimension 0 of the spec is 3"),
    ],
)
def test_spec_errors(spec, shape, match):
    mesh = MeshShape.of({"a": 4, "b": 2})
    with pytest.raises((ValueError, TypeError), match=match):
        DistType.from_spec(spec, shape, mesh)


def test_mesh_errors():
    with pytest.raises(ValueError, match="positive integer size"):
        MeshShape.of({"a": 0})
    with pytest.raises(ValueError, match="would be named alike"):
        MeshShape.of({"a": 4, "a#1": 2})
    # An already factored mesh (as the planner builds) is its own decomposition.
    assert MeshShape.of({"a#0": 2, "a#1": 2}).factor_names == ("a#0", "a#1")
