"""The backends of :mod:`planner.lowering`, one :class:`~planner.lowering.walk.Walker` each:

- :class:`Explicit` (``"explicit"``): the whole program is one ``shard_map``; every op runs its
  kernel on its tiles and values move between layouts by ``redist`` plans run on the tiles;
- :class:`PerOp` (``"per-op"``, the reference it grew from): one ``shard_map`` per split op,
  every move a ``redist.redistribute`` call, unsplit ops left to XLA;
- :class:`Xla` (``"xla"``, what ``AutoPlan.jit`` runs): the original ops on whole arrays, held
  to the schedule's layouts by ``with_sharding_constraint`` and partitioned by XLA, ``redist``
  making the moves predicted to be better made by it (:mod:`planner.lowering.xla_moves`).

Example:
    >>> Xla(prog, sched, mesh, dataflow(prog, sched), moves="xla").program(*arrays)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import redist
from planner.layout.dataflow import OpStep, input_spec, output_specs
from planner.lowering.kernels import bind, pspec, spatially_split, with_literals
from planner.lowering.on_factors import check_layouts, factor_axes, run_body
from planner.lowering.pipelined import Micro
from planner.lowering.walk import Walker
from planner.lowering.xla_moves import MoveChoice, choose
from planner.program.constraints import SHARDING_PARAM
from planner.program.ir import Program
from planner.program.ops import Op
from planner.program.schedule import Schedule, Spec, local_shape, xla_splits
from redist.calibration import Calibration
from redist.execute import tile_kernel


def _result_tiles(walker: Walker, op: Op, step: OpStep) -> list[tuple[int, ...]]:
    """The shapes of each device's tiles of ``op``'s results, laid out as ``step`` makes them."""
    return [local_shape(r.value.shape, s, walker.sizes) for r, s in zip(op.results, step.out_specs)]


def _shard_map_op(walker: Walker, op: Op, step: OpStep, args: list) -> tuple:
    """``op`` in a ``shard_map`` of its own, on the tiles ``step`` gives it."""
    return jax.shard_map(
        functools.partial(bind, op, local_out=_result_tiles(walker, op, step), step=step),
        mesh=walker.mesh,
        in_specs=tuple(pspec(s) for s in step.in_specs),
        out_specs=tuple(pspec(s) for s in step.out_specs),
        check_vma=False,
    )(*args)


class Explicit(Walker):
    """The program as one ``shard_map``: inputs enter as the schedule stores them, outputs leave
    in the layout their producer left them in, and every value inside is a device's tile."""

    holds_tiles = True

    def program(self, *flat):
        ins = tuple(pspec(input_spec(self.prog, self.sched, v)) for v in self.prog.inputs)
        outs = tuple(map(pspec, output_specs(self.prog, self.sched, self.steps)))
        return jax.shard_map(super().program, mesh=self.mesh, in_specs=ins, out_specs=outs,
                             check_vma=False)(*flat)  # fmt: skip

    def move(self, x, mv, micro: Micro | None):
        v, sizes, shape = mv.value, self.sizes, mv.value.shape
        if micro is not None:  # stages hold other data: move within one stage's devices
            shape = micro.shapes.get(v.name, v.shape)
            sizes = {a: n for a, n in sizes.items() if a not in micro.axes}
        plan = redist.plan(shape, pspec(mv.src), pspec(mv.dst), sizes, dtype=v.dtype)
        return tile_kernel(plan, tuple(sizes.items()))(x)

    def run_partitioned(self, op: Op, step: OpStep, args: list) -> tuple:
        return bind(op, *args, local_out=_result_tiles(self, op, step), step=step)

    def run_manual(self, op: Op, step: OpStep, args: list, micro: Micro | None) -> tuple:
        """The user's ``shard_map`` body on the tiles its specs give (the plan keeps them), its
        collectives over the prime factors of their axes (:mod:`planner.lowering.on_factors`)."""
        params = op.eqn.params
        mesh = params["mesh"]
        manual = params.get("newly_manual_axes", params.get("axis_names")) or mesh.axis_names
        names = factor_axes(dict(mesh.shape))
        if (
            micro is not None
            or set(manual) != set(mesh.axis_names)
            or any(self.sizes.get(f) is None for fs in names.values() for f in fs)
        ):
            raise NotImplementedError(
                f"{op.name}: the 'explicit' backend runs the program's shard_map where it is "
                "manual over every axis of the plan's mesh and outside a pipeline (here: manual "
                f"over {sorted(manual)} of {dict(mesh.shape)}, the plan's mesh factors "
                f"{sorted(self.sizes)}); use backend 'xla' (plan.jit's) or 'per-op'"
            )
        ndims = [len(o.value.shape) for o in op.operands]
        check_layouts(op.name, params["in_specs"], step.in_specs, names, ndims)
        ndims = [len(r.value.shape) for r in op.results]
        check_layouts(op.name, params["out_specs"], step.out_specs, names, ndims)
        return tuple(run_body(params["jaxpr"], with_literals(op.eqn, args), names))

    def run_microbatched(self, op: Op, step: OpStep, args: list, micro: Micro) -> tuple:
        shapes = [micro.shapes.get(r.value.name, r.value.shape) for r in op.results]
        shapes = [local_shape(sh, sp, self.sizes) for sh, sp in zip(shapes, step.out_specs)]
        if op.name in self.deferred:  # left partial: summed once after the ticks
            step = dataclasses.replace(step, pending=())
        return bind(op, *args, local_out=shapes, step=step)


class PerOp(Walker):
    """Whole arrays between ops; each split op in its own ``shard_map``, each move a
    ``redist.redistribute`` call (the plan the simulator priced: ``redist``'s bytes model)."""

    def move(self, x, mv, micro: Micro | None):
        try:
            return redist.redistribute(x, pspec(mv.src), pspec(mv.dst), mesh=self.mesh,
                                       cost_model="bytes")  # fmt: skip
        except ValueError:  # typed on the user's mesh (made by its shard_map): XLA moves it
            return lax.with_sharding_constraint(x, NamedSharding(self.mesh, pspec(mv.dst)))

    def run_partitioned(self, op: Op, step: OpStep, args: list) -> tuple:
        return _shard_map_op(self, op, step, args)


class Xla(Walker):
    """The original ops on whole arrays, each result held to its layout by a sharding constraint
    (given ``asked``, only the :func:`anchored` ones), XLA's partitioner making the moves except
    those ``moves`` gives ``redist`` (:func:`planner.lowering.xla_moves.choose`)."""

    stage_halos = False

    def __init__(self, prog: Program, sched: Schedule, mesh, steps: list[OpStep], *,
                 moves: str = "auto", calibration: Calibration | None = None,
                 asked: Schedule | None = None):  # fmt: skip
        super().__init__(prog, sched, mesh, steps)
        self.out_even = bool(xla_splits(sched))  # outputs made unevenly are returned evenly
        # given the layout the program asks for: only the ops the plan lays out otherwise are
        # constrained (None: every op)
        self.anchors = (anchored(prog, sched, asked, steps)
                        if asked is not None and not self.stages else None)  # fmt: skip
        self.choices: dict[tuple, MoveChoice] = {}
        if moves != "xla":
            cal = calibration or Calibration.default()
            for st in steps:
                for mv in st.moves:
                    key = (mv.value.name, mv.src, mv.dst)
                    if key not in self.choices and self.held(st.op, mv):
                        self.choices[key] = choose(mesh, mv, cal, probe=moves == "auto")

    def held(self, op: Op, mv=None) -> bool:
        """Whether ``op``'s layouts are constrained (and, given the move ``mv`` of one of its
        operands, the layout that operand is made in: ``redist`` moves a tile from its layout
        only where XLA holds it there)."""
        if self.anchors is None:
            return True
        made = None if mv is None else self.prog.producer.get(mv.value.name)
        return op.name in self.anchors and (made is None or made.name in self.anchors)

    def move(self, x, mv, micro: Micro | None):
        """XLA makes the change (asked by a constraint), unless ``redist`` is chosen."""
        choice = self.choices.get((mv.value.name, mv.src, mv.dst))
        if choice is None or not choice.use_redist or micro is not None:
            return self.constrain(x, mv.dst, micro)
        try:
            return redist.redistribute(x, pspec(mv.src), pspec(mv.dst), mesh=self.mesh,
                                       cost_model="bytes")  # fmt: skip
        except ValueError:  # typed on the user's mesh of whole axes (auto_axes): XLA moves it
            return self.constrain(x, mv.dst, micro)

    def run_partitioned(self, op: Op, step: OpStep, args: list) -> tuple:
        """XLA partitions ``op``, except where it splits a window: that runs on tiles with its
        halos exchanged (see :func:`planner.lowering.kernels.spatially_split`)."""
        if not spatially_split(step):
            return bind(op, *args)
        return _shard_map_op(self, op, step, args)

    def run_microbatched(self, op: Op, step: OpStep, args: list, micro: Micro) -> tuple:
        shapes = [micro.shapes.get(r.value.name, r.value.shape) for r in op.results]
        if op.name in self.deferred:
            return self._partial(op, step, args, shapes)
        if any(a.value.name in micro.parts for a in op.operands):  # a view of partial sums
            return jax.vmap(functools.partial(bind, op, local_out=shapes))(*args)
        return bind(op, *args, local_out=shapes)

    def settle(self, op: Op, step: OpStep, outs, micro: Micro | None):
        parted = None  # in a pipelined body: the axes a partial result is over
        if micro is not None:
            parted = step.pending if op.name in self.deferred else next(
                (micro.parts[a.value.name] for a in op.operands if a.value.name in micro.parts),
                None,
            )  # fmt: skip
        # a boundary op keeps its operand's constraint; an op XLA lays out takes none
        if op.how != "region" and self.held(op):
            outs = [self.constrain(x, sp if parted is None else (parted, *sp), micro)
                    for x, sp in zip(outs, step.out_specs)]  # fmt: skip
        if parted is not None:
            micro.parts.update((r.value.name, parted) for r in op.results)
        return outs

    def returned(self, outs: tuple) -> tuple:
        if not self.out_even:
            return outs
        specs = output_specs(self.prog, self.sched, self.steps)
        return tuple(self.constrain(x, s, None) for x, s in zip(outs, specs))

    def constrain(self, x, spec: Spec, micro: Micro | None):
        """``x`` constrained to ``spec``: on the mesh, or inside a pipeline's ``shard_map`` on
        the mesh it traces under, whose stage axes are manual (the transposes of ops, under
        ``jax.grad``, check their operands' meshes against it)."""
        mesh = jax.sharding.get_abstract_mesh() if micro is not None else self.mesh
        return lax.with_sharding_constraint(x, NamedSharding(mesh, pspec(spec)))

    def _partial(self, op: Op, step: OpStep, args, shapes):
        """``op`` on one microbatch, its sums over ``step.pending`` left partial: a
        ``shard_map`` manual over those axes runs it on each device's part and returns the
        partial results on a new leading axis split over them (the pipeline adds them over its
        ticks and sums that axis once, after the last)."""
        pending = step.pending
        mesh = jax.sharding.get_abstract_mesh()
        in_specs = tuple(PartitionSpec(*[tuple(a for a in d if a in pending) or None for d in sp])
                         for sp in step.in_specs)  # fmt: skip

        def part(*local):
            return tuple(x[None] for x in bind(op, *local, local_out=shapes))

        return jax.shard_map(part, mesh=mesh, in_specs=in_specs,
                             out_specs=tuple(PartitionSpec(pending) for _ in op.results),
                             axis_names=set(pending), check_vma=False)(*args)  # fmt: skip


def anchored(prog: Program, sched: Schedule, asked: Schedule, steps) -> frozenset[str] | None:
    """The ops backend ``"xla"`` constrains as ``sched`` lays them out, where the program's own
    sharding constraints ask for a layout (``asked``: they and the inputs' layouts, propagated):
    the constraints, the ops ``sched`` lays out otherwise than ``asked`` with their producers
    and consumers (XLA would carry a departure on to them), and ops splitting a window (run on
    tiles). Elsewhere the plan is what the program asks, and XLA propagates from the
    constraints as it does for the user's own ``jax.jit`` (on MaxText's step, half the time of
    constraining every value). ``None`` (every op constrained) where no constraint splits
    anything: XLA's propagation from the inputs alone lays out worse than the plan (on Gemma's
    step, 1.5x the time).

    Example:
        >>> anchored(prog, sched, plan.asked, dataflow(prog, sched))  # doctest: +SKIP
        frozenset({'sharding_constraint_3', 'dot_general_7'})
    """
    constrained = {op.name for op in prog.ops if op.primitive in SHARDING_PARAM}
    if not any(any(asked.assign.get(name, {}).values()) for name in constrained):
        return None
    departs = {op.name for op in prog.ops if sched.grid(op) != asked.grid(op)}
    out = constrained | {st.op.name for st in steps if spatially_split(st)}
    for op in prog.ops:
        producers = {prog.producer[a.value.name].name for a in op.operands
                     if a.value.name in prog.producer}  # fmt: skip
        if op.name in departs or producers & departs:
            out |= {op.name, *producers}
    return frozenset(out)
