"""``plan`` and ``auto_shard``: search a schedule for a function, then run it.

Example:
    >>> p = planner.plan(step_fn, params, batch, mesh=mesh)        # doctest: +SKIP
    >>> print(p.explain()); p.in_specs; p.to_json()
    >>> fast = planner.auto_shard(step_fn, mesh=mesh)              # plans once per input shapes
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from planner.analysis import analyze
from planner.calls import ArgumentMismatch, Signature
from planner.dataflow import dataflow, input_spec, output_specs
from planner.explanation import explain_rows, render
from planner.ir import Program
from planner.lowering import Lowered, lower
from planner.memory import AUTO, default_calibration, search_within
from planner.schedule import Schedule, Spec, make_schedule
from planner.simulator import simulate
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


@dataclasses.dataclass(eq=False)  # hashed by identity, as jax.jit(plan) needs
class AutoPlan:
    """A searched schedule with its prediction; callable: calling it runs :meth:`jit` (compiled on
    first use), and ``plan.lowered`` is the explicit lowering of the same schedule.

    ``in_specs`` / ``out_specs`` are ``PartitionSpec``s over ``spec_mesh``: the user's mesh, or,
    when the plan splits a dimension by part of a mesh axis, the same devices with that axis split
    into its prime factors (``c:8 -> c_0:2, c_1:2, c_2:2``; ``explain()`` says so).
    ``in_shardings`` / ``out_shardings`` are the same as ``NamedSharding``s (a concrete mesh is
    needed for those and to run the plan: :meth:`bind`; everything else works on an
    ``AbstractMesh`` or a ``{name: size}`` mesh). :meth:`save` keeps it in a file.
    """

    program: Program
    schedule: Schedule
    prediction: object
    mesh: object
    search_s: float
    in_tree: object
    out_tree: object
    replicated: object = None
    calibration: Calibration | None = None  # what the plan was priced on
    signature: Signature | None = None  # the arguments it was made for (planner.calls)
    donate_argnums: tuple[int, ...] = ()  # what jit() donates unless told otherwise

    @functools.cached_property
    def _signature(self) -> Signature:
        if self.signature is not None:
            return self.signature
        specs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in self.program.inputs]
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
        devices = _devices(self.mesh)
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
        too (on meshes with Explicit axes, whose values carry their sharding in their type, the
        boundary shardings only). ``moves`` says who makes the plan's changes of layout:
        ``"auto"``: ``redist`` where XLA would rematerialise (replicate, then slice) or ``redist``
        is predicted faster, XLA elsewhere (:meth:`move_choices` lists them); ``"xla"``: XLA;
        ``"redist"``: ``redist``. ``jit_kwargs`` go to ``jax.jit`` (``donate_argnums``,
        ``donate_argnames``). It takes the arguments the plan was made for: static ones (those
        without arrays) are ``static_argnums``, and each new structure, shape, dtype or static
        value is refused when traced (:class:`planner.calls.ArgumentMismatch`); with keyword
        arguments it is a :class:`planner.calls.KeywordJit`.

        Example:
            >>> step = plan.jit(donate_argnums=0)       # doctest: +SKIP
            >>> step.lower(*args).compile()
        """
        for k in ("in_shardings", "out_shardings"):
            if k in jit_kwargs:
                raise TypeError(f"plan.jit sets {k} itself; got {k}=")
        if self.donate_argnums:
            jit_kwargs.setdefault("donate_argnums", self.donate_argnums)
        in_shardings, out_shardings = jax.tree.leaves(self.in_shardings), self.out_shardings
        body = self._xla_lowered(moves).body
        return self._signature.jit(body, in_shardings, out_shardings, self.out_tree, **jit_kwargs)

    def _xla_lowered(self, moves: str) -> Lowered:
        explicit = any(str(t).endswith("Explicit") for t in getattr(self.mesh, "axis_types", ()))
        backend = "xla-inputs" if explicit else "xla"
        return Lowered(self.program, self.schedule, self.mesh, backend, moves, self.calibration)

    def move_choices(self, moves: str = "auto") -> list:
        """For every change of layout the plan makes, how XLA and ``redist`` would make it and
        which :meth:`jit` uses (:class:`planner.xla_moves.MoveChoice`; ``print`` them)."""
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
        if self.spec_mesh != self.mesh_shape:
            lines.append(
                f"the plan splits by parts of mesh axes: its specs are over {self.spec_mesh}, the "
                f"same devices as {self.mesh_shape} (plan.spec_mesh)"
            )
        return "\n".join(lines)

    def explain(self, verbose: bool = False) -> str:
        """One screen (:mod:`planner.summary`): the prediction against replication, data
        parallelism and FSDP, the inputs' layouts, the heavy ops and the user's lines that made
        them, collectives, memory, and what runs whole. ``verbose``: then every op."""
        from planner.summary import summarize

        text = summarize(self).text()
        if verbose:
            text += "\n\nEvery op:\n" + self.summary() + "\n" + render(self.explain_json())
        return text

    def compiled_report(self, mesh=None, moves: str = "auto"):
        """Compile :meth:`jit` for ``mesh`` (default: the plan's own; a plan made on an
        ``AbstractMesh`` or ``{name: size}`` is bound to a concrete mesh of the same axes, e.g.
        :func:`planner.topology_mesh`, without searching again) and return the compiler's
        verdict (:class:`planner.compiled.CompiledReport`)."""
        from planner.compiled import plan_compiled_report

        return plan_compiled_report(self, mesh, moves)

    def explain_json(self) -> list[dict]:
        return explain_rows(self.program, self.schedule, self.mesh_shape)

    def save(self, path: str) -> None:
        """Write the plan to ``path`` as JSON; :func:`planner.load` restores it without searching
        (see :mod:`planner.persistence` for the format)."""
        from planner import persistence

        persistence.save(self, path)

    def bind(self, mesh) -> AutoPlan:
        """This plan on ``mesh``, a ``jax.sharding.Mesh`` with the axis names and sizes of the
        (abstract) mesh it was made for: a new plan with shardings, that runs. Raises
        ``ValueError`` naming what differs."""
        from planner import persistence

        return persistence.bind(self, mesh)

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


def _devices(mesh):
    try:
        return getattr(mesh, "devices", None)
    except (NotImplementedError, ValueError):  # an AbstractMesh
        return None


def plan(
    fn: Callable,
    *args,
    mesh,
    memory_limit_bytes: int | float | str | None = AUTO,
    calibration: Calibration | None = None,
    donate_argnums: int | Sequence[int] = (),
    pipeline_axis: str | None = None,
    microbatches: int | Sequence[int] | None = None,
    **kwargs,
) -> AutoPlan:
    """Analyse ``fn(*args, **kwargs)`` (pytrees of arrays or ``jax.ShapeDtypeStruct``s; arguments
    without arrays are static, see :mod:`planner.calls`), search the best schedule on ``mesh`` (a
    ``Mesh``, an ``AbstractMesh`` or ``{name: size}``), return the plan.

    ``calibration`` prices time: by default the shipped one for the mesh's devices (a mesh from
    :func:`planner.topology_mesh` is priced as its TPU) or else for ``jax.default_backend()``;
    plan for another machine with e.g. ``Calibration.named("tpu_v5p")`` (see
    :mod:`redist.calibration`).

    ``memory_limit_bytes``: peak bytes per device no plan may be predicted over. ``"auto"`` (the
    default): the calibration's memory per device less :data:`planner.memory.MEMORY_RESERVE`
    (10%); a number: that; ``None`` or ``float("inf")``: no limit. When nothing fits,
    :class:`planner.memory.MemoryLimitError` names the smallest peak found and its largest
    buffers.

    ``donate_argnums``: the arguments whose buffers each call donates, as ``jax.jit``'s (e.g. the
    parameters and optimizer state of a training step): outputs of the same shape, dtype and
    layout are written into them, which the predicted peak counts on, and :meth:`AutoPlan.jit`
    donates them.

    ``pipeline_axis``: a mesh axis the plan may run the program's scanned layers over as GPipe
    stages (:mod:`planner.staging`): the layers split into as many stages as the axis has
    devices, the batch into ``microbatches`` (a count, counts to try, or by default P, 2P, 4P
    and 8P), the layers searched on the other axes; the plan is pipelined where that is
    predicted faster than the best plan without a pipeline (or where only it fits).
    """
    sig = Signature.of(args, kwargs)
    traced, values = sig.traced(fn, args, kwargs)
    positional = [() if a.static else x for a, x in zip(sig.args, args)]  # static: no inputs
    prog = donating(analyze(traced, *values), positional, donate_argnums)
    sizes = mesh_shape(mesh).sizes
    calibration = calibration or default_calibration(mesh)
    start = time.perf_counter()
    sched, pred = _search(prog, sizes, calibration, memory_limit_bytes, pipeline_axis,
                          microbatches)  # fmt: skip
    elapsed = time.perf_counter() - start
    replicated = simulate(prog, make_schedule(prog, {}, sizes, default="replicate"), calibration)
    out_tree = jax.tree.structure(jax.eval_shape(traced, *values))
    return AutoPlan(prog, sched, pred, mesh, elapsed, sig.in_tree, out_tree, replicated,
                    calibration, sig, _argnums(donate_argnums, len(args)))  # fmt: skip


def _search(prog, sizes, calibration, memory_limit_bytes, pipeline_axis, microbatches):
    """The best schedule, with a pipeline over ``pipeline_axis`` where that is better."""
    if pipeline_axis is None:
        if microbatches is not None:
            raise ValueError("microbatches needs a pipeline_axis to pipeline over")
        return search_within(prog, sizes, calibration, memory_limit_bytes)
    from planner.memory import MemoryLimitError, resolve_memory_limit
    from planner.staging import search_staged

    limit = resolve_memory_limit(memory_limit_bytes, calibration, math.prod(sizes.values()))
    flat, error = None, None
    try:
        flat = search_within(prog, sizes, calibration, memory_limit_bytes)
    except MemoryLimitError as e:
        error = e
    piped = search_staged(prog, sizes, calibration, limit, pipeline_axis, microbatches)
    if flat is None and piped is None:
        raise error
    if piped is None or (flat is not None and flat[1].time_s <= piped[1].time_s):
        return flat
    return piped


def _argnums(donate_argnums, n: int) -> tuple[int, ...]:
    nums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    for k in nums:
        if not isinstance(k, int) or not -n <= k < n:
            raise ValueError(f"donate_argnums={donate_argnums!r}: the function takes {n} "
                             "positional arguments; give their positions")  # fmt: skip
    return tuple(sorted({k % n for k in nums}))


def donating(prog: Program, args: tuple, donate_argnums) -> Program:
    """``prog`` with the inputs of the positional ``args`` numbered ``donate_argnums`` donated
    (:attr:`planner.ir.Program.donated`): ``prog.inputs`` are the leaves of ``args`` in order."""
    nums = _argnums(donate_argnums, len(args))
    if not nums:
        return prog
    names, k = [], 0
    for i, arg in enumerate(args):
        n = len(jax.tree.leaves(arg))
        if i in nums:
            names += [v.name for v in prog.inputs[k : k + n]]
        k += n
    return dataclasses.replace(prog, donated=frozenset(names))


def auto_shard(
    fn: Callable, *, mesh, memory_limit_bytes: int | float | str | None = AUTO
) -> Callable:
    """``fn`` planned on its first call for each signature (input structure, shapes, dtypes and
    static arguments, see :mod:`planner.calls`), then run."""
    plans: dict = {}

    def wrapped(*args, **kwargs):
        key = Signature.of(args, kwargs).key
        if key not in plans:
            plans[key] = plan(fn, *args, mesh=mesh, memory_limit_bytes=memory_limit_bytes,
                              **kwargs)  # fmt: skip
        return plans[key](*args, **kwargs)

    wrapped.plans = plans
    return wrapped
