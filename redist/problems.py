"""Named redistribution problems from the paper, as ``(mesh, shape, src, dst)`` with JAX-order specs.

Paper types are written minor-to-major; the specs here are the equivalent ``PartitionSpec`` entries
(major-to-minor). Used by the demo, the tests and the benchmarks.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

from redist.types import SpecEntry


class Problem(NamedTuple):
    name: str
    mesh: dict[str, int]
    shape: tuple[int, ...]
    src: tuple[SpecEntry, ...]
    dst: tuple[SpecEntry, ...]


M3 = {"a": 2, "b": 2, "c": 2}
XY4 = {"x": 4, "y": 4}

PAPER_PROBLEMS = (
    # Fig. 3, over {x:4, y:4}: permutations.
    Problem("fig3_swap_within_dim", XY4, (1024, 128), (("x", "y"),), (("y", "x"),)),
    Problem("fig3_swap_across_dims", XY4, (128, 64), ("x", "y"), ("y", "x")),
    Problem("fig3_swap_replicated", XY4, (128,), ("x",), ("y",)),
    # Fig. 5, over {x:4, y:4}: the source -> target pairs of its sequences (paper notation in
    # comments; the extraction of the figure is garbled, so each visible pair is one problem).
    # [32{x,y}512, 128] -> [128{x}512, 32{y}128]
    Problem("fig5_a", XY4, (512, 128), (("y", "x"), None), ("x", "y")),
    # [32{x}128, 512, 32{y}128] -> [32{x}128, 128{y}512, 128]
    Problem("fig5_b", XY4, (128, 512, 128), ("x", None, "y"), ("x", "y", None)),
    # [128, 128{x}512, 32{y}128] -> [128, 32{y,x}512, 128]
    Problem("fig5_c", XY4, (128, 512, 128), (None, "x", "y"), (None, ("x", "y"), None)),
    # [32{x}128, 512, 32{y}128] -> [128, 128{y}512, 128]
    Problem("fig5_d", XY4, (128, 512, 128), ("x", None, "y"), (None, "y", None)),
    # [32{x,y}512, 128] -> [128, 512, 32{y}128] reshaped: [32{x,y}512, 128] -> [512, 32{y}128]
    Problem("fig5_e", XY4, (512, 128), (("y", "x"), None), (None, "y")),
    # Example 3.1 needs 24 devices: {x:4, y:6}.
    Problem("ex3_1", {"x": 4, "y": 6}, (12, 12), ("x", "y"), ("y", "x")),
    # Example 4.9 / 6.8 / 7.1: a single alltoall.
    Problem("ex4_9", {"a": 8}, (8, 8), ("a", None), (None, "a")),
    # Fig. 13: P1-P4 (mesh a:2, b:2, c:2); paper {c:2,a:2} is c minor, so a major.
    Problem("P1", M3, (360, 368, 320), (None, "c", None), (("a", "c"), None, "b")),
    Problem("P2", M3, (80, 80, 72, 64), (None, "c", None, None), ("b", None, "c", None)),
    Problem("P3", M3, (296, 360, 312), (None, None, "c"), (("c", "b"), "a", None)),
    Problem("P4", M3, (16,) * 6, ("c", None, None, "a", None, "b"), (None,) * 5 + ("a",)),
)


def by_name(name: str) -> Problem:
    for p in PAPER_PROBLEMS:
        if p.name == name:
            return p
    raise KeyError(f"no problem named {name!r}; known: {[p.name for p in PAPER_PROBLEMS]}")


def random_spec(rng: random.Random, mesh: dict[str, int], rank: int) -> tuple[SpecEntry, ...]:
    """The paper's §8 recipe: each mesh axis is left replicated or splits a random dimension
    (uniformly among the ``rank + 1`` choices); axes inside a dimension come in random order."""
    entries: list[list[str]] = [[] for _ in range(rank)]
    for name in mesh:
        k = rng.randrange(rank + 1)
        if k < rank:
            entries[k].append(name)
    for e in entries:
        rng.shuffle(e)
    return tuple(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)


def random_problem(
    rng: random.Random,
    mesh: dict[str, int],
    *,
    max_rank: int = 6,
    min_rank: int = 1,
    min_elems: int = 1,
    max_elems: int = 4096,
    name: str = "random",
) -> Problem:
    """A random problem of rank in ``[min_rank, max_rank]`` whose global size is log-uniform in
    ``[min_elems, max_elems]``.

    Example:
        >>> random_problem(random.Random(0), {"a": 2, "b": 2}, max_elems=64).shape  # doctest: +SKIP
        (2, 8, 2)
    """
    if not 1 <= min_elems <= max_elems:
        raise ValueError(f"need 1 <= min_elems <= max_elems, got {min_elems}, {max_elems}")
    for _ in range(10_000):
        rank = rng.randint(min_rank, max_rank)
        src, dst = random_spec(rng, mesh, rank), random_spec(rng, mesh, rank)
        base = [
            math.lcm(*(math.prod(mesh[n] for n in _names(spec[i])) for spec in (src, dst)))
            for i in range(rank)
        ]
        target = math.exp(rng.uniform(math.log(min_elems), math.log(max_elems)))
        room = target / math.prod(base)
        if room < 1:
            continue
        weights = [rng.expovariate(1.0) for _ in range(rank)]
        total = sum(weights)
        shape = tuple(b * max(1, int(room ** (w / total))) for b, w in zip(base, weights))
        if min_elems <= math.prod(shape) <= max_elems:
            return Problem(name, dict(mesh), shape, src, dst)
    raise ValueError(f"cannot draw a problem of {min_elems}-{max_elems} elements on mesh {mesh}")


def cut_uneven(p: Problem, rng: random.Random) -> Problem:
    """``p`` with every dimension of more than one element cut by 1 to 7 elements (at most half
    of it): the paper's recipe with extents that their splits mostly do not divide.

    Example:
        >>> cut_uneven(Problem("r", {"a": 2}, (16, 8), ("a",), ()), random.Random(0)).shape
        (9, 4)
    """
    shape = tuple(n - rng.randint(1, min(7, n // 2)) if n > 1 else n for n in p.shape)
    return p._replace(shape=shape)


def _names(entry: SpecEntry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
