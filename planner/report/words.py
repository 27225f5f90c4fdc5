"""Words for a plan, on the user's mesh axis names (never the prime factors schedules are written
on): layouts, how an op is split, sizes and times, and the notes on constraints, pipelines and
splits only XLA runs.

Example:
    >>> spec_text(((("a#0", "a#1"),), ()), MeshShape.of({"a": 4}))   # doctest: +SKIP
    "P('a', None)"
"""

from __future__ import annotations

import math
import os

from planner.cost.pipeline import bubble
from planner.cost.simulator import Prediction
from planner.layout.dataflow import output_specs
from planner.layout.staging import region_of
from planner.program.constraints import requests
from planner.program.halo import split
from planner.program.ir import Program
from planner.program.microbatch import microbatching
from planner.program.ops import Op, is_key
from planner.program.schedule import (
    Schedule,
    Spec,
    stage_factors,
    xla_splits,
)
from planner.report.leaves import state_pairs
from planner.solver.ties import MEMORY_SHARE, MEMORY_TIE, TIME_TIE, wins_on_memory
from redist.types import MeshShape

_FRACTION = {2: "half", 3: "a third", 4: "a quarter", 8: "an eighth"}


_ROLE = {  # loop name prefixes of products and convolutions -> words
    "dot_general": {"b": "batched dim", "m": "rows", "n": "columns", "k": "contraction"},
    "conv_general_dilated": {"n": "batch", "g": "groups", "o": "out features",
                             "i": "in features", "s": "spatial", "w": "window"},
}  # fmt: skip


def axis_parts(factors, mesh: MeshShape) -> list[tuple[str, tuple[str, ...]]]:
    """Factor names (major first) as ``(axis, factors)``: consecutive factors of one axis
    taken together."""
    out: list[tuple[str, tuple[str, ...]]] = []
    for f in factors:
        axis = mesh.factor_axis[f]
        if out and out[-1][0] == axis:
            out[-1] = (axis, (*out[-1][1], f))
        else:
            out.append((axis, (f,)))
    return out


def _part(axis: str, factors: tuple[str, ...], mesh: MeshShape, quote: str) -> str:
    """``'model'``, or in words the part of it that ``factors`` are: ``major half of 'model'``."""
    name = f"{quote}{axis}{quote}"
    every = mesh.axis_factors(axis)
    if factors == every:
        return name
    ways = math.prod(mesh.factor_size[f] for f in factors)
    if ways == mesh.sizes[axis]:
        return f"all of {name} in another device order"
    r = mesh.sizes[axis] // ways
    where = ("major " if factors == every[: len(factors)] else
             "minor " if factors == every[-len(factors) :] else "a middle ")  # fmt: skip
    fraction = _FRACTION.get(r, f"1/{r}")
    return f"{where}{fraction.removeprefix('a ').removeprefix('an ')} of {name}"


def spec_text(spec: Spec, mesh: MeshShape) -> str:
    """A factor-level layout as a ``PartitionSpec`` on the user's axis names; a dimension split
    by part of an axis reads ``half of 'model'`` (trailing whole dimensions dropped)."""
    entries = []
    for axes in spec:
        parts = [_part(a, fs, mesh, "'") for a, fs in axis_parts(axes, mesh)]
        entries.append("None" if not parts else parts[0] if len(parts) == 1
                       else f"({', '.join(parts)})")  # fmt: skip
    while entries and entries[-1] == "None":
        entries.pop()
    return f"P({', '.join(entries)})"


def split_words(axes, mesh: MeshShape) -> str:
    """``('data', 'model#0', 'model#1')`` -> ``"data and model"``."""
    parts = [_part(a, fs, mesh, "") for a, fs in axis_parts(axes, mesh)]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def mib_text(nbytes: float) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20 or nbytes == 0:
        return f"{nbytes / 2**20:.2f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"


def ms_text(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


_DTYPE = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16",
          "int32": "i32", "int64": "i64", "int8": "i8", "uint32": "u32", "uint8": "u8"}  # fmt: skip


def times_text(a: float, b: float) -> str:
    """``a / b`` as ``"1.25x"``; two zeros (a program that computes nothing) are ``"1.00x"``.

    Example:
        >>> times_text(3.0, 2.0), times_text(0.0, 0.0), times_text(1.0, 0.0)
        ('1.50x', '1.00x', 'infx')
    """
    if b == 0:
        return "1.00x" if a == 0 else "infx"
    return f"{a / b:.2f}x"


def shape_text(v) -> str:
    dtype = "key" if is_key(v.dtype) else _DTYPE.get(v.dtype, v.dtype)
    return f"{dtype}[{','.join(map(str, v.shape))}]"


def code_line(source) -> str:
    """``(file, line, library)`` -> ``file.py:12`` (``in optax`` when it called a library)."""
    if not source:
        return "?"
    path, line, library = source
    return f"{os.path.basename(path)}:{line}" + (f" in {library}" if library else "")


def _loop_words(op: Op, loop, batch: set[str]) -> str:
    if loop.name in batch:
        return "batch"
    roles = _ROLE.get(op.primitive)
    spatial = {"s0": "rows", "s1": "columns", "w0": "window rows", "w1": "window columns"}
    if op.windows and loop.name in spatial:
        return spatial[loop.name]
    if roles and loop.name[:1] in roles:
        return roles[loop.name[:1]]
    for acc in op.results:
        for d, dims in enumerate(acc.dims):
            if dims and dims[0] == loop.name:
                return f"dim {d}"
    if any(name == loop.name for name, _ in op.reductions):
        return "reduced dim"
    return loop.name


def operation_text(op: Op) -> str:
    if op.primitive == "dot_general" and len(op.operands) == 2:
        a, b = (acc.value for acc in op.operands)
        return f"{'x'.join(map(str, a.shape))} @ {'x'.join(map(str, b.shape))}"
    return shape_text(op.results[0].value) if op.results else ""


def how_split(op: Op, step, sched: Schedule, mesh: MeshShape, batch: set[str]) -> str:
    if op.how == "manual":  # the user's shard_map: its own layouts
        ins = ", ".join(spec_text(s, mesh) for s in step.in_specs)
        outs = ", ".join(spec_text(s, mesh) for s in step.out_specs)
        return f"the program's shard_map, as it lays itself out: in {ins}; out {outs}"
    parts = []
    halos = {w.owner: w for w in op.windows}
    for lp in op.loops:
        axes = sched.axes_of(op, lp.name)
        if axes:
            text = f"{_loop_words(op, lp, batch)} {lp.extent} over {split_words(axes, mesh)}"
            if lp.name in halos:
                text += _halo_words(halos[lp.name], math.prod(mesh.factor_size[a] for a in axes))
            parts.append(text)
    if not parts:
        return "whole on every device"
    text = ", ".join(parts)
    if step.pending:
        how = "reduce-scattered" if any(s is not None for s in step.scatter) else "all-reduced"
        text += f"; partial {step.combine}s {how}"
    return text


def _halo_words(w, parts: int) -> str:
    """`` with a halo of 1`` (elements of the input from each neighbour), or of ``L`` before and
    ``R`` after; nothing where the windows need none."""
    cut = split(w, parts)
    if cut is None or not (cut.left or cut.right):
        return ""
    if cut.left == cut.right:
        return f" with a halo of {cut.left}"
    return f" with a halo of {cut.left} before, {cut.right} after"


DEPARTURES_SHOWN = 3


def constraint_words(prog: Program, sched: Schedule, asked: Schedule | None, mesh: MeshShape,
                     pred: Prediction, asked_pred: Prediction) -> tuple[str, ...]:  # fmt: skip
    """Lines on the program's sharding constraints: how many the plan keeps, the ones it departs
    from (the layout asked and the one planned) and what departing buys against the layout the
    program asks for (``asked``, :mod:`planner.solver.requested`)."""
    reqs = requests(prog)
    if not reqs:
        return ()
    if asked is None:
        return (f"Sharding constraints: {len(reqs)} in the program, ignored (constraints='drop', "
                "or none holds on this mesh)",)  # fmt: skip
    by_name = {o.name: o for o in prog.ops}
    departed = []
    for req in reqs:
        op = by_name[req.op]
        planned = sched.spec(op, op.results[0])
        wanted = asked.spec(op, op.results[0])
        if planned != wanted:
            departed.append((op, wanted, planned))
    line = (
        f"Sharding constraints: {len(reqs)} in the program; the plan keeps "
        f"{len(reqs) - len(departed)}"
    )
    if not departed:
        line += (f" (departing must be predicted over {TIME_TIE:.0%} faster, or as fast in over "
                 f"{MEMORY_TIE:.0%} less memory)")  # fmt: skip
    else:
        line += (
            f", departs from {len(departed)}: {times_text(asked_pred.time_s, pred.time_s)} as "
            f"fast as your layout, {times_text(pred.peak_bytes, asked_pred.peak_bytes)} its "
            "memory (plan(..., constraints='keep') keeps them)"
        )
    out = [line]
    for op, wanted, planned in departed[:DEPARTURES_SHOWN]:
        out.append(f"  {code_line(op.source)} {op.name}: asked {spec_text(wanted, mesh)}, planned "
                   f"{spec_text(planned, mesh)}")  # fmt: skip
    if len(departed) > DEPARTURES_SHOWN:
        out.append(f"  and {len(departed) - DEPARTURES_SHOWN} more")
    return tuple(out)


def xla_only_words(sched: Schedule) -> tuple[str, ...]:
    """A line on the splits only XLA's partitioner runs, where the plan has any: loops split into
    parts that do not divide them (padded tiles) and looked-up dimensions (masked).

    Example:
        ``  Splits only XLA runs (plan.jit; plan.lowered refuses them): 37 loops split unevenly
        (padded tiles), e.g. dot_general_232, loop n (50257 over 8)``
    """
    splits = xla_splits(sched)
    if not splits:
        return ()
    padded = [s for s in splits if not s.endswith("(looked up, masked)")]
    parts = [f"{len(padded)} loops split unevenly (padded tiles)" if padded else "",
             f"{len(splits) - len(padded)} looked-up dimensions split (masked)"
             if len(padded) < len(splits) else ""]  # fmt: skip
    return (f"  Splits only XLA runs (plan.jit; plan.lowered refuses them): "
            f"{', '.join(p for p in parts if p)}, e.g. {splits[0]}",)  # fmt: skip


def pipeline_words(prog: Program, sched: Schedule) -> tuple[str, ...]:
    """One line per pipelined scan: which layers each stage holds, the microbatches, the bubble.

    Example:
        ``Pipeline (scan at model.py:92, backward): layers 0-1 on stage 0 of `pipe`, 2-3 on
        stage 1; 8 microbatches of 2 rows, GPipe bubble 11%``
    """

    lines = []
    for st in sched.stages:
        r = region_of(prog, st)
        p = math.prod(sched.mesh[a] for a in stage_factors(st.axis, sched.mesh))
        per = r.eqn.params["length"] // p
        ranges = [f"{s * per}-{s * per + per - 1}" if per > 1 else f"{s * per}" for s in range(p)]
        shown = [f"{ranges[s]} on stage {s}" for s in (range(p) if p <= 5 else (0, 1, p - 1))]
        if p > 5:
            shown.insert(2, "...")
        stages = f"layers {shown[0]} of `{st.axis}`, " + ", ".join(shown[1:])
        rows = microbatching(prog, r).batch // st.microbatches
        where = code_line(prog.ops[r.body].source if r.body < r.stop else None)
        way = "backward" if r.eqn.params["reverse"] else "forward"
        kind = "GPipe"
        if st.repeats > 1:  # stage s runs chunks s, s + P, ...: stage 0's shown
            c = per // st.repeats
            runs = [f"{j * p * c}-{j * p * c + c - 1}" if c > 1 else f"{j * p * c}"
                    for j in range(st.repeats)]  # fmt: skip
            kind = (f"circular over {st.repeats} rounds (stage 0 runs layers "
                    f"{', '.join(runs)}; each stage's put in that order every step),")  # fmt: skip
        lines.append(f"  Pipeline (scan at {where}, {way}): {stages}; {st.microbatches} "
                     f"microbatches of {rows} rows, {kind} bubble "
                     f"{100 * bubble(p, st.microbatches, st.repeats):.0f}%")  # fmt: skip
    return tuple(lines)


def tie_text(rows: list[dict]) -> str:
    """Why the plan is not the fastest row of ``explain()``'s prediction, where the reason is a
    tie in time broken by memory (``""`` otherwise: no row is faster, or the faster one is
    over the memory limit or the user's layout, which :func:`constraint_words` explains).

    Example:
        >>> tie_text([{"name": "this plan", "time_s": 1.02, "peak_bytes": 80},
        ...           {"name": "FSDP", "time_s": 1.0, "peak_bytes": 100}])
        'chosen over FSDP for its memory: 20% less peak for 1.02x the time (within 3% of the fastest, the plan freeing at least 5% of its peak wins)'
    """
    plan, *others = rows
    faster = [r for r in others if "time_s" in r and r["time_s"] < plan["time_s"]]
    if not faster:
        return ""
    best = min(faster, key=lambda r: (r["time_s"], r["peak_bytes"]))
    if not wins_on_memory(
        (plan["time_s"], plan["peak_bytes"]), (best["time_s"], best["peak_bytes"])
    ):
        return ""
    return (f"chosen over {best['name']} for its memory: "
            f"{1 - plan['peak_bytes'] / best['peak_bytes']:.0%} less peak for "
            f"{times_text(plan['time_s'], best['time_s'])} the time (within {TIME_TIE:.0%} of "
            f"the fastest, the plan freeing at least {MEMORY_SHARE:.0%} of its peak wins)")  # fmt: skip


def outputs_text(prog: Program, sched: Schedule, steps, plan, specs) -> str:
    """Whether the state a step returns comes back in the layouts it came in."""
    pairs = state_pairs(prog, plan.in_tree, plan.out_tree)
    out_specs = output_specs(prog, sched, steps)
    if not pairs:
        return ""
    moved = [(i, o) for i, o in pairs if specs[i] != out_specs[o]]
    if not moved:
        return "the state it returns keeps these layouts: feed it back as it is"
    return (
        f"{len(moved)} of the {len(pairs)} state arrays it returns come back in another "
        "layout (plan.out_specs): the next step re-lays them out"
    )
