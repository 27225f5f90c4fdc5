"""Generic discovery of iteration spaces for primitives without a rule (as EasyDist does).

Run the primitive on random inputs, then on halves of candidate input dimensions (the same split
applied to every operand that has the dimension), and compare with the whole result:

- if the two results concatenated along output dimension ``d`` give the whole result, the split
  dimensions and ``d`` share a parallel loop;
- if they sum to the whole result, the split dimensions form a sum-reduction loop.

What is not discovered is read whole and its loops are not partitionable. The probes run on
shrunk shapes (every distinct dimension size mapped to a distinct small one of the same parity,
so a dimension shared by several operands stays shared); when the primitive does not accept
them (a parameter fixes a size), on the real shapes if they hold at most ``FULL_SIZE_LIMIT``
elements, else not at all (the op runs replicated).

Example:
    >>> op = discover("cumsum_4", eqn, ins, outs)   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math

import numpy as np

from planner.program.ops import Access, Loop, Op

MAX_COMBOS = 64
FULL_SIZE_LIMIT = 1 << 16


def _shrink(shapes: list[tuple[int, ...]]) -> dict[int, int]:
    """Distinct sizes -> small sizes: even ones to 2, 4, 6, ..., odd ones (> 1) to 3, 5, ..."""
    sizes = sorted({n for s in shapes for n in s if n > 1})
    evens = iter(range(2, 1 << 30, 2))
    odds = iter(range(3, 1 << 30, 2))
    return {n: next(evens) if n % 2 == 0 else next(odds) for n in sizes}


def _random(shape, dtype: str, rng: np.random.Generator) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dt, np.integer):
        return rng.integers(0, 7, size=shape).astype(dt)
    return (rng.random(shape) + 0.5).astype(dt)  # positive: inside most functions' domains


def _split(x: np.ndarray, dim: int | None, half: int) -> np.ndarray:
    if dim is None:
        return x
    n = x.shape[dim] // 2
    return np.take(x, range(half * n, (half + 1) * n), axis=dim)


def discover(name: str, eqn, ins, outs, seed: int = 0) -> Op | None:
    """An :class:`Op` from running ``eqn``'s primitive on pieces, or ``None`` if it cannot run."""
    if any(o.shape != outs[0].shape for o in outs):  # several results: of one shape (an unstack)
        return None
    out = outs[0]
    literal = [getattr(v, "val", None) for v in eqn.invars]
    idx = [k for k, v in enumerate(ins) if v is not None]

    def run(pieces):  # quietly: a probe is not the user's program (a debug print in it, say)
        with contextlib.redirect_stdout(io.StringIO()):
            res = eqn.primitive.bind(*pieces, **eqn.params)
        return np.stack([np.asarray(r) for r in (res if eqn.primitive.multiple_results else [res])])

    small = _shrink([out.shape] + [ins[k].shape for k in idx])
    probes = [small, {n: n for n in small}]  # shrunk shapes, else the real ones if small enough
    if sum(math.prod(ins[k].shape) for k in idx) > FULL_SIZE_LIMIT:
        probes.pop()
    for size in probes:
        rng = np.random.default_rng(seed)
        shapes = {k: tuple(size.get(n, n) for n in ins[k].shape) for k in idx}
        args = [_random(shapes[k], ins[k].dtype, rng) if k in shapes else literal[k]
                for k in range(len(ins))]  # fmt: skip
        try:
            whole = run(args)
        except Exception:  # noqa: BLE001 - a primitive that cannot run eagerly is replicated
            continue
        if whole.shape == (len(outs), *(size.get(n, n) for n in out.shape)):  # results stacked
            break
    else:
        return None
    in_dims = {k: [()] * len(ins[k].shape) for k in idx}
    out_dims: list = [()] * len(out.shape)
    loops: list[Loop] = []
    reductions = []
    used = {k: set() for k in idx}

    def combos(size: int):
        options = [[None] + [d for d, n in enumerate(shapes[k]) if n == size and d not in used[k]]
                   for k in idx]  # fmt: skip
        for combo in itertools.islice(itertools.product(*options), MAX_COMBOS):
            if any(d is not None for d in combo):
                yield combo

    def halves(combo):
        res = []
        for h in (0, 1):
            pieces = list(args)
            for k, d in zip(idx, combo):
                pieces[k] = _split(args[k], d, h)
            res.append(run(pieces))
        return res

    for od, size in enumerate(whole.shape[1:]):
        if size < 2 or size % 2:
            loops.append(Loop(f"i{od}", out.shape[od], partitionable=False))
            out_dims[od] = (f"i{od}",)
            continue
        for combo in combos(size):
            try:
                a, b = halves(combo)
            except Exception:  # noqa: BLE001 - this split is not a valid input
                continue
            joined = np.concatenate([a, b], axis=od + 1) if a.shape == b.shape else None
            if (
                joined is not None
                and joined.shape == whole.shape
                and np.allclose(joined, whole, equal_nan=True)
            ):
                lp = Loop(f"i{od}", out.shape[od])
                loops.append(lp)
                out_dims[od] = (lp.name,)
                for k, d in zip(idx, combo):
                    if d is not None:
                        in_dims[k][d] = (lp.name,)
                        used[k].add(d)
                break
        else:
            loops.append(Loop(f"i{od}", out.shape[od], partitionable=False))
            out_dims[od] = (f"i{od}",)
    sizes = sorted({n for k in idx for d, n in enumerate(shapes[k]) if d not in used[k]})
    for size in sizes:
        if size < 2 or size % 2:
            continue
        for combo in combos(size):
            try:
                a, b = halves(combo)
            except Exception:  # noqa: BLE001
                continue
            if a.shape == whole.shape and np.allclose(a + b, whole, rtol=1e-4, atol=1e-5):
                k0, d0 = next((k, d) for k, d in zip(idx, combo) if d is not None)
                lp = Loop(f"r{len(reductions)}", ins[k0].shape[d0])
                loops.append(lp)
                reductions.append((lp.name, "sum"))
                for k, d in zip(idx, combo):
                    if d is not None:
                        in_dims[k][d] = (lp.name,)
                        used[k].add(d)
                break
    return Op(
        name, eqn.primitive.name, tuple(loops),
        tuple(Access(ins[k], tuple(in_dims[k])) for k in idx),
        tuple(Access(o, tuple(out_dims)) for o in outs), reductions=tuple(reductions),
        how="discovered",
    )  # fmt: skip
