"""A plan in one screen: what ``AutoPlan.explain()`` opens with.

Six sections, in this order, on the user's mesh axis names (never the prime factors schedules
are written on) and the user's pytree paths:

1. the prediction: step time and peak memory per device of the plan, of full replication (every
   device runs the whole step), of data parallelism over the whole mesh and of FSDP (the same,
   with the weights stored split), all simulated on the plan's mesh and calibration;
2. the layout of each input by its pytree path, identical subtrees written once;
3. the heavy ops, with the line of the user's code that made them and how they are split;
4. the collectives of one step, by kind;
5. memory per device: parameters, optimizer state, batch, and the rest at the peak;
6. what runs whole on every device, and why.

How inputs are classified (a stated heuristic, for the memory line and the word "batch"):

- an argument of the function is *state* when it comes back: an output (or an element of a
  tuple, list or dict output, or of one of those) has its tree structure, shapes and dtypes;
- state under an ``optax`` state object, or under a key naming one (``opt_state``,
  ``optimizer``), is *optimizer state*; other state is *parameters*;
- when some argument is state, the others are the *batch*, and the leading dimension of each
  batch array is what the heavy ops call "batch" (followed through the data flow); when none
  is, every argument is an *input*.

Example:
    >>> print(summarize(plan).text())          # doctest: +SKIP
    >>> summarize(plan).as_dict()["collectives"]
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os

import jax

from planner.cost.pipeline import bubble
from planner.cost.simulator import Prediction
from planner.layout.dataflow import dataflow, input_spec, output_specs
from planner.layout.staging import region_of
from planner.program.constraints import requests
from planner.program.halo import split
from planner.program.ir import Program
from planner.program.memo import PerObject
from planner.program.microbatch import microbatching
from planner.program.ops import Op, is_key
from planner.program.schedule import (
    Schedule,
    Spec,
    stage_factors,
    xla_splits,
)
from planner.solver.schedule_search import TIME_TIE
from planner.target.confirm import describe_checks
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
OPTIMIZER_KEYS = ("opt_state", "optimizer")
_FRACTION = {2: "half", 3: "a third", 4: "a quarter", 8: "an eighth"}
_ROLE = {  # loop name prefixes of products and convolutions -> words
    "dot_general": {"b": "batched dim", "m": "rows", "n": "columns", "k": "contraction"},
    "conv_general_dilated": {"n": "batch", "g": "groups", "o": "out features",
                             "i": "in features", "s": "spatial", "w": "window"},
}  # fmt: skip


# ---------------------------------------------------------------------------- words for axes


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


def _mib(nbytes: float) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if nbytes >= 2**20 or nbytes == 0:
        return f"{nbytes / 2**20:.2f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"


def _ms(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


_DTYPE = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16",
          "int32": "i32", "int64": "i64", "int8": "i8", "uint32": "u32", "uint8": "u8"}  # fmt: skip


def _times(a: float, b: float) -> str:
    """``a / b`` as ``"1.25x"``; two zeros (a program that computes nothing) are ``"1.00x"``.

    Example:
        >>> _times(3.0, 2.0), _times(0.0, 0.0), _times(1.0, 0.0)
        ('1.50x', '1.00x', 'infx')
    """
    if b == 0:
        return "1.00x" if a == 0 else "infx"
    return f"{a / b:.2f}x"


def _shape(v) -> str:
    dtype = "key" if is_key(v.dtype) else _DTYPE.get(v.dtype, v.dtype)
    return f"{dtype}[{','.join(map(str, v.shape))}]"


def _where(source) -> str:
    """``(file, line, library)`` -> ``file.py:12`` (``in optax`` when it called a library)."""
    if not source:
        return "?"
    path, line, library = source
    return f"{os.path.basename(path)}:{line}" + (f" in {library}" if library else "")


# ---------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One input array: its pytree path (split into keys), value, kind and layout."""

    parts: tuple[str, ...]
    index: int
    kind: str  # "parameters", "optimizer state", "batch" or "input"

    @property
    def path(self) -> str:
        return "".join(self.parts)


def _arg_names(prog: Program, paths) -> list[str]:
    """The name of each argument: from the traced function's signature where JAX recorded it."""
    names: dict[int, str] = {}
    debug = getattr(getattr(prog.jaxpr, "jaxpr", None), "debug_info", None)
    arg_names = getattr(debug, "arg_names", None)
    for k, path in enumerate(paths):
        i = path[0].idx
        if i in names:
            continue
        suffix = jax.tree_util.keystr(tuple(path[1:]))
        full = arg_names[k] if arg_names and len(arg_names) == len(paths) else None
        if full and full.endswith(suffix) and len(full) > len(suffix):
            names[i] = full[: len(full) - len(suffix)]
        else:
            names[i] = f"args[{i}]"
    return [names[p[0].idx] for p in paths]


def _signature(tree, values) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((values[k].shape, values[k].dtype) for k in leaves)


def _nodes(tree, depth: int) -> list:
    """``tree`` and its subtrees down to ``depth`` levels (tuples, lists, dicts)."""
    out = [tree]
    if depth and isinstance(tree, (tuple, list, dict)):
        for child in tree.values() if isinstance(tree, dict) else tree:
            out += _nodes(child, depth - 1)
    return out


def _is_optax(x) -> bool:
    return type(x).__module__.split(".")[0] == "optax"


def state_pairs(prog: Program, in_tree, out_tree) -> list[tuple[int, int]]:
    """``(input, output)`` positions of the arrays a step returns in place of an argument: the
    argument's leaves against those of the first output node (the output, or an element of it
    down to two levels of tuples, lists and dicts; not a lone output array) that has the
    argument's tree structure, shapes and dtypes. Each output is returned in place of one
    argument at most: arguments with more leaves claim theirs first (the parameters a step
    returns, not a batch array of the shape of one of them)."""
    args = jax.tree_util.tree_unflatten(in_tree, list(range(len(prog.inputs))))
    outs = jax.tree_util.tree_unflatten(out_tree, list(range(len(prog.outputs))))
    nodes = [t for t in _nodes(outs, 2) if t is not outs or not isinstance(t, int)]
    pairs, claimed = [], set()
    for arg in sorted(args, key=lambda a: -len(jax.tree_util.tree_leaves(a))):
        sig = _signature(arg, prog.inputs)
        node = next((t for t in nodes if _signature(t, prog.outputs) == sig
                     and claimed.isdisjoint(jax.tree_util.tree_leaves(t))), None)  # fmt: skip
        if node is not None:
            claimed.update(jax.tree_util.tree_leaves(node))
            pairs += zip(jax.tree_util.tree_leaves(arg), jax.tree_util.tree_leaves(node))
    return sorted(pairs)


def _repeating_parameters(args, prog: Program, state: set[int]) -> set[int]:
    """Where no optax type or key names the optimizer state (a Keras optimizer's variables, a
    list beside the weights): the state leaves of an argument's part (an argument, or an element
    of one) whose arrays repeat the shapes of an earlier part's, scalars aside (Adam's moments of
    the parameters, besides its step count)."""
    parts = []
    for arg in args if isinstance(args, (tuple, list)) else (args,):
        children = list(arg.values()) if isinstance(arg, dict) else arg
        parts += list(children) if isinstance(children, (tuple, list)) else [arg]
    groups = [jax.tree_util.tree_leaves(p) for p in parts]
    groups = [g for g in groups if g and set(g) <= state]

    def shapes(g):
        return collections.Counter(prog.inputs[k].shape for k in g if prog.inputs[k].shape)

    out: set[int] = set()
    for i, g in enumerate(groups):
        mine = shapes(g)
        for earlier in groups[:i]:
            theirs = shapes(earlier)
            if mine and set(mine) <= set(theirs) and mine.total() >= theirs.total():
                out.update(g)
                break
    return out


def classify(prog: Program, in_tree, out_tree) -> list[Leaf]:
    """Every input with its path and kind (see the module docstring for the heuristic)."""
    args = jax.tree_util.tree_unflatten(in_tree, list(range(len(prog.inputs))))
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    names = _arg_names(prog, paths)
    state = {i for i, _ in state_pairs(prog, in_tree, out_tree)}
    optimizer = set()
    for path, sub in jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_optax)[0]:
        keys = jax.tree_util.keystr(tuple(path)).lower()
        if _is_optax(sub) or any(k in keys for k in OPTIMIZER_KEYS):
            optimizer.update(jax.tree_util.tree_leaves(sub))
    if not optimizer:
        optimizer = _repeating_parameters(args, prog, state)
    leaves = []
    for k, (path, name) in enumerate(zip(paths, names)):
        parts = (name, *(jax.tree_util.keystr((key,)) for key in path[1:]))
        kind = ("optimizer state" if k in optimizer else "parameters") if k in state else (
            "batch" if state else "input")  # fmt: skip
        leaves.append(Leaf(parts, k, kind))
    return leaves


def _group_layouts(leaves: list[Leaf], shapes: dict, specs: dict) -> list[tuple[str, str, str]]:
    """``(paths, layout, kind)`` lines, one per input, except: a subtree whose arrays have the same
    relative paths, shapes and layouts as one already listed is written ``as`` that one (with its
    like neighbours), and a subtree of three or more arrays that all have one layout is written
    once."""
    root: dict = {}
    for leaf in leaves:
        node = root
        for part in leaf.parts[:-1]:
            node = node.setdefault(part, {})
        node[leaf.parts[-1]] = leaf

    def sig(node, prefix=()) -> tuple:
        if isinstance(node, Leaf):
            return ((prefix, shapes[node.index], specs[node.index]),)
        return tuple(s for key, child in node.items() for s in sig(child, (*prefix, key)))

    seen: dict[tuple, str] = {}
    lines: list[tuple[str, str, str]] = []

    def kind(node) -> str:
        while not isinstance(node, Leaf):
            node = next(iter(node.values()))
        return node.kind

    def emit(node, prefix: str) -> None:
        items = list(node.items())
        i = 0
        while i < len(items):
            key, child = items[i]
            name = prefix + key
            if isinstance(child, Leaf):
                lines.append((name, f"{shapes[child.index]:<14} {specs[child.index]}", child.kind))
                i += 1
                continue
            s = sig(child)
            alike = {spec for *_, spec in s}
            if len(s) > 1 and s in seen:
                run = [name]
                while i + len(run) < len(items):
                    key2, child2 = items[i + len(run)]
                    if isinstance(child2, Leaf) or sig(child2) != s:
                        break
                    run.append(prefix + key2)
                shown = ", ".join(run) if len(run) <= 3 else f"{run[0]} ... {run[-1]} ({len(run)})"
                lines.append((shown, f"as {seen[s]}", kind(child)))
                i += len(run)
                continue
            seen.setdefault(s, name)
            if len(s) > 2 and len(alike) == 1:
                lines.append(
                    (f"{name} ({len(s)} arrays)", f"{'all':<14} {alike.pop()}", kind(child))
                )
            else:
                emit(child, name)
            i += 1

    emit(root, "")
    return lines


# ---------------------------------------------------------------------------- the plan's ops


def _batch_loops(prog: Program, leaves: list[Leaf]) -> dict[str, set[str]]:
    """Op name -> its loops that run over the batch: the leading dimension of each batch input,
    followed through the ops' access maps."""
    dims: dict[str, list] = {}
    for leaf in leaves:
        v = prog.inputs[leaf.index]
        if leaf.kind == "batch" and v.shape:
            dims[v.name] = [True] + [False] * (len(v.shape) - 1)
    out: dict[str, set[str]] = {}
    for op in prog.ops:
        loops = set()
        for acc in op.operands:
            for d, batch in zip(acc.dims, dims.get(acc.value.name, ())):
                if d and batch:
                    loops.add(d[0])
        if loops:
            out[op.name] = loops
            for acc in op.results:
                dims[acc.value.name] = [bool(d) and d[0] in loops for d in acc.dims]
    return out


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


def _operation(op: Op) -> str:
    if op.primitive == "dot_general" and len(op.operands) == 2:
        a, b = (acc.value for acc in op.operands)
        return f"{'x'.join(map(str, a.shape))} @ {'x'.join(map(str, b.shape))}"
    return _shape(op.results[0].value) if op.results else ""


def _how_split(op: Op, step, sched: Schedule, mesh: MeshShape, batch: set[str]) -> str:
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


def collectives(pred: Prediction) -> dict:
    """Kind (as reports print it) -> ``{"count", "bytes", "seconds"}`` of one step (bytes sent
    per device), read from the prediction (:meth:`planner.cost.simulator.Prediction.traffic`);
    local slices under ``"copy"``."""
    return {kind_label(k): {"count": t.count, "bytes": t.bytes, "seconds": t.seconds}
            for k, t in pred.traffic().items()}  # fmt: skip


# ---------------------------------------------------------------------------- the comparisons


# ---------------------------------------------------------------------------- the summary


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

    def as_dict(self) -> dict:
        return {
            "pipelines": list(self.pipelines),
            "prediction": self.prediction,
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
            line = f"  {row['name']:<34} {_ms(row['time_s']):>10} {_mib(row['peak_bytes']):>11}"
            if row["name"] != "this plan":
                line += (f"   this plan {_times(row['time_s'], self.time_s)} as fast, "
                         f"{_times(self.memory['peak_bytes'], row['peak_bytes'])} the "
                         "memory")  # fmt: skip
            pred.append(line)
        pred += list(self.pipelines)
        heavy = ["Heavy ops (by predicted time; alike ops counted together):"]
        for h in self.heavy:
            count = f" x{h['count']}" if h["count"] > 1 else ""
            comm = f" (comm {_ms(h['comm_s'])})" if h["comm_s"] > 0.05 * h["time_s"] else ""
            heavy.append(f"  {100 * h['share']:4.1f}% {_ms(h['time_s']):>9}  {h['primitive']}{count}"
                         f"  {h['where']}  {h['operation']}: {h['split']}{comm}")  # fmt: skip
        coll = ["Collectives per step (bytes sent per device):"]
        total_comm = sum(self.collectives[k]["seconds"] for k in KINDS if k in self.collectives)
        for kind in KINDS:
            c = self.collectives.get(kind)
            if c:
                coll.append(f"  {kind:<15} {c['count']:>5} x  {_mib(c['bytes']):>10}  "
                            f"{_ms(c['seconds']):>9}")  # fmt: skip
        if len(coll) == 1:
            coll[0] += " none"
        else:
            coll.append(f"  communication: {_ms(total_comm)} of the {_ms(self.time_s)} step")
        mem = self.memory
        named = [(k, mem[k]) for k in ("parameters", "optimizer state", "batch", "inputs")
                 if mem.get(k)]  # fmt: skip
        memory = [
            f"Memory per device: peak {_mib(mem['peak_bytes'])}"
            + (f" (at {mem['peak_at']})" if mem.get("peak_at") else ""),
            "  = " + "".join(f"{k} {_mib(b)} + " for k, b in named)
            + f"activations and temporaries {_mib(mem['rest_bytes'])}",
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
            whole.append(f"  {why} ({_ms(seconds)}): {', '.join(names)}")
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

    # 2. layouts of the inputs
    leaves = classify(prog, plan.in_tree, plan.out_tree)
    specs = [input_spec(prog, sched, v) for v in prog.inputs]
    shapes = {leaf.index: _shape(prog.inputs[leaf.index]) for leaf in leaves}
    spec_texts = {leaf.index: spec_text(specs[leaf.index], mesh) for leaf in leaves}
    layouts = [{"path": leaf.path, "kind": leaf.kind, "shape": list(prog.inputs[leaf.index].shape),
                "dtype": prog.inputs[leaf.index].dtype, "spec": spec_text(specs[leaf.index], mesh)}
               for leaf in leaves]  # fmt: skip
    parts_note = ""
    if plan.spec_mesh != mesh:
        parts_note = ("a part of an axis splits a dimension fewer ways; plan.in_specs write parts "
                      f"on plan.spec_mesh {plan.spec_mesh} (major part first)")  # fmt: skip
    outputs = _outputs_text(prog, sched, steps, plan, specs)

    # 3. heavy ops
    costs = {c.op: c for c in pred.ops}
    batch = _batch_loops(prog, leaves) if any(lf.kind == "batch" for lf in leaves) else {}
    groups: dict[tuple, dict] = {}
    for st in steps:
        op, c = st.op, costs[st.op.name]
        if op.how == "region":
            continue
        split = _how_split(op, st, sched, mesh, batch.get(op.name, set()))
        key = (op.primitive, op.source, _operation(op), split)
        g = groups.setdefault(key, {"primitive": op.primitive, "where": _where(op.source),
                                    "operation": _operation(op), "split": split, "count": 0,
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
        mem["peak_at"] = f"{at.op}, {_where(prog.op(at.op).source)}"

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
        header, rows, layouts, _group_layouts(leaves, shapes, spec_texts), outputs, parts_note,
        [{k: v for k, v in g.items()} for g in heavy], coll, mem,
        sorted(whole.values(), key=lambda w: -w["time_s"]), n_whole, t_whole / total, total_ops,
        pred.time_s,
        constraint_words(prog, sched, plan.asked, mesh, pred, asked)
        + pipeline_words(prog, sched) + xla_only_words(sched),
    )  # fmt: skip
    return summary


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
        line += (f" (departing must be predicted over {TIME_TIE:.0%} faster, or as fast in less "
                 "memory)")  # fmt: skip
    else:
        line += (
            f", departs from {len(departed)}: {_times(asked_pred.time_s, pred.time_s)} as "
            f"fast as your layout, {_times(pred.peak_bytes, asked_pred.peak_bytes)} its "
            "memory (plan(..., constraints='keep') keeps them)"
        )
    out = [line]
    for op, wanted, planned in departed[:DEPARTURES_SHOWN]:
        out.append(f"  {_where(op.source)} {op.name}: asked {spec_text(wanted, mesh)}, planned "
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
        where = _where(prog.ops[r.body].source if r.body < r.stop else None)
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


def _outputs_text(prog: Program, sched: Schedule, steps, plan, specs) -> str:
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
