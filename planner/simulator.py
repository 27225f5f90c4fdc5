"""Predict time, bytes and peak memory per device of a scheduled program (DistIR-style).

Walks the :func:`planner.dataflow.dataflow` of a schedule in program order:

- each op's kernel costs the roofline of its local flops and the bytes it reads and writes in
  memory, both as the XLA compiler counts them (:mod:`planner.costs`: ``2 M N K`` for products,
  one per element of arithmetic, none for data movement; a value fused into the kernel that
  consumes it costs no bytes); a region boundary op (a value passing into or out of a scan
  body) costs nothing but its moves;
- an op inside a scan body costs its trip count times its one run (``op.trips``);
- each layout change costs its ``redist`` plan, step by step (dynslice: a local copy; collectives:
  latency + wire bytes / bandwidth of their kind and group size);
- each pending sum (or max, min, ...) costs an all-reduce, or a reduce-scatter when the
  dataflow scatters it;
- memory: inputs and outputs stay live; other values from production to their last use; at each
  op, the live values plus its results plus the copies its operands were moved into (a moved
  copy serves this op only) plus what a redist plan holds beyond its final tile.

Example:
    >>> pred = simulate(prog, sched)           # doctest: +SKIP
    >>> pred.time_s, pred.comm_bytes, pred.peak_bytes
"""

from __future__ import annotations

import dataclasses
import math

import redist
from planner.costs import fusion, op_bytes, op_flops
from planner.dataflow import dataflow, input_spec
from planner.ir import Program, itemsize
from planner.schedule import Schedule, Spec, local_shape
from redist.calibration import Calibration, wire_bytes


@dataclasses.dataclass(frozen=True)
class OpCost:
    op: str
    compute_s: float
    comm_s: float
    comm_bytes: float  # wire bytes per device
    memory_bytes: int  # live bytes per device while the op runs
    flops: float = 0.0  # per device, as the compiler counts them (planner.costs)
    bytes_accessed: float = 0.0  # per device: kernel reads and writes, collectives' in and out


@dataclasses.dataclass(frozen=True)
class Prediction:
    time_s: float
    comm_bytes: float
    peak_bytes: int
    ops: tuple[OpCost, ...]
    flops: float = 0.0  # per device, all ops and their trips (compiled.cost_analysis()'s count)
    bytes_accessed: float = 0.0  # per device, likewise ("bytes accessed")
    transcendentals: float = 0.0  # per device, likewise

    def __str__(self) -> str:
        return (
            f"predicted {self.time_s * 1e3:.3f} ms, {self.comm_bytes / 2**20:.3f} MiB sent per "
            f"device, peak {self.peak_bytes / 2**20:.3f} MiB per device"
        )


def _bytes(shape, spec: Spec, sizes: dict[str, int], dtype: str) -> int:
    return math.prod(local_shape(shape, spec, sizes)) * itemsize(dtype)


def step_costs(plan: redist.Plan, cal: Calibration) -> list[tuple[str, float, float]]:
    """``(kind, seconds, wire bytes per device)`` of each step of a redist plan; ``kind`` is the
    calibration's collective kind, or ``"copy"`` for a local slice (no wire bytes)."""
    out = []
    n_dev = plan.mesh.num_devices
    for s in plan.steps:
        before = s.before.local_size * plan.itemsize
        after = s.after.local_size * plan.itemsize
        if s.kind == "dynslice":
            out.append(("copy", after / cal.copy_bytes_per_s, 0.0))
            continue
        kind, nbytes = {
            "allgather": ("all-gather", after),
            "alltoall": ("all-to-all", before),
            "allpermute": ("collective-permute", before * len(s.perm) / n_dev),
        }[s.kind]
        n = s.group_size if s.kind != "allpermute" else n_dev
        if s.kind == "allpermute":
            d = cal.domain_devices or n_dev
            crosses = any(a // d != b // d for a, b in s.perm)
        else:
            crosses = cal.crosses(plan.mesh, s.axes)
        out.append(
            (kind, cal.collective_time(kind, nbytes, n, crosses), wire_bytes(kind, nbytes, n))
        )
    return out


def plan_cost(plan: redist.Plan, cal: Calibration) -> tuple[float, float]:
    """Predicted seconds and wire bytes per device of a redist plan."""
    t = wire = 0.0
    for _, seconds, sent in step_costs(plan, cal):
        t, wire = t + seconds, wire + sent
    return t, wire


class _Live(dict):
    """Live values -> bytes per device, with their running total."""

    total = 0

    def __setitem__(self, name: str, size: int) -> None:
        self.total += size - self.get(name, 0)
        super().__setitem__(name, size)

    def pop(self, name: str) -> None:
        self.total -= super().pop(name, 0)


def _memo(prog: Program, cal: Calibration, sizes: dict[str, int]) -> dict:
    """Per-op prices already computed for this program, calibration and mesh: a search prices
    thousands of schedules that differ in a few ops, so each op's price under the same layouts
    is computed once (once for all the layers that repeat it, keyed by :attr:`Op.signature`)."""
    caches = prog.__dict__.setdefault("_price_memo", {})
    key = (id(cal), tuple(sorted(sizes.items())))
    if key not in caches:  # the calibration is held so that its id stays its own
        caches[key] = (cal, {})
    return caches[key][1]


def _price(op, st, sched: Schedule, sizes, m, cal: Calibration):
    """One op's (compute s, communication s, wire bytes, transient bytes, bytes of each moved
    operand in its new layout, bytes of each result, (flops, transcendentals, bytes accessed)),
    per trip."""
    comm_t = wire = 0.0
    transient = 0
    moved = []
    accessed = 0.0  # bytes the collectives read and write
    for mv in st.moves:
        plan = redist.plan(mv.value.shape, mv.src, mv.dst, m, dtype=mv.value.dtype)
        t, w = plan_cost(plan, cal)
        comm_t, wire = comm_t + t, wire + w
        transient = max(transient, plan.peak_bytes)
        moved.append(_bytes(mv.value.shape, mv.dst, sizes, mv.value.dtype))
        accessed += sum(s.before.local_size + s.after.local_size for s in plan.steps) * (
            plan.itemsize
        )
    outs = [
        _bytes(r.value.shape, sp, sizes, r.value.dtype) for r, sp in zip(op.results, st.out_specs)
    ]
    ins = [_bytes(a.value.shape, sp, sizes, a.value.dtype)
           for a, sp in zip(op.operands, st.in_specs)]  # fmt: skip
    local = {lp.name: lp.extent // math.prod(sizes[a] for a in sched.axes_of(op, lp.name))
             for lp in op.loops}  # fmt: skip
    fused = fusion(sched.program)
    # once per op (the compiler also counts a cheap op it copies into several kernels each time:
    # a few percent more on elementwise-heavy programs); none for an op no kernel needs
    ran = 1 if fused.runs[op.name] else 0
    flops, transcendentals = (ran * x for x in op_flops(op, local))
    was_moved = {mv.value.name for mv in st.moves}
    read, written = op_bytes(op, fused, ins, outs, [a.value.name in was_moved for a in op.operands])
    compute = 0.0 if op.how == "region" else cal.compute_time(flops, read, written)
    accessed += read + written
    if st.pending:
        n = math.prod(sizes[a] for a in st.pending)
        crosses = cal.crosses(m, st.pending)
        for k_res, size in enumerate(outs):
            if st.scatter[k_res] is None:
                comm_t += cal.collective_time("all-reduce", size, n, crosses)
                wire += wire_bytes("all-reduce", size, n)
                accessed += 2 * size
                flops += size / itemsize(op.results[k_res].value.dtype)
            else:
                comm_t += cal.collective_time("reduce-scatter", size * n, n, crosses)
                wire += wire_bytes("reduce-scatter", size * n, n)
                accessed += size * n + size
                flops += size * n / itemsize(op.results[k_res].value.dtype)
    counts = (flops, transcendentals, accessed)
    return compute, comm_t, wire, transient, tuple(moved), tuple(outs), counts


def _priced(st, sched: Schedule, sizes, m, cal: Calibration, memo: dict) -> tuple:
    """:func:`_price` of one step, memoized by everything it depends on."""
    op = st.op
    key = (op.signature, tuple((mv.value.shape, mv.value.dtype, mv.src, mv.dst) for mv in st.moves),
           tuple(sched.axes_of(op, lp.name) for lp in op.loops), st.in_specs, st.out_specs,
           st.pending, st.scatter, fusion(sched.program).key(op))  # fmt: skip
    priced = memo.get(key)
    if priced is None:
        priced = memo[key] = _price(op, st, sched, sizes, m, cal)
    return priced


def op_seconds(
    prog: Program, sched: Schedule, names, calibration: Calibration | None = None
) -> dict[str, float]:
    """Predicted seconds of the ops ``names`` alone (kernel and communication, times their trips),
    without walking the rest of the program: the chain DP prices the ops at a border this way."""
    cal = calibration or Calibration.default()
    sizes = sched.mesh
    m = redist.MeshShape.of(sizes)
    memo = _memo(prog, cal, sizes)
    out = {}
    for st in dataflow(prog, sched, only=names):
        compute, comm_t, *_ = _priced(st, sched, sizes, m, cal, memo)
        out[st.op.name] = (compute + comm_t) * st.op.trips
    return out


def simulate(prog: Program, sched: Schedule, calibration: Calibration | None = None) -> Prediction:
    """Predicted time, wire bytes and peak memory per device of ``prog`` under ``sched``."""
    return _simulate(prog, sched, calibration or Calibration.default())


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A buffer live on each device at the predicted peak: a program value in its own layout
    (``kind`` ``"input"``, ``"output"``, ``"constant"`` or ``"from <op>"``), an operand's copy in
    the layout the running op reads it in (``"moved for <op>"``), or what a redistribution holds
    beyond its result (``"scratch"``)."""

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


def peak_buffers(prog: Program, sched: Schedule, calibration: Calibration | None = None) -> Peak:
    """What is live on each device at ``simulate``'s predicted peak, largest first."""
    values = {v.name: v for v in prog.inputs}
    values.update((v.name, v) for v, _ in prog.consts)
    values.update((r.value.name, r.value) for o in prog.ops for r in o.results)
    kinds = {v.name: "constant" for v, _ in prog.consts}
    kinds.update((v.name, "output") for v in prog.outputs)
    kinds.update((v.name, "input") for v in prog.inputs)
    found: list = []

    def record(op, live, moves, moved, transient):
        bufs = [Buffer(n, values[n].shape, values[n].dtype, b,
                       kinds.get(n) or f"from {prog.producer[n].name}")
                for n, b in live.items()]  # fmt: skip
        bufs += [Buffer(mv.value.name, mv.value.shape, mv.value.dtype, b, f"moved for {op}")
                 for mv, b in zip(moves, moved)]  # fmt: skip
        if transient:
            bufs.append(Buffer(f"redistribution for {op}", (), "uint8", transient, "scratch"))
        found[:] = [op, sorted(bufs, key=lambda b: -b.bytes)]

    pred = _simulate(prog, sched, calibration or Calibration.default(), record)
    return Peak(pred.peak_bytes, found[0], tuple(found[1]))


def _simulate(prog: Program, sched: Schedule, cal: Calibration, on_peak=None) -> Prediction:
    """:func:`simulate`; ``on_peak(op name, live values, moves, moved bytes, scratch bytes)`` is
    called whenever the peak grows (first with the inputs and constants, op None)."""
    sizes = sched.mesh
    m = redist.MeshShape.of(sizes)
    steps = dataflow(prog, sched)
    last_use: dict[str, int] = {}
    for k, st in enumerate(steps):
        for acc in st.op.operands:
            last_use[acc.value.name] = k
    keep = {v.name for v in prog.inputs} | {v.name for v in prog.outputs}
    live = _Live()
    for v in prog.inputs:
        live[v.name] = _bytes(v.shape, input_spec(prog, sched, v), sizes, v.dtype)
    for v, _ in prog.consts:
        live[v.name] = _bytes(v.shape, ((),) * len(v.shape), sizes, v.dtype)
    costs = []
    transcendentals = 0.0
    peak = live.total
    if on_peak is not None:
        on_peak(None, live, (), (), 0)
    memo = _memo(prog, cal, sizes)
    for k, st in enumerate(steps):
        op = st.op
        compute, comm_t, wire, transient, moved, outs, counts = _priced(
            st, sched, sizes, m, cal, memo
        )
        for r, size in zip(op.results, outs):
            live[r.value.name] = size
        # A moved copy serves this op alone; the value stays live in its own layout until its
        # last use (so a weight stored split and gathered for one product is held whole only
        # while that product runs).
        scratch = max(0, transient - max(moved, default=0))
        now = live.total + sum(moved) + scratch
        if on_peak is not None and now > peak:
            on_peak(op.name, live, st.moves, moved, scratch)
        peak = max(peak, now)
        costs.append(OpCost(op.name, compute * op.trips, comm_t * op.trips, wire * op.trips, now,
                            counts[0] * op.trips, counts[2] * op.trips))  # fmt: skip
        transcendentals += counts[1] * op.trips
        for acc in op.operands:
            name = acc.value.name
            if last_use.get(name) == k and name not in keep:
                live.pop(name)
    total = sum(c.compute_s + c.comm_s for c in costs)
    return Prediction(total, sum(c.comm_bytes for c in costs), peak, tuple(costs),
                      sum(c.flops for c in costs), sum(c.bytes_accessed for c in costs),
                      transcendentals)  # fmt: skip
