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
memory once and writes the values it hands on, and nothing in between. XLA:CPU fuses less
(:data:`SEPARATE_KERNELS`: products alone, expensive values read by two kernels written, no
sibling fusion), so :func:`fusion` has a model per backend. Kernel boundaries are a property of
the program (and the backend) alone; the bytes of each read and write depend on the layouts a schedule
gives (local tiles), so :func:`op_bytes` prices one op with its operand and result tile sizes.

Example:
    >>> f = fusion(prog, "cpu")                                            # doctest: +SKIP
    >>> op_flops(op, {"m": 64, "n": 32, "k": 16})                          # doctest: +SKIP
    (65536.0, 0.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence

from planner.program.ir import Program
from planner.program.memo import PerObject
from planner.program.ops import Access, Op, itemsize
from planner.program.rules import CUMULATIVE, ELEMENTWISE, IDENTITIES, REDUCTIONS, SCATTERS

# No arithmetic: data movement, index computations the compiler folds, and region boundaries.
MOVEMENT = (
    frozenset(
        """broadcast_in_dim reshape squeeze expand_dims transpose iota stop_gradient copy copy_p
    slice dynamic_slice concatenate pad gather rev split sharding_constraint device_put
    optimization_barrier bitcast_convert_type random_wrap random_unwrap real imag conj
    get swap addupdate program_id num_programs tile""".split()
    )
    | IDENTITIES
)  # layout requests, checkpoint names and a Pallas kernel's reads and writes of its blocks:
# no arithmetic
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
EXPENSIVE = TRANSCENDENTAL | {"div", "rem", "logistic", "exp2", "erf_inv", "threefry2x32"}
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
reduction's identity: a select), as XLA:CPU compiles it (tests/planner/test_uneven_loops.py)."""


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
    if op.kernel_flops is not None:  # a kernel sized at run time: its own estimate
        return op.kernel_flops
    if op.body:  # an opaque op: what its body does on each device, whatever the extents
        return body_flops(op)
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


def body_flops(op: Op) -> tuple[float, float]:
    """``(flops, transcendentals)`` of one run of an opaque op on one device: its
    :attr:`~planner.program.ops.Op.body`'s ops, each as often as it runs."""
    flops = trans = 0.0
    for b in op.body:
        f, t = op_flops(b)
        flops, trans = flops + f * b.trips, trans + t * b.trips
    return flops, trans


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


SEPARATE_KERNELS = frozenset({"cpu"})
"""Backends whose compiler fuses less than the TPU's (XLA:CPU, JAX 0.10 and 0.12, checked on its
HLO): a product is a kernel of its own (a YNNPACK or Eigen dot) that fuses no elementwise op
into its operands or its result (a view of an operand, a transpose or reshape, is folded into
the product's dimensions); an expensive elementwise value (:data:`EXPENSIVE`) that kernels
beside one read is written once (``wrapped_tanh``) rather than computed again in each; a
reduction computes a value fused into it only when it is the value's one reader; and kernels
reading the same value are not fused into one with several outputs: each reads it."""

FUSION_MODELS = ("tpu", *sorted(SEPARATE_KERNELS))
"""The fusion models :func:`fusion` has: the TPU's (also XLA:GPU's), and XLA:CPU's."""

FOLDED_VIEWS = frozenset("reshape squeeze expand_dims transpose".split()) | IDENTITIES
"""Data movement a product folds into its dimensions (:data:`SEPARATE_KERNELS`)."""


KERNELS: PerObject[dict[str, Fusion]] = PerObject("kernels (fusion) per backend")


def fusion_model(backend: str) -> str:
    """The fusion model of :data:`FUSION_MODELS` that ``backend``'s compiler follows."""
    return backend if backend in FUSION_MODELS else "tpu"


def fusion(prog: Program, backend: str = "tpu") -> Fusion:
    """Where the ``backend``'s compiler begins and ends kernels in ``prog`` (cached on the
    program per backend).

    A value stays inside a kernel (is not written to memory) when it is not a program output and
    either its producer is data movement or elementwise and every consumer can fuse it (anything
    but the ``"other"`` kinds), copied into each consumer; or its producer is a product whose one
    consumer is elementwise (the product's output fusion). Every other value is written once and
    read by each kernel that uses it. A kernel is an op with a written result plus everything
    fused into it, backwards. Backends in :data:`SEPARATE_KERNELS` fuse less (see there).

    Example:
        >>> fusion(prog, "cpu").writes["tanh_2"]   # tanh read by two kernels   # doctest: +SKIP
        (1,)
    """
    cache = KERNELS.get(prog, dict)
    backend = fusion_model(backend)
    if backend in cache:
        return cache[backend]
    separate = backend in SEPARATE_KERNELS
    kinds = {o.name: kind(o) for o in prog.ops}
    outputs = {v.name for v in prog.outputs}
    uses = prog.uses
    producer = prog.producer
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
                if spread:
                    continue
                if any(kinds[c] == "other" for c in consumers):
                    materialized.add(name)
                elif separate and len(consumers) > 1 and any(kinds[c] == "reduction"
                                                             for c in consumers):  # fmt: skip
                    materialized.add(name)  # a reduction fuses only what it alone reads
            elif k == "dense" and len(consumers) == 1 and not separate:
                dense_out.append((name, next(iter(consumers))))
            else:
                materialized.add(name)
    if separate:
        materialized |= _read_by_products(prog, kinds)
    # A product's output fuses into its one elementwise consumer when that consumer is the end
    # of its kernel (written, so that the product runs in one kernel, never copied).
    for name, c in dense_out:
        consumer = prog.op(c)
        if kinds[c] != "elementwise" or not all(
            r.value.name in materialized for r in consumer.results
        ):
            materialized.add(name)
    groups = list(_members(prog, materialized))
    kernels = _kernels(prog, groups)
    while separate:  # an expensive value read by several kernels is written by its own
        shared = {r.value.name for o in prog.ops if o.primitive in EXPENSIVE
                  for r in o.results if r.value.name not in materialized
                  and len({k for c, _ in uses.get(r.value.name, ()) for k in kernels[c.name]}) > 1}  # fmt: skip
        if not shared:
            break
        materialized |= shared
        groups = list(_members(prog, materialized))
        kernels = _kernels(prog, groups)
    reads: dict[str, list[int]] = {o.name: [0] * len(o.operands) for o in prog.ops}
    runs = {o.name: len(kernels[o.name]) for o in prog.ops}
    shared_reads: set[str] = set()  # values read by some kernel that is not a product's
    for root, members in groups:
        # A product's kernel reads its inputs itself; the other kernels reading one value are
        # siblings the compiler fuses into one kernel with several outputs: read once for all.
        seen: set[str] = set() if separate or kinds[root.name] == "dense" else shared_reads
        for o in sorted((prog.op(n) for n in members), key=lambda o: prog.index[o.name]):
            for k, acc in enumerate(o.operands):
                name = acc.value.name
                if name in seen or (name in producer and name not in materialized):
                    continue
                seen.add(name)
                reads[o.name][k] += 1
    writes = {o.name: tuple(int(r.value.name in materialized) for r in o.results)
              for o in prog.ops}  # fmt: skip
    out = Fusion(frozenset(materialized), {n: tuple(v) for n, v in reads.items()}, writes, runs)
    cache[backend] = out
    return out


def _read_by_products(prog: Program, kinds: Mapping[str, str]) -> set[str]:
    """Values a product reads from memory where products fuse nothing (:data:`SEPARATE_KERNELS`):
    each operand, or what a view of it (:data:`FOLDED_VIEWS`) reads, back to a value that is a
    program input or made by an op that is not a view."""
    out: set[str] = set()
    producer = prog.producer
    for o in prog.ops:
        if kinds[o.name] != "dense":
            continue
        stack = [a.value.name for a in o.operands]
        while stack:
            name = stack.pop()
            p = producer.get(name)
            if p is None:
                continue
            if p.primitive in FOLDED_VIEWS and len(p.operands) == 1:
                stack.append(p.operands[0].value.name)
            elif kinds[p.name] in ("movement", "elementwise"):
                out.add(name)
    return out


def _members(prog: Program, materialized: Collection[str]):
    """Each kernel as ``(root, member op names)``: an op with a written result and the ops whose
    values reach it without being written."""
    producer = prog.producer
    for root in prog.ops:
        if not any(r.value.name in materialized for r in root.results):
            continue
        members, stack = {root.name}, [root]
        while stack:
            o = stack.pop()
            for acc in o.operands:
                p = producer.get(acc.value.name)
                if p is not None and acc.value.name not in materialized and p.name not in members:
                    members.add(p.name)
                    stack.append(p)
        yield root, members


def _kernels(prog: Program, groups) -> dict[str, set[str]]:
    """The roots of the kernels each op runs in (``groups``: :func:`_members`; none: dead code
    the compiler drops)."""
    out: dict[str, set[str]] = {o.name: set() for o in prog.ops}
    for root, members in groups:
        for n in members:
            out[n].add(root.name)
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
