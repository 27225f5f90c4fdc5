"""The paper's data-transfer cost model (Fig. 11, App. B), in bytes per device.

| step       | cost                                   |
|------------|----------------------------------------|
| dynslice   | 0 (local)                              |
| allgather  | localsize after the step               |
| alltoall   | localsize (unchanged by the step)      |
| allpermute | localsize (unchanged by the step)      |
| reducescatter | localsize before the step (a pending sum reduced onto a dimension) |
| allreduce  | 2 x localsize (a pending sum reduced everywhere: reduce-scatter + all-gather) |

Example:
    >>> step_cost("allgather", before=4, after=8, itemsize=4)
    32
"""

from __future__ import annotations

import functools
import math

from redist.calibration import Calibration, wire_bytes
from redist.collectives import CollectiveKind, of_step

COMMUNICATING = ("alltoall", "allgather", "allpermute", "reducescatter", "allreduce")
COST_MODELS = ("bytes", "bytes+copies", "calibrated")
"""The search's cost models; ``"calibrated:<name>"`` is the calibrated model on the shipped
calibration ``<name>`` (``"calibrated"`` alone: the CPU file), see :func:`cost_model_ok`."""
AUTO = "auto"
"""``redistribute``'s default: the calibrated model on the calibration of the devices the move
runs on (resolved where the mesh is known, :func:`redist.api.resolved_cost_model`)."""
KINDS = ("dynslice",) + COMMUNICATING


def step_cost(kind: str, *, before: int, after: int, itemsize: int) -> int:
    """Bytes per device moved by one step from a tile of ``before`` to ``after`` elements."""
    if kind == "dynslice":
        return 0
    if kind == "allgather":
        return after * itemsize
    if kind in ("alltoall", "allpermute", "reducescatter"):
        return before * itemsize
    if kind == "allreduce":
        return 2 * before * itemsize
    raise ValueError(f"unknown step kind {kind!r}; expected one of {KINDS}")


def local_copy_elems(kind: str, before: tuple[int, ...], after: tuple[int, ...], dim: int) -> int:
    """Elements a step copies locally beyond its communication (row-major tiles).

    A ``dynslice`` materializes its slice; an ``allgather`` or ``alltoall`` whose gathered
    dimension ``dim`` is not leading (a dimension before it has size > 1) must interleave the
    received pieces, which costs a copy of the output. Backends differ; on CPU a local copy costs
    about as much as a transfer, on accelerators much less.

    Example:
        >>> local_copy_elems("allgather", (4, 2), (4, 4), dim=1)
        16
    """
    if kind == "dynslice":
        return math.prod(after)
    if kind in ("allgather", "alltoall") and math.prod(after[:dim]) > 1:
        return math.prod(after)
    return 0


def search_weight(
    kind: str,
    before: tuple[int, ...],
    after: tuple[int, ...],
    dim: int,
    itemsize: int,
    model: str,
    group: int = 2,
) -> int:
    """The edge weight of a weak step under ``model``: bytes per device for ``"bytes"`` and
    ``"bytes+copies"``; for ``"calibrated"``, nanoseconds on the default calibration (latency
    plus wire bytes over bandwidth for the collective over ``group`` devices, plus local copies
    at the copy bandwidth), so that small, latency-bound moves prefer fewer collectives."""
    w = step_cost(kind, before=math.prod(before), after=math.prod(after), itemsize=itemsize)
    if model == "bytes":
        return w
    copies = local_copy_elems(kind, before, after, dim) * itemsize
    if model == "bytes+copies":
        return w + copies
    if is_calibrated(model):
        return _calibrated_ns(kind, w, copies, group, model)
    raise ValueError(f"cost_model must be one of {COST_MODELS}, got {model!r}")


def is_calibrated(model: str) -> bool:
    """``"calibrated"`` or ``"calibrated:<name>"``."""
    return model == "calibrated" or model.startswith("calibrated:")


@functools.cache
def model_calibration(model: str) -> Calibration:
    """The calibration a calibrated cost model prices on: ``"calibrated"`` the shipped CPU file
    (:meth:`Calibration.default`), ``"calibrated:tpu_v5p"`` that shipped file."""
    name = model.partition(":")[2]
    return Calibration.named(name) if name else Calibration.default()


def cost_model_ok(model: str) -> bool:
    """Whether ``model`` names a cost model: one of :data:`COST_MODELS`, or ``"calibrated:<name>"``
    of a shipped calibration."""
    if model in COST_MODELS:
        return True
    if not is_calibrated(model):
        return False
    try:
        model_calibration(model)
    except ValueError:
        return False
    return True


def _calibrated_ns(kind: str, nbytes: int, copies: int, group: int, model: str) -> int:
    cal = model_calibration(model)
    seconds = copies / cal.copy_bytes_per_s
    if kind != "dynslice":
        named = nbytes / 2 if kind == "allreduce" else nbytes  # step_cost counts 2x for it
        seconds += cal.collective_time(of_step(kind), named, group)
    return round(seconds * 1e9)


def plan_weight(plan, model: str) -> int:
    """The search's weight of a concrete ``plan`` (a :class:`redist.steps.Plan`) under ``model``:
    :func:`search_weight` summed over its steps, the permutations that lowering adds included,
    which the weak search does not see. Steps of even layouts only (no reblocks).

    Example:
        >>> plan_weight(plan((8,), P(), P("a"), {"a": 2}), "bytes")      # doctest: +SKIP
        0
    """
    total = 0
    for s in plan.steps:
        group = plan.mesh.num_devices if s.kind == "allpermute" else s.group_size
        dim = max(m[0] for m in s.moves) if s.moves else s.dim or 0
        total += search_weight(s.kind, s.before.local_shape, s.after.local_shape, dim,
                               plan.itemsize, model, group)  # fmt: skip
    return total


def calibrated_floor_ns(nbytes: int, model: str = "calibrated") -> int:
    """A lower bound, in the calibrated ``model``'s nanoseconds, on moving ``nbytes`` per device
    in one or more collectives (A*'s heuristic): the smallest latency plus the bytes at the best
    bandwidth, less a little for rounding."""
    if nbytes <= 0:
        return 0
    cal = model_calibration(model)
    kinds = (CollectiveKind.ALL_TO_ALL, CollectiveKind.ALL_GATHER)
    seconds = min(cal.latency_s[k] for k in kinds) + nbytes / 2 / max(
        cal.bytes_per_s[k] for k in kinds
    )
    return max(0, int(seconds * 1e9) - 16)


def step_costs(plan, cal: Calibration) -> list[tuple[str, float, float]]:
    """``(kind, seconds, wire bytes per device)`` of each step of ``plan`` (a
    :class:`redist.steps.Plan`) on calibration ``cal``; ``kind`` is the calibration's collective
    kind, or ``"copy"`` for a local slice (no wire bytes).

    Example:
        >>> [k for k, _, _ in step_costs(plan((8, 8), P("a"), P(), {"a": 2}),
        ...                              Calibration.named("tpu_v5p"))]      # doctest: +SKIP
        ['all-gather']
    """
    out = []
    n_dev = plan.mesh.num_devices
    for s in plan.steps:
        before = s.before.local_size * plan.itemsize
        after = s.after.local_size * plan.itemsize
        if s.kind == "dynslice":
            out.append(("copy", after / cal.copy_bytes_per_s, 0.0))
            continue
        if s.kind == "reblock":  # rounds of collective-permutes of a few rows (redist.uneven)
            rounds = s.collectives
            seconds = rounds and rounds * cal.collective_time(
                CollectiveKind.PERMUTE, s.cost_bytes / rounds, n_dev
            )
            out.append((CollectiveKind.PERMUTE, seconds, float(s.cost_bytes)))
            continue
        if s.kind == "allgather" and s.serial:  # rounds of collective-permutes of the tile
            rounds = s.group_size - 1
            seconds = rounds * cal.collective_time(
                CollectiveKind.PERMUTE, before, n_dev, cal.crosses(plan.mesh, s.axes)
            )
            out.append((CollectiveKind.PERMUTE, seconds, float(rounds * before)))
            continue
        kind = of_step(s.kind)
        nbytes = {"allgather": after, "allpermute": before * len(s.perm) / n_dev}.get(
            s.kind, before
        )
        n = s.group_size if s.kind != "allpermute" else n_dev
        if s.kind == "allpermute":
            d = cal.domain_devices or n_dev
            crosses = any(a // d != b // d for a, b in s.perm)
        else:
            crosses = cal.crosses(plan.mesh, s.axes)
        out.append(
            (kind, cal.collective_time(kind, nbytes, n, crosses), wire_bytes(kind, nbytes, n))
        )
    return out


def plan_cost(plan, cal: Calibration) -> tuple[float, float]:
    """Predicted seconds and wire bytes per device of ``plan`` on calibration ``cal``."""
    t = wire = 0.0
    for _, seconds, sent in step_costs(plan, cal):
        t, wire = t + seconds, wire + sent
    return t, wire
