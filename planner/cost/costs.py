"""Flops, transcendentals and bytes accessed per device of one op, counted as the XLA compiler's
cost analysis counts them (``compiled.cost_analysis()``: ``flops``, ``transcendentals``,
``bytes accessed``), so that a plan's prediction can be checked against the compiled program.

Flops (XLA's ``HloCostAnalysis``, checked on the TPU compiler, libtpu 0.0.42):

| op                                         | flops                                   |
|--------------------------------------------|-----------------------------------------|
| ``dot_general``, convolutions              | 2 per loop point (``2 M N K``)          |
| arithmetic, comparisons, ``select_n``,     | 1 per result element                    |
| ``convert_element_type``, ``clamp``, ...   |                                         |
| ``exp log tanh sqrt rsqrt pow erf sin``... | none: 1 *transcendental* per element    |
| ``logistic`` / ``exp2`` / ``erf_inv``      | 3 / 1 / 37 and 1 / 1 / 2 transcendental |
| ``integer_pow`` ``y``                      | its multiplies (``x**3``: 2, ``x**-2``: |
|                                            | 2, ``x**1``: none)                      |
| reductions (sum, max, ...)                 | 1 per element reduced away (input -     |
|                                            | output elements); arg-reductions 9      |
| scatters                                   | 1 per update element                    |
| ``threefry2x32``                           | 117 per result element                  |
| broadcasts, reshapes, transposes, slices,  | none (data movement)                    |
| gathers, concatenation, iota, scan bounds  |                                         |
| a pending sum (all-reduce)                 | 1 per element of the buffer             |
| a reduction over a loop split unevenly     | 3 per operand element: the padding      |
|                                            | masked (index add, compare, select)     |

Bytes follow fusion (:func:`fusion`): XLA fuses chains of elementwise ops, broadcasts and
reshapes into the kernel that consumes them (a reduction, a product, the last op of the chain),
and an elementwise consumer into the product it follows; a fused kernel reads its inputs from
memory once and writes the values it hands on, and nothing in between. Kernel boundaries are a
property of the program alone; the bytes of each read and write depend on the layouts a schedule
gives (local tiles), so :func:`op_bytes` prices one op with its operand and result tile sizes.

Example:
    >>> f = fusion(prog)                                                   # doctest: +SKIP
    >>> op_flops(op, {"m": 64, "n": 32, "k": 16})                          # doctest: +SKIP
    (65536.0, 0.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence

from planner.program.ir import Program
from planner.program.ops import Access, Op, itemsize
from planner.program.rules import CUMULATIVE, ELEMENTWISE, IDENTITIES, REDUCTIONS, SCATTERS

# No arithmetic: data movement, index computations the compiler folds, and region boundaries.
MOVEMENT = (
    frozenset(
        """broadcast_in_dim reshape squeeze expand_dims transpose iota stop_gradient copy copy_p
    slice dynamic_slice concatenate pad gather rev split sharding_constraint device_put
    optimization_barrier bitcast_convert_type random_wrap random_unwrap real imag conj""".split()
    )
    | IDENTITIES
)  # layout requests and checkpoint names: no kernel of their own
# Elementwise ops the compiler counts as transcendentals, not flops (HloCostAnalysis).
TRANSCENDENTAL = frozenset(
    "exp log tanh sqrt rsqrt cbrt pow erf sin cos tan log1p expm1 atan2".split()
)
# (flops, transcendentals) per result element where the TPU compiler expands an op (measured
# with compiled.cost_analysis() on 2**20 float32 elements, libtpu 0.0.42).
EXPANDED = {
    "logistic": (3.0, 1.0),  # 1 / (1 + exp(-x))
    "exp2": (1.0, 1.0),  # exp(x * ln 2)
    "erf_inv": (37.0, 2.0),
    "threefry2x32": (117.0, 0.0),  # 20 rounds of add, rotate, xor (jax.random.bits)
    "one_minus_square": (2.0, 0.0),  # 1 - x * x (tanh's derivative, JAX >= 0.12)
}
ARG_REDUCTION_FLOPS = 9.0  # compare and select of value and index per reduced element (measured)
# Elementwise ops the compiler does not copy into several consumers (XLA's "expensive" ops).
EXPENSIVE = TRANSCENDENTAL | frozenset(EXPANDED) | {"div", "rem", "logistic"}
DENSE = frozenset({"dot_general", "conv_general_dilated"})


def kind(op: Op) -> str:
    """How the compiler treats ``op`` when fusing: ``"movement"`` (fused into each consumer,
    scan boundaries included), ``"elementwise"``, ``"dense"``, ``"reduction"``, or ``"other"``
    (scatters, in-place updates, sorts, cumulative ops, unknown primitives: their own kernel)."""
    if op.how == "region" or op.primitive in MOVEMENT:
        return "movement"
    if op.primitive in ELEMENTWISE or op.primitive in EXPANDED:
        return "elementwise"
    if op.primitive in DENSE:
        return "dense"
    if op.primitive in REDUCTIONS:
        return "reduction"
    return "other"


def elements(acc: Access, extents: Mapping[str, int]) -> int:
    """Elements of ``acc``'s value per device, given each loop's local extent (a dimension read
    whole keeps its size)."""
    return math.prod(
        math.prod(extents[lp] for lp in dims) if dims else n
        for n, dims in zip(acc.value.shape, acc.dims)
    )


PAD_MASK_FLOPS = 3.0
"""Per operand element of a reduction whose reduced loop is split unevenly: XLA's partitioner masks
the padding (the element's global index: an add to an iota; below the extent: a compare; else the
reduction's identity: a select), as XLA:CPU compiles it (tests/test_planner_uneven.py)."""


def padding_mask_flops(op: Op, extents: Mapping[str, int], padded: Collection[str]) -> float:
    """Flops XLA spends masking the padding of ``op``'s reduced loops split unevenly (``padded``:
    the names of the loops whose tiles are padded; ``extents``: each loop's local extent).

    Example:
        >>> padding_mask_flops(reduce_sum_op, {"i0": 64, "r1": 126}, {"r1"})   # doctest: +SKIP
        24192.0
    """
    if not op.operands or not any(lp in padded for lp, _ in op.reductions):
        return 0.0
    return PAD_MASK_FLOPS * elements(op.operands[0], extents)


def _integer_pow_multiplies(y: int) -> int:
    """Multiplies (and the final reciprocal) of JAX's lowering of ``x ** y`` by squaring."""
    if y == 0:
        return 0
    n = abs(y)
    return (n.bit_length() - 1) + (bin(n).count("1") - 1) + (1 if y < 0 else 0)


def dense_kind(op: Op) -> tuple[str, str]:
    """``(operand dtype, precision)`` of a matmul or convolution, what its rate depends on: the
    wider operand dtype, and ``"highest"`` / ``"high"`` where the op's ``precision`` param asks
    for either on some operand (else ``"default"``).

    Example:
        >>> dense_kind(op)   # jnp.dot(a, b, precision="highest") on float32  # doctest: +SKIP
        ('float32', 'highest')
    """
    dtypes = [a.value.dtype for a in op.operands] or [r.value.dtype for r in op.results]
    dtype = str(max(dtypes, key=itemsize))
    given = op.eqn.params.get("precision") if op.eqn is not None else None
    names = [str(p).lower() for p in (given if isinstance(given, tuple) else (given,))]
    for level in ("highest", "high"):
        if any(n.endswith(level) for n in names):
            return dtype, level
    return dtype, "default"


def op_flops(op: Op, extents: Mapping[str, int] | None = None) -> tuple[float, float]:
    """``(flops, transcendentals)`` of one run of ``op`` on one device, as XLA counts them (see
    the module's table); ``extents``: each loop's local extent (default: the whole op)."""
    if extents is None:
        extents = {lp.name: lp.extent for lp in op.loops}
    if op.how == "region":
        return 0.0, 0.0
    p = op.primitive
    out = float(sum(elements(r, extents) for r in op.results))
    if p in DENSE:
        return 2.0 * math.prod(extents[lp.name] for lp in op.loops), 0.0
    if p in MOVEMENT:
        return 0.0, 0.0
    if p in REDUCTIONS:
        reduced = max(0.0, elements(op.operands[0], extents) - out) if op.operands else 0.0
        per = ARG_REDUCTION_FLOPS if p in ("argmax", "argmin") else 1.0
        return per * reduced, 0.0
    if p in SCATTERS:
        return float(elements(op.operands[-1], extents)) if op.operands else 0.0, 0.0
    if p in EXPANDED:
        flops, trans = EXPANDED[p]
        return flops * out, trans * out
    if p in TRANSCENDENTAL:
        return 0.0, out
    if p == "integer_pow":
        return float(_integer_pow_multiplies(int(op.eqn.params["y"]))) * out, 0.0
    if p == "select_n":
        return max(1, len(op.operands) - 2) * out, 0.0
    if p == "convert_element_type" and op.operands:
        same = op.operands[0].value.dtype == op.results[0].value.dtype
        return (0.0 if same else out), 0.0
    if p in CUMULATIVE or p in ELEMENTWISE:
        return out, 0.0
    return out, 0.0  # an unknown primitive: one per result element


@dataclasses.dataclass(frozen=True)
class Fusion:
    """Kernel boundaries of a program (see :func:`fusion`).

    ``materialized``: value names written to memory (kernel results and program outputs).
    ``reads[op]``: per operand, how many kernels read it from memory on this op's behalf (0:
    fused from a producer in the same kernel, or read by another member of the kernel).
    ``writes[op]``: per result, whether it is written (1) or stays inside its kernel (0).
    ``runs[op]``: in how many kernels the op runs (a cheap op fused into several consumers is
    computed, and counted by the compiler, in each; 0: dead code the compiler drops).
    """

    materialized: frozenset[str]
    reads: Mapping[str, tuple[int, ...]]
    writes: Mapping[str, tuple[int, ...]]
    runs: Mapping[str, int]

    def key(self, op: Op) -> tuple:
        """What pricing ``op`` depends on beyond its signature."""
        return self.reads[op.name], self.writes[op.name], self.runs[op.name]


def fusion(prog: Program) -> Fusion:
    """Where the compiler's kernels begin and end in ``prog`` (cached on the program).

    A value stays inside a kernel (is not written to memory) when it is not a program output and
    either its producer is data movement or elementwise and every consumer can fuse it (anything
    but the ``"other"`` kinds), copied into each consumer unless the producer is expensive (then
    only with one consumer); or its producer is a product whose one consumer is elementwise (the
    product's output fusion). Every other value is written once and read by each kernel that
    uses it. A kernel is an op with a written result plus everything fused into it, backwards.
    """
    cached = prog.__dict__.get("_fusion")
    if cached is not None:
        return cached
    kinds = {o.name: kind(o) for o in prog.ops}
    outputs = {v.name for v in prog.outputs}
    uses = prog.uses
    materialized: set[str] = set()
    dense_out: list[tuple[str, str]] = []
    for o in prog.ops:
        k = kinds[o.name]
        for r in o.results:
            name = r.value.name
            consumers = {c.name for c, _ in uses.get(name, ())}
            if name in outputs:
                materialized.add(name)
            elif not consumers:
                continue
            elif k in ("movement", "elementwise"):
                # a broadcast or iota fuses into any consumer (it reads next to nothing)
                spread = o.primitive in ("broadcast_in_dim", "iota") and all(
                    math.prod(a.value.shape) <= 1 for a in o.operands
                )
                if not spread and any(kinds[c] == "other" for c in consumers):
                    materialized.add(name)
            elif k == "dense" and len(consumers) == 1:
                dense_out.append((name, next(iter(consumers))))
            else:
                materialized.add(name)
    # A product's output fuses into its one elementwise consumer when that consumer is the end
    # of its kernel (written, so that the product runs in one kernel, never copied).
    for name, c in dense_out:
        consumer = prog.op(c)
        if kinds[c] != "elementwise" or not all(
            r.value.name in materialized for r in consumer.results
        ):
            materialized.add(name)
    producer = prog.producer
    reads: dict[str, list[int]] = {o.name: [0] * len(o.operands) for o in prog.ops}
    runs = dict.fromkeys((o.name for o in prog.ops), 0)
    shared: set[str] = set()  # values read by some kernel that is not a product's
    for root in prog.ops:
        if not any(r.value.name in materialized for r in root.results):
            continue
        # the kernel: root and the ops whose values reach it without being written
        members, stack = {root.name}, [root]
        while stack:
            o = stack.pop()
            for acc in o.operands:
                p = producer.get(acc.value.name)
                if p is not None and acc.value.name not in materialized and p.name not in members:
                    members.add(p.name)
                    stack.append(p)
        # A product's kernel reads its inputs itself; the other kernels reading one value are
        # siblings the compiler fuses into one kernel with several outputs: read once for all.
        seen: set[str] = set() if kinds[root.name] == "dense" else shared
        for o in sorted((prog.op(n) for n in members), key=lambda o: prog.index[o.name]):
            runs[o.name] += 1
            for k, acc in enumerate(o.operands):
                name = acc.value.name
                if name in seen or (name in producer and name not in materialized):
                    continue
                seen.add(name)
                reads[o.name][k] += 1
    writes = {o.name: tuple(int(r.value.name in materialized) for r in o.results)
              for o in prog.ops}  # fmt: skip
    out = Fusion(frozenset(materialized), {n: tuple(v) for n, v in reads.items()}, writes, runs)
    prog.__dict__["_fusion"] = out
    return out


def op_bytes(
    op: Op,
    fused: Fusion,
    operand_bytes: Sequence[float],
    result_bytes: Sequence[float],
    moved: Sequence[bool] = (),
) -> tuple[float, float]:
    """``(read, written)`` bytes per device of one run of ``op`` under :func:`fusion`: its
    operands read from memory (``operand_bytes``: each operand's tile in the layout the op reads
    it) and its results written (``result_bytes``). An operand moved to another layout for this
    op (``moved[k]``) is read from the moved copy even where it would otherwise be fused."""
    if op.how == "region":
        return 0.0, 0.0
    reads = fused.reads[op.name]
    read = 0.0
    for k, nbytes in enumerate(operand_bytes):
        times = reads[k] if k < len(reads) else 0
        if k < len(moved) and moved[k]:
            times = max(times, 1)
        read += times * nbytes
    written = sum(w * b for w, b in zip(fused.writes[op.name], result_bytes))
    return read, float(written)
