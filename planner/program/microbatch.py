"""Which values of a scan body a pipeline may cut into microbatches, and how.

A pipeline runs a scanned layer stack on ``K`` microbatches, one at a time per stage. That is
exact when the body never mixes microbatches: some loop of every op that reads the carry's
leading (batch) dimension keeps indexing that dimension through the body, split like any
partitionable loop, and what sums over it (a weight's gradient) only leaves the body as a stacked
output, where the pipeline adds the microbatches' parts. :func:`microbatching` proves this on the
planner's loop nests: it unifies every loop with the array dimensions it indexes (through the
body, major loop of a merged dimension), takes the class of the carries' dimension 0 as the
microbatch class, and refuses, naming the op, any body that reads a batch dimension whole (a
gather, an ``iota`` along it, a window), splits it as the minor part of a merged dimension, or
uses a sum over it inside the layer.

Example:
    >>> mb = microbatching(prog, region)                     # doctest: +SKIP
    >>> mb.dim["v12"], mb.batch, mb.kind("v40")               # doctest: +SKIP
    (0, 16, 'sum')
"""

from __future__ import annotations

import dataclasses

from networkx.utils import UnionFind

from planner.program.ir import Program
from planner.program.jaxpr_params import scan_split
from planner.program.memo import PerObject
from planner.program.ops import Op, Region

LINEAR = frozenset(
    "add sub neg transpose reshape convert_element_type copy copy_p squeeze expand_dims "
    "reduce_sum".split()
)
"""Ops through which a sum over microbatches may pass on its way out (sums of sums)."""


class NotPipelinable(ValueError):
    """A scan whose body mixes microbatches; the message names the op and the reason."""


@dataclasses.dataclass(frozen=True)
class Microbatching:
    """How a scan body splits into microbatches.

    Attributes:
        batch: the extent of the microbatch loop (the carries' leading dimension).
        dim: body value name -> the dimension holding the batch (major part of it when merged),
            for values that have one.
        per_row: body value name -> elements of that dimension per batch row (1 unless merged).
        sums: body values that are partial sums over the batch (one microbatch's part).
        exits: per stacked output of the region, ``"batch"`` (stacked along its batch
            dimension), ``"sum"`` (added over microbatches) or ``"same"`` (the same for every
            microbatch).
    """

    batch: int
    dim: dict[str, int]
    per_row: dict[str, int]
    sums: frozenset[str]
    exits: tuple[str, ...]

    def shape(self, name: str, shape: tuple[int, ...], microbatches: int) -> tuple[int, ...]:
        """The shape of body value ``name`` on one microbatch."""
        d = self.dim.get(name)
        if d is None:
            return shape
        return (*shape[:d], shape[d] // microbatches, *shape[d + 1 :])

    def check(self, microbatches: int, mesh_parts: dict[str, int] | None = None) -> None:
        """Raise ``ValueError`` unless the batch splits into ``microbatches`` (and, given the
        number of parts each value's batch dimension is split into, into those too)."""
        if microbatches < 1 or self.batch % microbatches:
            raise ValueError(
                f"a batch of {self.batch} does not split into microbatches={microbatches}; "
                f"choose a divisor of {self.batch}"
            )
        for name, parts in (mesh_parts or {}).items():
            rows = self.batch // microbatches
            if rows % parts:
                raise ValueError(
                    f"a microbatch of {rows} rows of {name!r} does not split into the {parts} "
                    f"parts its layout has; use fewer microbatches (a divisor of "
                    f"{self.batch // parts})"
                )


def _where(op: Op) -> str:
    src = f" ({op.source[0]}:{op.source[1]})" if op.source else ""
    return f"{op.name}{src}"


PROVEN: PerObject[dict[int, Microbatching]] = PerObject("scans proven to run on microbatches")


def microbatching(prog: Program, region: Region) -> Microbatching:
    """Prove that ``region`` (a scan) runs exactly on microbatches of its carries' dimension 0.

    Raises:
        NotPipelinable: (a ``ValueError``) naming the op or value that mixes microbatches.
    """
    proven = PROVEN.get(prog, dict)
    if region.start not in proven:
        proven[region.start] = _prove(prog, region)
    return proven[region.start]


def _prove(prog: Program, region: Region) -> Microbatching:
    if region.kind != "scan":
        raise NotPipelinable(f"only a scan's layers can be pipelined, not a {region.kind}")
    split = scan_split(region.eqn)
    nc, nk = split.consts, split.carry
    entries = prog.ops[region.start : region.body]
    n_out = len(region.outputs)
    body = prog.ops[region.body : region.stop - n_out]
    exits = prog.ops[region.stop - n_out : region.stop]
    carries = [o.results[0].value for o in entries[nc : nc + nk]]
    if not carries or any(not v.shape for v in carries):
        raise NotPipelinable(
            "the scan has no carry with a leading (batch) dimension to cut into microbatches"
        )
    classes, minor = UnionFind(), set()
    for op in (*body, *exits):
        accesses = op.operands if op in exits else (*op.operands, *op.results)
        for acc in accesses:
            for d, loops in enumerate(acc.dims):
                if loops:
                    classes.union((op.name, loops[0]), (acc.value.name, d))
                    minor.update((op.name, lp) for lp in loops[1:])
    for v in carries[1:]:
        classes.union((v.name, 0), (carries[0].name, 0))
    root = classes[(carries[0].name, 0)]
    batch = carries[0].shape[0]
    if any(v.shape[0] != batch for v in carries):
        raise NotPipelinable(
            f"the carries' leading dimensions differ ({[v.shape[0] for v in carries]}); a "
            "pipeline cuts one batch into microbatches"
        )

    def batch_dims(v) -> list[int]:
        return [d for d in range(len(v.shape)) if classes[(v.name, d)] == root]

    dim: dict[str, int] = {}
    per_row: dict[str, int] = {}
    values = [o.results[0].value for o in entries] + [r.value for o in body for r in o.results]
    for v in values:
        ds = batch_dims(v)
        if len(ds) > 1:
            raise NotPipelinable(f"value {v.name} has the batch in two dimensions {ds}")
        if ds:
            dim[v.name] = ds[0]
            per_row[v.name] = v.shape[ds[0]] // batch
    sums: set[str] = set()
    for op in body:
        mine = [lp for lp in op.loops if classes[(op.name, lp.name)] == root]
        for acc in op.operands:
            d = dim.get(acc.value.name)
            if d is not None and not acc.dims[d]:
                raise NotPipelinable(
                    f"{_where(op)} reads the batch dimension of {acc.value.name} whole"
                )
        if len(mine) > 1:
            raise NotPipelinable(f"{_where(op)} runs two loops over the batch")
        if mine:
            lp = mine[0]
            if (op.name, lp.name) in minor:
                raise NotPipelinable(f"{_where(op)} merges the batch as a minor dimension")
            if not lp.partitionable or any(w.owner == lp.name for w in op.windows):
                raise NotPipelinable(f"{_where(op)} needs the whole batch (loop {lp.name})")
            if lp.extent != batch:
                raise NotPipelinable(
                    f"{_where(op)}'s batch loop has extent {lp.extent}, the batch {batch}"
                )
            if lp.name in dict(op.reductions):
                sums.update(r.value.name for r in op.results if r.value.name not in dim)
        read = [a.value.name for a in op.operands if a.value.name in sums]
        if read:
            partial = op.primitive in ("add", "sub") and len(read) < len(op.operands)
            if op.primitive not in LINEAR or mine or partial:
                raise NotPipelinable(
                    f"{_where(op)} reads {read[0]}, a sum over the batch, inside the layer: "
                    "a microbatch has only its part"
                )
            sums.update(r.value.name for r in op.results)
    for op in exits[:nk]:
        v = op.operands[0].value
        if v.name in sums or dim.get(v.name) != 0:
            raise NotPipelinable(
                f"the carry {v.name} leaves the layer without its batch in dimension 0"
            )
    kinds = []
    for op in exits[nk:]:
        v = op.operands[0].value
        kinds.append("batch" if v.name in dim else "sum" if v.name in sums else "same")
    return Microbatching(batch, dim, per_row, frozenset(sums), tuple(kinds))
