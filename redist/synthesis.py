"""``synthesize``: the pure entry point from two types to a cached :class:`Plan` (no JAX)."""

from __future__ import annotations

import dataclasses
import functools
import math

from redist.concrete import make_plan, reduce_pending
from redist.cost import (
    COST_MODELS,
    cost_model_ok,
    is_calibrated,
    model_calibration,
    plan_cost,
    plan_weight,
)
from redist.search import weak_paths
from redist.steps import Plan
from redist.types import DistType, MeshShape, padded_size
from redist.uneven import parts, reblocks, with_sizes, working_extent

# Chunks below this many bytes keep the final permutation separate: rounds of small messages
# are latency-bound. Measured by experiments/fold_threshold.py on 8 CPU devices: folding is slower
# below 256 KiB chunks and on par or faster from 384-512 KiB, for groups of 2, 4 and 8.
FOLD_MIN_BYTES = 512 << 10


@functools.lru_cache(maxsize=4096)
def synthesize(
    mesh: MeshShape,
    src: DistType,
    dst: DistType,
    dtype: str,
    itemsize: int,
    cost_model: str = "bytes",
    fold_min_bytes: int = FOLD_MIN_BYTES,
) -> Plan:
    """The memory-bounded, near-optimal plan from ``src`` to ``dst`` (cached on its inputs).

    ``cost_model`` is what the search minimizes: ``"bytes"`` (the paper's Fig. 11),
    ``"bytes+copies"`` (bytes plus local copies) or ``"calibrated"`` (time: latency + bandwidth
    per collective, from the calibration file; see :mod:`redist.cost`). Either way the plan
    reports the paper's ``cost_bytes`` and stays within the memory bound.

    Raises:
        ValueError: if the global shapes differ.
    """
    if src.global_shape != dst.global_shape:
        raise ValueError(
            f"source global shape {src.global_shape} differs from destination {dst.global_shape}"
        )
    if not cost_model_ok(cost_model):
        raise ValueError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")
    if src.pending:
        return _reduce_then_move(mesh, src, dst, dtype, itemsize, cost_model, fold_min_bytes)
    if src.global_size == 0:  # nothing to move: the destination layout is had for free
        return Plan(mesh, src, dst, dtype, itemsize, ())
    most = model_calibration(cost_model).fold_max_bytes if is_calibrated(cost_model) else None

    def planned(model: str) -> Plan:
        return searched(mesh, src, dst, dtype, itemsize, model, fold_min_bytes, most)

    plan = planned(cost_model)
    if not is_calibrated(cost_model):
        return plan
    timed, lean = plan, planned("bytes")
    plan = fewer_bytes_unless_faster(timed, lean, cost_model)
    cal = model_calibration(cost_model)
    if cal.memory_tie:  # the other candidate, where it holds less within the tie
        plan = leaner(plan, timed if plan is lean else lean, cal)
    return in_series(plan) if cal.serial_rounds else plan


def searched(
    mesh: MeshShape,
    src: DistType,
    dst: DistType,
    dtype: str,
    itemsize: int,
    model: str,
    fold_min_bytes: int = FOLD_MIN_BYTES,
    fold_max_bytes: int | None = None,
) -> Plan:
    """The plan ``model``'s search finds and lowers, before :func:`synthesize` weighs it against
    the bytes model's and the memory tie (``fold_max_bytes``: the calibration's limit on folding
    a permutation into an all-to-all, :attr:`Calibration.fold_max_bytes`).

    Example:
        >>> searched(mesh, src, dst, "float32", 4, "calibrated:tpu_v5p").kinds  # P4  # doctest: +SKIP
        ('allpermute', 'allgather', 'allgather')
    """
    paths = weak_paths(src.global_shape, src.local_shape, dst.local_shape, mesh.primes, itemsize,
                       model)  # fmt: skip
    return make_plan(mesh, src, dst, paths, dtype, itemsize, fold_min_bytes, model, fold_max_bytes)


def in_series(plan: Plan) -> Plan:
    """``plan`` run in rounds of ``ppermute`` one after another where XLA:GPU would otherwise
    hold more (:attr:`Calibration.serial_rounds`): every alltoall that permutes its results,
    and a last allgather into a dimension after one the tile splits (whose result layout is
    fixed, so XLA:GPU stages the whole result to transpose it into place).

    Example:
        >>> [s.serial for s in in_series(plan).steps]   # r0014 on 8 GPUs  # doctest: +SKIP
        [True]
    """
    steps = list(plan.steps)
    for k, s in enumerate(steps):
        if s.kind == "alltoall" and s.perm:
            steps[k] = dataclasses.replace(s, serial=True)
    last = steps[-1] if steps else None
    if last is not None and last.kind == "allgather" and _after_a_split(last):
        steps[-1] = dataclasses.replace(last, serial=True)
    return dataclasses.replace(plan, steps=tuple(steps))


def _after_a_split(step) -> bool:
    """Whether ``step``'s dimension comes after one its result's tile holds more than once."""
    return any(n != 1 for n in step.after.local_shape[: step.dim])


def fewer_bytes_unless_faster(timed: Plan, lean: Plan, model: str) -> Plan:
    """``timed`` (the calibrated search's plan) where it is priced faster than ``lean`` (the
    bytes model's) as lowered, the permutations lowering adds included (:func:`plan_weight`),
    else ``lean``: the weak search cannot see those permutations, and a plan that moves more
    bytes must be faster for it. A ``lean`` of slices alone is taken outright: any other plan
    writes the same destination tile and communicates besides. (The CPU calibration prices an
    all-gather's bytes above a copy's rate, as it times collectives in a chain whose kernels
    write their results, so by its figures slicing a small tile and gathering it could look
    cheaper than slicing once; measured on 8 CPU devices, it is 1.4-1.7x slower.)

    Example:
        >>> fewer_bytes_unless_faster(timed, lean, "calibrated").kinds   # r0029  # doctest: +SKIP
        ('dynslice',)
    """
    if lean.cost_bytes >= timed.cost_bytes:
        return timed
    if lean.cost_bytes == 0:  # slices alone: every other plan writes the same tile, and sends
        return lean
    if model_calibration(model).fold_max_bytes is not None:
        # TPU: the bytes plan may run a permutation of large chunks inside its all-to-all,
        # which the compiler stages whole (Calibration.fold_max_bytes); time does not see it
        return timed
    return timed if plan_weight(timed, model) < plan_weight(lean, model) else lean


def leaner(fast: Plan, lean: Plan, cal) -> Plan:
    """``lean`` where it holds less at once than ``fast`` (:attr:`Plan.held_bytes`) and is
    predicted within the calibration's ``memory_tie`` of its time on ``cal``, else ``fast``: on
    TPU calibrations the compiler's temporaries follow the tiles a plan holds at once.

    Example:
        >>> leaner(fast, lean, Calibration.named("tpu_v5p")) is lean  # P4   # doctest: +SKIP
        True
    """
    if lean.held_bytes >= fast.held_bytes:
        return fast
    within = plan_cost(lean, cal)[0] <= (1 + cal.memory_tie) * plan_cost(fast, cal)[0]
    return lean if within else fast


def _reduce_then_move(mesh, src, dst, dtype, itemsize, cost_model, fold_min_bytes,
                      extent=None) -> Plan:  # fmt: skip
    """Reduce the pending sum first, then move: a reduce-scatter onto any dimension its factors
    divide, or an all-reduce; the cheapest total (then fewest collectives) wins. Memory stays
    within ``max(src tile, dst tile)``: the reduction's result is no larger than its input. With
    an ``extent`` (uneven layouts) the rest is planned by :func:`synthesize_uneven`: partial
    tiles hold no rows to reblock until they are summed."""
    if src.global_size == 0:
        return Plan(mesh, src, dst, dtype, itemsize, (), extent)
    n = math.prod(mesh.factor_size[a] for a in src.pending)
    options = [d for d, dim in enumerate(src.dims) if dim.local % n == 0] + [None]
    best = None
    for dim in options:
        first = reduce_pending(mesh, src, dim, itemsize)
        args = (dtype, itemsize, cost_model, fold_min_bytes)
        rest = synthesize(mesh, first.after, dst, *args) if extent is None \
            else synthesize_uneven(mesh, first.after, dst, extent, *args)  # fmt: skip
        plan = Plan(mesh, src, dst, dtype, itemsize, (first, *rest.steps), extent)
        key = (plan.cost_bytes, plan.num_collectives, dst.dim_of(first.axes[0]) != dim)
        if best is None or key < best[0]:
            best = (key, plan)
    return best[1]


@functools.lru_cache(maxsize=4096)
def synthesize_uneven(
    mesh: MeshShape,
    src: DistType,
    dst: DistType,
    extent: tuple[int, ...],
    dtype: str,
    itemsize: int,
    cost_model: str = "bytes",
    fold_min_bytes: int = FOLD_MIN_BYTES,
) -> Plan:
    """The plan moving an array of true shape ``extent`` between layouts typed at their padded
    sizes (``src``, ``dst``; see :mod:`redist.uneven`): reblocks onto the working extent, the
    even plan there, reblocks off it. Equals :func:`synthesize` where nothing is padded.

    Raises:
        ValueError: if a padded size is not ``extent``'s dimension padded to its parts.
    """
    for name, t in (("source", src), ("destination", dst)):
        for i, (n, d) in enumerate(zip(extent, t.dims, strict=True)):
            if d.size < n:
                raise ValueError(
                    f"the {name}'s dimension {i} has size {d.size}, less than its extent {n} "
                    f"(padded to its {parts(d)} parts: {padded_size(n, parts(d))})"
                )
    if src.global_shape == dst.global_shape == extent:
        return synthesize(mesh, src, dst, dtype, itemsize, cost_model, fold_min_bytes)
    if math.prod(extent) == 0:
        return Plan(mesh, src, dst, dtype, itemsize, (), extent)
    if src.pending:
        return _reduce_then_move(mesh, src, dst, dtype, itemsize, cost_model, fold_min_bytes,
                                 extent)  # fmt: skip
    work = tuple(working_extent(n, s.size, parts(s), d.size, parts(d))
                 for n, s, d in zip(extent, src.dims, dst.dims))  # fmt: skip
    s_work, d_work = with_sizes(src, work), with_sizes(dst, work)
    core = synthesize(mesh, s_work, d_work, dtype, itemsize, cost_model, fold_min_bytes)
    steps = (
        *reblocks(mesh, src, s_work, extent, itemsize),
        *core.steps,
        *reblocks(mesh, d_work, dst, extent, itemsize),
    )
    return Plan(mesh, src, dst, dtype, itemsize, steps, extent)
