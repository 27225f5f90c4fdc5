"""The layouts a user's inputs are given, per leaf: ``in_shardings`` passed to compare with, or the
arrays' own shardings (``plan(..., compare="auto")``), as the planner's per-dimension axes.

Example:
    >>> given_specs((params, batch), (P(), P("fsdp")), mesh)       # doctest: +SKIP
    ((), (), (('fsdp',), ()))
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from planner.program.constraints import spec_of
from planner.program.schedule import Spec
from redist.types import MeshShape


def _is_layout(x) -> bool:
    return x is None or isinstance(x, (Sharding, PartitionSpec))


def given_specs(args, shardings, mesh: MeshShape) -> tuple[Spec | None, ...]:
    """Per leaf of ``args`` (a tuple of the function's non-static arguments), the layout
    ``shardings`` gives it: a pytree of ``NamedSharding`` / ``PartitionSpec`` / ``None`` with
    the structure of ``args`` or a prefix of it (one entry for a whole argument), or ``"auto"``:
    each ``jax.Array``'s own ``NamedSharding``. ``None`` for a leaf with none, and for every leaf
    where no layout splits anything. Size-1 mesh axes are dropped; an axis the mesh lacks, or of
    another size, raises ``ValueError`` naming the leaf.
    """
    leaves, tree = jax.tree.flatten(args)
    if isinstance(shardings, str):
        if shardings != "auto":
            raise ValueError(f"compare must be 'auto', None or in_shardings, got {shardings!r}")
        layouts = [x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else None
                   for x in leaves]  # fmt: skip
    else:
        try:
            spread = jax.tree.map(lambda s, x: jax.tree.map(lambda _: s, x), shardings, args,
                                  is_leaf=_is_layout)  # fmt: skip
        except ValueError as e:
            raise ValueError(
                f"compare: the in_shardings' structure does not match the arguments' ({tree}): {e}"
            ) from None
        layouts = jax.tree.leaves(spread, is_leaf=_is_layout)
    specs = []
    for k, (x, layout) in enumerate(zip(leaves, layouts)):
        spec = None if layout is None else spec_of(layout, len(getattr(x, "shape", ())))
        try:
            specs.append(None if spec is None else _on_mesh(spec, layout, mesh, k))
        except ValueError:
            if shardings != "auto":
                raise
            specs.append(None)  # an array on another mesh: not the plan's to compare with
    if not any(s and any(s) for s in specs):
        return ()
    return tuple(specs)


def _on_mesh(spec, layout, mesh: MeshShape, leaf: int) -> Spec:
    own = dict(getattr(getattr(layout, "mesh", None), "shape", None) or mesh.sizes)
    out = []
    for axes in spec:
        kept = []
        for a in axes or ():
            size = own.get(a)
            if size == 1:
                continue
            if mesh.sizes.get(a) != size:
                raise ValueError(
                    f"compare: input leaf {leaf} is laid out over mesh axis {a!r} (size {size}); "
                    f"the plan's mesh is {dict(mesh.sizes)}"
                )
            kept.append(a)
        out.append(tuple(kept))
    return tuple(out)
