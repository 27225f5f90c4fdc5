"""``AutoPlan``: a searched (or hand-written, or loaded) schedule of a function, ready to run.

It carries the program, the schedule, its prediction and the mesh; calling it runs the schedule
under ``jax.jit`` with the planned shardings, ``plan.lowered`` is the explicit lowering,
``plan.explain()`` the one-screen summary (:mod:`planner.report`), ``plan.save(path)`` writes it to
a file (:mod:`planner.persistence`) and ``plan.bind(mesh)`` moves a plan made on an abstract mesh
onto devices.

Example:
    >>> p = planner.plan(step_fn, params, batch, mesh=mesh)        # doctest: +SKIP
    >>> p.in_specs, p.prediction, p(params, batch)
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
from jax.sharding import NamedSharding, PartitionSpec

from planner.calls import ArgumentMismatch, Signature
from planner.cost.comparisons import Comparisons, compare
from planner.cost.simulator import Prediction
from planner.layout.dataflow import dataflow, input_spec, output_specs
from planner.layout.explanation import explain_rows, render
from planner.lowering.spmd import Lowered, lower
from planner.persistence import mesh_differences, save
from planner.program.ir import Program
from planner.program.remat import RematDecision
from planner.program.schedule import Schedule, Spec
from planner.report import summarize
from planner.solver.strategies import experts
from planner.target.compiled import plan_compiled_report, program_structs
from planner.target.confirm import MemoryCheck, describe_checks
from redist.calibration import Calibration
from redist.meshes import translate
from redist.specs import mesh_shape
from redist.types import DistType, MeshShape


def _factor_type(spec: Spec, shape, mesh: MeshShape) -> DistType:
    """A factor-level spec (major first per dimension) as a type over ``mesh``'s factors."""
    return DistType.from_axes(shape, [tuple(reversed(a)) for a in spec], mesh)


def _spec_mesh(types: list[DistType], mesh: MeshShape) -> MeshShape:
    """The user's mesh, with every axis that some type uses only in part split into its prime
    factors (named ``axis_0``, ``axis_1``, ... major first; ``axis__0``, ... when those names are
    taken): the coarsest mesh over the same devices on which every type is a ``PartitionSpec``."""
    broken = set()
    for t in types:
        for entry in t.to_spec(mesh):
            for name in (entry,) if isinstance(entry, str) else entry or ():
                if name not in mesh.sizes:
                    broken.add(mesh.factor_axis[name])
    taken = set(mesh.sizes)
    axes = []
    for name, size in mesh.axes:
        if name not in broken:
            axes.append((name, size))
            continue
        sizes = [f.size for f in mesh.factors if f.axis == name]
        prefix = f"{name}_"
        while any(f"{prefix}{k}" in taken for k in range(len(sizes))):
            prefix += "_"
        axes += [(f"{prefix}{k}", n) for k, n in enumerate(sizes)]
        taken.update(n for n, _ in axes)
    return MeshShape(tuple(axes))


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as jax.jit(plan) needs
class AutoPlan:
    """A searched schedule with its prediction; callable: calling it runs :meth:`jit` (compiled on
    first use), and ``plan.lowered`` is the explicit lowering of the same schedule.

    ``in_specs`` / ``out_specs`` are ``PartitionSpec``s over ``spec_mesh``: the user's mesh, or,
    when the plan splits a dimension by part of a mesh axis, the same devices with that axis split
    into its prime factors (``c:8 -> c_0:2, c_1:2, c_2:2``; ``explain()`` says so).
    ``in_shardings`` / ``out_shardings`` are the same as ``NamedSharding``s (a concrete mesh is
    needed for those and to run the plan: :meth:`bind`; everything else works on an
    ``AbstractMesh`` or a ``{name: size}`` mesh). :meth:`save` keeps it in a file. A plan is a
    value (frozen; :meth:`bind` and ``dataclasses.replace`` make new ones), made by :meth:`of`.
    """

    program: Program
    schedule: Schedule
    prediction: Prediction | None  # None: not priced
    mesh: object  # a jax.sharding.Mesh, an AbstractMesh or {name: size}
    search_s: float
    in_tree: object  # the arguments' pytree structure
    out_tree: object  # the results'
    replicated: Prediction | None = None  # full replication's prediction, the row it beats
    calibration: Calibration | None = None  # what the plan was priced on
    signature: Signature | None = None  # the arguments it was made for (planner.calls)
    donate_argnums: tuple[int, ...] = ()  # what jit() donates unless told otherwise
    remat: RematDecision | None = None  # what checkpointed layers save, where the planner chose
    memory_checks: tuple[MemoryCheck, ...] = ()  # the compiles that confirmed its memory
    asked: Schedule | None = None  # the layout the program asks for (planner.solver.requested)
    # where the plan is that layout as given: what the search chose without it, predicted
    on_its_own: Prediction | None = None
    # plan(rank="compiled"): the candidates compiled and priced (planner.target.ranked)
    compiled_ranking: tuple = ()

    @classmethod
    def of(cls, program: Program, schedule: Schedule, mesh, *, prediction=None,
           calibration: Calibration | None = None, signature: Signature | None = None,
           in_tree=None, out_tree=None, search_s: float = 0.0, replicated=None,
           donate_argnums: tuple[int, ...] = (), remat: RematDecision | None = None,
           memory_checks: tuple[MemoryCheck, ...] = (), asked: Schedule | None = None,
           on_its_own: Prediction | None = None) -> AutoPlan:  # fmt: skip
        """A plan of ``schedule`` for ``program`` on ``mesh``, every other field by name:
        ``prediction`` (``None``: not priced), the ``calibration`` it was priced on, the
        ``signature`` of the arguments it was made for (``in_tree`` defaults to its), the
        search's seconds, full ``replicated``'s prediction, what :meth:`jit` donates, the remat
        decision, the compiles that confirmed its memory, the layout the program ``asked``
        for and, where the plan is that layout, the prediction of the search's choice without it
        (``on_its_own``).

        Example:
            >>> AutoPlan.of(prog, sched, mesh, prediction=simulate(prog, sched))  # doctest: +SKIP
        """
        if in_tree is None and signature is not None:
            in_tree = signature.in_tree
        return cls(program, schedule, prediction, mesh, search_s, in_tree, out_tree, replicated,
                   calibration, signature, tuple(donate_argnums), remat, tuple(memory_checks),
                   asked, on_its_own)  # fmt: skip

    @functools.cached_property
    def comparisons(self) -> Comparisons:
        """What this plan is compared with (full replication, the experts' strategies, the
        program's own layout), priced once on its calibration and mesh; ``explain()`` reads it.

        Example:
            >>> dict(plan.comparisons.experts)["FSDP over data, fsdp"].time_s  # doctest: +SKIP
            0.0123
        """
        cal = self.calibration or Calibration.default()
        sizes = self.mesh_shape.sizes
        return compare(
            self.program, sizes, cal, experts(self.program, sizes).rows, self.asked, self.replicated
        )

    @functools.cached_property
    def _signature(self) -> Signature:
        if self.signature is not None:
            return self.signature
        specs = program_structs(self.program)
        return Signature.of(jax.tree.unflatten(self.in_tree, specs), {})

    @functools.cached_property
    def mesh_shape(self) -> MeshShape:
        return mesh_shape(self.mesh)

    @functools.cached_property
    def _boundary_types(self) -> tuple[list[DistType], list[DistType]]:
        m = self.mesh_shape
        ins = [_factor_type(input_spec(self.program, self.schedule, v), v.shape, m)
               for v in self.program.inputs]  # fmt: skip
        steps = dataflow(self.program, self.schedule)
        outs = [_factor_type(sp, v.shape, m) for v, sp in
                zip(self.program.outputs, output_specs(self.program, self.schedule, steps))]  # fmt: skip
        return ins, outs

    @functools.cached_property
    def spec_mesh(self) -> MeshShape:
        """The mesh ``in_specs`` and ``out_specs`` are written on (see the class docstring)."""
        ins, outs = self._boundary_types
        return _spec_mesh(ins + outs, self.mesh_shape)

    def _specs(self, types: list[DistType], tree) -> object:
        specs = [PartitionSpec(*translate(t, self.mesh_shape, self.spec_mesh).to_spec(self.spec_mesh))
                 for t in types]  # fmt: skip
        return jax.tree.unflatten(tree, specs)

    @property
    def in_specs(self):
        return self._specs(self._boundary_types[0], self.in_tree)

    @property
    def out_specs(self):
        return self._specs(self._boundary_types[1], self.out_tree)

    def _concrete_spec_mesh(self):
        devices = mesh_devices(self.mesh)
        if devices is None:
            raise ValueError(
                f"this plan was made for a mesh without devices ({self.mesh_shape}); its layouts "
                "are in_specs / out_specs over spec_mesh. Bind it to a jax.sharding.Mesh of those "
                "axes (plan.bind(mesh)), or build NamedShardings on your own mesh from those "
                "specs, to get shardings or run it"
            )
        names = [n for n, _ in self.spec_mesh.axes]
        sizes = tuple(s for _, s in self.spec_mesh.axes)
        if names == list(self.mesh.axis_names):
            return self.mesh
        types = []  # each axis of spec_mesh has the type of the user's axis it is (part of)
        for name, kind in zip(self.mesh.axis_names, self.mesh.axis_types):
            types += [kind] * (1 if name in names else len(self.mesh_shape.axis_factors(name)))
        return jax.sharding.Mesh(devices.reshape(sizes), tuple(names), axis_types=tuple(types))

    @property
    def in_shardings(self):
        """``NamedSharding``s of the inputs, for ``jax.jit(..., in_shardings=...)``."""
        mesh = self._concrete_spec_mesh()
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.in_specs,
                            is_leaf=lambda s: isinstance(s, PartitionSpec))  # fmt: skip

    @property
    def out_shardings(self):
        """``NamedSharding``s of the outputs, for ``jax.jit(..., out_shardings=...)``."""
        mesh = self._concrete_spec_mesh()
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.out_specs,
                            is_leaf=lambda s: isinstance(s, PartitionSpec))  # fmt: skip

    @functools.cached_property
    def lowered(self) -> Lowered:
        self._concrete_spec_mesh()  # a clear error on meshes without devices
        lowered = lower(self.program, self.schedule, self.mesh)
        lowered.signature = self._signature
        return lowered

    def jit(self, moves: str = "auto", **jit_kwargs):
        """The user's function as a ``jax.jit`` with this plan's shardings, run by XLA's SPMD
        partitioner: ``in_shardings`` / ``out_shardings`` at the boundary and a sharding constraint
        on every value whose layout the plan fixes, inside scans, loops, conds and custom rules
        too (on meshes with Explicit axes the program runs with them Auto inside,
        ``jax.sharding.auto_axes``, its results typed as the plan lays them out). ``moves`` says
        who makes the plan's changes of layout: ``"auto"``: ``redist`` where XLA would rematerialise (replicate, then slice) or ``redist``
        is predicted faster, XLA elsewhere (:meth:`move_choices` lists them); ``"xla"``: XLA;
        ``"redist"``: ``redist``. ``jit_kwargs`` go to ``jax.jit`` (``donate_argnums``,
        ``donate_argnames``). It takes the arguments the plan was made for: static ones (those
        without arrays) are ``static_argnums``, and each new structure, shape, dtype or static
        value is refused when traced (:class:`planner.calls.ArgumentMismatch`); it is a
        :class:`planner.calls.PlannedJit`: keyword arguments are passed on, and arrays placed in
        another layout are moved to the plan's first. Where the program has sharding constraints,
        only the values the plan lays out otherwise than they ask (and their neighbours) are
        constrained; elsewhere XLA propagates from the user's constraints, as their own
        ``jax.jit`` does (:func:`planner.lowering.spmd.anchored`).

        Example:
            >>> step = plan.jit(donate_argnums=0)       # doctest: +SKIP
            >>> step.lower(*args).compile()
            >>> plan.jit(donate_argnums=0) is step      # made once: compiled once  # doctest: +SKIP
            True
        """
        for k in ("in_shardings", "out_shardings"):
            if k in jit_kwargs:
                raise TypeError(f"plan.jit sets {k} itself; got {k}=")
        if self.donate_argnums:
            jit_kwargs.setdefault("donate_argnums", self.donate_argnums)
        key = (moves, tuple(sorted(jit_kwargs.items())))
        try:
            hash(key)
        except TypeError:  # an unhashable argument: made anew
            return self._made_jit(moves, jit_kwargs)
        if key not in self._jits:
            self._jits[key] = self._made_jit(moves, jit_kwargs)
        return self._jits[key]

    @functools.cached_property
    def _jits(self) -> dict:
        """:meth:`jit`'s results by its arguments (a new ``jax.jit`` would compile again)."""
        return {}

    def _made_jit(self, moves: str, jit_kwargs: dict):
        """A new :meth:`jit` (see there) of ``moves`` with ``jit_kwargs``."""
        in_shardings, out_shardings = jax.tree.leaves(self.in_shardings), self.out_shardings
        lowered = self._xla_lowered(moves)
        body = lowered.body
        if lowered.explicit:
            # Values on Explicit axes carry their sharding in their type and each op's result
            # takes the one its typing rule gives (an FSDP step's activations whole): the plan
            # runs with the axes Auto inside, its constraints held, its results typed as planned.
            body = jax.sharding.auto_axes(body, out_sharding=tuple(jax.tree.leaves(out_shardings)))
        return self._signature.jit(body, in_shardings, out_shardings, self.out_tree, **jit_kwargs)

    def _xla_lowered(self, moves: str) -> Lowered:
        return Lowered(
            self.program, self.schedule, self.mesh, "xla", moves, self.calibration, self.asked
        )

    def move_choices(self, moves: str = "auto") -> list:
        """For every change of layout the plan makes, how XLA and ``redist`` would make it and
        which :meth:`jit` uses (:class:`planner.lowering.xla_moves.MoveChoice`; ``print`` them)."""
        return list(self._xla_lowered(moves).choices.values())

    @functools.cached_property
    def _jitted(self):
        return self.jit()

    def __call__(self, *args, **kwargs):
        """Run the plan as :meth:`jit` does (``plan.lowered`` is the explicit lowering: the whole
        program as one ``shard_map``); arguments unlike those the plan was made for are refused
        (:class:`planner.calls.ArgumentMismatch`, a ``TypeError`` and a ``ValueError``)."""
        try:
            return self._jitted(*args, **kwargs)
        except (TypeError, ValueError) as e:
            if isinstance(e, ArgumentMismatch):
                raise
            self._signature.check(args, kwargs)  # JAX refused them first: say how they differ
            raise

    def summary(self) -> str:
        """The prediction, against full replication, and the mesh the specs are written on."""
        lines = [f"{self.prediction}; search {self.search_s:.2f} s"]
        if self.replicated is not None:
            ratio = self.replicated.time_s / max(self.prediction.time_s, 1e-12)
            lines.append(
                f"replicated: {self.replicated}; this plan is predicted {ratio:.2f}x as fast"
                + (" (replication is best: nothing pays for its communication)"
                   if not any(self.schedule.assign.values()) else "")
            )  # fmt: skip
        if self.remat is not None:
            lines.append(self.remat.describe())
        if self.memory_checks:
            lines.append(describe_checks(self.memory_checks))
        if self.spec_mesh != self.mesh_shape:
            lines.append(
                f"the plan splits by parts of mesh axes: its specs are over {self.spec_mesh}, the "
                f"same devices as {self.mesh_shape} (plan.spec_mesh)"
            )
        return "\n".join(lines)

    def explain(self, verbose: bool = False) -> str:
        """One screen (:mod:`planner.report`): the prediction against replication, data
        parallelism and FSDP, the inputs' layouts, the heavy ops and the user's lines that made
        them, collectives, memory, and what runs whole. ``verbose``: then every op."""
        text = summarize(self).text()
        if verbose:
            text += "\n\nEvery op:\n" + self.summary() + "\n" + render(self.explain_json())
        return text

    def compiled_report(self, mesh=None, moves: str = "auto"):
        """Compile :meth:`jit` for ``mesh`` (default: the plan's own; a plan made on an
        ``AbstractMesh`` or ``{name: size}`` is bound to a concrete mesh of the same axes, e.g.
        :func:`planner.topology_mesh`, without searching again) and return the compiler's
        verdict (:class:`planner.target.compiled.CompiledReport`)."""
        return plan_compiled_report(self, mesh, moves)

    def explain_json(self) -> list[dict]:
        return explain_rows(self.program, self.schedule, self.mesh_shape)

    def save(self, path: str) -> None:
        """Write the plan to ``path`` as JSON; :func:`planner.load` restores it without searching
        (see :mod:`planner.persistence` for the format)."""
        save(self, path)

    def bind(self, mesh) -> AutoPlan:
        """This plan on ``mesh``, a ``jax.sharding.Mesh`` with the axis names and sizes of the
        (abstract) mesh it was made for: a new plan with shardings, that runs. Raises
        ``ValueError`` naming what differs."""
        if mesh_devices(mesh) is None:
            raise ValueError(
                f"bind needs a jax.sharding.Mesh with devices; got {type(mesh).__name__}"
            )
        problems = mesh_differences(self.mesh_shape, mesh_shape(mesh))
        if problems:
            raise ValueError(
                f"this plan was made for the mesh {self.mesh_shape}: " + "; ".join(problems)
            )
        return dataclasses.replace(self, mesh=mesh)

    def __repr__(self) -> str:
        return f"AutoPlan({len(self.program.ops)} ops on {self.mesh_shape}: {self.prediction})"

    def to_json(self) -> str:
        return json.dumps({
            "prediction": {
                "time_s": self.prediction.time_s,
                "comm_bytes": self.prediction.comm_bytes,
                "peak_bytes": self.prediction.peak_bytes,
            },
            "replicated_time_s": getattr(self.replicated, "time_s", None),
            "search_s": self.search_s,
            "spec_mesh": dict(self.spec_mesh.axes),
            "schedule": {op: {lp: list(ax) for lp, ax in loops.items()}
                         for op, loops in self.schedule.assign.items() if loops},
            "ops": self.explain_json(),
        }, indent=2)  # fmt: skip


def mesh_devices(mesh):
    """The devices of ``mesh`` (an array), None for an ``AbstractMesh`` or ``{name: size}``."""
    try:
        return getattr(mesh, "devices", None)
    except (NotImplementedError, ValueError):  # an AbstractMesh
        return None
