"""What a schedule does, op by op, without devices: grids, layouts and the collectives inserted.

Pure (no JAX): works for a plan made for an ``AbstractMesh`` or a ``{name: size}`` mesh of
thousands of devices, and is what ``explain()`` and ``to_json()`` print.

Example:
    >>> rows = explain_rows(prog, sched, MeshShape.of({"a": 2, "b": 4}))   # doctest: +SKIP
    >>> print(render(rows))
"""

from __future__ import annotations

import dataclasses
import math

import redist
from planner.layout.dataflow import dataflow
from planner.program.ir import Program
from planner.program.ops import itemsize
from planner.program.schedule import Schedule, Spec, local_shape

# The collective that combines a split reduction of each kind.
COLLECTIVE = {"sum": "psum", "max": "pmax", "min": "pmin", "and": "pmin", "or": "pmax"}


@dataclasses.dataclass
class Event:
    op: str
    kind: str  # "redistribute", "psum", "psum_scatter", "pmax", "pmin"
    value: str
    detail: str
    bytes: int


def entries(spec: Spec) -> tuple:
    """A factor-level spec as ``PartitionSpec`` entries (one name, a tuple of names, or None)."""
    return tuple(None if not a else a[0] if len(a) == 1 else tuple(a) for a in spec)


def factored(m: redist.MeshShape) -> redist.MeshShape:
    """``m`` with every axis split into its prime factors, named as schedules name them."""
    return redist.MeshShape(tuple((f.name, f.size) for f in m.factors))


def events(steps, m: redist.MeshShape) -> list[Event]:
    """The collectives each op's step inserts, with the paper's bytes per device."""
    m = factored(m)
    out = []
    for step in steps:
        op = step.op
        for mv in step.moves:
            plan = redist.plan(mv.value.shape, entries(mv.src), entries(mv.dst), m,
                               dtype=mv.value.dtype)  # fmt: skip
            detail = f"{plan.src} -> {plan.dst}: {' '.join(plan.kinds)}"
            out.append(Event(op.name, "redistribute", mv.value.name, detail, plan.cost_bytes))
        if step.pending:
            for k, r in enumerate(op.results):
                size = math.prod(local_shape(r.value.shape, step.out_specs[k], m.factor_size))
                kind = "psum_scatter" if step.scatter[k] is not None else COLLECTIVE[step.combine]
                out.append(Event(op.name, kind, r.value.name, f"over {step.pending}",
                                 size * itemsize(r.value.dtype)))  # fmt: skip
    return out


def explain_rows(
    prog: Program, sched: Schedule, m: redist.MeshShape, evs: list[Event] | None = None
) -> list[dict]:
    """One row per op: its grid, operand and result types, pending sum and collectives."""
    if evs is None:
        evs = events(dataflow(prog, sched), m)
    m = factored(m)
    rows = []
    for op in prog.ops:
        types = lambda accs, op=op: [  # noqa: E731
            str(redist.DistType.from_spec(entries(sched.spec(op, a)), a.value.shape, m))
            for a in accs
        ]
        rows.append({
            "op": op.name,
            "grid": sched.grid(op),
            "operands": types(op.operands),
            "results": types(op.results),
            "pending_sum_over": list(sched.pending(op)),
            "collectives": [dataclasses.asdict(e) for e in evs if e.op == op.name],
        })  # fmt: skip
    return rows


def render(rows: list[dict]) -> str:
    """The rows as text: a block per op that is split or communicates, one line per op else."""
    lines = []
    for row in rows:
        lines.append(f"{row['op']}: grid {row['grid']}")
        lines.append(f"    in  {', '.join(row['operands']) or '-'}")
        lines.append(f"    out {', '.join(row['results'])}")
        for e in row["collectives"]:
            lines.append(f"    + {e['kind']} {e['value']}: {e['detail']} ({e['bytes']} B/device)")
    return "\n".join(lines)
