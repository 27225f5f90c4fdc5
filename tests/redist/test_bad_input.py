"""Every bad input to the pure layer is refused with a ValueError / TypeError /
NotImplementedError that names the argument, what was received and what is valid: never a hang,
a crash, an internal error, or a silent reinterpretation. No devices needed."""

import contextlib
import math
import re
import signal
import time
import warnings

import numpy as np
import pytest

import redist
from redist.specs import check_options, dtype_info, movable_dtype
from redist.types import MAX_DEVICES, MAX_RANK, DistType, MeshShape, check_shape, prime_factors

MESH = {"a": 2, "b": 4}


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging."""

    def fail(*_):
        raise TimeoutError(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _trial_division(n: int) -> tuple[int, ...]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return tuple(out + [n] if n > 1 else out)


def test_prime_factors_exact_and_fast_for_big_numbers():
    for n in range(5000):
        assert prime_factors(n) == _trial_division(n), n
    start = time.perf_counter()
    assert prime_factors(2**61 - 1) == (2**61 - 1,)
    assert prime_factors((2**31 - 1) * (2**31 + 11)) == (2**31 - 1, 2**31 + 11)
    assert prime_factors(999983**2) == (999983, 999983)
    assert prime_factors(2**63 - 1) == (7, 7, 73, 127, 337, 92737, 649657)
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize("size", [2**61 - 1, 2**31 - 1, 2**40, MAX_DEVICES + 1])
def test_mesh_size_is_bounded_before_factoring(size):
    with (
        deadline(5),
        pytest.raises(ValueError, match=r"supports meshes of at most 1048576 \(2\*\*20\)"),
    ):
        MeshShape.of({"a": size})
    with pytest.raises(ValueError, match=r"mesh \{a:1024, b:2048\} has 2097152 devices"):
        MeshShape.of({"a": 2**10, "b": 2**11})


def test_largest_mesh_plans():
    mesh = MeshShape.of({"a": 2**10, "b": 2**10})
    assert mesh.num_devices == MAX_DEVICES
    with deadline(60):
        p = redist.plan((2**10, 2**10, 8), ("a", "b"), (None, None, None), mesh)
    assert p.kinds == ("allgather", "allgather")


def test_types_layer_refuses_bad_values_too():
    mesh = MeshShape.of(MESH)
    with pytest.raises(TypeError, match=r"the spec must be a tuple or list .* got 'ab'"):
        DistType.from_spec("ab", (8, 8), mesh)
    with pytest.raises(TypeError, match=r"shape\[0\] must be an integer, got 8.5"):
        DistType.from_spec(("a",), (8.5, 8), mesh)
    with pytest.raises(TypeError, match=r"unreduced must be a collection"):
        DistType.from_spec(("a",), (8, 8), mesh, unreduced="b")
    with pytest.raises(TypeError, match=r"got np.int64\(2\) .* \(build meshes with MeshShape.of\)"):
        MeshShape((("a", np.int64(2)),))  # direct construction takes Python ints only
    with pytest.raises(TypeError, match=r"mesh axes must be \(name, size\) pairs, got 'a'"):
        MeshShape.of(["a"])
    assert DistType.from_spec([["a", "b"]], [8], mesh) == DistType.from_spec(
        (("a", "b"),), (8,), mesh
    )
    assert check_shape((1,) * MAX_RANK) == (1,) * MAX_RANK
    assert check_shape((0, 2**63 - 1)) == (0, 2**63 - 1)
    assert math.prod(check_shape((2**31, 2**31))) == 2**62
    with pytest.raises(ValueError, match=r"has 9223372036854775808 elements"):
        check_shape((2**31, 2**31, 2))


def test_high_rank_plans_in_bounded_time():
    with deadline(30):
        p = redist.plan((2,) * (MAX_RANK - 2) + (1, 1), ("a",), (None, "a"), MESH)
    assert p.kinds == ("alltoall",)


SHAPE, SRC, DST = (8, 8), ("a",), ()

# (plan arguments that differ from (SHAPE, SRC, DST, MESH), error type, message regex)
BAD = [
    # shapes: only tuples/lists of non-negative integers, at most rank 64 and 2**63 - 1 elements
    (dict(shape=(8.7, 8)), TypeError, r"shape\[0\] must be an integer, got 8.7 of type float"),
    (dict(shape=("16", 8)), TypeError, r"shape\[0\] must be an integer, got '16' of type str"),
    (dict(shape=(np.float64(8), 8)), TypeError, r"shape\[0\] must be an integer"),
    (dict(shape=(True, 8)), TypeError, r"shape\[0\] must be an integer, got True of type bool"),
    (dict(shape=(8, None)), TypeError, r"shape\[1\] must be an integer, got None"),
    (dict(shape=(8, [8])), TypeError, r"shape\[1\] must be an integer, got \[8\] of type list"),
    (dict(shape="88"), TypeError, r"shape must be a tuple of non-negative integers, got '88'"),
    (dict(shape=8), TypeError, r"shape must be a tuple of non-negative integers, got 8"),
    (dict(shape=None), TypeError, r"shape must be a tuple .* got None"),
    (dict(shape={8, 16}), TypeError, r"shape must be a tuple .* of type set"),
    (dict(shape=(-8, 8)), ValueError, r"shape\[0\] must be non-negative, got -8"),
    (dict(shape=(2**70,)), ValueError, r"shape\[0\] is 1180591620717411303424, more than"),
    (dict(shape=(8,) * 40), ValueError, r"shape .* has \d+ elements, more than .* \(2\*\*63 - 1\)"),
    (dict(shape=(1,) * 200), ValueError, r"shape has rank 200; redist supports .* at most 64"),
    # specs: PartitionSpec, NamedSharding, or a tuple/list of entries; nothing unordered
    (dict(src={"a": 1}), TypeError, r"src: src must be a PartitionSpec.*got \{'a': 1\} of type dict"),
    (dict(dst={"a": 1}), TypeError, r"dst: dst must be a PartitionSpec.* of type dict"),
    (dict(src={"a"}), TypeError, r"src: src must be a PartitionSpec.* of type set"),
    (dict(src=frozenset({"a"})), TypeError, r"src must be a PartitionSpec.* of type frozenset"),
    (dict(src=iter(["a"])), TypeError, r"src must be a PartitionSpec.* of type list_iterator"),
    (dict(src="a"), TypeError, r"src must be a PartitionSpec.*got 'a' of type str"),
    (dict(src=b"a"), TypeError, r"src must be a PartitionSpec.* of type bytes"),
    (dict(src=42), TypeError, r"src must be a PartitionSpec.* of type int"),
    (dict(src=(1,)), TypeError, r"src: src entry 0 is 1; expected None, an axis name"),
    (dict(dst=(None, 1.5)), TypeError, r"dst: dst entry 1 is 1.5; expected None"),
    (dict(src=(...,)), TypeError, r"src entry 0 is Ellipsis"),
    (dict(src=(("a", ("b",)),)), TypeError, r"src entry 0 is \('a', \('b',\)\), which holds"),
    (dict(src=(("a", None),)), TypeError, r"src entry 0 .* holds None; a tuple entry holds mesh"),
    (dict(src=("a", "a")), ValueError, r"src: mesh axis 'a' is used twice \(dimensions 0 and 1\)"),
    (dict(dst=(("a", "a"),)), ValueError, r"dst: mesh axis 'a' is used twice in dimension 0"),
    (dict(src=("z",)), ValueError, r"src: .* names mesh axis 'z', .* valid axes: \('a', 'b'\)"),
    (dict(src=("a#0",)), ValueError, r"src: .* names mesh axis 'a#0'.* valid axes"),
    (dict(src=("a", None, None)), ValueError, r"src: PartitionSpec .* has 3 entries .* rank 2"),
    (dict(shape=(), src=("a",)), ValueError, r"src: .* has 1 entries but the array has rank 0"),
    # meshes: {str: positive int} mappings, Mesh / AbstractMesh, MeshShape
    (dict(mesh={"a": 2.5}), TypeError, r"mesh: mesh axis 'a' must have a positive integer size, got 2.5"),
    (dict(mesh={"a": "2"}), TypeError, r"mesh: mesh axis 'a' .* got '2' of type str"),
    (dict(mesh={"a": np.float32(2)}), TypeError, r"mesh: mesh axis 'a' .* of type float32"),
    (dict(mesh={"a": True}), TypeError, r"mesh: mesh axis 'a' .* got True of type bool"),
    (dict(mesh={"a": None}), TypeError, r"mesh: mesh axis 'a' .* got None"),
    (dict(mesh={1: 2}), TypeError, r"mesh: mesh axis names must be strings, got 1 of type int"),
    (dict(mesh={"a": 0}), ValueError, r"mesh: mesh axis 'a' must have a positive integer size, got 0"),
    (dict(mesh={"a": -2}), ValueError, r"mesh axis 'a' must have a positive integer size, got -2"),
    (dict(mesh={"a#0": 2, "a": 4}), ValueError, r"mesh: .* would be named alike"),
    (dict(mesh={"a": 2**61 - 1}), ValueError, r"mesh: mesh \{a:\d+\} has \d+ devices; .* at most"),
    (dict(mesh={"a": 2**31 - 1}), ValueError, r"mesh: .* supports meshes of at most 1048576"),
    (dict(mesh=None), TypeError, r"mesh must be a jax.sharding.Mesh.*got None"),
    (dict(mesh=[("a", 2)]), TypeError, r"mesh must be a jax.sharding.Mesh.* of type list"),
    (dict(mesh="a"), TypeError, r"mesh must be a jax.sharding.Mesh.* of type str"),
    (dict(mesh={}), ValueError, r"src: .* names mesh axis 'a', which is not in the mesh \{\}"),
    # dtypes: element types of JAX arrays that collectives can move
    (dict(dtype=None), TypeError, r"dtype: expected a dtype .* got None \(numpy would read"),
    (dict(dtype=object), TypeError, r"dtype: dtype object \(Python objects\) is not an element"),
    (dict(dtype=str), TypeError, r"dtype: dtype <U0 \(unicode strings\)"),
    (dict(dtype="S3"), TypeError, r"dtype: dtype \|S3 \(byte strings\)"),
    (dict(dtype="f4,f4"), TypeError, r"\(raw or structured records\)"),
    (dict(dtype="datetime64[s]"), TypeError, r"\(datetimes\) is not an element type"),
    (dict(dtype="notatype"), TypeError, r"dtype: 'notatype' is not a valid numpy/JAX dtype"),
    (dict(dtype=3), TypeError, r"dtype: 3 is not a valid numpy/JAX dtype"),
    (dict(dtype="int2"), TypeError, r"dtype: dtype int2 is a sub-byte type \(2 bits\)"),
    (dict(dtype="uint4"), TypeError, r"dtype: dtype uint4 is a sub-byte type .* \(e.g. uint8\)"),
    (dict(dtype="float4_e2m1fn"), TypeError, r"float4_e2m1fn is a sub-byte type \(4 bits\)"),
    # options
    (dict(fold_min_bytes="x"), TypeError, r"fold_min_bytes must be an integer, got 'x'"),
    (dict(fold_min_bytes=1.5), TypeError, r"fold_min_bytes must be an integer, got 1.5"),
    (dict(fold_min_bytes=None), TypeError, r"fold_min_bytes must be an integer, got None"),
    (dict(fold_min_bytes=-1), ValueError, r"fold_min_bytes must be a non-negative .* got -1"),
    (dict(cost_model="foo"), ValueError, r"cost_model must be one of \('bytes', .*got 'foo'"),
    (dict(cost_model=None), TypeError, r"cost_model must be one of .* got None of type NoneType"),
]  # fmt: skip


def _id(v) -> str:
    """A test id that is the same in every process (pytest-xdist compares them): no addresses."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(v))[:60]


@pytest.mark.parametrize("change, error, match", BAD, ids=_id)
def test_bad_input_is_refused_with_a_clear_error(change, error, match):
    args = dict(shape=SHAPE, src=SRC, dst=DST, mesh=MESH) | change
    with deadline(10), pytest.raises(error, match=match):
        redist.plan(**args)


def test_partition_spec_errors():
    from jax.sharding import PartitionSpec as P

    with pytest.raises(TypeError, match=r"src: src entry 0 is UNCONSTRAINED"):
        redist.plan((8, 8), P(P.UNCONSTRAINED), (), MESH)
    with pytest.raises(NotImplementedError, match=r"src has reduced axes \{'b'\}"):
        redist.plan((8, 8), P("a", reduced={"b"}), (), MESH)
    with pytest.raises(NotImplementedError, match=r"dst .* has unreduced axes"):
        redist.plan((8, 8), (), P("a", unreduced={"b"}), MESH)
    with pytest.raises(ValueError, match=r"src: unreduced names mesh axis 'z'"):
        redist.plan((8, 8), P("a", unreduced={"z"}), (), MESH)


GOOD = [
    dict(shape=(np.int64(8), np.int32(8))),
    dict(shape=[8, 8]),
    dict(mesh={"a": np.int64(2), "b": np.uint8(4)}),
    dict(mesh={"a": 2, "b": 4, "c": 1}),
    dict(src=["a"], dst=[None, ["a", "b"]]),
    dict(src=(("a",),), dst=((), None)),
    dict(src=None),
    dict(dtype="bool"),
    dict(dtype=np.int16),
    dict(dtype="bfloat16"),
    dict(dtype="float8_e4m3fn"),
    dict(dtype="float8_e5m2"),
    dict(dtype="complex64"),
    dict(dtype=np.dtype("float64")),
    dict(fold_min_bytes=np.int64(0), cost_model="bytes+copies"),
]


@pytest.mark.parametrize("change", GOOD, ids=_id)
def test_what_jax_accepts_is_accepted(change):
    args = dict(shape=SHAPE, src=SRC, dst=DST, mesh=MESH) | change
    p = redist.plan(**args)
    assert p.global_shape == (8, 8) and all(type(n) is int for n in p.global_shape)
    assert all(type(s) is int for _, s in p.mesh.axes)
    redist.run_reference(p, np.arange(64).reshape(8, 8))


def test_jax_objects_are_accepted():
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = AbstractMesh((2, 4), ("a", "b"))
    p = redist.plan((8, 8), NamedSharding(mesh, P("a")), P(None, ("a", "b")), mesh, jnp.bfloat16)
    assert p.itemsize == 2 and p.dst == DistType.from_spec((None, ("a", "b")), (8, 8), p.mesh)
    assert redist.plan((8, 8), P("a", unreduced={"b"}), P(), mesh).kinds[0] == "reducescatter"


@pytest.mark.parametrize(
    "dtype", ["int2", "uint2", "int4", "uint4", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"]
)
def test_movable_dtype_refuses_sub_byte_types(dtype):
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=rf"^x: dtype {name} is a sub-byte type \(\d bits\)"):
        movable_dtype(dtype)
    assert dtype_info(dtype) == (name, 1)  # a JAX dtype, only not movable


@pytest.mark.parametrize(
    "dtype, expected",
    [("bool", ("bool", 1)), (np.int8, ("int8", 1)), ("uint64", ("uint64", 8)),
     ("bfloat16", ("bfloat16", 2)), ("float8_e4m3fn", ("float8_e4m3fn", 1)),
     ("float8_e8m0fnu", ("float8_e8m0fnu", 1)), ("complex128", ("complex128", 16)),
     (np.zeros(2, np.float16), ("float16", 2))],
)  # fmt: skip
def test_movable_dtype_accepts_normal_types(dtype, expected):
    assert movable_dtype(dtype) == expected == dtype_info(dtype)


@pytest.mark.parametrize("dtype", [None, object, "O", str, "U3", "V8", "notatype", "complex32"])
def test_dtype_info_refuses_what_is_no_jax_element_type(dtype):
    with pytest.raises(TypeError, match=r"^x: "):
        dtype_info(dtype, argname="x")
    with pytest.raises(TypeError, match=r"^x: "):
        movable_dtype(dtype)


def registered_dtypes() -> list[np.dtype]:
    """Every element type numpy and ml_dtypes register (whatever versions are installed)."""
    import ml_dtypes

    found = {np.dtype(t) for t in set(np.sctypeDict.values())}
    for name in dir(ml_dtypes):
        kind = getattr(ml_dtypes, name)
        if isinstance(kind, type) and issubclass(kind, np.generic):
            found.add(np.dtype(kind))
    return sorted(found, key=str)


def jax_takes(dt: np.dtype) -> bool:
    """JAX's own answer, asked through an array constructor (shapes only, no device)."""
    import jax
    import jax.numpy as jnp

    try:
        with warnings.catch_warnings():  # 64-bit types without jax_enable_x64: JAX takes them
            warnings.simplefilter("ignore")
            jax.eval_shape(lambda: jnp.zeros((0,), dt))
    except TypeError:
        return False
    return True


def test_dtype_info_takes_exactly_what_jax_takes():
    dtypes = registered_dtypes()
    assert {"bfloat16", "float8_e4m3fn", "int4", "float64"} <= {d.name for d in dtypes}
    for dt in dtypes:
        try:
            dtype_info(dt, argname="x")
            taken = True
        except TypeError as e:
            assert str(e).startswith("x: dtype "), e
            taken = False
        assert taken == jax_takes(dt), dt


def test_check_options():
    assert check_options("calibrated", np.int32(7)) == ("calibrated", 7)
    assert type(check_options("bytes", np.int64(1))[1]) is int
    with pytest.raises(TypeError, match=r"fold_min_bytes must be an integer, got True"):
        check_options("bytes", True)
    with pytest.raises(ValueError, match=r"cost_model must be one of .*'calibrated'\), got 'time'"):
        check_options("time", 0)


@pytest.mark.parametrize("unreduced", [(), ("b",)])
def test_zero_size_plan_carries_its_destination(unreduced):
    from jax.sharding import PartitionSpec as P

    p = redist.plan((0, 8), P("a", unreduced=set(unreduced)), P(None, "a"), MESH)
    assert p.steps == ()
    assert p.dst == DistType.from_spec((None, "a"), (0, 8), MeshShape.of(MESH))
    tiles = redist.run_reference(p, np.zeros((0, 8), np.float32))
    assert len(tiles) == 8 and all(t.shape == (0, 4) for t in tiles)


def test_run_reference_checks_its_arguments():
    p = redist.plan((0, 8), ("a",), (None, "a"), MESH)
    with pytest.raises(ValueError, match="array shape"):
        redist.run_reference(p, np.zeros((8, 8)))
    with pytest.raises(TypeError, match="plan must be a redist.Plan"):
        redist.run_reference("plan", np.zeros((0, 8)))
