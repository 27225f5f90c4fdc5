"""Every bad input to the pure layer is refused with a ValueError / TypeError /
NotImplementedError that names the argument, what was received and what is valid: never a hang,
a crash, an internal error, or a silent reinterpretation. No devices needed."""

import contextlib
import math
import signal
import time

import numpy as np
import pytest

import redist
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
