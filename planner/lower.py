"""Lowering a scheduled program to one jitted SPMD program.

Backend ``"explicit"``: every op runs its local kernel in a ``shard_map`` on the layouts the
schedule derives; between a producer's layout and a consumer's required layout a memory-bounded
``redist`` plan moves the data; a partitioned reduction loop leaves partial sums, resolved right
away with ``psum``, or ``psum_scatter`` when the first consumer wants that result split along the
summed axes. Backend ``"xla"``: the original ops with ``with_sharding_constraint`` on every value
(XLA inserts the collectives) - the baseline. Backend ``"xla-inputs"``: only the inputs are placed
as the schedule says and XLA's sharding propagation decides the rest.

Example:
    >>> f = planner.lower(prog, sched, mesh)        # doctest: +SKIP
    >>> out = f(*args); print(f.explain())
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

import redist
from planner.dataflow import OpStep, dataflow, input_spec
from planner.ir import Op, Program
from planner.schedule import Schedule, Spec, local_shape

SHAPE_PARAMS = ("shape", "new_sizes")
BACKENDS = ("explicit", "xla", "xla-inputs")
SHARDING_PARAMS = ("sharding", "out_sharding")


def _pspec(spec: Spec) -> PartitionSpec:
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in spec))


@dataclasses.dataclass
class Event:
    op: str
    kind: str  # "redistribute", "psum", "psum_scatter"
    value: str
    detail: str
    bytes: int


class Lowered:
    """A scheduled program as a jitted function, with ``explain()`` and ``in_specs``."""

    def __init__(self, prog: Program, sched: Schedule, mesh, backend: str = "explicit"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.prog, self.sched, self.backend = prog, sched, backend
        self.mesh = mesh = factored_mesh(mesh)
        self.sizes = dict(mesh.shape)
        self.steps = dataflow(prog, sched)
        self.in_specs = tuple(input_spec(prog, sched, v) for v in prog.inputs)
        self.events = _events(self.steps, redist.MeshShape.of(self.sizes))
        in_shardings = tuple(NamedSharding(mesh, _pspec(s)) for s in self.in_specs)
        body = self._explicit if backend == "explicit" else self._xla
        self._jitted = jax.jit(body, in_shardings=in_shardings)

    def __call__(self, *args):
        flat = jax.tree.leaves(args)
        if len(flat) != len(self.prog.inputs):
            raise ValueError(f"expected {len(self.prog.inputs)} arrays, got {len(flat)}")
        outs = self._jitted(*flat)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def lower(self, *args):
        return self._jitted.lower(*jax.tree.leaves(args))

    # ----- the explicit backend -----
    def _explicit(self, *flat):
        env: dict[str, object] = {v.name: x for v, x in zip(self.prog.inputs, flat)}
        env.update({v.name: c for v, c in self.prog.consts})
        for step in self.steps:
            self._run(step, env)
        return tuple(env[v.name] for v in self.prog.outputs)

    def _run(self, step: OpStep, env) -> None:
        op, mesh = step.op, self.mesh
        for mv in step.moves:
            env[mv.value.name] = redist.redistribute(
                env[mv.value.name], _pspec(mv.src), _pspec(mv.dst), mesh=mesh
            )
        args = [env[acc.value.name] for acc in op.operands]
        if not step.partitioned:
            outs = _bind(op, args, None)
        else:
            local_out = [
                local_shape(r.value.shape, s, self.sizes)
                for r, s in zip(op.results, step.out_specs)
            ]
            outs = jax.shard_map(
                lambda *xs: _bind(op, xs, local_out, step.pending, step.scatter),
                mesh=mesh,
                in_specs=tuple(_pspec(s) for s in step.in_specs),
                out_specs=tuple(_pspec(s) for s in step.out_specs),
                check_vma=False,
            )(*args)
        for r, x in zip(op.results, outs):
            env[r.value.name] = x

    # ----- the baseline: sharding constraints, XLA inserts the collectives -----
    def _xla(self, *flat):
        env = {v.name: x for v, x in zip(self.prog.inputs, flat)}
        env.update({v.name: c for v, c in self.prog.consts})
        for op in self.prog.ops:
            outs = _bind(op, [env[a.value.name] for a in op.operands], None)
            for r, x in zip(op.results, outs):
                if self.backend == "xla-inputs":  # only the inputs are placed; XLA propagates
                    env[r.value.name] = x
                    continue
                spec = self.sched.spec(op, r)
                env[r.value.name] = lax.with_sharding_constraint(
                    x, NamedSharding(self.mesh, _pspec(spec))
                )
        return tuple(env[v.name] for v in self.prog.outputs)

    # ----- introspection -----
    def explain_json(self) -> list[dict]:
        rows = []
        m = redist.MeshShape.of(self.sizes)
        for op in self.prog.ops:
            types = lambda accs, op=op: [  # noqa: E731
                str(redist.DistType.from_spec(_pspec(self.sched.spec(op, a)), a.value.shape, m))
                for a in accs
            ]
            rows.append({
                "op": op.name,
                "grid": self.sched.grid(op),
                "operands": types(op.operands),
                "results": types(op.results),
                "pending_sum_over": list(self.sched.pending(op)),
                "collectives": [dataclasses.asdict(e) for e in self.events if e.op == op.name],
            })  # fmt: skip
        return rows

    def explain(self) -> str:
        lines = []
        for row in self.explain_json():
            lines.append(f"{row['op']}: grid {row['grid']}")
            lines.append(f"    in  {', '.join(row['operands']) or '-'}")
            lines.append(f"    out {', '.join(row['results'])}")
            for e in row["collectives"]:
                lines.append(
                    f"    + {e['kind']} {e['value']}: {e['detail']} ({e['bytes']} B/device)"
                )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(self.explain_json(), indent=2)


def _events(steps, m: redist.MeshShape) -> list[Event]:
    """The collectives each op's step inserts, with the paper's bytes per device."""
    out = []
    for step in steps:
        op = step.op
        for mv in step.moves:
            plan = redist.plan(
                mv.value.shape, _pspec(mv.src), _pspec(mv.dst), m, dtype=mv.value.dtype
            )
            detail = f"{plan.src} -> {plan.dst}: {' '.join(plan.kinds)}"
            out.append(Event(op.name, "redistribute", mv.value.name, detail, plan.cost_bytes))
        if step.pending:
            for k, r in enumerate(op.results):
                size = math.prod(local_shape(r.value.shape, step.out_specs[k], m.factor_size))
                kind = "psum_scatter" if step.scatter[k] is not None else "psum"
                out.append(Event(op.name, kind, r.value.name, f"over {step.pending}",
                                 size * np.dtype(r.value.dtype).itemsize))  # fmt: skip
    return out


def factored_mesh(mesh):
    """The same devices with every mesh axis split into its prime factors (``a:4 -> a#0, a#1``)."""
    from jax.sharding import AxisType, Mesh

    shape = redist.MeshShape.of(dict(mesh.shape))
    if shape.factor_names == tuple(mesh.axis_names):
        return mesh
    sizes = [f.size for f in shape.factors]
    return Mesh(mesh.devices.reshape(sizes), shape.factor_names,
                axis_types=(AxisType.Auto,) * len(sizes))  # fmt: skip


def _bind(op: Op, args, local_out, pending=(), scatter=None):
    eqn = op.eqn
    params = dict(eqn.params)
    if local_out is not None:
        for key in SHAPE_PARAMS:
            if key in params and len(op.results) == 1:
                params[key] = tuple(local_out[0])
    for key in SHARDING_PARAMS:
        if key in params:
            params[key] = None
    it = iter(args)
    full = [v.val if isinstance(v, jcore.Literal) else next(it) for v in eqn.invars]
    out = eqn.primitive.bind(*full, **params)
    outs = list(out) if eqn.primitive.multiple_results else [out]
    if pending:
        for k, x in enumerate(outs):
            if scatter and scatter[k] is not None:
                outs[k] = lax.psum_scatter(x, pending, scatter_dimension=scatter[k], tiled=True)
            else:
                outs[k] = lax.psum(x, pending)
    return tuple(outs)


def lower(prog: Program, sched: Schedule, mesh, backend: str = "explicit") -> Lowered:
    """One jitted SPMD program for ``prog`` under ``sched`` on ``mesh`` (see module docs)."""
    return Lowered(prog, sched, mesh, backend)
