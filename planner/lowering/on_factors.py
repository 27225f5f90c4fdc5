"""The body of the program's own ``shard_map`` run on the tiles of backend ``"explicit"``, whose
one ``shard_map`` is over the mesh's prime factors (``fsdp:4 -> fsdp#0, fsdp#1``): every
collective of the body that names a mesh axis names its factors instead (a tuple of axes is one
axis to JAX's collectives, its index the factors' digits, major first: the axis' own index),
through JAX's API (``axis_index`` of a tuple combines the factors' indices); calls in the body
run in place, and loops and branches run as they are where they call no collective.

Example:
    >>> outs = run_body(eqn.params["jaxpr"], tiles, {"fsdp": ("fsdp#0", "fsdp#1")})
    ...                                                                   # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
from jax import lax
from jax._src import core

import redist
from planner.lowering.kernels import SHARDING_PARAMS
from planner.program.jaxpr_params import inner_jaxpr, map_jaxprs
from redist.specs import entry_axes, padded_entries

_JAXPRS = (core.Jaxpr, *((core.ClosedJaxpr,) if hasattr(core, "ClosedJaxpr") else ()))


def factor_axes(sizes: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """Each mesh axis' prime factors, major first, as backend ``"explicit"`` names them.

    Example:
        >>> factor_axes({"fsdp": 4, "tensor": 2})
        {'fsdp': ('fsdp#0', 'fsdp#1'), 'tensor': ('tensor',)}
    """
    out: dict[str, tuple[str, ...]] = {a: () for a in sizes}
    for f in redist.MeshShape.of(sizes).factors:
        out[f.axis] += (f.name,)
    return out


def _renamed(value, names: dict[str, tuple[str, ...]]):
    """An axis parameter with every mesh axis written as its factors (a name that is its own
    only factor stays as it is)."""
    if isinstance(value, str):
        got = names.get(value, (value,))
        return got[0] if len(got) == 1 else got
    if isinstance(value, (tuple, list)):
        return tuple(f for v in value for f in (names.get(v, (v,)) if isinstance(v, str) else (v,)))
    return value


def _collective(eqn, x, names):
    """``eqn`` (one of :data:`COLLECTIVES`) on ``x`` through JAX's API, over the factors: under
    the program's ``shard_map`` (no replication types) the API binds the untyped collectives,
    where the body, traced with them, may hold typed ones (``psum_invariant``, ``pvary``)."""
    p = eqn.params
    axes = _renamed(p.get("axes", p.get("axis_name")), names)
    kind = eqn.primitive.name
    if kind in ("pvary", "pcast", "preduced"):
        return x
    if kind in ("psum", "psum_invariant"):
        return lax.psum(x, axes)
    if kind in ("pmax", "pmin"):
        return getattr(lax, kind)(x, axes)
    if kind in ("all_gather", "all_gather_invariant"):
        return lax.all_gather(x, axes, axis=p["all_gather_dimension"], tiled=p["tiled"])
    if kind == "ppermute":
        return lax.ppermute(x, axes, p["perm"])
    if kind == "all_to_all":
        return lax.all_to_all(x, axes, p["split_axis"], p["concat_axis"], tiled=p["tiled"])
    if kind == "reduce_scatter":
        return lax.psum_scatter(x, axes, scatter_dimension=p["scatter_dimension"],
                                tiled=p["tiled"])  # fmt: skip
    return lax.axis_index(axes)  # axis_index


COLLECTIVES = frozenset({"pvary", "pcast", "preduced", "psum", "psum_invariant", "pmax", "pmin",
                         "all_gather", "all_gather_invariant", "ppermute", "all_to_all",
                         "reduce_scatter", "axis_index"})  # fmt: skip
"""The collectives a body may call, run through JAX's API (:func:`_collective`)."""

INLINED = frozenset({"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2",
                     "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})  # fmt: skip
"""Calls whose body is run in place (their values: a call, a rematerialisation and a custom
derivative compute what their body computes)."""


def _nested(params) -> list:
    out = []
    for v in params.values():
        for b in v if isinstance(v, tuple) else (v,):
            if isinstance(b, _JAXPRS):
                out.append(inner_jaxpr(b)[0])
    return out


def _names_axes(eqn, names) -> bool:
    """Whether ``eqn``'s ``axis_name`` or ``axes`` param names a mesh axis (a collective)."""
    for key in ("axis_name", "axes"):
        v = eqn.params.get(key)
        if any(isinstance(a, str) and a in names for a in (v if isinstance(v, tuple) else (v,))):
            return True
    return False


def _calls_collectives(jaxpr) -> bool:
    return any(e.primitive.name in COLLECTIVES or e.primitive.name == "shard_map"
               or any(map(_calls_collectives, _nested(e.params))) for e in jaxpr.eqns)  # fmt: skip


def _unsharded(jaxpr):
    """``jaxpr`` (any nesting) with the result shardings its equations name (on the user's mesh,
    where the tiles are typed on the plan's) dropped."""
    if not isinstance(jaxpr, core.Jaxpr):
        return jaxpr.replace(jaxpr=_unsharded(jaxpr.jaxpr))
    return jaxpr.replace(eqns=[e.replace(params=_unsharded_params(e.params)) for e in jaxpr.eqns])


def _unsharded_params(params: dict) -> dict:
    """An equation's ``params`` without the result shardings (see :func:`_unsharded`)."""
    return {k: None if k in SHARDING_PARAMS else map_jaxprs(v, _unsharded)
            for k, v in params.items()}  # fmt: skip


def run_body(jaxpr, args, names: dict[str, tuple[str, ...]], consts=()) -> list:
    """The ``shard_map`` body ``jaxpr`` evaluated on the tiles ``args``, its collectives over
    the factors ``names`` gives each axis (see the module docs). ``NotImplementedError`` for
    collectives inside a loop or a branch of the body, or a ``shard_map`` nested in it."""
    env: dict = {}

    def read(v):
        if isinstance(v, core.Literal):  # typed on the user's mesh: its number alone
            return np.asarray(v.val, v.aval.dtype)
        return env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        kind = eqn.primitive.name
        if kind in COLLECTIVES:
            outs = [_collective(eqn, x, names) for x in ins] if kind != "axis_index" else \
                [_collective(eqn, None, names)]  # fmt: skip
        elif kind in INLINED:
            key = next(k for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in eqn.params)
            inner, inner_consts = inner_jaxpr(eqn.params[key])
            outs = run_body(inner, ins, names, inner_consts)
        elif _names_axes(eqn, names):
            raise NotImplementedError(
                f"the collective {kind} of the program's shard_map, under backend 'explicit' "
                f"(it runs {sorted(COLLECTIVES)}); use backend 'xla' (plan.jit's) or 'per-op'"
            )
        elif any(map(_calls_collectives, _nested(eqn.params))):
            raise NotImplementedError(
                f"a collective inside a {kind} of the program's shard_map, under backend "
                "'explicit'; use backend 'xla' (plan.jit's) or 'per-op'"
            )
        else:
            params = eqn.primitive.get_bind_params(_unsharded_params(eqn.params))
            out = eqn.primitive.bind(*ins, **params)
            outs = list(out) if eqn.primitive.multiple_results else [out]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def check_layouts(op_name: str, user_specs, step_specs, names, ndims) -> None:
    """Raises ``NotImplementedError`` unless the tiles the plan gives (``step_specs``, factor
    tuples per dimension) are those the ``shard_map``'s own specs (``user_specs``) ask for."""
    for user, step, ndim in zip(user_specs, step_specs, ndims):
        want = tuple(tuple(f for a in entry_axes(e) for f in names.get(a, (a,)))
                     for e in padded_entries(user, ndim)[:ndim])  # fmt: skip
        if tuple(map(tuple, step)) != want:
            raise NotImplementedError(
                f"{op_name}: the plan lays an operand of the program's shard_map out as {step}, "
                f"not as its specs {user} ask ({want}); backend 'explicit' runs the body on the "
                "plan's tiles"
            )


__all__ = ["check_layouts", "factor_axes", "run_body"]
