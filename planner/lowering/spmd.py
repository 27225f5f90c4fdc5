"""Lowering a scheduled program to one jitted SPMD program.

Backend ``"explicit"``: the whole program is one ``shard_map`` over the mesh; every op runs its
local kernel on the tiles of the layouts the schedule derives (an unpartitioned op on whole
arrays, on every device); between a producer's layout and a consumer's required layout a
memory-bounded ``redist`` plan moves the tile with collectives. Backend ``"per-op"`` is the
reference it grew from: one ``shard_map`` per partitioned op, unpartitioned ops left to XLA,
every move a ``redist.redistribute`` call. In both, a partitioned reduction loop leaves partial
results, combined right away by their own operation (``psum``, or ``psum_scatter`` when the first
consumer wants the sum split along the summed axes; ``pmax`` / ``pmin`` for max / min, and / or).
Regions keep their construct: a scan runs as ``lax.scan`` whose body runs on the split layouts
(collectives inside the body); ``checkpoint`` and ``custom_jvp`` / ``custom_vjp`` calls are
re-bound around their planned bodies, so rematerialisation and the user's differentiation rules
survive.

Backend ``"xla"`` (what ``AutoPlan.jit`` runs): the original ops with ``with_sharding_constraint``
on every value, regions included, run by XLA's SPMD partitioner, which makes the layout changes
except those where it would rematerialise or ``redist`` is predicted faster: ``redist`` makes
those (``moves``, see :mod:`planner.lowering.xla_moves`). Given the layout the program's own
constraints ask for (``asked``), only the values the plan lays out otherwise are constrained and
XLA propagates from the user's constraints elsewhere (:func:`anchored`). Backend
``"xla-inputs"``: only the inputs are placed as the schedule says and XLA's sharding
propagation decides the rest.

Here :class:`Lowered` (placing the inputs, jitting, ``explain()``) picks the backend's walker
(:mod:`planner.lowering.backends`), which walks the program (:mod:`planner.lowering.walk`) and
binds each op's kernel (:mod:`planner.lowering.kernels`).

Example:
    >>> f = planner.lower(prog, sched, mesh)        # doctest: +SKIP
    >>> out = f(*args); print(f.explain())
"""

from __future__ import annotations

import json

import jax
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh, NamedSharding

import redist
from planner.layout.dataflow import dataflow, input_spec
from planner.layout.explanation import events, explain_rows, render
from planner.layout.staging import check_stages
from planner.lowering.backends import Explicit, PerOp, Xla, anchored
from planner.lowering.kernels import pspec
from planner.lowering.xla_moves import MoveChoice
from planner.program.ir import Program
from planner.program.schedule import Schedule, xla_splits
from redist.calibration import Calibration

__all__ = ["BACKENDS", "MOVES", "Lowered", "anchored", "factored_mesh", "lower"]

BACKENDS = ("explicit", "per-op", "xla", "xla-inputs")
MOVES = ("auto", "xla", "redist")
WALKERS = {"explicit": Explicit, "per-op": PerOp}


class Lowered:
    """A scheduled program as a jitted function, with ``explain()`` and ``in_specs``.

    Called (or ``lower``-ed) on the program's input arrays (pytrees of them, flattened); given
    the ``signature`` of the user's function (:class:`planner.calls.Signature`, as
    :attr:`planner.AutoPlan.lowered` has), also on the user's own arguments, static ones
    included."""

    signature = None  # the user's arguments (planner.calls.Signature), when known

    def __init__(self, prog: Program, sched: Schedule, mesh, backend: str = "explicit",
                 moves: str = "auto", calibration: Calibration | None = None,
                 asked: Schedule | None = None):  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if moves not in MOVES:
            raise ValueError(f"moves must be one of {MOVES}, got {moves!r}")
        self.prog, self.sched, self.backend = prog, sched, backend
        self.explicit = AxisType.Explicit in tuple(getattr(mesh, "axis_types", ()))
        # XLA's partitioner keeps each value where its constraint says only on Auto axes: on
        # Explicit ones every op's result takes the layout its typing rule gives, and a
        # constraint then moves it (an FSDP step's activations held whole, then sliced).
        self.mesh = mesh = factored_mesh(mesh, auto=backend == "xla")
        self.sizes = dict(mesh.shape)
        self.shape = redist.MeshShape.of(self.sizes)  # the mesh of prime factors, made once
        check_stages(prog, sched)
        only_xla = xla_splits(sched)
        if only_xla and backend in ("explicit", "per-op"):
            raise NotImplementedError(
                f"the {backend!r} backend runs even splits of its own kernels only (shard_map "
                f"holds no padded tiles, and its gathers and scatters look up whole operands); "
                f"this schedule splits {'; '.join(only_xla)}: run it with backend='xla' (what "
                "plan.jit runs)"
            )
        self.steps = dataflow(prog, sched)
        self.in_specs = tuple(input_spec(prog, sched, v) for v in prog.inputs)
        self.events = events(self.steps, self.shape)
        self.in_shardings = in_shardings = tuple(NamedSharding(mesh, pspec(s))
                                                 for s in self.in_specs)  # fmt: skip
        if sched.stages and backend not in ("explicit", "xla", "xla-inputs"):
            raise NotImplementedError(
                f"pipelined scans run under the 'explicit' and 'xla' backends, not {backend!r}"
            )
        if backend == "xla":
            self.walker = Xla(prog, sched, mesh, self.steps, moves=moves, calibration=calibration,
                              asked=asked)  # fmt: skip
        elif backend in WALKERS:
            self.walker = WALKERS[backend](prog, sched, mesh, self.steps)
        else:  # "xla-inputs": the original program, its inputs placed
            self.walker = None
        self._body = self._xla if self.walker is None else self.walker.program
        self._jitted = jax.jit(self.body, in_shardings=in_shardings)

    @property
    def choices(self) -> dict[tuple, MoveChoice]:
        """Backend ``"xla"``: for each change of layout, who makes it (XLA or ``redist``)."""
        return getattr(self.walker, "choices", {})

    @property
    def anchors(self) -> frozenset[str] | None:
        """Backend ``"xla"`` given ``asked``: the ops it constrains (None: every op)."""
        return getattr(self.walker, "anchors", None)

    def body(self, *flat):
        """The program on its inputs (to trace), the factored mesh being the context: under
        ``jax.set_mesh(mesh)`` the context is the user's mesh, whose axes of non-prime sizes the
        ``shard_map``s over their prime factors would not match."""
        ambient = jax.sharding.get_abstract_mesh()
        if ambient.empty or ambient == self.mesh.abstract_mesh or self.backend == "xla-inputs":
            return self._body(*flat)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            return self._body(*flat)

    def __call__(self, *args, **kwargs):
        outs = self._jitted(*self._placed(args, kwargs))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*self._placed(args, kwargs))

    def _placed(self, args, kwargs) -> list:
        """The arrays of ``args``, those not yet on devices (numpy arrays, Python numbers) put
        where the schedule stores them, and on a mesh of Explicit axes every array laid out
        otherwise: ``jax.jit`` would trace them with their own sharding in their type, which the
        ``shard_map``'s ``in_specs`` refuse."""
        flat = jax.tree.leaves(args)
        arrays_only = all(hasattr(x, "shape") for x in flat) and len(flat) == len(self.prog.inputs)
        if self.signature is not None and (kwargs or not arrays_only):
            self.signature.check(args, kwargs)  # the user's arguments, static ones included
            flat = self.signature.arrays(args, kwargs)
        elif kwargs:
            raise TypeError(f"this lowering takes the program's arrays, flat; got keyword "
                            f"arguments {sorted(kwargs)}")  # fmt: skip
        if len(flat) != len(self.prog.inputs):
            raise ValueError(f"expected {len(self.prog.inputs)} arrays, got {len(flat)}")
        out = []
        for x, s in zip(flat, self.in_shardings):
            # an array laid out otherwise on Explicit axes: its type would not be in_specs'
            retyped = (self.explicit and isinstance(x, jax.Array)
                       and not x.sharding.is_equivalent_to(s, x.ndim))  # fmt: skip
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
                x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            elif retyped or not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
                x = jax.device_put(x, s)
            out.append(x)
        return out

    # ----- the baseline: XLA propagates from the inputs -----
    def _xla(self, *flat):
        """The original program; the inputs are placed as the schedule says."""
        return tuple(jcore.jaxpr_as_fun(self.prog.jaxpr)(*flat))

    # ----- introspection -----
    def explain_json(self) -> list[dict]:
        return explain_rows(self.prog, self.sched, self.shape, self.events)

    def explain(self) -> str:
        return render(self.explain_json())

    def to_json(self) -> str:
        return json.dumps(self.explain_json(), indent=2)


def factored_mesh(mesh, auto: bool = False):
    """The same devices with every mesh axis split into its prime factors (``a:4 -> a#0, a#1``),
    its axes Auto; the mesh itself where its axes are prime (and Auto, given ``auto``)."""
    shape = redist.MeshShape.of(dict(mesh.shape))
    types = tuple(getattr(mesh, "axis_types", ()))
    if shape.factor_names == tuple(mesh.axis_names) and not (auto and AxisType.Explicit in types):
        return mesh
    sizes = [f.size for f in shape.factors]
    return Mesh(mesh.devices.reshape(sizes), shape.factor_names,
                axis_types=(AxisType.Auto,) * len(sizes))  # fmt: skip


def lower(prog: Program, sched: Schedule, mesh, backend: str = "explicit", moves: str = "auto",
          calibration: Calibration | None = None, asked: Schedule | None = None) -> Lowered:  # fmt: skip
    """One jitted SPMD program for ``prog`` under ``sched`` on ``mesh`` (see module docs).

    ``moves`` (backend ``"xla"``): who makes each change of layout: ``"auto"`` (``redist`` where
    XLA would rematerialise or ``redist`` is predicted faster, see
    :mod:`planner.lowering.xla_moves`), ``"xla"`` or ``"redist"`` (all of them). ``asked``
    (backend ``"xla"``): the layout the program's constraints ask for, as
    :attr:`planner.AutoPlan.asked` has it: where ``sched`` agrees with it, XLA propagates from
    the program's own constraints (:func:`anchored`)."""
    return Lowered(prog, sched, mesh, backend, moves, calibration, asked)
