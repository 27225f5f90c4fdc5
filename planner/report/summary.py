"""A plan in one screen: what ``AutoPlan.explain()`` opens with.

Six sections, in this order, on the user's mesh axis names (never the prime factors schedules
are written on) and the user's pytree paths:

1. the prediction: step time and peak memory per device of the plan, of full replication (every
   device runs the whole step), of data parallelism over the whole mesh and of FSDP (the same,
   with the weights stored split), of the layout the program asks for ("your layout") and,
   where the plan is that layout, of what the search chose without it, all simulated on the
   plan's mesh and calibration;
2. the layout of each input by its pytree path, identical subtrees written once;
3. the heavy ops, with the line of the user's code that made them and how they are split;
4. the collectives of one step, by kind;
5. memory per device: parameters, optimizer state, batch, and the rest at the peak;
6. what runs whole on every device, and why.

How inputs are classified is :mod:`planner.report.leaves`; the words, :mod:`planner.report.words`.
The figures are read from the plan's prediction and comparisons (:mod:`planner.cost`): nothing
here prices.

Example:
    >>> print(summarize(plan).text())          # doctest: +SKIP
    >>> summarize(plan).as_dict()["collectives"]
"""

from __future__ import annotations

import collections
import dataclasses

from planner.cost.simulator import Prediction
from planner.layout.dataflow import dataflow, input_spec
from planner.program.ir import Program
from planner.program.memo import PerObject
from planner.program.schedule import (
    Schedule,
)
from planner.report.leaves import batch_loops, classify, group_layouts
from planner.report.words import (
    code_line,
    constraint_words,
    how_split,
    mib_text,
    ms_text,
    operation_text,
    outputs_text,
    pipeline_words,
    shape_text,
    spec_text,
    tie_text,
    times_text,
    xla_only_words,
)
from planner.target.confirm import describe_checks
from planner.target.ranked import describe_ranking
from redist.calibration import Calibration
from redist.collectives import CollectiveKind, kind_label
from redist.types import MeshShape

MAX_LINES = 40


HEAVY = 8


KINDS = tuple(
    c.short
    for c in (
        CollectiveKind.ALL_GATHER,
        CollectiveKind.ALL_TO_ALL,
        CollectiveKind.REDUCE_SCATTER,
        CollectiveKind.ALL_REDUCE,
        CollectiveKind.PERMUTE,
    )
)  # the order rows print in


def collectives(pred: Prediction) -> dict:
    """Kind (as reports print it) -> ``{"count", "bytes", "seconds"}`` of one step (bytes sent
    per device), read from the prediction (:meth:`planner.cost.simulator.Prediction.traffic`);
    local slices under ``"copy"``."""
    return {kind_label(k): {"count": t.count, "bytes": t.bytes, "seconds": t.seconds}
            for k, t in pred.traffic().items()}  # fmt: skip


@dataclasses.dataclass
class Summary:
    """The sections of :func:`summarize`, as data (:meth:`as_dict`) and text (:meth:`text`)."""

    header: str
    prediction: list[dict]
    layouts: list[dict]
    layout_lines: list[tuple[str, str]]
    outputs: str
    parts_note: str
    heavy: list[dict]
    collectives: dict
    memory: dict
    whole: list[dict]
    whole_ops: int
    whole_share: float
    total_ops: int
    time_s: float
    pipelines: tuple[str, ...] = ()
    tie: str = ""

    def as_dict(self) -> dict:
        return {
            "pipelines": list(self.pipelines),
            "prediction": self.prediction,
            "tie": self.tie,
            "layouts": self.layouts,
            "outputs": self.outputs,
            "heavy_ops": self.heavy,
            "collectives": self.collectives,
            "memory": self.memory,
            "whole": self.whole,
        }

    def text(self, max_lines: int = MAX_LINES) -> str:
        pred = [self.header, "Prediction per step and device (simulated):"]
        for row in self.prediction:
            if "reason" in row:
                pred.append(f"  {row['name']:<34} {row['reason']}")
                continue
            line = f"  {row['name']:<34} {ms_text(row['time_s']):>10} {mib_text(row['peak_bytes']):>11}"
            if row["name"] != "this plan":
                line += (f"   this plan {times_text(row['time_s'], self.time_s)} as fast, "
                         f"{times_text(self.memory['peak_bytes'], row['peak_bytes'])} the "
                         "memory")  # fmt: skip
            if "over" in row:
                line += f" (over the {row['over'] / 1e9:.3g} GB searched under)"
            pred.append(line)
        if self.tie:
            pred.append(f"  {self.tie}")
        pred += list(self.pipelines)
        heavy = ["Heavy ops (by predicted time; alike ops counted together):"]
        for h in self.heavy:
            count = f" x{h['count']}" if h["count"] > 1 else ""
            comm = f" (comm {ms_text(h['comm_s'])})" if h["comm_s"] > 0.05 * h["time_s"] else ""
            heavy.append(f"  {100 * h['share']:4.1f}% {ms_text(h['time_s']):>9}  {h['primitive']}{count}"
                         f"  {h['where']}  {h['operation']}: {h['split']}{comm}")  # fmt: skip
        coll = ["Collectives per step (bytes sent per device):"]
        total_comm = sum(self.collectives[k]["seconds"] for k in KINDS if k in self.collectives)
        for kind in KINDS:
            c = self.collectives.get(kind)
            if c:
                coll.append(f"  {kind:<15} {c['count']:>5} x  {mib_text(c['bytes']):>10}  "
                            f"{ms_text(c['seconds']):>9}")  # fmt: skip
        if len(coll) == 1:
            coll[0] += " none"
        else:
            coll.append(
                f"  communication: {ms_text(total_comm)} of the {ms_text(self.time_s)} step"
            )
        mem = self.memory
        named = [(k, mem[k]) for k in ("parameters", "optimizer state", "batch", "inputs")
                 if mem.get(k)]  # fmt: skip
        memory = [
            f"Memory per device: peak {mib_text(mem['peak_bytes'])}"
            + (f" (at {mem['peak_at']})" if mem.get("peak_at") else ""),
            "  = " + "".join(f"{k} {mib_text(b)} + " for k, b in named)
            + f"activations and temporaries {mib_text(mem['rest_bytes'])}",
        ]  # fmt: skip
        if any(k in mem for k in ("parameters", "optimizer state")):
            memory.append("  (parameters: arguments the step returns with their shapes; optimizer "
                          "state: those under optax states)")  # fmt: skip
        whole = [f"Runs whole on every device: {self.whole_ops} of {self.total_ops} ops, "
                 f"{100 * self.whole_share:.1f}% of the predicted time"]  # fmt: skip
        reasons: dict[str, list] = {}
        for w in self.whole:
            reasons.setdefault(w["why"], []).append(w)
        for why, ws in sorted(reasons.items(), key=lambda r: -sum(w["time_s"] for w in r[1])):
            names = [w["primitive"] + (f" x{w['count']}" if w["count"] > 1 else "") for w in ws]
            if len(names) > 5:
                names = names[:5] + [f"{sum(w['count'] for w in ws[5:])} more"]
            seconds = sum(w["time_s"] for w in ws)
            whole.append(f"  {why} ({ms_text(seconds)}): {', '.join(names)}")
        fixed = len(pred) + len(heavy) + len(coll) + len(memory) + len(whole)
        extra = [x for x in (self.parts_note, self.outputs) if x]
        room = max(4, max_lines - fixed - 1 - len(extra))
        lay = ["Layouts of the inputs (PartitionSpecs on the mesh's axes; plan.in_specs):"]
        width = min(60, max((len(p) for p, *_ in self.layout_lines), default=0))
        rows = _shorten(self.layout_lines, room)
        for path, spec, *_ in rows:
            lay.append(f"  {path:<{width}}  {spec}")
        lay += [f"  {x}" for x in extra]
        return "\n".join(pred + lay + heavy + coll + memory + whole)


def _shorten(lines: list[tuple], room: int) -> list[tuple]:
    """At most ``room`` lines: the last lines of the largest kind (parameters, usually) give way
    to one line saying how many were left out, so that every kind keeps its first lines."""
    if len(lines) <= room:
        return lines
    drop = len(lines) - room + 1
    counts = collections.Counter(kind for *_, kind in lines)
    kind = counts.most_common(1)[0][0]
    at = [k for k, (*_, kd) in enumerate(lines) if kd == kind]
    if len(at) <= drop:
        gone = set(range(room - 1, len(lines)))
    else:
        gone = set(at[len(at) - drop :])
    out = [line for k, line in enumerate(lines) if k not in gone]
    out.insert(min(gone), (f"... {len(gone)} more lines", "plan.in_specs has every input", kind))
    return out


SUMMARIES: PerObject[Summary] = PerObject("summaries of plans")


def summarize(plan) -> Summary:
    """The summary of an :class:`planner.autoplan.AutoPlan` (held in :data:`SUMMARIES`)."""
    return SUMMARIES.get(plan, lambda: _summarize(plan))


def _summarize(plan) -> Summary:
    prog: Program = plan.program
    sched: Schedule = plan.schedule
    pred: Prediction = plan.prediction
    mesh: MeshShape = plan.mesh_shape
    cal = plan.calibration or Calibration.default()
    steps = dataflow(prog, sched)

    # 1. the prediction against the strategies people run
    compared = plan.comparisons
    whole = compared.replicated
    rows = [{"name": "this plan", "time_s": pred.time_s, "peak_bytes": pred.peak_bytes}]
    rows.append({"name": "full replication (whole step each)", "time_s": whole.time_s,
                 "peak_bytes": whole.peak_bytes})  # fmt: skip
    for label, result in compared.experts:
        if isinstance(result, Prediction):
            rows.append({"name": label, "time_s": result.time_s, "peak_bytes": result.peak_bytes})
        else:
            rows.append({"name": label, "reason": result})
    asked = compared.asked
    if asked is not None:
        rows.append({"name": "your layout (constraints, inputs)", "time_s": asked.time_s,
                     "peak_bytes": asked.peak_bytes})  # fmt: skip
    own = plan.on_its_own  # the plan is the user's layout: what the search chose without it
    if own is not None:
        rows.append({"name": "the search without your layout", "time_s": own.time_s,
                     "peak_bytes": own.peak_bytes})  # fmt: skip
    searched = [c.searched_limit for c in plan.memory_checks if c.layout == "searched"]
    for row in rows[1:]:  # a faster row the search could not take: say why
        if searched and row.get("peak_bytes", 0) > searched[-1] and row["time_s"] < pred.time_s:
            row["over"] = searched[-1]
    func = getattr(getattr(prog.jaxpr, "jaxpr", None), "debug_info", None)
    func = getattr(func, "func_src_info", None) or "the function"
    if not any(sched.assign.values()):
        rows[0]["name"] = "this plan (replication is best)"
    header = (f"Plan for {func.split(' at ')[0]} on {' x '.join(f'{a}:{n}' for a, n in mesh.axes)}"
              f" ({mesh.num_devices} devices), priced for {cal.backend}; searched in "
              f"{plan.search_s:.2f} s")  # fmt: skip
    if plan.remat is not None:
        header += "\n" + plan.remat.describe()
    if plan.memory_checks:
        header += "\n" + describe_checks(plan.memory_checks)
    if plan.compiled_ranking:
        header += "\n" + describe_ranking(plan.compiled_ranking)

    # 2. layouts of the inputs
    leaves = classify(prog, plan.in_tree, plan.out_tree)
    specs = [input_spec(prog, sched, v) for v in prog.inputs]
    shapes = {leaf.index: shape_text(prog.inputs[leaf.index]) for leaf in leaves}
    spec_texts = {leaf.index: spec_text(specs[leaf.index], mesh) for leaf in leaves}
    layouts = [{"path": leaf.path, "kind": leaf.kind, "shape": list(prog.inputs[leaf.index].shape),
                "dtype": prog.inputs[leaf.index].dtype, "spec": spec_text(specs[leaf.index], mesh)}
               for leaf in leaves]  # fmt: skip
    parts_note = ""
    if plan.spec_mesh != mesh:
        parts_note = ("a part of an axis splits a dimension fewer ways; plan.in_specs write parts "
                      f"on plan.spec_mesh {plan.spec_mesh} (major part first)")  # fmt: skip
    outputs = outputs_text(prog, sched, steps, plan, specs)

    # 3. heavy ops
    costs = {c.op: c for c in pred.ops}
    batch = batch_loops(prog, leaves) if any(lf.kind == "batch" for lf in leaves) else {}
    groups: dict[tuple, dict] = {}
    for st in steps:
        op, c = st.op, costs[st.op.name]
        if op.how == "region":
            continue
        split = how_split(op, st, sched, mesh, batch.get(op.name, set()))
        key = (op.primitive, op.source, operation_text(op), split)
        g = groups.setdefault(key, {"primitive": op.primitive, "where": code_line(op.source),
                                    "operation": operation_text(op), "split": split, "count": 0,
                                    "time_s": 0.0, "comm_s": 0.0, "ops": []})  # fmt: skip
        g["count"] += 1
        g["time_s"] += c.compute_s + c.comm_s
        g["comm_s"] += c.comm_s
        g["ops"].append(op.name)
    total = max(pred.time_s, 1e-30)
    heavy = sorted(groups.values(), key=lambda g: -g["time_s"])[:HEAVY]
    for g in heavy:
        g["share"] = g["time_s"] / total

    # 4. collectives
    coll = collectives(pred)

    # 5. memory
    mem: dict = {"peak_bytes": pred.peak_bytes}
    for leaf in leaves:
        key = "inputs" if leaf.kind == "input" else leaf.kind
        mem[key] = mem.get(key, 0) + pred.input_bytes[leaf.index]
    held = sum(mem.get(k, 0) for k in ("parameters", "optimizer state", "batch", "inputs"))
    mem["rest_bytes"] = max(0, pred.peak_bytes - held)
    at = max((c for c in pred.ops if c.op in prog.index), key=lambda c: c.memory_bytes,
             default=None)  # fmt: skip
    if at is not None and at.memory_bytes >= pred.peak_bytes:
        mem["peak_at"] = f"{at.op}, {code_line(prog.op(at.op).source)}"

    # 6. what runs whole
    whole: dict[tuple, dict] = {}
    n_whole, t_whole = 0, 0.0
    for c in pred.ops:
        if c.whole is None:
            continue
        primitive, why = prog.op(c.op).primitive, c.whole
        w = whole.setdefault((primitive, why), {"primitive": primitive, "why": why,
                                                "count": 0, "time_s": 0.0})  # fmt: skip
        w["count"] += 1
        w["time_s"] += c.compute_s + c.comm_s
        n_whole += 1
        t_whole += c.compute_s + c.comm_s
    total_ops = sum(op.how != "region" for op in prog.ops)
    summary = Summary(
        header, rows, layouts, group_layouts(leaves, shapes, spec_texts), outputs, parts_note,
        [{k: v for k, v in g.items()} for g in heavy], coll, mem,
        sorted(whole.values(), key=lambda w: -w["time_s"]), n_whole, t_whole / total, total_ops,
        pred.time_s,
        constraint_words(prog, sched, plan.asked, mesh, pred, asked)
        + pipeline_words(prog, sched) + xla_only_words(sched),
        tie_text(rows),
    )  # fmt: skip
    return summary
