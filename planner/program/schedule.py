"""Schedules: which mesh axes split which loops of each op, and the layouts that follow.

A schedule maps op name -> {loop name: mesh axis or tuple of axes (major first)}. Axes may be
whole mesh axes (``"a"``) or their prime factors (``"a#0"``, ``"a#1"`` for ``a:4``, major first, as
in :mod:`redist.types`); internally every axis is a prime factor. Ops not named
get theirs by propagation: forward from the layouts their operands already have, then backward
from their consumers' requirements, so that a user names only a few ops (as with GSPMD
annotations).

Example:
    >>> sched = prog.schedule({"dot_general_0": {"m": "a", "n": ("b", "c")}}, mesh)  # doctest: +SKIP

A schedule may run scans as GPipe pipelines (:class:`Stages`: a scan's layers cut into stages
over a mesh axis, its batch into microbatches; what that implies is in
:mod:`planner.layout.staging`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from planner.program.halo import split
from planner.program.ops import Access, Op
from planner.program.rules import COMBINABLE, IDENTITIES
from redist.types import MeshShape, padded_size

if TYPE_CHECKING:  # Program.schedule makes schedules, so this module sees Program as a type only
    from planner.program.ir import Program


@dataclasses.dataclass(frozen=True)
class Stages:
    """A scan of a planned program run as a GPipe pipeline: the region starting at op index
    ``region``, its layers cut into stages over mesh axis ``axis`` (one stage per position along
    it), its batch into ``microbatches`` (see :mod:`planner.program.microbatch`).

    With ``repeats`` ``R > 1`` the pipeline is circular (MaxText's ``num_pipeline_repeats``):
    the layers are cut into ``R P`` chunks, chunk ``c`` run by stage ``c mod P``, so each
    microbatch goes round the stages ``R`` times and the bubble shrinks ``R``-fold
    (:func:`planner.cost.pipeline.bubble`); the stacked values enter in circular order and
    leave in layer order again (:func:`planner.layout.staging.circular_rounds`).

    Example:
        >>> Stages(region=37, axis="pipe", microbatches=8)
        Stages(region=37, axis='pipe', microbatches=8, repeats=1)
    """

    region: int
    axis: str
    microbatches: int
    repeats: int = 1


def stage_factors(axis: str, sizes: dict[str, int]) -> tuple[str, ...]:
    """The prime factors of mesh axis ``axis`` among a factored mesh's ``sizes`` (major first).

    Example:
        >>> stage_factors("pipe", {"pipe#0": 2, "pipe#1": 2, "data": 2})
        ('pipe#0', 'pipe#1')
    """
    found = tuple(a for a in sizes if a == axis or a.startswith(f"{axis}#"))
    if not found:
        axes = sorted({a.split("#")[0] for a in sizes})
        raise ValueError(f"pipeline axis {axis!r} is not a mesh axis; the mesh has {axes}")
    return found


Axes = tuple[str, ...]
Spec = tuple[Axes, ...]  # per array dimension, the mesh axes splitting it (major first)


def local_shape(shape, spec: Spec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Per-device shape of an array of ``shape`` laid out as ``spec`` over mesh factor ``sizes``:
    ``ceil(n / parts)`` per dimension, the last tiles padded where the parts do not divide ``n``
    (as XLA lays it out).

    Example:
        >>> local_shape((12, 6), (("a",), ()), {"a": 8})
        (2, 6)
    """
    return tuple(tile(n, math.prod(sizes[a] for a in axes)) for n, axes in zip(shape, spec))


def tile(extent: int, parts: int) -> int:
    """Rows per device of a dimension of ``extent`` split ``parts`` ways (padded where xla).

    Example:
        >>> tile(50257, 8)
        6283
    """
    return padded_size(extent, parts) // parts


def is_even(shape, spec: Spec, sizes: Mapping[str, int]) -> bool:
    """Whether every dimension of ``shape`` is divided by the parts ``spec`` splits it into."""
    return all(n % math.prod(sizes[a] for a in axes) == 0 for n, axes in zip(shape, spec))


def even_layout(shape, spec: Spec, sizes: Mapping[str, int]) -> Spec:
    """The layout an array of ``shape`` in ``spec`` is held in at the program's boundary, where JAX
    refuses uneven layouts (``in_shardings``, ``out_shardings``, ``device_put``): ``spec`` where
    even; else the axes of each dimension they do not divide move to the largest dimension they
    divide with the axes already there (an embedding split by vocabulary 50,257 is held split by
    its width), or are dropped where none is.

    Example:
        >>> even_layout((50257, 768), (("a",), ()), {"a": 8})
        ((), ('a',))
    """
    if is_even(shape, spec, sizes):
        return spec
    dims = [tuple(axes) for axes in spec]
    loose: list[str] = []
    for d, (n, axes) in enumerate(zip(shape, spec)):
        if n % math.prod(sizes[a] for a in axes):
            dims[d], loose = (), loose + list(axes)
    parts = math.prod(sizes[a] for a in loose)
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[d] % (math.prod(sizes[a] for a in dims[d]) * parts) == 0:
            dims[d] += tuple(loose)
            break
    return tuple(dims)


def uneven_splittable(op: Op, loop: str) -> bool:
    """Whether ``loop`` of ``op`` may be split into parts that do not divide its extent (padded
    tiles, run by XLA's partitioner: :meth:`planner.AutoPlan.jit`). Not a loop of an op with
    windows (a convolution or pool split spatially runs on its own tiles, unpadded), of an access
    with a halo, or a loop of merged dimensions (a reshape: padding one loop is no padding of
    the merged dimension)."""
    if op.windows:
        return False
    for acc in op.operands + op.results:
        for k, d in enumerate(acc.dims):
            if loop in d and (len(d) > 1 or any(acc.halo[k : k + 1] and acc.halo[k])):
                return False
    return True


def splits(op: Op, loop: str, parts: int, xla: bool = False) -> bool:
    """Whether ``loop`` of ``op`` may be split ``parts`` ways: a partitionable loop whose extent
    ``parts`` divides; with ``xla``, also splits only XLA's partitioner runs (``plan.jit``): a
    loop of at least ``parts`` iterations that :func:`uneven_splittable` allows (padded tiles),
    and a looked-up dimension of a gather or scatter (:attr:`Loop.masked`).

    Example:
        >>> splits(op, "n", 8, xla=True)   # n = 50257             # doctest: +SKIP
        True
    """
    lp = op.loop[loop]
    if not lp.partitionable or (lp.masked and not xla):
        return False
    if lp.extent % parts == 0:
        return True
    return xla and lp.extent >= parts and uneven_splittable(op, loop)


def xla_splits(sched: Schedule) -> list[str]:
    """The splits of ``sched`` only XLA's partitioner runs, as ``"op, loop l (50257 over 8)"`` for
    a loop split into parts that do not divide it and ``"op, loop l (looked up, masked)"`` for a
    gather's or scatter's looked-up dimension (empty for a schedule any backend runs)."""
    out = []
    for o in sched.program.ops:
        for lp in o.loops:
            axes = sched.axes_of(o, lp.name)
            parts = math.prod(sched.mesh[a] for a in axes)
            if lp.extent % parts:
                out.append(f"{o.name}, loop {lp.name} ({lp.extent} over {parts})")
            elif lp.masked and axes:
                out.append(f"{o.name}, loop {lp.name} (looked up, masked)")
    return out


def _axes(value) -> Axes:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Assignments of mesh factors to loops, per op; ``mesh`` maps factor names to sizes."""

    program: Program
    mesh: dict[str, int]
    assign: dict[str, dict[str, Axes]]
    stored: dict[str, Spec] = dataclasses.field(
        default_factory=dict
    )  # input name -> at-rest layout
    stages: tuple = ()  # planner.program.schedule.Stages: scans run as pipelines

    def __post_init__(self):
        # the user's shard_maps keep their layouts in every schedule (in place: a schedule
        # being propagated shares its assignment dict with the propagation)
        pinned = self.program.manual_assignment
        if pinned and any(self.assign.get(name) != loops for name, loops in pinned.items()):
            self.assign.update(pinned)

    def axes_of(self, op: Op, loop: str) -> Axes:
        return self.assign.get(op.name, {}).get(loop, ())

    def spec(self, op: Op, access: Access) -> Spec:
        """The layout ``access`` has under this schedule (operand required / result produced).
        A pipelined scan's stacked inputs and outputs have their layer axis over its stages."""
        loops = self.assign.get(op.name)
        if not loops:  # called a million times in a search: the common cases first
            spec: Spec = ((),) * len(access.dims)
        else:
            spec = tuple(
                [
                    loops.get(d[0], ())
                    if len(d) == 1
                    else tuple([a for lp in d for a in loops.get(lp, ())])
                    for d in access.dims
                ]
            )
        staged = self.staged.get(op.name) if self.stages else None
        if staged and access is (op.operands[0] if op.primitive == "scan_xs" else op.results[0]):
            spec = (staged, *spec[1:])
        return spec

    @functools.cached_property
    def factors(self) -> MeshShape:
        """The mesh this schedule splits over, its axes the prime factors of the user's
        (``a#0``, ``a#1``; an axis of prime size keeps its name), made once per schedule.

        Example:
            >>> sched.factors.factor_size   # doctest: +SKIP
            {'a#0': 2, 'a#1': 2, 'b': 2}
        """
        return MeshShape.of(self.mesh)

    @functools.cached_property
    def staged(self) -> dict[str, Axes]:
        """Entry (``scan_xs``) and exit (``scan_ys``) op name -> the stage axis' factors, for the
        scans this schedule runs as pipelines (:class:`planner.program.schedule.Stages`)."""
        out: dict[str, Axes] = {}
        starts = {st.region: st for st in self.stages}
        for r in self.program.regions:
            st = starts.get(r.start)
            if st is None:
                continue
            axes = stage_factors(st.axis, self.mesh)
            ends = (*self.program.ops[r.start : r.body],
                    *self.program.ops[r.stop - len(r.outputs) : r.stop])  # fmt: skip
            for o in ends:
                if o.primitive in ("scan_xs", "scan_ys"):
                    out[o.name] = axes
        return out

    def pending(self, op: Op) -> Axes:
        """Mesh axes over which the op's results are partial (partitioned reductions)."""
        return tuple(a for lp, _ in op.reductions for a in self.axes_of(op, lp))

    def combine(self, op: Op) -> str:
        """How the partial results are combined: ``"sum"``, ``"max"``, ``"min"``, ``"and"`` or
        ``"or"`` (one kind per op: :func:`check_assignment` refuses mixtures)."""
        kinds = {kind for lp, kind in op.reductions if self.axes_of(op, lp)}
        return kinds.pop() if kinds else "sum"

    def grid(self, op: Op) -> str:
        parts = []
        for lp in op.loops:
            axes = self.axes_of(op, lp.name)
            parts.append(f"{lp.name}:{'x'.join(axes) if axes else '-'}")
        return " ".join(parts)


def factor_axes(shape: MeshShape, axes: Axes, where: str) -> Axes:
    """Whole axes -> their prime factors (major first); factor names pass through."""
    out: list[str] = []
    for a in axes:
        if a in shape.sizes:
            out.extend(shape.axis_factors(a))
        elif a in shape.factor_size:
            out.append(a)
        else:
            raise ValueError(
                f"{where}: unknown mesh axis {a!r}; mesh axes are {shape.axis_names} "
                f"(prime factors {shape.factor_names})"
            )
    return tuple(out)


def check_assignment(shape: MeshShape, op: Op, loops: Mapping, xla: bool = False) -> dict:
    """Validate one op's assignment; raise ``ValueError`` naming the op, loop and sizes. With
    ``xla``, loops may be split into parts that do not divide them (:func:`splits`)."""
    mesh = shape.factor_size
    out: dict[str, Axes] = {}
    seen: dict[str, str] = {}
    for loop, value in loops.items():
        if loop not in op.loop:
            raise ValueError(
                f"op {op.name!r} has no loop {loop!r}; its loops are {[lp.name for lp in op.loops]}"
            )
        axes = factor_axes(shape, _axes(value), f"op {op.name!r}, loop {loop!r}")
        for a in axes:
            if a in seen:
                raise ValueError(
                    f"op {op.name!r}: mesh axis {a!r} is used twice (loops {seen[a]!r} and "
                    f"{loop!r}); an axis may split one loop of an op"
                )
            seen[a] = loop
        lp = op.loop[loop]
        parts = math.prod(mesh[a] for a in axes)
        if axes and not lp.partitionable:
            raise ValueError(
                f"op {op.name!r}, loop {loop!r} cannot be partitioned (its kernel needs the "
                "whole range: gathers, concatenation axes, convolution windows, arg-reductions)"
            )
        if axes and lp.masked and not xla:
            raise ValueError(
                f"op {op.name!r}, loop {loop!r} is the dimension a {op.primitive} looks up; only "
                "XLA's partitioner splits it (each device looks up its own range, the rest "
                "masked): make the schedule with xla=True and run it with plan.jit"
            )
        if axes and not splits(op, loop, parts, xla):
            hint = (
                "; with xla=True (run by plan.jit) a loop of at least that many iterations "
                "may be split, padded, unless its tiles must line up with another array's"
                if not xla
                else " (not a loop of a convolution or pool, with a halo or the major loop of a "
                "reshape)"
            )
            raise ValueError(
                f"op {op.name!r}, loop {loop!r} of extent {lp.extent} is not divisible by the "
                f"{parts} parts of mesh axes {axes}; choose axes whose sizes divide {lp.extent}"
                + hint
            )
        if axes:
            out[loop] = axes
    for w in op.windows:
        parts = math.prod(mesh[a] for a in out.get(w.owner, ()))
        if split(w, parts) is None:
            raise ValueError(
                f"op {op.name!r}, loop {w.owner!r}: its input dimension {w.dim} of size {w.size} "
                f"cannot be split in {parts} tiles with a halo (the tiles must divide it, line up "
                f"with the {'output' if w.by_output else 'window'}'s tiles, as 'SAME' padding "
                "does, and be at least as wide as the halo)"
            )
    kinds = {kind for lp, kind in op.reductions if out.get(lp)}
    if kinds - COMBINABLE or len(kinds) > 1:
        raise ValueError(
            f"op {op.name!r}: partitioned reductions of kinds {sorted(kinds)} cannot be combined; "
            f"split one kind of {sorted(COMBINABLE)} at a time"
        )
    for d in op.merged:
        if _strided(op, d, out, mesh):
            raise ValueError(
                f"op {op.name!r}: loops {d} are merged into one dimension; a loop after "
                f"{d[0]!r} may be partitioned only where every loop before it is split into "
                "single iterations (else its tiles are strided, not blocks)"
            )
    return out


def _strided(op: Op, dims: tuple[str, ...], loops: Mapping[str, Axes], mesh) -> bool:
    """Whether ``loops`` split a loop of merged ``dims`` after one not split into single
    iterations: its tiles of the merged dimension would be strided, not blocks.

    Example: ``dims=("c", "r")``, ``c`` of 4 over ``a:4``, ``r`` over ``b``: blocks (False);
    ``c`` over ``a:2``: strided (True).
    """
    whole = False
    for lp in dims:
        parts = math.prod(mesh[a] for a in loops.get(lp, ()))
        if whole and parts > 1:
            return True
        whole = whole or parts != op.loop[lp].extent
    return False


def _spread(op: Op, loop: str, axes: Axes, mesh) -> list[tuple[str, Axes]]:
    """``axes`` asked of ``loop``, the major loop of a merged dimension, spread over that
    dimension's loops major first: a loop takes the axes whose sizes multiply to its extent,
    the next loop the rest (``(f#0, ..., f#8)`` over ``(c=4, r=256)``: ``c`` the first two).
    Elsewhere ``[(loop, axes)]``."""
    for d in op.merged:
        if d[0] == loop:
            size, k = 1, 0
            while k < len(axes) and size < op.loop[loop].extent:
                size, k = size * mesh[axes[k]], k + 1
            if size == op.loop[loop].extent and k < len(axes):
                return [(loop, axes[:k]), *_spread(op, d[1], axes[k:], mesh)]
    return [(loop, axes)]


def make_schedule(
    prog: Program,
    assign: Mapping[str, Mapping],
    mesh: Mapping[str, int],
    default="propagate",
    stored: Mapping[str, Sequence] | None = None,
    xla: bool = False,
    order: str = "largest",
) -> Schedule:
    """Validate the named ops' assignments and complete the others (``default``).

    ``default="propagate"`` fills unnamed ops from their neighbours; ``"replicate"`` leaves them
    unpartitioned. ``stored`` gives inputs an at-rest layout (input name -> axes per dimension,
    e.g. FSDP's sharded parameters); such inputs are moved to what their consumers need, and
    propagation starts from it. Other inputs are stored as their first consumer needs them.
    ``xla``: loops may be split into parts that do not divide them (:func:`splits`; padded
    tiles, which only XLA's partitioner runs: :meth:`planner.AutoPlan.jit`, the ``"xla"`` backend).
    ``order``: how an op settles operands that want one mesh axis (:data:`ORDERS`).
    """
    shape = MeshShape.of(mesh)
    mesh = shape.factor_size
    names = {o.name for o in prog.ops}
    for name in assign:
        if name not in names:
            raise ValueError(f"schedule names unknown op {name!r}; ops are {sorted(names)}")
    if default not in ("propagate", "replicate"):
        raise ValueError(f"default must be 'propagate' or 'replicate', got {default!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    fixed = {
        o.name: check_assignment(shape, o, assign[o.name], xla)
        for o in prog.ops
        if o.name in assign and not o.manual
    }
    fixed.update(prog.manual_assignment)
    at_rest = _stored_specs(prog, shape, stored or {})
    result = dict(fixed)
    if default == "propagate":
        _propagate(prog, mesh, result, set(fixed), at_rest, xla, order)
    for src, dst in prog.ties:  # a scan's carry leaves the body in the layout it entered with
        result[dst] = result.get(src, {})
    return Schedule(prog, mesh, result, at_rest)


def _stored_specs(prog: Program, shape: MeshShape, stored: Mapping) -> dict[str, Spec]:
    inputs = {v.name: v for v in prog.inputs}
    out = {}
    for name, spec in stored.items():
        if name not in inputs:
            raise ValueError(f"stored names unknown input {name!r}; inputs are {sorted(inputs)}")
        v = inputs[name]
        if len(spec) != len(v.shape):
            raise ValueError(
                f"stored layout of {name!r} has {len(spec)} entries for rank {len(v.shape)}"
            )
        dims = tuple(factor_axes(shape, _axes(a), f"input {name!r}") for a in spec)
        for d, (n, axes) in enumerate(zip(v.shape, dims)):
            parts = math.prod(shape.factor_size[a] for a in axes)
            if n % parts:
                raise ValueError(
                    f"input {name!r}, dimension {d} of size {n} is not divisible by the {parts} "
                    f"parts of {axes}"
                )
        out[name] = dims
    return out


ORDERS = ("largest", "loops", "operands")
"""How propagation settles an op's operands that want one mesh axis (:func:`make_schedule`):
``"largest"``, the larger operand's layout wins and its loops take their axes first (XLA's rule
for a product); ``"loops"``, the larger's wins, but the op's loops take axes in their own order;
``"operands"``, the earlier operand's wins, loops in their order. Each is a guess at what XLA's
propagation settles on; none is right for every program (MaxText's Llama 2 7B: ``"largest"``;
its DeepSeek-V3 tiny: ``"operands"``)."""


def _try(
    op: Op, mesh, wanted: dict[str, Axes], xla: bool = False, as_wanted: bool = True
) -> dict[str, Axes]:
    """Keep the wanted loop assignments that are valid for ``op`` (greedy, in the order they are
    wanted where ``as_wanted``: the first operand's layout before a later one's where both want
    an axis, as XLA keeps an activation's batch split and gathers the weight whose contraction
    it splits; else in the op's loop order)."""
    out: dict[str, Axes] = {}
    used: set[str] = set()
    for wanted_loop in wanted if as_wanted else [lp.name for lp in op.loops]:
        asked = wanted.get(wanted_loop, ())
        if not asked or wanted_loop not in op.loop:
            continue
        for loop, axes in _spread(op, wanted_loop, asked, mesh):
            if used & set(axes) or loop in out:
                continue
            if not splits(op, loop, math.prod(mesh[a] for a in axes), xla):
                continue
            out[loop] = axes
            used.update(axes)
    strided = bool(op.merged)
    while strided:  # a minor loop dropped may leave another dimension's tiles strided
        strided = [d for d in op.merged if _strided(op, d, out, mesh)]
        for d in strided:
            for lp in d[1:]:
                out.pop(lp, None)
    for w in op.windows:  # spatial splits whose tiles do not line up (planner.program.halo)
        if split(w, math.prod(mesh[a] for a in out.get(w.owner, ()))) is None:
            out.pop(w.owner)
    return out


def want_loops(access: Access, spec: Spec, wanted: dict, used: set[str] | None = None) -> None:
    """Add to ``wanted`` (loop -> axes) the first loop of each dimension of ``access`` that
    ``spec`` splits, where that loop is not wanted yet (with ``used``: and over axes not used
    yet, which it then records).

    Example:
        >>> wanted = {}; want_loops(x_access, (("fsdp",), ()), wanted)   # doctest: +SKIP
        >>> wanted
        {'i0': ('fsdp',)}
    """
    for d, axes in zip(access.dims, spec):
        if not d or not axes or d[0] in wanted:
            continue
        if used is not None:
            if used & set(axes):
                continue
            used.update(axes)
        wanted[d[0]] = axes


def _users_want(op: Op, consumers, result: dict, sched: Schedule, wanted: dict) -> dict:
    """Add to ``wanted`` the loops of ``op`` its results' partitioned consumers split, as each
    reads them (:func:`want_loops`); returns ``wanted``."""
    for wants in _each_user(op, consumers, result, sched):
        wants(wanted, None)
    return wanted


def _each_user(op: Op, consumers, result: dict, sched: Schedule) -> list[Callable]:
    """Per partitioned consumer of ``op``'s results, ``wants(wanted, used)``: adds the loops it
    splits as it reads them (:func:`want_loops`)."""
    return [functools.partial(want_loops, res, sched.spec(c, acc))
            for res in op.results for c, acc in consumers.get(res.value.name, ())
            if result.get(c.name)]  # fmt: skip


def _refine(
    op: Op, mesh, result: dict, consumers, sched: Schedule, xla: bool, as_wanted: bool = True
) -> bool:
    """Split ``op`` (partitioned already, no reduction) further on loops its consumers split
    and it leaves whole, over axes it does not use (a local slice, no communication), or as one
    consumer splits it where that cuts it into more parts (:func:`_more_specific`), as XLA's
    propagation makes a sharding more specific: the transpose of a weight's gradient takes the
    weight's FSDP split from the update that reads it, and the product's partial sum before it
    becomes a reduce-scatter. Returns whether it changed."""
    if op.reductions:
        return False
    return _more_specific(
        op, mesh, result, xla, as_wanted, _each_user(op, consumers, result, sched)
    )


def _refinable(op: Op) -> bool:
    """Whether an op may split further from its operands' layouts: one with no reduction, one
    reducing every loop (a norm's sum: its partial sums are one number each), or one reducing
    a single operand (a softmax's sum over a vocabulary the logits split: partial sums of the
    smaller result, summed, as XLA partitions a reduce, rather than the logits gathered)."""
    return not op.reductions or len(op.reductions) == len(op.loops) or len(op.operands) == 1


def _refine_from(op: Op, mesh, result: dict, layout: dict, xla: bool, as_wanted: bool,
                 order: str) -> bool:  # fmt: skip
    """Split ``op`` (partitioned already, :func:`_refinable`) further on loops its operands'
    layouts split and it leaves whole, over axes it does not use, or as one operand is split
    where that cuts it into more parts (:func:`_more_specific`), as XLA's propagation makes a
    sharding more specific from an operand too: the square of a weight's gradient for the
    gradient norm takes the FSDP split the gradient gained from its update (MaxText's fsdp x
    tensor layout), rather than gathering it. Returns whether it changed."""
    return _more_specific(op, mesh, result, xla, as_wanted, _each_operand(op, layout, order))


def _operands_want(op: Op, layout: dict, order: str, wanted: dict) -> None:
    """Add to ``wanted`` the loops of ``op`` its operands' ``layout``s split (:func:`want_loops`),
    the operands taken in ``order``'s order (:data:`ORDERS`)."""
    for wants in _each_operand(op, layout, order):
        wants(wanted, None)


def _largest_want(op: Op, layout: dict, result: dict, sched: Schedule, wanted: dict) -> None:
    """Add to ``wanted`` the loops of ``op`` its operands' ``layout``s split and those its
    results' partitioned users (a sharding constraint on the result) split as they read them,
    the largest of these tensors first (:func:`want_loops`), as Shardy resolves a conflict
    between factors: the factor of the larger source tensor wins. MaxText's MLP product reads
    an activation split over ``tensor`` on its contraction, and its result is constrained over
    ``tensor`` on the MLP dimension: the larger result wins, the activation is gathered, rather
    than the result summed over ``tensor`` and scattered."""
    each = [(math.prod(acc.value.shape), functools.partial(want_loops, acc, layout[acc.value.name]))
            for acc in op.operands if acc.value.name in layout]  # fmt: skip
    each += [(math.prod(res.value.shape), functools.partial(want_loops, res, sched.spec(c, acc)))
             for res in op.results for c, acc in sched.program.through_elementwise.get(res.value.name, ())
             if c.primitive in IDENTITIES and result.get(c.name)]  # fmt: skip
    for _, wants in sorted(each, key=lambda e: -e[0]):
        wants(wanted, None)


def _each_operand(op: Op, layout: dict, order: str) -> list[Callable]:
    """Per operand of ``op`` with a ``layout``, in ``order``'s order (:data:`ORDERS`),
    ``wants(wanted, used)``: adds the loops that layout splits (:func:`want_loops`)."""
    accesses = op.operands if order == "operands" else op.operands_by_size
    return [functools.partial(want_loops, acc, layout[acc.value.name])
            for acc in accesses if acc.value.name in layout]  # fmt: skip


def _more_specific(op: Op, mesh, result: dict, xla: bool, as_wanted: bool,
                   each: Sequence[Callable[[dict, set], None]]) -> bool:  # fmt: skip
    """``op``'s assignment with the loops its neighbours want (``each``: one per neighbour,
    ``wants(wanted, used)`` adding its wants over axes not ``used``) where :func:`_try` keeps
    more of them than it has, over axes it does not use; else the loops one neighbour wants
    alone, where they split ``op`` into more parts than it has, the most of those (XLA keeps the
    more specific of two shardings that conflict: an Adam update's split over fsdp x tensor
    reaches back through the gradient's elementwise ops, which their product first split over
    tensor alone). Returns whether it changed."""
    have = result[op.name]
    used = {a for axes in have.values() for a in axes}
    wanted = dict(have)
    for wants in each:
        wants(wanted, used)
    if wanted != have:
        new = _try(op, mesh, wanted, xla, as_wanted)
        if len(new) > len(have):
            result[op.name] = new
            return True
    best, most = have, None
    seen: set[tuple] = set()  # many users often want one thing: each want tried once
    for wants in each:
        alone: dict[str, Axes] = {}
        wants(alone, set())
        key = tuple(alone.items())
        if not alone or key in seen:
            continue
        seen.add(key)
        most = _parts(have, mesh) if most is None else most
        if _parts(alone, mesh) <= most:  # _try keeps some of these axes, so no more parts
            continue
        new = _try(op, mesh, alone, xla, as_wanted)
        parts = _parts(new, mesh)
        if parts > most:
            best, most = new, parts
    if best is have:
        return False
    result[op.name] = best
    return True


def _parts(loops: Mapping[str, Axes], mesh) -> int:
    """How many parts an op's assignment ``loops`` splits it into.

    Example:
        >>> _parts({"m": ("a",), "n": ("b", "c")}, {"a": 2, "b": 2, "c": 3})
        12
    """
    return math.prod([mesh[a] for axes in loops.values() for a in axes])


def _returned_as_asked(prog: Program, fixed: set[str]) -> dict[str, tuple[Op, Access]]:
    """Scan carries (their entering op's name) whose body returns them from a fixed op (a
    sharding constraint, a ``shard_map``) -> that op and its result: the carry takes that
    layout, moved once as the loop starts rather than at every step, as XLA settles a while
    loop's carry on what its body asks (MaxText's decoder carries its activations with the
    batch split its layers constrain, not with the embedding table's split of its lookup)."""
    out = {}
    for src, dst in prog.ties:
        back = prog.op(dst).operands
        p = prog.producer.get(back[0].value.name) if len(back) == 1 else None
        if p is not None and p.name in fixed and len(prog.op(src).results) == 1:
            out[src] = (p, next(r for r in p.results if r.value.name == back[0].value.name))
    return out


def _carry_as_used(entry: Op, exit_: Op, mesh, result: dict, fixed: set[str], consumers,
                   sched: Schedule, xla: bool, as_wanted: bool) -> bool:  # fmt: skip
    """A loop carry nothing split (an accumulator started from zeros) takes the split the
    loop's users want of its final value, as XLA settles a while loop's carry on its users too:
    MaxText's vocabulary tiling accumulates the unembedding's gradient over its chunks, and
    the update that reads it wants it split as the weight is. Returns whether it changed."""
    if result.get(entry.name) or entry.name in fixed:
        return False
    wanted = _users_want(exit_, consumers, result, sched, {})
    new = _try(entry, mesh, wanted, xla, as_wanted) if wanted else {}
    if not new:
        return False
    result[entry.name] = result[exit_.name] = new
    return True


def _propagate(
    prog: Program,
    mesh,
    result: dict,
    fixed: set[str],
    at_rest,
    xla: bool,
    order: str = "largest",
    rounds: int = 3,
    remember: bool = True,
) -> None:
    """Complete ``result`` (op name -> loops -> axes; the ``fixed`` ops' kept): forward from
    the operands' layouts, backward from the users', ``rounds`` times or until nothing changes.
    ``remember``: an op that settled unchanged is not settled again until what it reads
    changes (``False``: every op in every round, the reference the tests hold this to)."""
    consumers = prog.uses
    tied = dict((dst, src) for src, dst in prog.ties)
    returned = _returned_as_asked(prog, fixed)
    sched = Schedule(prog, mesh, result)
    as_wanted = order == "largest"
    near = prog.neighbours if remember else {}
    # (pass, op) -> the assignments it read (its own, its neighbours') when it last settled
    # unchanged: it settles unchanged again while they are the same (a search makes thousands
    # of schedules of MaxText's DeepSeek-V3, each settled here in up to three rounds)
    settled: dict[tuple[int, str], tuple] = {}

    def settles(side: int, o: Op, refine: Callable[[], bool]) -> bool:
        """Whether ``refine()`` changed ``o`` (not called where ``o`` settled unchanged on what
        it reads now: its assignment and those of its operands' producers, ``side`` 0, or of its
        results' users, 1)."""
        read = remember and (result[o.name], *[result.get(n) for n in near[o.name][side]])
        if read and settled.get((side, o.name)) == read:
            return False
        if refine():
            return True
        settled[side, o.name] = read
        return False

    for k in range(rounds):
        changed = False
        # Forward: an op follows the layouts of its operands (after the first round, only ops
        # still unpartitioned, which a later op's requirement may since have reached).
        layout: dict[str, Spec] = dict(at_rest)  # value name -> produced (or stored) layout
        for o in prog.ops:
            if o.name in tied:
                result[o.name] = result.get(tied[o.name], {})
            elif o.name not in fixed and (k == 0 or not result.get(o.name)):
                wanted: dict[str, Axes] = {}
                if o.name in returned:  # a carry the body returns as a constraint asks
                    p, acc = returned[o.name]
                    want_loops(o.results[0], sched.spec(p, acc), wanted)
                if order == "largest":
                    _largest_want(o, layout, result, sched, wanted)
                else:
                    _operands_want(o, layout, order, wanted)
                new = _try(o, mesh, wanted, xla, as_wanted)
                changed |= k > 0 and bool(new)
                result[o.name] = new
            elif o.name not in fixed and _refinable(o):
                changed |= settles(0, o, lambda o=o, layout=layout: _refine_from(
                    o, mesh, result, layout, xla, as_wanted, order))  # fmt: skip
            for acc in o.results:
                layout[acc.value.name] = sched.spec(o, acc)
        # Backward: an op left unpartitioned follows what its consumers require of its results.
        for o in reversed(prog.ops):
            if o.name in tied:
                changed |= _carry_as_used(prog.op(tied[o.name]), o, mesh, result, fixed,
                                          consumers, sched, xla, as_wanted)  # fmt: skip
                continue
            if o.name in fixed:
                continue
            if result.get(o.name):
                changed |= settles(1, o, lambda o=o: _refine(
                    o, mesh, result, consumers, sched, xla, as_wanted))  # fmt: skip
                continue
            wanted = _users_want(o, consumers, result, sched, {})
            result[o.name] = _try(o, mesh, wanted, xla, as_wanted)
            changed |= bool(result[o.name])
        if not changed:
            break
