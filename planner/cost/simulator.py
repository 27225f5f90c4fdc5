"""Predict time, bytes and peak memory per device of a scheduled program (DistIR-style).

Walks the :func:`planner.layout.dataflow.dataflow` of a schedule in program order:

- each op's kernel costs the roofline of its local flops and the bytes it reads and writes in
  memory, both as the XLA compiler counts them (:mod:`planner.cost.costs`: ``2 M N K`` for products,
  one per element of arithmetic, none for data movement; a value fused into the kernel that
  consumes it costs no bytes); a region boundary op (a value passing into or out of a scan
  body) costs nothing but its moves;
- an op inside a scan body costs its trip count times its one run (``op.trips``), its kernel at
  the calibration's ``loop_body_factor`` where the compiler keeps the loop rolled
  (:func:`rolled_ops`); every kernel costs ``kernel_s`` more, and the program's call ``step_s``;
- each layout change costs its ``redist`` plan, step by step (dynslice: a local copy; collectives:
  latency + wire bytes / bandwidth of their kind and group size);
- each pending sum (or max, min, ...) costs an all-reduce, or a reduce-scatter when the
  dataflow scatters it;
- memory, as the compiled program's total (arguments + outputs + temporaries - aliased): the
  inputs it reads and its constants are held throughout, its outputs from the op that makes
  them (their memory holds temporaries before; an output written into a donated input adds
  nothing); the buffers of :mod:`planner.cost.buffers` (what XLA keeps after fusion: no fused
  elementwise chain, broadcast, iota or bitcast is stored; a loop's operands and stacked outputs
  for the whole loop; an elementwise result written into a dying operand of its size) from
  their first to their last use; the copy a value is moved into for its readers in another
  layout (one per value and layout), while they run; and what the running op holds beyond its
  results: a redist plan's steps, operand copies its kernel makes, a partial result beside its
  all-reduce or reduce-scatter. Sums nothing reads before the program's last one (a step's
  gradients) are combined into one collective, as XLA's combiners do: their partial results
  wait for it; a ``shard_map`` result its body sums (``psum``) is held in place of what dies
  where the ``shard_map`` runs (:func:`summed_in_place`);
- a pipelined scan (:class:`planner.program.schedule.Stages`) as GPipe runs it: its body's work and
  communication at ``(K + P - 1) / (K P)`` of the whole loop's, one hand-over of the carry per
  tick over the stage axis, and its body's batch-carrying values at one microbatch's size (the
  stacked outputs, GPipe's in-flight activations, hold all ``K``).

Example:
    >>> pred = simulate(prog, sched)           # doctest: +SKIP
    >>> pred.time_s, pred.comm_bytes, pred.peak_bytes
"""

from __future__ import annotations

import collections
import dataclasses
import math

import redist
from planner.cost.buffers import ALL_REDUCE_THEN_SLICE, inlined_scans, kernel_copies, lifetimes
from planner.cost.costs import (
    DENSE,
    Fusion,
    dense_kind,
    fusion,
    op_bytes,
    op_flops,
    padding_mask_flops,
)
from planner.layout.dataflow import Move, OpStep, dataflow, input_spec, made_specs, output_specs
from planner.layout.staging import (
    circular_passes,
    circular_rounds,
    deferred_sums,
    pipeline_runs,
    region_of,
)
from planner.program.halo import halo_bytes
from planner.program.ir import Program
from planner.program.jaxpr_params import scan_split
from planner.program.manual import axis_factors, collective_axes
from planner.program.memo import PerObject
from planner.program.ops import Op, is_key, itemsize
from planner.program.schedule import (
    Schedule,
    Spec,
    local_shape,
    make_schedule,
    stage_factors,
    tile,
)
from redist.calibration import Calibration, wire_bytes
from redist.collectives import CollectiveKind
from redist.cost import step_costs
from redist.hlo import ragged_bytes


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Collectives of one ``kind`` (a :class:`redist.collectives.CollectiveKind`, or ``"copy"``
    for a redistribution's local slices, which send nothing) in one step: how many run, the
    bytes each device sends and their seconds.

    Example:
        >>> Traffic("all-gather", 1, 4096.0, 1e-5).times(3)
        Traffic(kind='all-gather', count=3, bytes=12288.0, seconds=3e-05)
    """

    kind: str
    count: float
    bytes: float
    seconds: float

    def times(self, runs: float, share: float | None = None) -> Traffic:
        """Run ``runs`` times, moving ``share`` (default ``runs``) times the bytes and time."""
        share = runs if share is None else share
        return Traffic(self.kind, self.count * runs, self.bytes * share, self.seconds * share)

    def plus(self, other: Traffic) -> Traffic:
        """Both together (of one kind)."""
        return Traffic(self.kind, self.count + other.count, self.bytes + other.bytes,
                       self.seconds + other.seconds)  # fmt: skip


def totals(traffic) -> tuple[float, float]:
    """``(seconds, bytes sent per device)`` of ``traffic`` (:class:`Traffic` values) together.

    Example:
        >>> totals([Traffic("all-gather", 1, 8.0, 1e-6), Traffic("all-reduce", 1, 4.0, 2e-6)])
        (3e-06, 12.0)
    """
    return sum(t.seconds for t in traffic), sum(t.bytes for t in traffic)


@dataclasses.dataclass(frozen=True)
class OpCost:
    op: str
    compute_s: float
    comm_s: float
    comm_bytes: float  # wire bytes per device
    memory_bytes: int  # live bytes per device while the op runs
    flops: float = 0.0  # per device, as the compiler counts them (planner.cost.costs)
    bytes_accessed: float = 0.0  # per device: kernel reads and writes, collectives' in and out
    traffic: tuple[Traffic, ...] = ()  # its collectives, by kind (comm_s is their seconds)
    whole: str | None = None  # why it runs whole on every device (whole_reason); None: split


@dataclasses.dataclass(frozen=True)
class Prediction:
    time_s: float
    comm_bytes: float
    peak_bytes: int
    ops: tuple[OpCost, ...]
    flops: float = 0.0  # per device, all ops and their trips (compiled.cost_analysis()'s count)
    bytes_accessed: float = 0.0  # per device, likewise ("bytes accessed")
    transcendentals: float = 0.0  # per device, likewise
    input_bytes: tuple[int, ...] = ()  # per device, each program input in the layout it is given

    def __str__(self) -> str:
        return (
            f"predicted {self.time_s * 1e3:.3f} ms, {self.comm_bytes / 2**20:.3f} MiB sent per "
            f"device, peak {self.peak_bytes / 2**20:.3f} MiB per device"
        )

    def traffic(self) -> dict[str, Traffic]:
        """The step's collectives summed by kind (``"copy"``: local slices), in the order they
        first run: what the prediction's communication time is made of.

        Example:
            >>> simulate(prog, sched, cal).traffic()["all-gather"].bytes   # doctest: +SKIP
            1048576.0
        """
        out: dict[str, Traffic] = {}
        for c in self.ops:
            for t in c.traffic:
                out[t.kind] = out[t.kind].plus(t) if t.kind in out else t
        return out


def _bytes(shape, spec: Spec, sizes: dict[str, int], dtype: str) -> int:
    return math.prod(local_shape(shape, spec, sizes)) * itemsize(dtype)


ROLLED: PerObject[frozenset[str]] = PerObject("ops of rolled loop bodies")
PRICES: PerObject[dict] = PerObject("per-op prices, by calibration and mesh (see _memo)")


def rolled_ops(prog: Program) -> frozenset[str]:
    """The ops of loop bodies the compiler keeps as loops: a ``while``'s, and a scan's whose
    ``unroll`` is below its length (held in :data:`ROLLED`). Their kernels are priced at the
    calibration's ``loop_body_factor`` (no fusion across iterations, slicing of stacked operands).

    Example:
        >>> "dot_general_12" in rolled_ops(prog)   # a scanned layer's product   # doctest: +SKIP
        True
    """
    return ROLLED.get(prog, lambda: _rolled(prog))


def _rolled(prog: Program) -> frozenset[str]:
    unrolled = {r.start for r in inlined_scans(prog)}
    names = set()
    for r in prog.regions:
        if r.kind not in ("scan", "while") or r.start in unrolled:
            continue
        names.update(o.name for o in prog.ops[r.body : r.stop] if o.how != "region")
    return frozenset(names)


def _memo(prog: Program, cal: Calibration, sizes: dict[str, int]) -> dict:
    """Per-op prices already computed for this program, calibration and mesh: a search prices
    thousands of schedules that differ in a few ops, so each op's price under the same layouts
    is computed once (once for all the layers that repeat it, keyed by :attr:`Op.signature`)."""
    caches = PRICES.get(prog, dict)
    key = (id(cal), tuple(sorted(sizes.items())))
    if key not in caches:  # the calibration is held so that its id stays its own
        caches[key] = (cal, {})
    return caches[key][1]


def whole_reason(op: Op, factor_sizes: dict[str, int]) -> str:
    """Why ``op`` runs whole on every device under a schedule that splits none of its loops,
    on a mesh of ``factor_sizes`` (prime factor -> size), as ``explain()`` says it.

    Example:
        >>> whole_reason(iota_op, {"a": 2})          # doctest: +SKIP
        'its dimensions must stay whole'
    """
    if op.how == "replicated":
        return "no rule understands it"
    if any(is_key(a.value.dtype) for a in op.operands + op.results):
        return "random bits, drawn whole"
    if all(lp.extent == 1 for lp in op.loops):
        return "scalars"
    cut = [lp for lp in op.loops if lp.partitionable]
    if not cut:
        return "its dimensions must stay whole"
    sizes = set(factor_sizes.values())
    if not any(lp.extent % s == 0 for lp in cut for s in sizes):
        return "its sizes do not divide the mesh"
    return "not worth splitting (it would cost more than it saves)"


def _whole(op: Op, factor_sizes: dict[str, int], memo: dict) -> str:
    """:func:`whole_reason`, memoized in ``memo`` (:func:`_memo`'s) by the op's signature."""
    key = ("whole", op.signature_id)
    if key not in memo:
        memo[key] = whole_reason(op, factor_sizes)
    return memo[key]


def _plan_traffic(plan, cal: Calibration) -> list[Traffic]:
    """The collectives of a ``redist`` plan's steps, one :class:`Traffic` each."""
    return [Traffic(kind, 1, sent, seconds) for kind, seconds, sent in step_costs(plan, cal)]


BODY_COLLECTIVES = {
    **dict.fromkeys(("psum", "psum2", "psum_invariant", "pmax", "pmin"), CollectiveKind.ALL_REDUCE),
    **dict.fromkeys(("all_gather", "all_gather_invariant"), CollectiveKind.ALL_GATHER),
    **dict.fromkeys(("reduce_scatter", "psum_scatter"), CollectiveKind.REDUCE_SCATTER),
    **dict.fromkeys(("all_to_all", "ragged_all_to_all"), CollectiveKind.ALL_TO_ALL),
    "ppermute": CollectiveKind.PERMUTE,
}
"""The collectives a ``shard_map``'s body may call, by primitive name, as the calibration
prices them."""


def body_traffic(op: Op, sizes, m, cal: Calibration) -> list[Traffic]:
    """The collectives the body of the user's ``shard_map`` ``op`` calls, one :class:`Traffic`
    each (times its trips), over the mesh factors its axes are (``sizes``: factor -> size); a
    ragged all-to-all at the smaller of its input and output buffers, as the compiled step is
    priced (:func:`redist.hlo.ragged_bytes`)."""
    out = []
    for b in op.body:
        kind = BODY_COLLECTIVES.get(b.primitive)
        factors = tuple(f for a in collective_axes(b) for f in axis_factors(op, a))
        n = math.prod(sizes[f] for f in factors)
        if kind is None or n <= 1:
            continue
        named = b.results if kind == CollectiveKind.ALL_GATHER else b.operands
        each = tuple(math.prod(a.value.shape) * itemsize(a.value.dtype) for a in named)
        nbytes = ragged_bytes(each, 0) if b.primitive == "ragged_all_to_all" else sum(each)
        seconds = cal.collective_time(kind, nbytes, n, cal.crosses(m, factors))
        out.append(Traffic(kind, 1, wire_bytes(kind, nbytes, n), seconds).times(b.trips))
    return out


def _move(mv: Move, m, cal: Calibration, memo: dict) -> tuple[list[Traffic], int, int]:
    """A move's ``redist`` plan as (its collectives, its peak bytes, the bytes its steps read and
    write), memoized in ``memo`` (:func:`_memo`'s) by the value's shape and dtype and the layouts:
    the ops of every layer move alike."""
    key = ("move", mv.value.shape, mv.value.dtype, mv.src, mv.dst)
    if key not in memo:
        plan = redist.plan(mv.value.shape, mv.src, mv.dst, m, dtype=mv.value.dtype)
        steps = sum(s.before.local_size + s.after.local_size for s in plan.steps)
        memo[key] = (_plan_traffic(plan, cal), plan.peak_bytes, steps * plan.itemsize)
    return memo[key]


def _price(op, st, sched: Schedule, sizes, m, cal: Calibration, memo: dict):
    """One op's (compute s, communication s, wire bytes, transient bytes, bytes of each moved
    operand in its new layout, bytes of each result, bytes its kernel holds while it runs,
    (flops, transcendentals, bytes accessed), its collectives), per trip."""
    transient = 0
    moved = []
    traffic: list[Traffic] = []
    accessed = 0.0  # bytes the collectives read and write
    if op.manual:  # the collectives the user's shard_map calls
        traffic += body_traffic(op, sizes, m, cal)
    for mv in st.moves:
        collectives, peak, steps = _move(mv, m, cal, memo)
        traffic += collectives
        transient = max(transient, peak)
        moved.append(_bytes(mv.value.shape, mv.dst, sizes, mv.value.dtype))
        accessed += steps
    outs = [
        _bytes(r.value.shape, sp, sizes, r.value.dtype) for r, sp in zip(op.results, st.out_specs)
    ]
    ins = [_bytes(a.value.shape, sp, sizes, a.value.dtype)
           for a, sp in zip(op.operands, st.in_specs)]  # fmt: skip
    parts = {lp.name: math.prod(sizes[a] for a in sched.axes_of(op, lp.name)) for lp in op.loops}
    local = {lp.name: tile(lp.extent, parts[lp.name]) for lp in op.loops}
    padded = {lp.name for lp in op.loops if lp.extent % parts[lp.name]}
    fused = fusion(sched.program, cal.backend)
    # once per op (the compiler also counts a cheap op it copies into several kernels each time:
    # a few percent more on elementwise-heavy programs); none for an op no kernel needs
    ran = 1 if fused.runs[op.name] else 0
    flops, transcendentals = (ran * x for x in op_flops(op, local))
    flops += ran * padding_mask_flops(op, local, padded)
    launched = ran and op.how != "region" and any(fused.writes[op.name])  # a kernel of its own
    was_moved = {mv.value.name for mv in st.moves}
    read, written = op_bytes(op, fused, ins, outs, [a.value.name in was_moved for a in op.operands])
    rate = cal.dense_rate(*dense_kind(op), flops) if op.primitive in DENSE else None
    compute = 0.0 if op.how == "region" else cal.compute_time(flops, read, written, rate)
    compute += cal.kernel_s if launched else 0.0
    accessed += read + written
    if st.pending:
        n = math.prod(sizes[a] for a in st.pending)
        crosses = cal.crosses(m, st.pending)
        for k_res, size in enumerate(outs):
            elems = size / itemsize(op.results[k_res].value.dtype)
            if st.scatter[k_res] is None:
                kind, nbytes = CollectiveKind.ALL_REDUCE, size
                accessed, flops = accessed + 2 * size, flops + elems
            else:
                kind, nbytes = CollectiveKind.REDUCE_SCATTER, size * n
                accessed, flops = accessed + size * n + size, flops + elems * n
            traffic.append(Traffic(kind, 1, wire_bytes(kind, nbytes, n),
                                   cal.collective_time(kind, nbytes, n, crosses)))  # fmt: skip
    extended = 0  # a convolution's input tile with its halo, made before the kernel runs
    for w in op.windows:
        axes = sched.axes_of(op, w.owner)
        borders = halo_bytes(w, math.prod(sizes[a] for a in axes), ins[w.input])
        for border in borders:
            if border:
                seconds = cal.collective_time(CollectiveKind.PERMUTE, border, 2,
                                              cal.crosses(m, axes))  # fmt: skip
                traffic.append(Traffic(CollectiveKind.PERMUTE, 1, float(border), seconds))
                accessed += 2 * border
        extended = max(extended, ins[w.input] + sum(borders) if any(borders) else 0)
    # What the kernel holds while it runs: operands it copies into another order, and a partial
    # result beside its sum (an all-reduce writes a new buffer; a reduce-scatter reads the partial
    # result at its whole size, and where the compiler all-reduces it then slices, writes one).
    copies = extended + sum(
        _bytes(a.value.shape, sp, sizes, a.value.dtype)
        for a, sp in zip(op.operands, st.in_specs)
        if a in kernel_copies(op, cal.backend)
    )
    partial = 0
    if st.pending:
        n = math.prod(sizes[a] for a in st.pending)
        whole = 2 if cal.backend in ALL_REDUCE_THEN_SLICE else 1
        partial = sum(size if st.scatter[k_res] is None else whole * size * n
                      for k_res, size in enumerate(outs))  # fmt: skip
    counts = (flops, transcendentals, accessed)
    comm_t, wire = totals(traffic)
    return (compute, comm_t, wire, transient, tuple(moved), tuple(outs), (copies, partial), counts,
            tuple(traffic))  # fmt: skip


def step_key(st: OpStep, sched: Schedule) -> tuple:
    """What the price of step ``st`` depends on besides its op's kernels (:meth:`Fusion.key`):
    its op's signature and its layouts, equal for the like op of another window of a program
    laid out alike (another layer's), whatever the names."""
    op = st.op
    loops = sched.assign.get(op.name)
    split = tuple([loops.get(lp.name, ()) for lp in op.loops]) if loops else ((),) * len(op.loops)
    moves = tuple([(mv.value.shape, mv.value.dtype, mv.src, mv.dst) for mv in st.moves])
    return (op.signature_id, moves, split, st.in_specs, st.out_specs, st.pending, st.scatter)


def _priced(st, sched: Schedule, sizes, m, cal: Calibration, memo: dict, fused: Fusion) -> tuple:
    """:func:`_price` of one step, memoized by everything it depends on (``fused``: the
    program's kernels under ``cal``'s backend)."""
    key = (step_key(st, sched), fused.key(st.op))
    priced = memo.get(key)
    if priced is None:
        priced = memo[key] = _price(st.op, st, sched, sizes, m, cal, memo)
    return priced


def op_steps(prog: Program, sched: Schedule, names=None) -> tuple[tuple[int, tuple], ...]:
    """The ops ``names`` (default: all) of ``prog`` under ``sched`` as ``(index in prog,
    step_key)``, in program order: what :func:`op_seconds` prices them by, the same for a
    program of the same structure under the same layouts (the chain DP's window of another
    layer)."""
    index = prog.index
    return tuple((index[st.op.name], step_key(st, sched))
                 for st in dataflow(prog, sched, only=names))  # fmt: skip


def _memoized(prog: Program, sched: Schedule, cal: Calibration, steps):
    """Each op at ``steps`` (:func:`op_steps`) with its price: memoized, else priced from its
    step (the data flow walked for that op alone)."""
    memo = _memo(prog, cal, sched.mesh)
    fused = fusion(sched.program, cal.backend)
    for k, key in steps:
        op = prog.ops[k]
        priced = memo.get((key, fused.key(op)))
        if priced is None:
            (st,) = dataflow(prog, sched, only=(op.name,))
            priced = _priced(st, sched, sched.mesh, sched.factors, cal, memo, fused)
        yield op, priced


def op_seconds(prog: Program, sched: Schedule, names, calibration: Calibration | None = None,
               steps: tuple[tuple[int, tuple], ...] | None = None) -> dict[str, float]:  # fmt: skip
    """Predicted seconds of the ops ``names`` alone (kernel and communication, times their trips),
    without walking the rest of the program: the chain DP prices the ops at a border this way.
    ``steps``: :func:`op_steps` of ``names``, made for ``prog`` or a program of the same structure
    under the same layouts; the data flow is walked only for an op whose price is not memoized."""
    cal = calibration or Calibration.default()
    rolled = rolled_ops(prog)
    steps = op_steps(prog, sched, names) if steps is None else steps
    out = {}
    for op, (compute, comm_t, *_) in _memoized(prog, sched, cal, steps):
        slower = cal.loop_body_factor if op.name in rolled else 1.0
        out[op.name] = (compute * slower + comm_t) * op.trips
    return out


def _trips(op: Op, priced: tuple, cal: Calibration, rolled: frozenset[str]) -> tuple[float, float]:
    """An op's kernel and communication seconds over its trips (the kernels of loops the
    compiler keeps rolled at the calibration's ``loop_body_factor``)."""
    compute, comm_t = priced[0], priced[1]
    if op.name in rolled:
        compute *= cal.loop_body_factor
    return compute * op.trips, comm_t * op.trips


Priced = tuple[tuple[tuple[int, tuple], ...], tuple[float, ...]]


def window_steps(prog: Program, sched: Schedule, calibration: Calibration | None = None) -> Priced:
    """What :func:`seconds` prices ``prog`` under ``sched`` by: every op's :func:`op_steps`, and
    the seconds of returning each output evenly, the same for a program of the same structure
    under the same layouts; its ops' prices are memoized."""
    cal = calibration or Calibration.default()
    steps = dataflow(prog, sched)
    memo = _memo(prog, cal, sched.mesh)
    fused = fusion(sched.program, cal.backend)
    for st in steps:
        _priced(st, sched, sched.mesh, sched.factors, cal, memo, fused)
    made = made_specs(prog, sched, steps)
    evenly = returned_evenly(prog, sched, made, output_specs(prog, sched, steps, made), cal)
    return (tuple((k, step_key(st, sched)) for k, st in enumerate(steps)),
            tuple(c.compute_s + c.comm_s for c in evenly))  # fmt: skip


def seconds(prog: Program, sched: Schedule, calibration: Calibration | None = None,
            steps: Priced | None = None) -> tuple[float, tuple[float, ...]]:  # fmt: skip
    """:func:`simulate`'s predicted time and the seconds of each of its costs (each op's kernel
    and communication, the even returns, the program's call), without its memory: what the
    chain DP needs of a window. ``steps``: :func:`window_steps`, made for ``prog`` or a program
    of the same structure under the same layouts."""
    cal = calibration or Calibration.default()
    if sched.stages:  # pipelines are priced as the whole simulation prices them
        pred = _simulate(prog, sched, cal)
        return pred.time_s, tuple(c.compute_s + c.comm_s for c in pred.ops)
    ops, evenly = window_steps(prog, sched, cal) if steps is None else steps
    rolled = rolled_ops(prog)
    out = []
    for op, priced in _memoized(prog, sched, cal, ops):
        kernel, comm = _trips(op, priced, cal, rolled)
        out.append(kernel + comm)
    out += evenly
    if cal.step_s:
        out.append(cal.step_s + 0.0)
    return sum(out), tuple(out)


def simulate(prog: Program, sched: Schedule, calibration: Calibration | None = None) -> Prediction:
    """Predicted time, wire bytes and peak memory per device of ``prog`` under ``sched``."""
    return _simulate(prog, sched, calibration or Calibration.default())


REPLICATED: PerObject[dict] = PerObject("full replication's prediction, by calibration and mesh")


def replicated(prog: Program, sizes: dict[str, int], calibration: Calibration) -> Prediction:
    """The prediction of ``prog`` run whole on every device of a mesh of ``sizes`` (the row every
    plan is compared with), made once per program, calibration and mesh.

    Example:
        >>> replicated(prog, {"a": 2}, Calibration.default()).time_s     # doctest: +SKIP
        0.0123
    """
    key = (id(calibration), tuple(sizes.items()))
    held = REPLICATED.get(prog, dict)
    if key not in held:  # the calibration is held so that its id stays its own
        whole = make_schedule(prog, {}, dict(sizes), default="replicate")
        held[key] = (calibration, simulate(prog, whole, calibration))
    return held[key][1]


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A buffer live on each device at the predicted peak: a program value in its own layout
    (``kind`` ``"input"``, ``"output"``, ``"constant"`` or ``"from <op>"``), an operand's copy in
    the layout ops read it in (``"moved for <op>"``, the first of them), or what the running op
    holds beyond its result (``"scratch"``: a redistribution's steps, operand copies its kernel
    makes, a partial result before its reduce-scatter). A donated input that an output reuses is listed once, as the
    input."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # per device
    kind: str

    def __str__(self) -> str:
        return (f"{self.name} {self.dtype}{list(self.shape)} ({self.kind}): "
                f"{self.bytes:,} bytes per device")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Peak:
    """The predicted peak: its bytes per device, the op running then (None: before the first op)
    and the buffers live then, largest first."""

    bytes: int
    op: str | None
    buffers: tuple[Buffer, ...]


def peak_buffers(prog: Program, sched: Schedule, calibration: Calibration | None = None,
                 at: str | None = None) -> Peak:  # fmt: skip
    """What is live on each device at ``simulate``'s predicted peak, largest first; or, given
    ``at`` (an op's name), while that op runs (its ``bytes`` then).

    Example:
        >>> peak_buffers(prog, sched, cal, at="shard_map_1037").bytes     # doctest: +SKIP
    """
    values = {v.name: v for v in prog.inputs}
    values.update((v.name, v) for v, _ in prog.consts)
    values.update((r.value.name, r.value) for o in prog.ops for r in o.results)
    kinds = {v.name: "constant" for v, _ in prog.consts}
    kinds.update((v.name, "output") for v in prog.outputs)
    kinds.update((v.name, "input") for v in prog.inputs)
    found: list = []

    def record(op, fixed, live, others, scratch):
        bufs = [Buffer(n, values[n].shape, values[n].dtype, b,
                       kinds.get(n) or f"from {prog.producer[n].name}")
                for n, b in [*fixed.items(), *live.items()] if b]  # fmt: skip
        bufs += [Buffer(name, shape, dtype, b, kind)
                 for name, shape, dtype, kind, b in others if b]  # fmt: skip
        if scratch:
            bufs.append(Buffer(f"scratch of {op}", (), "uint8", scratch, "scratch"))
        found[:] = [op, sorted(bufs, key=lambda b: -b.bytes)]

    pred = _simulate(prog, sched, calibration or Calibration.default(), record, at)
    if at is not None and found[0] != at:
        raise ValueError(f"no op named {at!r} in the program")
    if at is not None:
        return Peak(next(c.memory_bytes for c in pred.ops if c.op == at), at, tuple(found[1]))
    return Peak(pred.peak_bytes, found[0], tuple(found[1]))


def _fixed(prog: Program, sched: Schedule, steps, priced, sizes, lt,
           returned: tuple[Spec, ...]) -> tuple[dict, dict]:  # fmt: skip
    """Bytes per device of what the compiled program takes from its caller: the inputs it reads
    and its constants (held throughout), and its outputs (held from where they are made; zero
    for those written into a donated input of the same shape, dtype and layout, as
    ``jax.jit(donate_argnums=...)`` aliases them)."""
    held: dict[str, int] = {}
    specs: dict[str, Spec] = {}
    for v in prog.inputs:
        if v.name in lt.fixed:
            specs[v.name] = input_spec(prog, sched, v)
            held[v.name] = _bytes(v.shape, specs[v.name], sizes, v.dtype)
    for v, _ in prog.consts:
        held[v.name] = _bytes(v.shape, ((),) * len(v.shape), sizes, v.dtype)
    free = [v for v in prog.inputs if v.name in prog.donated and v.name in held]
    returned = dict(zip((v.name for v in prog.outputs), returned))
    outputs: dict[str, int] = {}
    for v in prog.outputs:
        if v.name in held or v.name in outputs:  # an input returned as it is, or a constant
            continue
        op = prog.producer[v.name]
        k = prog.index[op.name]
        r = next(i for i, res in enumerate(op.results) if res.value.name == v.name)
        spec = returned[v.name]
        donor = next((d for d in free if (d.shape, d.dtype, specs[d.name]) ==
                      (v.shape, v.dtype, spec)), None)  # fmt: skip
        if donor is not None:
            free.remove(donor)
        size = (priced[k][5][r] if spec == steps[k].out_specs[r]
                else _bytes(v.shape, spec, sizes, v.dtype))  # fmt: skip
        outputs[v.name] = 0 if donor is not None else size
    return held, outputs


def returned_evenly(prog: Program, sched: Schedule, made, returned, cal: Calibration) -> list:
    """The moves of outputs ``made`` in uneven layouts to the even ones they are ``returned`` in
    (:func:`planner.layout.dataflow.made_specs`, :func:`~planner.layout.dataflow.output_specs`),
    one :class:`OpCost` each."""
    m = sched.factors
    out = []
    for v, src, dst in zip(prog.outputs, made, returned):
        if src != dst:
            traffic = _plan_traffic(redist.plan(v.shape, src, dst, m, dtype=v.dtype), cal)
            out.append(OpCost(f"{v.name} returned evenly", 0.0, *totals(traffic), 0,
                              traffic=tuple(traffic)))  # fmt: skip
    return out


BODY_SUMS: PerObject[collections.Counter] = PerObject("a shard_map body's psum results")


def summed_bytes(op: Op, result_bytes) -> int:
    """The bytes per device of the manual ``op``'s results (``result_bytes``, per result) that
    a ``psum`` of its body makes, matched by per-device size and dtype.

    Example:
        >>> summed_bytes(moe_backward, [7516192768, 7516192768, 7516192768])  # doctest: +SKIP
        22548578304
    """
    if op.how != "manual":
        return 0
    sums = collections.Counter(BODY_SUMS.get(op, lambda: collections.Counter(
        (math.prod(r.value.shape) * itemsize(r.value.dtype), r.value.dtype)
        for b in op.body if BODY_COLLECTIVES.get(b.primitive) == CollectiveKind.ALL_REDUCE
        for r in b.results
    )))  # fmt: skip
    total = 0
    for r, size in zip(op.results, result_bytes):
        if sums[size, r.value.dtype] > 0:
            sums[size, r.value.dtype] -= 1
            total += size
    return total


def summed_in_place(steps, priced, ending: list[int]) -> list[int]:
    """Per op, the bytes its results and what dies where it runs are not held at once
    (``ending``: per op, the bytes of buffers and moved copies released after it): a
    ``shard_map`` whose body sums a result over devices sums it after reading what it was
    computed from, in that memory. MaxText's mixture of experts sums each expert weight's
    gradient whole (``psum``) after the backward products read the weight gathered whole:
    the compiler holds one or the other, not both (DeepSeek-V3 on 512 v5p chips, three
    7.5 GB gradients beside three gathered weights, predicted 123.5 GB against MaxText's
    101.7 GB compiled; Qwen3-235B on 256, 37.4 GB against 32.2 GB)."""
    return [min(summed_bytes(st.op, priced[k][5]), ending[k]) for k, st in enumerate(steps)]


def _chains(prog: Program, lt, priced, outputs: dict[str, int]) -> list[tuple[int, int, int, str]]:
    """The temporaries and outputs as ``(first, last, bytes, name of the first value)``, first and
    last the times their ops run at (:attr:`planner.cost.buffers.Lifetimes.order`): a result
    written in place into a buffer of its size that dies where it is made continues that
    buffer's allocation; an output's lasts to the end (one written into a donated input adds
    nothing: the input holds it). A buffer that every layer of an unrolled scan keeps adds the
    other layers' copies (:attr:`planner.cost.buffers.Lifetimes.repeated`)."""

    def name(key: tuple[int, int]) -> str:
        return prog.ops[key[0]].results[key[1]].value.name

    time = lt.times

    def size_of(key: tuple[int, int]) -> int:
        size = priced[key[0]][5][key[1]]
        if name(key) in lt.host:
            return 0
        return size // 2 if key in lt.narrowed else size

    after: dict[tuple, tuple] = {}  # a buffer -> the result written into it where it dies
    for k, results in enumerate(lt.reuse):
        for r, candidates in results:
            size = priced[k][5][r]
            for key in candidates:
                if key not in after and size_of(key) == size:
                    after[key] = (k, r)
                    break
    spans = {key: [begin, begin] for begin, keys in enumerate(lt.alloc) for key in keys}
    for end, keys in enumerate(lt.free):
        for key in keys:
            spans[key][1] = end
    continuing = set(after.values())
    last_op = len(prog.ops) - 1
    out = []
    for key, (begin, end) in spans.items():
        if key in continuing:
            continue  # written into the buffer of an earlier value
        last, layers = key, list(lt.repeated.get(key, ()))
        while last in after:
            last = after[last]
            layers += lt.repeated.get(last, ())
        if last in spans:
            end = spans[last][1]
        else:  # an output: to the end, unless a donated input holds it
            end = last_op if outputs.get(name(last)) else time[last[0]]
        out.append((begin, end, size_of(key), name(key)))
        out += [(b, e, size_of(key) * n, name(key)) for b, e, n in layers]
    ended = {name(key) for key in continuing if key not in spans}
    out += [
        (lt.made[n], last_op, size, n) for n, size in outputs.items() if size and n not in ended
    ]
    return out


def _combined(prog: Program, lt, steps, priced, sizes, whole: int) -> tuple[set[int], list]:
    """The sums the compiler combines into one collective, and what they hold: those whose
    results nothing reads before the last partial sum of the program is made (a step's gradients,
    summed together before the update). Returns the ops whose partial results wait for the
    combined collective (their own kernels hold nothing more) and ``(first, last, bytes)``
    spans (times: :attr:`planner.cost.buffers.Lifetimes.order`) of what they hold: a partial
    result at its whole size from where it is made, and beside the results where the combined
    collective runs (``whole``: 2 where a reduce-scatter is an all-reduce and a slice,
    :data:`planner.cost.buffers.ALL_REDUCE_THEN_SLICE`)."""
    summed = [k for k, st in enumerate(steps) if st.pending]
    if len(summed) < 2:
        return set(), []
    time = lt.times
    final = max(summed, key=time.__getitem__)
    last = time[final]
    members, spans = set(), []
    for k in summed:
        if k == final:
            continue
        st = steps[k]
        if not all(lt.first[r.value.name] > last for r in st.op.results):
            continue
        members.add(k)
        n = math.prod(sizes[a] for a in st.pending)
        for size, scatter in zip(priced[k][5], st.scatter):
            if scatter is None:  # the partial result is counted as the result until it is summed
                spans.append((last, last, size))
            else:  # the whole partial result until then, besides the scattered result
                spans.append((lt.at[k], last, size * n - size))
                spans.append((last, last, size + (whole - 1) * size * n))
    return members, spans


def hand_overs(prog: Program, sched: Schedule, steps, cal: Calibration) -> list[tuple]:
    """Per pipeline of ``sched``: ``(ticks, seconds, bytes)`` of handing one microbatch's carry
    to the next stage each tick (a collective-permute over the stage axis, on its link)."""
    m = sched.factors
    out = []
    for st in sched.stages:
        r = region_of(prog, st)
        axes = stage_factors(st.axis, sched.mesh)
        p, k = math.prod(sched.mesh[a] for a in axes), st.microbatches
        nc = scan_split(r.eqn).consts
        carry = sum(_bytes(v.shape, st_.out_specs[0], sched.mesh, v.dtype)
                    for st_ in steps[r.start + nc : r.body]
                    for v in [st_.op.results[0].value]
                    if st_.op.primitive == "scan_carry")  # fmt: skip
        seconds = cal.collective_time(CollectiveKind.PERMUTE, carry / k, p, cal.crosses(m, axes))
        out.append((st.repeats * k + p - 1, seconds, carry / k))
    return out


@dataclasses.dataclass(frozen=True)
class CircularOrder:
    """What a circular pipeline (``repeats > 1``) adds: ``seconds`` and ``sent`` bytes of putting
    its stacked inputs in circular order and its stacked outputs back (a ``ppermute`` of one
    chunk per :func:`circular_rounds` round that moves one), and the bytes it holds: the stacked
    inputs' circular copies and the first stage's carries waiting for their next round
    (``held``, through the pipeline), the stacked outputs' circular copies (``leaving``, at its
    end)."""

    start: int
    stop: int
    seconds: float
    sent: float
    held: int
    leaving: int
    collectives: int = 0  # the ppermutes it runs


def circular_orders(prog: Program, sched: Schedule, steps, cal: Calibration) -> list:
    """A :class:`CircularOrder` per circular pipeline of ``sched`` (values passed on in circular
    order, :func:`circular_passes`, are not reordered)."""
    m = sched.factors
    passes = circular_passes(prog, sched, steps)
    out = []
    for st in sched.stages:
        if st.repeats == 1:
            continue
        r = region_of(prog, st)
        axes = stage_factors(st.axis, sched.mesh)
        p = math.prod(sched.mesh[a] for a in axes)
        rounds = circular_rounds(p, st.repeats)
        moving = sum(any(s != d for s, d in pairs) for _, _, pairs in rounds)  # ppermutes
        sends = max(sum(s == i != d for _, _, pairs in rounds for s, d in pairs)
                    for i in range(p))  # fmt: skip  # chunks the busiest stage sends
        nc = scan_split(r.eqn).consts
        stacked_in = [_bytes(v.shape, st_.in_specs[0], sched.mesh, v.dtype)
                      for st_ in steps[r.start : r.body] if st_.op.primitive == "scan_xs"
                      for v in [st_.op.operands[0].value] if v.name not in passes]  # fmt: skip
        stacked_out = [_bytes(v.shape, st_.out_specs[0], sched.mesh, v.dtype)
                       for st_ in steps[r.stop - len(r.outputs) : r.stop]
                       if st_.op.primitive == "scan_ys"
                       for v in [st_.op.results[0].value] if v.name not in passes]  # fmt: skip
        carry = sum(_bytes(v.shape, st_.out_specs[0], sched.mesh, v.dtype)
                    for st_ in steps[r.start + nc : r.body]
                    for v in [st_.op.results[0].value]
                    if st_.op.primitive == "scan_carry")  # fmt: skip
        seconds = sent = 0.0
        for size in (*stacked_in, *stacked_out):
            one = size / st.repeats
            seconds += moving * cal.collective_time(CollectiveKind.PERMUTE, one, p,
                                                    cal.crosses(m, axes))  # fmt: skip
            sent += sends * one
        out.append(CircularOrder(r.start, r.stop - 1, seconds, sent, sum(stacked_in) + carry,
                                 sum(stacked_out), moving * len((*stacked_in, *stacked_out))))  # fmt: skip
    return out


def _pipelined(prog: Program, sched: Schedule, costs: list, steps, cal: Calibration,
               runs: dict, micro: dict) -> list:  # fmt: skip
    """``costs`` with the ops of pipelined scans (:class:`planner.program.schedule.Stages`) priced
    as GPipe runs them (:class:`planner.layout.staging.Runs`): work and the communication of
    batch-carrying values at ``(K + P - 1) / (K P)`` of the whole loop's (the bubble being
    ``(P - 1) / (K + P - 1)`` of it), communication of whole values (a layer's weights gathered,
    its gradient's partial sums) once per tick, ``(K + P - 1) / P`` times the loop's, but a weight
    gradient's partial sums combined once after the ticks (:func:`deferred_sums`) ``1 / P`` times
    the loop's; plus the stage :func:`hand_overs` and a circular pipeline's reordering of its
    stacked values (:func:`circular_orders`; its ``R K + P - 1`` ticks each run ``1 / R`` of a
    stage's layers: :class:`planner.layout.staging.Runs`)."""
    if not sched.stages:
        return costs
    costs = list(costs)
    once = {op for op, _ in deferred_sums(prog, sched, steps).values()}
    for i, st in enumerate(steps):
        run = runs.get(st.op.name)
        if run is None:
            continue
        sent = [mv.value.name for mv in st.moves]
        sent += [r.value.name for r in st.op.results] if st.pending else []
        comm = run.share if all(n in micro for n in sent) else run.calls
        if st.op.name in once:  # its stage's layers' sums, combined once after the ticks
            comm = 1 / run.stages
        c = costs[i]
        runs_of = 1 if st.op.name in once else run.calls  # how often its collectives run
        costs[i] = dataclasses.replace(c, compute_s=c.compute_s * run.share,
                                       comm_s=c.comm_s * comm, comm_bytes=c.comm_bytes * comm,
                                       flops=c.flops * run.share,
                                       bytes_accessed=c.bytes_accessed * run.share,
                                       traffic=tuple(t.times(runs_of, comm) for t in c.traffic))  # fmt: skip
    for st, (ticks, seconds, sent) in zip(sched.stages, hand_overs(prog, sched, steps, cal)):
        hand = Traffic(CollectiveKind.PERMUTE, 1, sent, seconds).times(ticks)
        costs.append(OpCost(f"pipeline hand-overs of {st.axis}", 0.0, hand.seconds, hand.bytes,
                            0, traffic=(hand,)))  # fmt: skip
    for c in circular_orders(prog, sched, steps, cal):
        order = Traffic(CollectiveKind.PERMUTE, c.collectives, c.sent, c.seconds)
        costs.append(OpCost(f"circular order of the pipeline at op {c.start}", 0.0, c.seconds,
                            c.sent, 0, traffic=(order,)))  # fmt: skip
    return costs


def _simulate(prog: Program, sched: Schedule, cal: Calibration, on_peak=None,
              at: str | None = None) -> Prediction:  # fmt: skip
    """:func:`simulate`; ``on_peak(op name, fixed, live values, others, scratch)`` is called
    whenever the peak grows (first with what is held throughout, op None), or given ``at`` only
    where that op runs; ``others`` are moved copies and waiting partial sums as ``(name, shape,
    dtype, kind, bytes)``."""
    sizes = sched.mesh
    m = sched.factors
    steps = dataflow(prog, sched)
    lt = lifetimes(prog, cal.backend)
    memo = _memo(prog, cal, sizes)
    fused = fusion(sched.program, cal.backend)
    priced = [_priced(st, sched, sizes, m, cal, memo, fused) for st in steps]
    made = made_specs(prog, sched, steps)
    returned = output_specs(prog, sched, steps, made)
    fixed, outputs = _fixed(prog, sched, steps, priced, sizes, lt, returned)
    base = sum(fixed.values())
    n = len(steps)
    grow, release = [0] * n, [0] * n
    runs, micro = pipeline_runs(prog, sched)
    chains = [
        (b, e, size // micro.get(n, 1), n) for b, e, size, n in _chains(prog, lt, priced, outputs)
    ]
    # grow, release and dying count times: op lt.running(t) runs at time t (time[k]: op k's)
    time = lt.times
    dying = [0] * n  # per time, the bytes of what its op did not make released after it
    for begin, end, size, name in chains:
        grow[begin] += size
        release[end] += size
        dying[end] += 0 if prog.producer.get(name) is steps[lt.running(end)].op else size
    # A value moved to a layout is held from its first move there to the last op reading that
    # copy (the compiler makes one collective for equal moves): while the op runs, or where its
    # readers run if it is fused or a view, or for a whole loop if it enters one.
    copies: dict[tuple, list] = {}  # (value, layout) -> [first op, last op, bytes, move, reader]
    for k, st in enumerate(steps):
        for mv, size in zip(st.moves, priced[k][4]):
            held = copies.get((mv.value.name, mv.dst))
            begin = lt.at[k]  # (a product the compiler defers: where it runs)
            if held is None:
                size //= micro.get(mv.value.name, 1)
                copies[(mv.value.name, mv.dst)] = [begin, lt.hold[k], size, mv, st.op.name]
            else:
                held[0], held[1] = min(held[0], begin), max(held[1], lt.hold[k])
    for begin, end, size, _, _ in copies.values():
        grow[begin] += size
        release[end] += size
        dying[end] += size
    whole = 2 if cal.backend in ALL_REDUCE_THEN_SLICE else 1
    members, waiting = _combined(prog, lt, steps, priced, sizes, whole)
    for begin, end, size in waiting:
        grow[begin] += size
        release[end] += size
    circular = circular_orders(prog, sched, steps, cal)
    for c in circular:
        grow[time[c.start]] += c.held
        release[time[c.stop]] += c.held
        grow[time[c.stop]] += c.leaving
        release[time[c.stop]] += c.leaving
    in_place = summed_in_place(steps, priced, [dying[time[k]] for k in range(n)])
    live = 0
    peak = base
    transcendentals = 0.0
    if on_peak is not None:
        on_peak(None, fixed, {}, (), 0)
        starts: dict[int, list] = {}
        for begin, end, size, name in chains:
            starts.setdefault(begin, []).append((name, size, end))
        for begin, end, size, mv, reader in copies.values():
            v = mv.value
            other = (v.name, v.shape, v.dtype, f"moved for {reader}")
            starts.setdefault(begin, []).append((other, size, end))
        for begin, end, size in waiting:
            other = (f"partial sums for the collective at {steps[lt.running(end)].op.name}",
                     (), "uint8", "scratch")  # fmt: skip
            starts.setdefault(begin, []).append((other, size, end))
        names: dict = {}  # (live buffer (value name, or other), last op) -> bytes
    rolled = rolled_ops(prog)
    costs = [None] * n
    for t in range(n):
        k = lt.running(t)
        st = steps[k]
        _, _, wire, transient, moved, outs, kernel, counts, traffic = priced[k]
        live += grow[t]
        copies_k, partial = kernel
        scratch = max(0, transient - max(moved, default=0)) + copies_k
        scratch += 0 if k in members else partial
        scratch //= (
            max((micro.get(r.value.name, 1) for r in st.op.results), default=1) if micro else 1
        )
        now = base + live + scratch - in_place[k]
        if on_peak is not None:
            for key, size, end in starts.get(t, ()):
                names[key, end] = names.get((key, end), 0) + size
            if (now > peak) if at is None else st.op.name == at:
                held: dict = {}
                for (key, _), b in names.items():
                    held[key] = held.get(key, 0) + b
                values = {key: b for key, b in held.items() if isinstance(key, str)}
                others = [(*key, b) for key, b in held.items() if not isinstance(key, str)]
                if in_place[k]:  # negative: what the summed results share with the dying
                    others.append((f"summed in place at {st.op.name}", (), "uint8",
                                   "in place", -in_place[k]))  # fmt: skip
                on_peak(st.op.name, fixed, values, others, scratch)
            names = {(key, end): b for (key, end), b in names.items() if end > t}
        peak = max(peak, now)
        trips, op = st.op.trips, st.op
        kernel_s, comm_s = _trips(op, priced[k], cal, rolled)
        split = op.how == "region" or any(sched.assign.get(op.name, {}).values()) or st.pending
        costs[k] = OpCost(op.name, kernel_s, comm_s, wire * trips, now,
                          counts[0] * trips, counts[2] * trips,
                          tuple([tr.times(trips) for tr in traffic]),
                          None if split else _whole(op, sizes, memo))  # fmt: skip
        transcendentals += counts[1] * st.op.trips
        live -= release[t]
    costs = _pipelined(prog, sched, costs, steps, cal, runs, micro)
    costs += returned_evenly(prog, sched, made, returned, cal)
    if cal.step_s:
        costs.append(OpCost("program call (dispatch)", cal.step_s, 0.0, 0.0, 0))
    total = sum(c.compute_s + c.comm_s for c in costs)
    # the inputs held throughout are sized already (_fixed); an input no op reads is sized here
    given = tuple(fixed[v.name] if v.name in fixed else
                  _bytes(v.shape, input_spec(prog, sched, v), sizes, v.dtype)
                  for v in prog.inputs)  # fmt: skip
    return Prediction(total, sum(c.comm_bytes for c in costs), peak, tuple(costs),
                      sum(c.flops for c in costs), sum(c.bytes_accessed for c in costs),
                      transcendentals, given)  # fmt: skip
