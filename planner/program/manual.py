"""The user's ``shard_map`` regions as ops whose layouts are the user's: each operand enters as
its ``in_specs`` say and each result leaves as its ``out_specs`` say, in every schedule.

A ``shard_map`` (MaxText's splash attention, a mixture of experts' dispatch, ring attention) is
written for one layout: its body runs on each device's tiles and may call collectives over the
mesh's axes. The planner keeps it as one op (``how="manual"``) whose loops are the mesh factors
the ``shard_map`` splits over (``@fsdp#0``, ...), each pinned to its factor
(:attr:`planner.program.ops.Op.manual`), plus one whole loop per tile dimension. The rest of the
program is planned around it: producers and consumers may lay its values out otherwise, and the
moves into and out of its layouts are priced like any other. Its body, analysed on the tiles
(:attr:`planner.program.ops.Op.body`), prices its kernel.

Example:
    >>> op = shard_map_op("shard_map_7", eqn, ins, outs, body)       # doctest: +SKIP
    >>> op.manual
    (('@fsdp#0', ('fsdp#0',)), ('@fsdp#1', ('fsdp#1',)))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from planner.program.ops import Access, Loop, Op, Value
from redist.specs import entry_axes, padded_entries
from redist.types import MeshShape


def spec_axes(spec, rank: int) -> list[tuple[str, ...]]:
    """A ``PartitionSpec``'s mesh axes per dimension (``()`` where whole), ``rank`` of them.

    Example:
        >>> spec_axes(("a", ("b", "c")), 3)
        [('a',), ('b', 'c'), ()]
    """
    return [entry_axes(e) for e in padded_entries(spec, rank)[:rank]]


def mesh_sizes(eqn) -> dict[str, int]:
    """The ``shard_map``'s mesh: axis name -> size."""
    mesh = eqn.params["mesh"]
    return dict(zip(mesh.axis_names, (int(n) for n in mesh.axis_sizes)))


def shard_map_op(name: str, eqn, ins: Sequence[Value | None], outs: Sequence[Value],
                 body: tuple[Op, ...]) -> Op:  # fmt: skip
    """The ``shard_map`` equation ``eqn`` as a manual op (see the module); ``body``: its body's
    ops on the tiles. Axes of size 1 are left out (they split nothing)."""
    sizes = mesh_sizes(eqn)
    shape = MeshShape.of({a: n for a, n in sizes.items() if n > 1})
    loops: dict[str, Loop] = {}
    manual: dict[str, tuple[str, ...]] = {}

    def dims(v: Value, spec, tag: str) -> tuple[tuple[str, ...], ...]:
        out = []
        for d, axes in enumerate(spec_axes(spec, len(v.shape))):
            factors = [f for a in axes if sizes.get(a, 1) > 1 for f in shape.axis_factors(a)]
            parts = math.prod(shape.factor_size[f] for f in factors)
            for f in factors:
                loops.setdefault(f"@{f}", Loop(f"@{f}", shape.factor_size[f], False))
                manual[f"@{f}"] = (f,)
            local = Loop(f"{tag}{d}", v.shape[d] // parts, False)
            loops[local.name] = local
            out.append((*(f"@{f}" for f in factors), local.name))
        return tuple(out)

    operands = tuple(Access(v, dims(v, spec, f"in{k}.")) for k, (v, spec)
                     in enumerate(zip(ins, eqn.params["in_specs"])) if v is not None)  # fmt: skip
    results = tuple(Access(v, dims(v, spec, f"out{k}."))
                    for k, (v, spec) in enumerate(zip(outs, eqn.params["out_specs"])))  # fmt: skip
    for a in sorted(eqn.params.get("newly_manual_axes") or ()):  # manual, splitting nothing
        for f in shape.axis_factors(a) if sizes.get(a, 1) > 1 else ():
            loops.setdefault(f"@{f}", Loop(f"@{f}", shape.factor_size[f], False))
            manual[f"@{f}"] = (f,)
    ordered = sorted(loops.values(), key=lambda lp: (not lp.name.startswith("@"), lp.name))
    return Op(name, eqn.primitive.name, tuple(ordered), operands, results, how="manual",
              manual=tuple(sorted(manual.items())), body=body)  # fmt: skip


def axis_factors(op: Op, axis: str) -> tuple[str, ...]:
    """The mesh factors of ``axis`` (a whole axis name, as the body's collectives name it) that
    the manual ``op`` runs over, major first (none for an axis of size 1)."""
    return tuple(f for _, (f,) in op.manual if f == axis or f.startswith(axis + "#"))


def collective_axes(body_op: Op) -> tuple[str, ...]:
    """The mesh axes a collective of a ``shard_map``'s body runs over (``psum``'s ``axes``,
    the others' ``axis_name``); none for any other op."""
    params = getattr(body_op.eqn, "params", None) or {}
    names = params.get("axes", params.get("axis_name", ()))
    names = (names,) if isinstance(names, str) else tuple(names or ())
    return tuple(a for a in names if isinstance(a, str))


def check_mesh(ops: Sequence[Op], sizes: Mapping[str, int], where) -> None:
    """Raise ``ValueError`` naming the ``shard_map`` (``where(op)``: its name and line) whose mesh
    factors the plan's mesh (``sizes``: axis name -> size) lacks.

    Example:
        >>> check_mesh(prog.ops, {"fsdp": 4}, str)                      # doctest: +SKIP
        ValueError: shard_map_3 runs over mesh axis factor 'tensor' of size 2; ...
    """
    have = MeshShape.of({a: n for a, n in sizes.items() if n > 1}).factor_size
    for op in ops:
        for loop, (factor,) in op.manual:
            want = op.loop[loop].extent
            if have.get(factor) != want:
                axis = factor.split("#")[0]
                raise ValueError(
                    f"{where(op)} is a shard_map over mesh axis {axis!r} (factor {factor!r} of "
                    f"size {want}); the plan's mesh has {dict(sizes)}: plan on the mesh the "
                    "shard_map names, or one with its axes at the same sizes"
                )
