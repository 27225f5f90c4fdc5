"""Which values of a program the compiler keeps in memory, and from when to when (pure, no JAX).

XLA does not give every jaxpr value a buffer: it fuses producers into their consumers (a fused
value is computed where it is read and never stored), folds transposes and reshapes into the
ops that read them, writes an elementwise result into an operand that dies there, and keeps a
loop's operands and stacked outputs for the whole loop. :func:`lifetimes` mirrors that closely
enough for the peak memory per device (:mod:`planner.cost.simulator` sizes each buffer in its
layout). The fusion rule, by producer:

| the value of ...                              | is                                              |
|-----------------------------------------------|-------------------------------------------------|
| a program output                              | a buffer (held for the whole program)           |
| a dot, convolution, reduction, cumulative op, | a buffer                                        |
| sort, scatter, collective, unknown primitive  |                                                 |
| reshape, transpose, squeeze, expand_dims,     | a view of its operand: no memory of its own (a  |
| copy; a region's entry (scan and while        | bitcast, a transpose folded into its reader, a  |
| constants and carries, cond operands) and     | loop operand that is the outer buffer)          |
| its carry out                                 |                                                 |
| a fusible op: elementwise, broadcast_in_dim,  | fused (no buffer) unless a reader needs it in   |
| iota, convert, select_n, slice, dynamic_slice,| memory, or it is expensive (exp, log, tanh,     |
| gather, pad, concatenate, rev, scan_xs (a     | div, rsqrt, ...: XLA does not duplicate those)  |
| layer's slice of a stacked operand)           | and has more than one reader                    |
| scan_ys (a loop's stacked output)             | a buffer, allocated when its loop starts        |
| cond_merge                                    | a buffer                                        |

"Readers" of a value are the ops that run it: following fused values and views to the ops that
make a buffer (a cheap fused value is duplicated into every reader). Fusible ops, reductions and
scan_ys fuse what they read; dots, convolutions, collectives, sorts, scatters, unknown
primitives, a loop's carry (in and out), a cond's results and a loop operand need it in memory.
A loop operand computed from constants and iotas alone (a causal mask, a broadcast zero) is sunk
into the loop (XLA's while-loop constant sinking) and fused there.

In place: a fusible op's result (or a scatter's, a dynamic_update_slice's) is written into a
buffer of the same dtype and size that dies where it runs (:attr:`Lifetimes.reuse`; the
simulator checks that the layouts agree), so the two are one allocation; a chain of such buffers
that ends in an output is the output's allocation.

Lifetimes: a buffer lives from the op that makes it (a loop's stacked output: from the loop's
first op) to the last op that runs a reader of it; a buffer made before a loop's body and read
inside it lives to the loop's end (every iteration reads it); so does a stack a loop slices, also
where the layer's slice is a buffer of its own (before, such a stack was freed where the loop
began: Qwen3-235B's attention residuals, 25 GB per device at tensor 2 on 256 Ironwood devices,
were missing from its backward loop). A fused or view op "runs" where its
last reader runs, so a copy an op's operand was moved into lives that long (see
:attr:`Lifetimes.hold`). Inputs and constants are held for the whole program, outputs from the op
that makes them to the end (before, their memory holds temporaries, as XLA's buffer assignment
places temporaries in the outputs' allocations); the caller sizes them.

Backends differ (a calibration's ``backend``): XLA:CPU's reductions do not recompute a value
that other ops also read, nor a broadcast that several ops read (:data:`UNSHARED_REDUCTIONS`);
XLA:CPU and XLA:GPU copy a batched product's operands whose batch dimensions are not leading
(:func:`kernel_copies`); XLA:CPU makes a reduce-scatter as an all-reduce and a slice
(:data:`ALL_REDUCE_THEN_SLICE`); XLA:GPU never writes an elementwise result that a reduction
also reads, nor one made with a reduction over the rows of its operand (a softmax), into that
operand's buffer (:data:`REDUCED_NOT_IN_PLACE`). The TPU compiler does none of these, but keeps
a float32 stacked output that only default-precision products read in bfloat16
(:data:`NARROW_DOT_OPERANDS`: measured on a 6.6 B-parameter language model on 256 v5p chips, the
prediction went from 102 GB to 84.8 GB per device against 85.1 GB compiled).

Cheap float math (XLA:GPU, :data:`CHEAP_FLOAT_MATH`): a float exp, division, square root,
reciprocal square root or logistic is cheap, recomputed in each reader like an add, so what the
backward pass reads of a softmax or a SiLU is the scores or the gate, not their exponentials.
A 4-layer Llama (2048 wide, 16 heads, 8 x 2048 tokens, bfloat16 parameters) on one H100: the
scanned step predicted 28470 MiB (was 29470) against 33183 compiled; with 8 x 512 tokens and 512
wide, 870 (was 934) against 941.

Unrolled scans (XLA:GPU and the TPU compiler, :data:`INLINED_SCANS`): a scan whose ``unroll`` is
``True`` or at least its length is compiled as its layers written out: its stacked outputs are
not materialized but each layer's values are buffers of their own (:attr:`Lifetimes.repeated`),
and the stacked inputs of another unrolled scan that are such a stack are that layer's values,
so values fuse across it as within a layer. The Llama above unrolled: 19801 MiB compiled on one
H100, predicted 19509 (was 29470, as scanned); 1024 wide with 8 x 1024 tokens on a v5p chip,
3744 MiB compiled (5429 scanned), predicted 4029 (was 5127). XLA:CPU keeps them stacked: applied
there, that Llama unrolled predicted 0.59x of the compiled 7862 MiB (was 0.68x), an unrolled
LM 0.75x of 5631 (was 0.98x); it is left out. Only the memory changes: the program keeps its
scan.

Host memory: on backends whose host memory is not the device's (:data:`HOST_MEMORY`), a value
``device_put`` into a host memory space (a remat policy that offloads,
``save_and_offload_only_these_names``; ``jax.device_put(x, s.with_memory_kind("pinned_host"))``)
and what stacks, slices or views it there take no device memory (:attr:`Lifetimes.host`); the
``device_put`` back makes a device buffer. XLA:CPU's host memory is its devices' own.

Slices read in place (the TPU compiler, :data:`SLICED_IN_PRODUCTS`): a rolled loop's layer of a
stacked operand that a product reads is read inside the product, no buffer of its own. With both
rules (stacks held, slices in place), MaxText's steps predicted / compiled: Qwen3-235B at tensor
4 on 256 v5p chips 0.83 to 0.91, at tensor 2 on 256 Ironwood devices 0.89 to 0.97; Llama 2 7B on
64 v5p chips 1.03 to 1.04, 70B on 256 0.96 to 1.04.

Deferred products (the TPU compiler, :data:`DEFERRED_PRODUCTS`): a product outside loops whose
result no op reads before a later loop ends runs after that loop (after the last such loop
before its first reader): its operands live over the loop, its result is made after it. The
output layer's weight gradient of a training step is one (only the optimizer reads it), and
the logits' gradient it reads is then held over the layers' backward loop. MaxText's steps as
the TPU compiler scheduled them, predicted / compiled peak per device without and with the rule:
DeepSeek-V3 on 512 v5p chips 0.85 and 1.00 (its bf16[6,8192,129280] logits' gradient, 12.7 GB),
Llama 3.1 405B on two v6e-256 slices 0.89 and 1.01, Qwen3-235B on 256 v5p chips 0.90 and 0.99,
on 256 Ironwood devices 0.86 and 0.94; steps whose peak is elsewhere are unchanged. Not always:
on a hand-written language model (its loss's gradient fused into both products, bfloat16 or
float32, plain updates or optax's clipped AdamW, 4 v5p chips) the compiler keeps the product
before the loop, and the rule holds 3.6 MiB more there than it does (its peak, at the loss in
the forward pass, unchanged). MaxText's tiny DeepSeek-V3 on a v5p-8 defers it past the first of
its two backward loops only.

Expansions read by products (the TPU compiler, :data:`EXPANSIONS_IN_PRODUCTS`): a value cheap
ops make from values far smaller than it (:func:`expansions`: a one-hot, ids broadcast against
an iota, compared and converted) is computed inside every reader, products too, never held.
MaxText's embedding by one-hot product (``use_iota_embed``) on Llama 3.1 405B on two v6e-256
slices holds no bf16[4,8192,32064] one-hot per device (2.1 GB) in the compiler's buffers; the
model held it from the embedding to its gradient, the step's end.

The last layer's deferred work (the TPU compiler, :data:`PEELED_LAST_LAYER`): the compiler runs
a backward loop for all its layers but the last, that layer after it, and that layer's weight
gradients, which nothing needs before the next stack's backward loop ends (a global norm clips
them), after that loop: what they read of the layer is held over it (:func:`_peeled`; of an
opaque op, the operands its body computes them from). MaxText's DeepSeek-V3 with its ring of
experts on 512 v5p chips, dumped: its first MoE layer's expert and attention weight gradients
run after the three dense layers' backward loop, holding the ring's four gathered token chunks
and their gradients (eight bf16[147456,7168], 2.1 GB each per chip) and the layer's attention
activations over it; the compiler's live peak there is 96.9 GB, all it allocates (96.94 GB),
predicted 80.4 before the rule (0.83x) and 92.9 with it (0.96x). Not always: a two-stack MLP
step on 4 v5p chips (8192 tokens, 512 wide, weights split over the chips, residuals
offloaded), clipped, has its second stack's last weight gradients made right after its loop,
the rule holding what the compiler does not: 154 MiB compiled, predicted 162 (126 without);
updated plainly, nothing waits for the next loop and the rule does not apply (144 MiB compiled,
132 predicted; 168 if it applied).

Remat (``jax.checkpoint``): the jaxpr recomputes what it does not save, so the forward's values
die at their last forward use. In the backward pass the TPU compiler runs the recomputation
where it is read, not all of it first (:data:`SUNK_RECOMPUTATION`,
:func:`planner.cost.run_order.run_order`): the lifetimes are those of the ops in that order.

Example:
    >>> lt = lifetimes(prog, "tpu")                    # doctest: +SKIP
    >>> lt.kind["v12"], lt.alloc[3], lt.free[3]
"""

from __future__ import annotations

import dataclasses
import functools
import math

from planner.cost.run_order import arranged_program, run_order
from planner.program.ir import Program
from planner.program.memo import PerObject
from planner.program.ops import Op
from planner.program.rules import IDENTITIES

BUFFER, FUSED, VIEW = "buffer", "fused", "view"

VIEWS = frozenset("reshape squeeze expand_dims transpose copy copy_p optimization_barrier "
                  "sharding_constraint pvary random_wrap random_unwrap".split()) | IDENTITIES  # fmt: skip
ENTRIES = frozenset("scan_const scan_carry while_const while_carry cond_operand".split())
SINKABLE = frozenset("scan_const while_const cond_operand".split())  # constant operands sink
EXITS = frozenset("scan_carry_out while_carry_out".split())
STACKS = frozenset({"scan_ys"})
EXPENSIVE = frozenset(
    """exp exp2 expm1 log log1p tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh
    acosh atanh sqrt rsqrt cbrt div rem pow erf erfc erf_inv lgamma digamma polygamma igamma
    igammac igamma_grad_a random_gamma_grad bessel_i0e bessel_i1e zeta
    regularized_incomplete_beta threefry2x32 random_bits""".split()
)
CHEAP = frozenset(
    """abs add add_any and bitcast_convert_type broadcast_in_dim ceil clamp clz concatenate conj
    convert_element_type dynamic_slice eq floor gather ge gt imag integer_pow iota is_finite le lt
    max min mul ne neg nextafter not or pad population_count real reduce_precision rev round
    scan_xs select_n shift_left shift_right_arithmetic shift_right_logical sign slice split
    square stop_gradient sub xor one_minus_square""".split()
)
FUSIBLE = CHEAP | EXPENSIVE
FUSING = frozenset(
    """reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax
    argmin""".split()
)  # materialize their result, fuse what they read (scan_ys too)


IN_PLACE = frozenset("dynamic_update_slice scatter scatter-add scatter_add scatter-mul scatter_mul "
                     "scatter-min scatter_min scatter-max scatter_max".split())  # fmt: skip
"""Ops that write their result into their first operand's buffer when it dies there."""

UNSHARED_REDUCTIONS = frozenset({"cpu"})
"""Backends whose reductions recompute a fused value only when they are its one reader, and that
store a broadcast (a value larger than what it is computed from) that several ops read, rather
than recompute it in each (XLA:CPU's YNNPACK fusions): the normalized activations and broadcast
statistics of a layer norm, kept for its gradient."""

ALL_REDUCE_THEN_SLICE = frozenset({"cpu"})
"""Backends whose compiler makes a reduce-scatter as an all-reduce of the whole partial result
followed by a slice (XLA:CPU): both whole buffers exist while it runs."""

NARROW_DOT_OPERANDS = frozenset({"tpu"})
"""Backends whose products of float32 operands at default precision read them as bfloat16 (the
TPU's one-pass matrix unit): the compiler keeps a loop's float32 stacked output that only such
products read (through the backward loop's slices and views) in bfloat16, half its size, as
the TPU compiler does with the residuals of attention probabilities and layer inputs kept for
the weights' gradients."""

REDUCED_NOT_IN_PLACE = frozenset({"gpu"})
"""Backends that compute an elementwise result which a reduction also reads in one kernel with
the reduction (XLA:GPU's multi-output fusions), and one that reads a reduction over the rows
(the last dimension) of an operand it reads too in one kernel with that reduction (XLA:GPU's
softmax fusions), whose output is never that operand's buffer: an attention's probabilities
are a second buffer beside the scores (8 x 2048 x 16 heads, float32 on one H100: 4240 MiB
compiled, two 2 GiB buffers; the TPU compiler writes them in place, 2224 MiB). XLA:GPU writes
a centering of the columns in place, not one of the rows (its compiler for H100, JAX 0.10).
XLA:CPU (JAX 0.10) fuses that attention, both products and the softmax, into one YNNPACK kernel whose intermediates ``memory_analysis()`` does not see (196 MiB of
temporaries), yet running it raised the process's peak memory by 4338 MiB: two score buffers
too. CPU is left out because the compiled figure the CPU checks compare with does not count
them."""

CHEAP_FLOAT_MATH = frozenset({"gpu"})
"""Backends that recompute a float exp, division, square root, reciprocal square root or
logistic (:data:`RECOMPUTED_MATH`) in each of its readers, as a cheap op, rather than store it
when several ops read it (XLA:GPU's fusion counts float32 and float16 exp, divide, sqrt and
rsqrt as cheap, computes bfloat16 ones in float32 and expands logistic into exp and divide;
it stores a bfloat16 tanh or sin that a reduction and another op read). See the module
docstring for the figures."""

RECOMPUTED_MATH = frozenset("exp div sqrt rsqrt logistic".split())
FLOATS = frozenset("float32 float16 bfloat16".split())

INLINED_SCANS = frozenset({"gpu", "tpu"})
"""Backends that compile a scan whose ``unroll`` is ``True`` or at least its length as its
layers written out one after another (:func:`inlined_scans`): a stacked output is each layer's
value, a buffer of its own kept while something reads that layer (or fused into its readers),
and a stacked input of another unrolled scan that is such a stack is a view of the layer's
value (:func:`_inline`). A stack another op needs whole (a rolled loop's stacked input, a
product's operand, a program output) is made where the loop ends, its layers held till then.
See the module docstring for the figures; XLA:CPU is left out."""

HOST_MEMORY = frozenset({"tpu", "gpu"})
"""Backends whose devices have memory of their own beside the host's: values offloaded to the
host take none of it (the TPU compiler lists them as host temporaries)."""

BATCH_LEADING = frozenset({"cpu", "gpu"})
"""Backends whose batched products want the batch dimensions of each operand leading (XLA:CPU
and XLA:GPU canonicalize a ``dot_general`` to ``[batch, m, k] x [batch, k, n]``): an operand
whose batch dimensions are elsewhere is copied into that order while the product runs. TPU
layouts take any order."""


DEFERRED_PRODUCTS = frozenset({"tpu"})
"""Backends whose scheduler runs a product outside loops, whose result nothing reads before a
later loop ends, after that loop (:func:`_deferrable`): the product's operands are held
over the loop, its result is made after it. The TPU compiler does so with the output layer's
weight gradient, which only the optimizer reads: the logits' gradient it reads is kept over
the layers' backward loop (DeepSeek-V3 on 512 v5p chips, bf16[6,8192,129280] per chip: 12.7
GB of the 14.7 GB the model missed; Qwen3-235B on 256 Ironwood devices, 2.5 GB)."""


SLICED_IN_PRODUCTS = frozenset({"tpu"})
"""Backends whose products read a loop's layer of a stacked operand in place (the TPU compiler
fuses the dynamic slice into the product): such a slice is no buffer of its own. The stack
itself is held for the whole loop either way (a loop slices it at every step)."""

PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})

EXPANSIONS_IN_PRODUCTS = frozenset({"tpu"})
"""Backends whose products compute an operand made by cheap ops from far smaller values where
they read it (:func:`expansions`; the TPU compiler fuses a one-hot's comparison into the
product), so that no reader needs it in memory."""

EXPANSION = 8
"""A value is an expansion (:func:`expansions`) where what it is computed from is at most
``1 / EXPANSION`` of its size (or an expansion itself)."""

PEELED_LAST_LAYER = frozenset({"tpu"})
"""Backends whose compiler peels a rolled loop's last iteration out of the loop and defers that
layer's work whose results nothing reads before a later loop ends past that loop, as
:data:`DEFERRED_PRODUCTS` defers a product outside loops (:func:`_peeled`): the buffers of the
last layer that work reads are held over the later loop. The TPU compiler runs a backward
pass's layer loop for all but its last layer and that layer after it, and runs the layer's
weight gradients (which only the optimizer reads) after the next stack's backward loop."""

SUNK_RECOMPUTATION = frozenset({"tpu"})
"""Backends whose scheduler runs a checkpointed layer's recomputation just before the ops that
read it, where that holds nothing longer (:func:`planner.cost.run_order.run_order`): the
lifetimes are those of the ops in that order (:attr:`Lifetimes.order`)."""


def kernel_copies(op: Op, backend: str) -> tuple:
    """The operands (accesses) of ``op`` that the ``backend``'s kernel copies into another order
    before it runs (see :data:`BATCH_LEADING`); dimensions of size 1 do not count."""
    if op.primitive != "dot_general" or backend not in BATCH_LEADING or len(op.operands) != 2:
        return ()
    extent = {lp.name: lp.extent for lp in op.loops}
    read = [{lp for d in a.dims for lp in d} for a in op.operands]
    batch = [lp for d in op.results[0].dims for lp in d if extent[lp] > 1
             and all(lp in r for r in read)]  # fmt: skip
    if not batch:
        return ()
    out = []
    for a in op.operands:
        order = [lp for d in a.dims for lp in d if extent[lp] > 1]
        if order[: len(batch)] != batch:
            out.append(a)
    return tuple(out)


def _expands(op: Op) -> bool:
    """Whether ``op``'s result is larger than each of its operands (a broadcast, an iota, the
    product of two broadcast vectors)."""
    size = math.prod(op.results[0].value.shape) if op.results else 0
    return all(math.prod(a.value.shape) < size for a in op.operands)


def expansions(prog: Program) -> frozenset[str]:
    """The values cheap ops (:data:`CHEAP`, views) compute from values each at most
    ``1 / EXPANSION`` of their size or expansions themselves: a one-hot (token ids ``[B, S, 1]``
    compared with an iota ``[1, 1, V]``, converted), a broadcast vector. The TPU compiler
    computes them in each reader (:data:`EXPANSIONS_IN_PRODUCTS`).

    Example:
        >>> sorted(expansions(planner.analyze(lambda ids: jax.nn.one_hot(ids, 512), ids)))  # doctest: +SKIP
        ['v2', 'v3', 'v4']
    """
    out: set[str] = set()
    for op in prog.ops:
        if op.primitive not in CHEAP and op.primitive not in VIEWS:
            continue
        for r in op.results:
            size = math.prod(r.value.shape)
            if all(a.value.name in out or math.prod(a.value.shape) * EXPANSION <= size
                   for a in op.operands):  # fmt: skip
                out.add(r.value.name)
    return frozenset(out)


def category(op: Op) -> str:
    """How the compiler treats ``op``'s results: ``"view"``, ``"entry"`` / ``"exit"`` (views
    across a region's boundary), ``"fusible"``, ``"fusing"`` (a buffer that fuses what it
    reads), ``"stack"`` (scan_ys) or ``"materialize"`` (a buffer; what it reads must be one)."""
    p = op.primitive
    if p in VIEWS:
        return "view"
    if p in ENTRIES:
        return "entry"
    if p in EXITS:
        return "exit"
    if p in STACKS:
        return "stack"
    if p in FUSIBLE:
        return "fusible"
    if p in FUSING:
        return "fusing"
    return "materialize"


@dataclasses.dataclass(frozen=True)
class Lifetimes:
    """The buffers of a program and when they live (op indices into ``prog.ops``).

    Attributes:
        kind: op result name -> ``"buffer"``, ``"fused"`` or ``"view"``.
        alloc: per op, the buffers ``(op index, result index)`` allocated when it runs (not
            inputs, outputs or constants: see ``fixed`` and ``made``).
        free: per op, the buffers released after it runs.
        hold: per op, the last op during which copies of its operands moved to another layout
            are held (itself if it materializes its result, else where its readers run; a loop's
            end for a loop's entry).
        fixed: names of the values left to the caller: inputs that are read or returned,
            outputs, constants.
        made: output name -> the op that makes it (a loop's stacked output: the loop's first
            op); an output is held from then to the end, and its memory serves temporaries
            before (XLA places them in the output's allocation).
        first: op result name -> the first op that runs one of its readers.
        narrowed: the stacked outputs ``(op index, result index)`` kept at half their size
            (:data:`NARROW_DOT_OPERANDS`).
        host: names of the values held in host memory (:data:`HOST_MEMORY`).
        reuse: per op, its results (index, candidates) that may be written in place into a
            buffer that dies where the op runs and has the result's shape and dtype (an
            elementwise fusion's output, a scatter or dynamic_update_slice into its operand; a
            bitcast that is returned, into its operand), as XLA's buffer assignment shares them
            when the layouts agree too.
        at: per op, where it runs: its own index, or for a product the compiler defers past
            loops (:data:`DEFERRED_PRODUCTS`) the first op after the last of them.
        repeated: buffers of an unrolled scan's layer that outlive it, every layer's kept
            (:data:`INLINED_SCANS`): ``(op index, result index)`` -> the spans ``(first op,
            last op, copies)`` of the other layers' copies, besides the one of ``alloc`` and
            ``free`` (see :func:`_other_layers`).
        order: the op indices in the order the compiler runs them (:data:`SUNK_RECOMPUTATION`);
            empty: the program's. Times (the indices of ``alloc`` and ``free``, the values of
            ``hold``, ``at``, ``made`` and ``first``, the spans of ``repeated``) count places in
            that order; op indices (an op's entry in ``hold``, ``reuse`` or ``at``, a buffer's
            ``(op index, result index)``) are the program's.
    """

    kind: dict[str, str]
    alloc: tuple[tuple[tuple[int, int], ...], ...]
    free: tuple[tuple[tuple[int, int], ...], ...]
    hold: tuple[int, ...]
    fixed: frozenset[str]
    reuse: tuple[tuple[tuple[int, tuple[tuple[int, int], ...]], ...], ...]
    made: dict[str, int]
    first: dict[str, int]
    narrowed: frozenset[tuple[int, int]] = frozenset()
    host: frozenset[str] = frozenset()
    repeated: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = dataclasses.field(
        default_factory=dict
    )
    at: tuple[int, ...] = ()
    order: tuple[int, ...] = ()

    def running(self, t: int) -> int:
        """The index of the op that runs at time ``t``."""
        return self.order[t] if self.order else t

    @functools.cached_property
    def times(self) -> tuple[int, ...]:
        """Per op index, the time it runs at (its place in :attr:`order`).

        Example:
            >>> lifetimes(prog, "tpu").times[57]          # doctest: +SKIP
            41
        """
        if not self.order:
            return tuple(range(len(self.hold)))
        time = [0] * len(self.order)
        for t, k in enumerate(self.order):
            time[k] = t
        return tuple(time)


LIFETIMES: PerObject[dict[str, Lifetimes]] = PerObject("buffers and lifetimes per backend")


def lifetimes(prog: Program, backend: str = "tpu") -> Lifetimes:
    """The program's buffers and their lifetimes when compiled for ``backend`` (a calibration's
    ``backend``: see :data:`UNSHARED_REDUCTIONS`), per the module docstring; computed once per
    program and backend."""
    cache = LIFETIMES.get(prog, dict)
    if backend not in cache:
        order = run_order(prog) if backend in SUNK_RECOMPUTATION else ()
        if order == tuple(range(len(prog.ops))):
            order = ()
        arranged = arranged_program(prog, order) if order else prog
        lt = _lifetimes(
            arranged,
            backend in UNSHARED_REDUCTIONS,
            backend in REDUCED_NOT_IN_PLACE,
            backend in CHEAP_FLOAT_MATH,
            backend in INLINED_SCANS,
            backend in DEFERRED_PRODUCTS,
            backend in SLICED_IN_PRODUCTS,
            backend in EXPANSIONS_IN_PRODUCTS,
            backend in PEELED_LAST_LAYER,
        )
        if backend in NARROW_DOT_OPERANDS:
            lt = dataclasses.replace(lt, narrowed=_dot_only_stacks(arranged))
        if backend in HOST_MEMORY:
            lt = dataclasses.replace(lt, host=host_values(arranged))
        cache[backend] = _in_program_indices(lt, order) if order else lt
    return cache[backend]


def _in_program_indices(lt: Lifetimes, order: tuple[int, ...]) -> Lifetimes:
    """``lt`` of a program arranged in ``order`` (:func:`planner.cost.run_order.arranged_program`)
    with its op indices those of the program (its times stay places in ``order``)."""

    def key(k: tuple[int, int]) -> tuple[int, int]:
        return order[k[0]], k[1]

    def per_op(values: tuple) -> tuple:
        out = [None] * len(order)
        for p, v in enumerate(values):
            out[order[p]] = v
        return tuple(out)

    return dataclasses.replace(
        lt,
        alloc=tuple(tuple(map(key, keys)) for keys in lt.alloc),
        free=tuple(tuple(map(key, keys)) for keys in lt.free),
        hold=per_op(lt.hold),
        reuse=per_op(tuple(tuple((i, tuple(map(key, c))) for i, c in r) for r in lt.reuse)),
        narrowed=frozenset(map(key, lt.narrowed)),
        repeated={key(k): v for k, v in lt.repeated.items()},
        at=per_op(lt.at),
        order=order,
    )


def to_host(op: Op) -> bool:
    """Whether ``op`` puts its operands into host memory: a ``device_put`` whose destinations are
    a host memory space (``MemorySpace.Host``, as remat's offloading writes it) or shardings of
    a host memory kind (``"pinned_host"``, ``"unpinned_host"``)."""
    if op.primitive != "device_put" or op.eqn is None:
        return False
    return _host_places(op.eqn.params.get("devices") or ())


def host_values(prog: Program) -> frozenset[str]:
    """Values in host memory: results of :func:`to_host`, and views, slices, stacks and loop
    entries of such values alone.

    Example:
        >>> host_values(planner.analyze(step_that_offloads, *args))     # doctest: +SKIP
        frozenset({'v7', 'v11', 'v17'})
    """
    passing = VIEWS | ENTRIES | EXITS | STACKS | {"scan_xs"}
    out: set[str] = set()
    for op in prog.ops:
        if to_host(op) or (
            op.primitive in passing
            and op.operands
            and all(a.value.name in out for a in op.operands)
        ):
            out.update(r.value.name for r in op.results)
        elif op.how == "manual":
            out.update(op.results[k].value.name for k in _offloaded_outputs(op.eqn))
    return frozenset(out)


def _offloaded_outputs(eqn) -> list[int]:
    """The outputs of a ``shard_map`` that its body puts into host memory (MaxText's flash
    attention offloads its ``context`` residual inside its own ``shard_map``): their types
    say so (``bfloat16<host>[...]``).

    Example:
        >>> _offloaded_outputs(shard_map_eqn)     # doctest: +SKIP
        [1, 2]
    """
    return [k for k, v in enumerate(eqn.outvars)
            if "host" in str(getattr(v.aval, "memory_space", "")).lower()]  # fmt: skip


def _host_places(dests) -> bool:
    """Whether every destination of a ``device_put`` is host memory."""
    return bool(dests) and all(
        "Host" in str(d) or "host" in str(getattr(d, "memory_kind", None) or "") for d in dests
    )


def _default_precision(op: Op) -> bool:
    """Whether a product runs at the backend's default precision (no ``precision`` asked)."""
    params = getattr(op.eqn, "params", None) or {}
    precision = params.get("precision")
    if precision is None:
        return True
    names = precision if isinstance(precision, (tuple, list)) else (precision,)
    return all(p is None or "DEFAULT" in str(p) for p in names)


def _dot_only_stacks(prog: Program) -> frozenset[tuple[int, int]]:
    """Float32 stacked outputs that only products at default precision read (through slices
    of a loop and views), and that the program does not return."""
    uses = prog.uses
    outputs = {v.name for v in prog.outputs}
    passing = VIEWS | {"scan_xs", "scan_const", "convert_element_type"}

    def dot_only(name: str, seen: set) -> bool:
        if name in outputs or name in seen:
            return name not in outputs
        seen.add(name)
        readers = uses.get(name, ())
        for op, _ in readers:
            if op.primitive in ("dot_general", "conv_general_dilated"):
                if not _default_precision(op):
                    return False
            elif op.primitive in passing:
                if (
                    op.primitive == "convert_element_type"
                    and op.results[0].value.dtype != "bfloat16"
                ):
                    return False
                if not all(dot_only(r.value.name, seen) for r in op.results):
                    return False
            else:
                return False
        return bool(readers)

    out = set()
    for k, op in enumerate(prog.ops):
        if category(op) != "stack":
            continue
        for i, r in enumerate(op.results):
            if r.value.dtype == "float32" and dot_only(r.value.name, set()):
                out.add((k, i))
    return frozenset(out)


def _constant_like(prog: Program, cats: list[str]) -> set[str]:
    """Values computed from constants and iotas alone (through fusible ops and views)."""
    out = {v.name for v, _ in prog.consts}
    for op, cat in zip(prog.ops, cats):
        if cat in ("fusible", "view", "entry") and all(a.value.name in out for a in op.operands):
            out.update(r.value.name for r in op.results)
    return out


def inlined_scans(prog: Program) -> list:
    """The scan regions of ``prog`` whose ``unroll`` is ``True`` or at least their length."""
    out = []
    for r in prog.regions:
        if r.kind != "scan" or r.eqn is None:
            continue
        unroll, length = r.eqn.params.get("unroll", 1), r.eqn.params.get("length", 1)
        if unroll is True or (not isinstance(unroll, bool) and unroll >= length):
            out.append(r)
    return out


def _inline(prog: Program, cats: list[str], regions: list) -> None:
    """:data:`INLINED_SCANS`: in ``cats``, an unrolled scan's stacked outputs become fusible (a
    concatenation of its layers' values) and its stacked inputs that are such a stack (through
    views) views of the layer's value."""
    ops = prog.ops
    stacked = set()  # values that are an unrolled scan's stacked output, or views of one
    for r in regions:
        for k in range(r.body, r.stop):
            if ops[k].primitive == "scan_ys":
                cats[k] = "fusible"
                stacked.update(x.value.name for x in ops[k].results)
    for k, op in enumerate(ops):
        if cats[k] == "view" and op.operands and op.operands[0].value.name in stacked:
            stacked.update(x.value.name for x in op.results)
    for r in regions:
        for k in range(r.start, r.body):
            if ops[k].primitive == "scan_xs" and ops[k].operands[0].value.name in stacked:
                cats[k] = "view"


def _kinds(prog: Program, cats: list[str], unshared_reductions: bool,
           cheap_math: bool = False, sliced: frozenset[int] = frozenset(),
           expanded: frozenset[str] = frozenset()) -> dict[str, str]:  # fmt: skip
    """The fusion rule (module docstring): each op result's kind, deciding from the last op back
    (a value's readers are decided before it); the ``scan_xs`` ops of ``sliced`` are read
    inside the products that read them (:data:`SLICED_IN_PRODUCTS`), as are the values of
    ``expanded`` (:data:`EXPANSIONS_IN_PRODUCTS`)."""
    ops, index, uses = prog.ops, prog.index, prog.uses
    outputs = {v.name for v in prog.outputs}
    constant = _constant_like(prog, cats)

    def passes(c: int, operand: str) -> bool:
        """Whether reader ``c`` computes ``operand`` where it is read, or hands it on: fusible
        ops and views do; a loop's entry or scan_xs only a constant, which sinks into the
        loop (an unrolled scan's slice of an unrolled stack is a view: :func:`_inline`)."""
        if cats[c] in ("entry", "exit") or (ops[c].primitive == "scan_xs" and cats[c] != "view"):
            return ops[c].primitive in SINKABLE | {"scan_xs"} and operand in constant
        return cats[c] in ("fusible", "view")

    def cheap(op: Op) -> bool:
        """Whether ``op`` is duplicated into each of its readers (:data:`CHEAP`; an unrolled
        stack; :data:`CHEAP_FLOAT_MATH`)."""
        if op.primitive in CHEAP or op.primitive == "scan_ys":  # (a fusible scan_ys: unrolled)
            return True
        return (cheap_math and op.primitive in RECOMPUTED_MATH
                and all(r.value.dtype in FLOATS for r in op.results))  # fmt: skip

    kind: dict[str, str] = {}
    ends: dict[str, frozenset[int]] = {}  # value -> the ops that run its readers
    needy: dict[str, bool] = {}  # value -> whether one of them needs it in memory
    for k in range(len(ops) - 1, -1, -1):
        op, cat = ops[k], cats[k]
        for r in op.results:
            name = r.value.name
            readers: set[int] = set()
            needed = layers = False  # layers: a slice of an unrolled stack needs it in memory
            for c_op, _ in uses.get(name, ()):
                c = index[c_op.name]
                if not passes(c, name):
                    readers.add(c)
                    in_place = (k in sliced or name in expanded) and c_op.primitive in PRODUCTS
                    needed |= cats[c] not in ("fusing", "stack") and not in_place
                    continue
                for x in c_op.results:
                    if kind[x.value.name] == BUFFER:
                        readers.add(c)
                    elif c_op.primitive == "scan_xs":  # a view of the layer's value
                        readers |= ends[x.value.name]
                        layers |= needy[x.value.name]
                    else:
                        readers |= ends[x.value.name]
                        needed |= needy[x.value.name]
            unstacked = op.primitive == "scan_ys" and cat == "fusible"  # (:func:`_inline`)
            ends[name], needy[name] = frozenset(readers), needed or layers
            shared = len(readers) > 1
            if unstacked and name not in outputs and not needed:
                kind[name] = FUSED  # each layer's value, in memory where a slice needs it
            elif name in outputs or cat in ("materialize", "fusing", "stack"):
                kind[name] = BUFFER
            elif cat in ("view", "entry", "exit"):
                kind[name] = VIEW
            elif needed or layers or (shared and not cheap(op)):
                kind[name] = BUFFER
            elif (
                shared
                and unshared_reductions
                and (_expands(op) or any(cats[c] == "fusing" for c in readers))
            ):
                kind[name] = BUFFER
            else:
                kind[name] = FUSED  # (with no readers: dead, never computed)
    return kind


def _repeated(prog: Program, kind: dict[str, str], regions: list) -> dict[tuple[int, int], tuple]:
    """The buffers of an unrolled scan's body (and copies of its layer's slices) that its
    stacked outputs read, directly or through values fused or viewed there, every layer's kept:
    ``(op index, result index) -> (copies, the innermost such scan)``."""
    ops, index, producer = prog.ops, prog.index, prog.producer
    out: dict[tuple[int, int], tuple] = {}
    for r in sorted(regions, key=lambda r: r.start - r.stop):  # outermost first
        length = r.eqn.params.get("length", 1)
        seen: set[str] = set()
        todo = [a.value.name for k in range(r.body, r.stop) if ops[k].primitive == "scan_ys"
                for a in ops[k].operands]  # fmt: skip
        while todo:
            name = todo.pop()
            op = producer.get(name)
            if name in seen or op is None or not r.start <= index[op.name] < r.stop:
                continue
            seen.add(name)
            k = index[op.name]
            if k < r.body and op.primitive != "scan_xs":
                continue  # a loop-invariant or carried value: one
            if kind[name] == BUFFER:
                i = next(i for i, x in enumerate(op.results) if x.value.name == name)
                out[(k, i)] = (out.get((k, i), (1, r))[0] * length, r)
            else:
                todo.extend(a.value.name for a in op.operands)
    return out


def _other_layers(prog: Program, cats: list[str], regions: list, repeated: dict,
                  spans: dict) -> tuple[dict, list]:  # fmt: skip
    """:attr:`Lifetimes.repeated` from :func:`_repeated`, and the unrolled scans that read
    layers of such buffers (the span of each is the layer read first: to its last reader).

    An unrolled scan's body stands for its layers at the iteration where it holds the most:
    its last, where the layers it makes are all made; its first where it reads layers of
    another's (a backward pass reading the forward's residuals, each released by its layer),
    where the others are still held and what it makes has one layer made (the others are, by
    where it hands its results out, and the residuals released)."""
    ops = prog.ops
    reading = [r for r in regions
               if any(ops[k].primitive == "scan_xs" and cats[k] == "view"
                      for k in range(r.start, r.body))]  # fmt: skip
    out = {}
    for key, (copies, made_in) in repeated.items():
        begin, end = spans[key]
        if any(made_in is r for r in reading):  # at its first layer: one made
            begin = max(begin, made_in.stop - len(made_in.outputs))
        for r in reading:  # its layers read in r: held by r's later layers, not to r's end
            if spans[key][0] < r.body <= spans[key][1] < r.stop:
                end = max(end, r.stop - len(r.outputs) - 1)
        out[key] = ((begin, max(begin, end), copies - 1),) if copies > 1 else ()
    return out, reading


def _row_reduction(op: Op) -> bool:
    """Whether ``op`` is a reduction over its operand's last dimension that keeps another."""
    axes = (getattr(op.eqn, "params", None) or {}).get("axes")
    ndim = len(op.operands[0].value.shape) if op.operands else 0
    return axes is not None and ndim - 1 in axes and len(axes) < ndim


def _fused_reads(prog: Program, cats: list[str], kind: dict[str, str], k: int,
                 operands: tuple[str, ...] | None = None) -> list:  # fmt: skip
    """The buffers ``(op index, result index)`` that op ``k`` reads (of its ``operands``, by
    name; all if None), directly or through values fused or viewed into it."""
    ops, index, producer = prog.ops, prog.index, prog.producer
    out, seen = [], set()
    todo = [a.value.name for a in ops[k].operands] if operands is None else list(operands)
    while todo:
        name = todo.pop()
        p = producer.get(name)
        if name in seen or p is None:
            continue
        seen.add(name)
        j = index[p.name]
        if kind.get(name) == BUFFER:
            out.append((j, next(i for i, x in enumerate(p.results) if x.value.name == name)))
        elif cats[j] in ("fusible", "view"):
            todo.extend(a.value.name for a in p.operands)
    return out


def _rows_apart(prog: Program, cats: list[str], kind: dict[str, str]) -> dict[int, set]:
    """Per elementwise op, the buffers it may not be written into (:data:`REDUCED_NOT_IN_PLACE`):
    those that a reduction over rows it reads (through fused values) also reads, as one kernel
    computes both (a softmax's normalization, a row's centering)."""
    reads: dict[int, list] = {}
    out: dict[int, set] = {}
    for k, cat in enumerate(cats):
        if cat != "fusible":
            continue
        for j, _ in _fused_reads(prog, cats, kind, k):
            if cats[j] == "fusing" and _row_reduction(prog.ops[j]):
                if j not in reads:
                    reads[j] = _fused_reads(prog, cats, kind, j)
                out.setdefault(k, set()).update(reads[j])
    return out


def _lifetimes(prog: Program, unshared_reductions: bool, reduced_apart: bool = False,
               cheap_math: bool = False, inline: bool = False, defer: bool = False,
               in_products: bool = False, expanded_in_products: bool = False,
               peeled: bool = False) -> Lifetimes:  # fmt: skip
    ops, index, uses = prog.ops, prog.index, prog.uses
    n = len(ops)
    cats = [category(op) for op in ops]
    regions = inlined_scans(prog) if inline else []
    _inline(prog, cats, regions)
    sliced = _rolled_slices(prog, regions) if in_products else frozenset()
    expanded = expansions(prog) if expanded_in_products else frozenset()
    kind = _kinds(prog, cats, unshared_reductions, cheap_math, sliced, expanded)
    repeated = _repeated(prog, kind, regions)
    # Where each op runs: itself if it makes a buffer, else where its readers run.
    when = list(range(n))
    soonest = list(range(n))  # where an op runs first (a fused op: where its first reader does)
    last: dict[str, int] = {}
    first: dict[str, int] = {}
    past = _deferrable(prog, regions) if defer else {}
    at = list(range(n))
    for k in range(n - 1, -1, -1):
        for r in ops[k].results:
            readers = [index[c.name] for c, _ in uses.get(r.value.name, ())]
            last[r.value.name] = max((when[c] for c in readers), default=k)
            first[r.value.name] = min((soonest[c] for c in readers), default=k)
        if k in past:
            needed = min(first[r.value.name] for r in ops[k].results)
            ends = [stop for start, stop in past[k] if stop <= needed]
            if ends and needed > k:  # (a result no op reads is dead: left where it is)
                at[k] = when[k] = soonest[k] = max(ends)
        if not any(kind[r.value.name] == BUFFER for r in ops[k].results):
            when[k] = max((last[r.value.name] for r in ops[k].results), default=k)
            soonest[k] = min((first[r.value.name] for r in ops[k].results), default=k)
    read = {v.name for v in prog.inputs if v.name in uses}
    held = frozenset(read | {v.name for v in prog.outputs} | {v.name for v, _ in prog.consts})
    loops = sorted((r for r in prog.regions if r.kind in ("scan", "while")),
                   key=lambda r: r.stop - r.start)  # fmt: skip
    stack_start = {}  # a loop's stacked output is allocated when the (innermost) loop starts
    for r in reversed(loops):
        stack_start.update((k, r.start) for k in range(r.body, r.stop) if cats[k] == "stack")
    spans: dict[tuple[int, int], list[int]] = {}
    made: dict[str, int] = {}
    for k, op in enumerate(ops):
        for i, r in enumerate(op.results):
            if r.value.name in held:
                made.setdefault(r.value.name, stack_start.get(k, at[k]))
            elif kind[r.value.name] == BUFFER:
                begin = stack_start.get(k, at[k])
                spans[(k, i)] = [begin, max(last[r.value.name], begin)]
    hold = [[at[k], when[k]] for k in range(n)]
    extra, reading = _other_layers(prog, cats, regions, repeated, spans)
    for region in loops:  # read inside a loop, made before its body: held to the loop's end
        layers = any(region is r for r in reading)  # (a layer's slice: to its last reader)
        if _kept(region, regions):  # a rolled loop slices its stacks each step
            for key in _sliced_stacks(prog, cats, kind, region):
                if key in spans and spans[key][0] < region.start:
                    spans[key][1] = max(spans[key][1], region.stop - 1)
        for key, span in [*spans.items(), *enumerate(hold)]:
            if span[0] < region.body <= span[1] < region.stop and not (layers and key in extra):
                span[1] = region.stop - 1
    for key, until in _peeled(prog, cats, kind, regions).items() if peeled else ():
        if key in spans:  # held for the last layer's deferred work (:data:`PEELED_LAST_LAYER`)
            spans[key][1] = max(spans[key][1], until)
    alloc: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    free: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for key, (begin, end) in spans.items():
        alloc[begin].append(key)
        free[end].append(key)
    apart = _rows_apart(prog, cats, kind) if reduced_apart else {}
    reuse = []
    for k, op in enumerate(ops):
        reduced = (
            reduced_apart
            and cats[k] == "fusible"
            and any(
                cats[index[c.name]] == "fusing"
                for r in op.results
                for c, _ in uses.get(r.value.name, ())
            )
        )
        if reduced or (cats[k] not in ("fusible", "view") and op.primitive not in IN_PLACE):
            reuse.append(())
            continue
        reuse.append(tuple(
            (i, tuple(key for key in free[k] if key[0] != k and key not in repeated
                      and key not in apart.get(k, ())
                      and _same_size(ops[key[0]].results[key[1]].value, r.value)))
            for i, r in enumerate(op.results) if kind[r.value.name] == BUFFER
        ))  # fmt: skip
    return Lifetimes(kind, tuple(map(tuple, alloc)), tuple(map(tuple, free)),
                     tuple(end for _, end in hold), held, tuple(reuse), made, first,
                     repeated=extra, at=tuple(at))  # fmt: skip


def _sliced_stacks(prog: Program, cats: list[str], kind: dict[str, str], region) -> set:
    """The buffers ``(op index, result index)`` whose layers a loop's ``scan_xs`` slices
    (directly or through values fused or viewed into the slice): a rolled loop reads them at
    every step, also where its slice is a buffer of its own, as a product's operand is.

    Example:
        >>> _sliced_stacks(prog, cats, kind, backward_loop)            # doctest: +SKIP
        {(303, 0), (306, 0)}
    """
    return {key for k in range(region.start, region.body) if prog.ops[k].primitive == "scan_xs"
            for key in _fused_reads(prog, cats, kind, k)}  # fmt: skip


def _kept(region, inlined: list) -> bool:
    """Whether the compiler keeps ``region`` as a loop: a while, or a scan not ``inlined``."""
    return region.kind in ("scan", "while") and not any(region is x for x in inlined)


def _rolled_slices(prog: Program, inlined: list) -> frozenset[int]:
    """The ``scan_xs`` ops of the scans the compiler keeps as loops (not ``inlined``)."""
    return frozenset(k for r in prog.regions if r.kind == "scan" and _kept(r, inlined)
                     for k in range(r.start, r.body) if prog.ops[k].primitive == "scan_xs")  # fmt: skip


def _deferrable(prog: Program, inlined: list) -> dict[int, list[tuple[int, int]]]:
    """:data:`DEFERRED_PRODUCTS`: per product (``dot_general``) outside every loop and
    conditional, the ``(start, stop)`` of the outermost loops after it that the compiler keeps as
    loops (:func:`_kept`); calls (``checkpoint``, ``custom_vjp``) are inlined, so their ops count.

    Example:
        >>> _deferrable(prog, [])[726]                                  # doctest: +SKIP
        [(747, 1224), (1240, 1674)]
    """
    spans = _region_spans(prog)
    loops = [(r.start, r.stop) for r in _outer_loops(prog, inlined)]
    if not loops:
        return {}
    inside = {k for s, e in spans for k in range(s, e)}
    return {k: [(s, e) for s, e in loops if s > k] for k, op in enumerate(prog.ops)
            if op.primitive == "dot_general" and op.results and k not in inside
            and any(s > k for s, _ in loops)}  # fmt: skip


def _same_size(a, b) -> bool:
    """Whether values ``a`` and ``b`` have one dtype and as many elements."""
    return a.dtype == b.dtype and math.prod(a.shape) == math.prod(b.shape)


def _peeled(prog: Program, cats: list[str], kind: dict[str, str], inlined: list) -> dict:
    """:data:`PEELED_LAST_LAYER`: per buffer ``(op index, result index)`` made in a rolled
    scan's body and read by its last layer's deferred work, the time that work runs (the end
    of the last later loop before the stacks it writes are needed).

    A loop's deferred work: the ops of its body (not fused, not views) some of whose results
    reach, through fused values, views and other such ops, only stacked outputs of the loop
    that ops outside every loop read first after a later loop ends, one of them waiting for
    that loop (a backward pass's weight gradients, clipped by a global norm, where another
    layer stack's backward follows). An opaque op (a ``shard_map``) holds only the operands
    those results are computed from (:attr:`Op.feeds`).

    Example:
        >>> _peeled(prog, cats, kind, [])[(1397, 0)]                    # doctest: +SKIP
        2083
    """
    loops = _outer_loops(prog, inlined)
    reads = _Reads(prog, cats, kind)
    out: dict[tuple[int, int], int] = {}
    for r in loops:
        late = {k: t for k in range(r.body, r.stop) if r.kind == "scan"
                and prog.ops[k].primitive == "scan_ys" and (t := reads.needed_after(k, r, loops))}  # fmt: skip
        if late:
            _hold_for(prog, cats, kind, r, late, out)
    return out


def _region_spans(prog: Program) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of each loop and conditional of ``prog``."""
    return [(r.start, r.stop) for r in prog.regions if r.kind in ("scan", "while", "cond")]


def _outer_loops(prog: Program, inlined: list) -> list:
    """The loops the compiler keeps (:func:`_kept`) that no loop or conditional contains."""
    spans = _region_spans(prog)
    return [r for r in prog.regions if _kept(r, inlined)
            and not any((s, e) != (r.start, r.stop) and s <= r.start and r.stop <= e
                        for s, e in spans)]  # fmt: skip


class _Reads:
    """Who reads a program's values, and what they wait for (for :func:`_peeled`)."""

    def __init__(self, prog: Program, cats: list[str], kind: dict[str, str]):
        self.prog, self.cats, self.kind = prog, cats, kind
        self.spans = _region_spans(prog)
        self.after: dict[int, frozenset[str]] = {}  # a loop's start -> the values made from it
        self.first: dict[str, int] = {}

    def first_read(self, name: str) -> int:
        """The first op that reads ``name`` other than through views and fused values."""
        if name not in self.first:
            prog, found = self.prog, len(self.prog.ops)
            for c_op, _ in prog.uses.get(name, ()):
                c = prog.index[c_op.name]
                if self.cats[c] in ("view", "fusible") and all(
                        self.kind[x.value.name] != BUFFER for x in c_op.results):  # fmt: skip
                    found = min([found, *(self.first_read(x.value.name) for x in c_op.results)])
                else:
                    found = min(found, c)
            self.first[name] = found
        return self.first[name]

    def waits(self, name: str, q) -> bool:
        """Whether an op reading ``name`` (or a value fused or viewed from it) reads a value
        made from loop ``q`` too (a gradient clipped by a global norm that ``q``'s gradients
        are part of): it waits for ``q`` to end."""
        ops, uses = self.prog.ops, self.prog.uses
        if q.start not in self.after:
            made = {x.value.name for k in range(q.start, q.stop) for x in ops[k].results}
            for k in range(q.stop, len(ops)):
                if any(a.value.name in made for a in ops[k].operands):
                    made.update(x.value.name for x in ops[k].results)
            self.after[q.start] = frozenset(made)
        made, todo, seen = self.after[q.start], [name], set()
        while todo:
            for c_op, _ in uses.get(todo.pop(), ()):
                if c_op.name in seen:
                    continue
                seen.add(c_op.name)
                if any(a.value.name in made for a in c_op.operands):
                    return True
                todo.extend(x.value.name for x in c_op.results if self.kind[x.value.name] != BUFFER)
        return False

    def needed_after(self, k: int, r, loops: list) -> int:
        """For loop ``r``'s stacked output made by op ``k``: the end of the last later loop its
        first use outside loops waits for, or 0 (read in a loop, or by nothing waiting)."""
        names = [x.value.name for x in self.prog.ops[k].results]
        needed = min(map(self.first_read, names))
        if any(s <= needed < e for s, e in self.spans):
            return 0  # read in a later loop (a forward pass's residuals)
        return max((q.stop for q in loops if q.start >= r.stop and q.stop <= needed
                    and any(self.waits(n, q) for n in names)), default=0)  # fmt: skip


def _hold_for(prog: Program, cats: list[str], kind: dict[str, str], r, late: dict[int, int],
              out: dict) -> None:  # fmt: skip
    """:func:`_peeled` for loop ``r`` whose stacked outputs ``late`` (op index -> time) are
    written by deferred work: each buffer of ``r``'s body that work reads, into ``out``."""
    ops, index, uses = prog.ops, prog.index, prog.uses
    until: dict[str, int | None] = {}

    def deferred(name: str) -> int | None:
        """Where the work reading ``name`` runs, if all of it is deferred work."""
        if name not in until:
            until[name] = None  # (a cycle defers nothing)
            times = []
            for c_op, _ in uses.get(name, ()):
                c = index[c_op.name]
                if c in late:
                    times.append(late[c])
                elif r.body <= c < r.stop and c_op.results:
                    times.extend(deferred(x.value.name) for x in c_op.results)
                else:
                    times.append(None)
            until[name] = None if not times or None in times else max(times)
        return until[name]

    for k in range(r.body, r.stop):
        if cats[k] in ("fusible", "view", "entry", "exit", "stack"):
            continue
        results = {i: t for i, x in enumerate(ops[k].results)
                   if (t := deferred(x.value.name)) is not None}  # fmt: skip
        if not results:
            continue
        t = max(results.values())
        for key in _fused_reads(prog, cats, kind, k, _operands_feeding(ops[k], frozenset(results))):
            if r.body <= key[0] < r.stop:
                out[key] = max(out.get(key, t), t)


def _operands_feeding(op: Op, results: frozenset[int]) -> tuple[str, ...]:
    """The names of ``op``'s operands that its ``results`` (indices) are computed from: those
    its :attr:`Op.feeds` names (a ``shard_map``'s, from its body), else all of them.

    Example:
        >>> _operands_feeding(moe_backward, frozenset({2, 3}))         # doctest: +SKIP
        ('v2085', 'v2092')
    """
    names = tuple(a.value.name for a in op.operands)
    if not op.feeds:
        return names
    feeding = {k for i in results for k in op.feeds[i]}
    return tuple(n for k, n in enumerate(names) if k in feeding)
