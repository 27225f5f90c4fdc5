"""The layouts a program asks for: its sharding constraints, read as assignments of its ops.

``jax.lax.with_sharding_constraint`` (``sharding_constraint``), ``jax.sharding.reshard`` and
``mesh_cast`` (and flax's and Keras's logical constraints, which lower to them) are identities
whose result the user wants laid out as their sharding says. The rule table analyses them as
identities (:data:`planner.program.rules.IDENTITIES`); here each becomes a :class:`Request`, and
:func:`requested_assignment` the loop assignment that lays its result out as asked, which the
search may keep, start from or ignore (``plan(..., constraints=...)``).

Example:
    >>> reqs = requests(prog)                                         # doctest: +SKIP
    >>> assign, problems = requested_assignment(prog, MeshShape.of({"fsdp": 4, "tensor": 2}))
"""

from __future__ import annotations

import dataclasses

from planner.program.ir import Program
from planner.program.ops import Op
from planner.program.schedule import check_assignment, want_loops
from redist.types import MeshShape

SHARDING_PARAM = {"sharding_constraint": "sharding", "reshard": "dst_sharding",
                  "mesh_cast": "dst_sharding"}  # fmt: skip
"""Layout-request primitives and the parameter holding the sharding they ask for."""

MODES = ("hint", "keep", "drop")

RequestSpec = tuple[tuple[str, ...] | None, ...]


@dataclasses.dataclass(frozen=True)
class Request:
    """One sharding constraint: op ``op`` asks for its result laid out as ``spec`` (per dimension
    the mesh axes splitting it, major first; ``None``: left to the partitioner), on a mesh of
    ``mesh`` (axis name -> size) where the sharding says which.

    Example:
        >>> Request("sharding_constraint_3", (("fsdp",), ("tensor",)), {"fsdp": 4, "tensor": 2})
        Request(op='sharding_constraint_3', spec=(('fsdp',), ('tensor',)), mesh={'fsdp': 4, 'tensor': 2})
    """

    op: str
    spec: RequestSpec
    mesh: dict[str, int] | None = None


def spec_of(sharding, rank: int) -> RequestSpec | None:
    """``sharding``'s layout of an array of ``rank`` dimensions (a ``NamedSharding``, or a bare
    ``PartitionSpec`` as JAX accepts under ``set_mesh``): per dimension the mesh axes, major
    first, ``None`` where unconstrained; ``None`` for a sharding without named axes.

    Example:
        >>> spec_of(PartitionSpec("fsdp", ("data", "tensor")), 3)          # doctest: +SKIP
        (('fsdp',), ('data', 'tensor'), ())
    """
    spec = getattr(sharding, "spec", sharding)
    if spec is None or isinstance(spec, str) or not hasattr(spec, "__iter__"):
        return None
    out: list = []
    for entry in tuple(spec)[:rank]:
        if entry is None:
            out.append(())
        elif str(entry) == "UNCONSTRAINED":
            out.append(None)
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return tuple(out) + ((),) * (rank - len(out))


def _mesh_of(sharding) -> dict[str, int] | None:
    mesh = getattr(sharding, "mesh", None)
    shape = getattr(mesh, "shape", None)
    return dict(shape) if shape else None


def requests(prog: Program) -> list[Request]:
    """The program's layout requests, in program order (those whose sharding names no mesh
    axes, such as a ``GSPMDSharding``, are left out)."""
    out = []
    for op in prog.ops:
        key = SHARDING_PARAM.get(op.primitive)
        if key is None or op.eqn is None:
            continue
        sharding = op.eqn.params.get(key)
        spec = spec_of(sharding, len(op.results[0].value.shape))
        free = op.eqn.params.get("unconstrained_dims") or ()
        if spec is not None:
            spec = tuple(None if d in free else axes for d, axes in enumerate(spec))
            out.append(Request(op.name, spec, _mesh_of(sharding)))
    return out


def requested_assignment(
    prog: Program, shape: MeshShape, xla: bool = True
) -> tuple[dict[str, dict[str, tuple[str, ...]]], list[str]]:
    """``(assignment, problems)``: for each request that can hold on a mesh of ``shape``, its
    op's loops split as the request lays the result out (size-1 axes ignored; an unconstrained
    dimension left whole); ``problems`` says, per request that cannot hold, why (an axis the mesh
    lacks or of another size, a split the dimension does not allow).

    Example:
        >>> assign, problems = requested_assignment(prog, MeshShape.of({"fsdp": 4}))  # doctest: +SKIP
        >>> assign
        {'sharding_constraint_2': {'i0': ('fsdp#0', 'fsdp#1')}}
    """
    by_name = {o.name: o for o in prog.ops}
    assign, problems = {}, []
    for req in requests(prog):
        op = by_name[req.op]
        try:
            assign[op.name] = check_assignment(shape, op, _loops(op, req, shape), xla)
        except ValueError as e:
            problems.append(f"{where(op)}: {e}")
    return assign, problems


def _loops(op: Op, req: Request, shape: MeshShape) -> dict[str, tuple[str, ...]]:
    """The loops of ``op`` that ``req`` splits (its size-1 axes dropped); raises ``ValueError``
    naming an axis the plan's mesh does not have at the size asked."""
    spec = []
    for axes in req.spec:
        wanted = []
        for a in axes or ():
            size = (req.mesh or shape.sizes).get(a, shape.sizes.get(a))
            if size == 1:
                continue
            if a not in shape.sizes or shape.sizes[a] != size:
                raise ValueError(
                    f"it asks for mesh axis {a!r} of size {size}; the plan's mesh has "
                    f"{dict(shape.sizes)}"
                )
            wanted.append(a)
        spec.append(tuple(wanted))
    loops: dict[str, tuple[str, ...]] = {}
    want_loops(op.results[0], tuple(spec), loops)
    return loops


def where(op: Op) -> str:
    """``op``'s name and, where known, the user's line that made it (``"op (file.py:12)"``)."""
    if op.source is None:
        return op.name
    return f"{op.name} ({op.source[0].rsplit('/', 1)[-1]}:{op.source[1]})"
