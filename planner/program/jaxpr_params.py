"""The params of JAX's structured equations, read the same way on every JAX the project tests
(0.10.2 on Python 3.11, 0.12 on Python 3.13): the one place that knows how they differ.

A ``scan`` equation's operands are its constants, then its carries, then the arrays it scans
over (``xs``); its results are the final carries, then the stacked outputs (``ys``). JAX up to
0.11 gives the counts as ``num_consts`` / ``num_carry`` params; JAX 0.12 gives ``ft_in``, a flat
tree packing the three groups, which its own rules unpack (``consts, carry, xs =
ft_in.update(args).unpack()`` in ``jax/_src/lax/control_flow/loops.py``), and ``ft_out``
packing (carries, ys). The inner jaxpr is a ``ClosedJaxpr`` up to 0.11 and a ``Jaxpr`` holding
its own constants on 0.12; both answer ``.jaxpr`` and ``.consts``.

Example:
    >>> split = scan_split(eqn)  # doctest: +SKIP
    >>> carry = eqn.invars[split.consts : split.consts + split.carry]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

from jax._src import core
from jax._src.interpreters import partial_eval as pe


@dataclasses.dataclass(frozen=True)
class ScanSplit:
    """How many of a scan's operands are constants, carries and scanned arrays."""

    consts: int
    carry: int
    xs: int


def scan_split(eqn) -> ScanSplit:
    """The operand groups of ``scan`` equation ``eqn``, on any supported JAX.

    Raises:
        ValueError: ``eqn`` is not a scan, or its params are of a form no tested JAX writes.
    """
    p, n = eqn.params, len(eqn.invars)
    if "num_consts" in p and "num_carry" in p:  # JAX <= 0.11
        nc, nk = int(p["num_consts"]), int(p["num_carry"])
        return ScanSplit(nc, nk, n - nc - nk)
    if "ft_in" in p:  # JAX 0.12: a flat tree of (consts, carry, xs)
        parts = p["ft_in"].unpack()
        if len(parts) == 3:
            split = ScanSplit(*(len(part) for part in parts))
            if split.consts + split.carry + split.xs == n:
                return split
    raise ValueError(
        f"cannot read the operand groups of a {eqn.primitive.name!r} equation with params "
        f"{sorted(p)} on this JAX; the planner reads scans of JAX 0.10 to 0.12"
    )


def inner_jaxpr(closed) -> tuple[object, tuple]:
    """``(jaxpr, consts)`` of a nested jaxpr param: a ``ClosedJaxpr`` (JAX <= 0.11), a ``Jaxpr``
    holding its constants (0.12), or an open ``Jaxpr`` (``remat``'s, before 0.12)."""
    return getattr(closed, "jaxpr", closed), tuple(getattr(closed, "consts", ()))


def map_jaxprs(value, fn):
    """An equation's param ``value`` with ``fn`` applied to each jaxpr it is (a ``Jaxpr`` or a
    ``ClosedJaxpr``) or holds (a tuple of them: ``cond``'s branches); other values as they are.

    Example:
        >>> params = {k: map_jaxprs(v, unroll) for k, v in eqn.params.items()}  # doctest: +SKIP
    """
    jaxprs = (core.Jaxpr, *((core.ClosedJaxpr,) if hasattr(core, "ClosedJaxpr") else ()))
    if isinstance(value, jaxprs):
        return fn(value)
    if isinstance(value, tuple) and value and all(isinstance(b, jaxprs) for b in value):
        return tuple(fn(b) for b in value)
    return value


OPEN_JAXPR_PRIMITIVES = frozenset({"checkpoint", "remat", "remat2"})  # jax.checkpoint's names


def with_body(eqn, closed) -> tuple[dict, tuple]:
    """``(params, leading operands)`` to re-bind call-like ``eqn`` around ``closed`` (a traced
    body, whose operands are ``eqn``'s) instead of its own body.

    A call that takes an open jaxpr (``jax.checkpoint``'s; on JAX <= 0.11 any whose param has
    no ``consts``) gets the body's constants as leading operands; one that takes a closed jaxpr
    gets ``closed`` as it is."""
    params = dict(eqn.params)
    key = next(k for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in params)
    inner, consts = inner_jaxpr(closed)
    if eqn.primitive.name in OPEN_JAXPR_PRIMITIVES or not hasattr(params[key], "consts"):
        params[key] = pe.convert_constvars_jaxpr(inner)
        return params, consts
    params[key] = closed
    return params, ()


def live(closed):
    """``closed`` (a top-level jaxpr: ``ClosedJaxpr`` up to 0.11, ``Jaxpr`` on 0.12) without the
    equations no output depends on (dead code, which XLA drops too: the loss a ``jax.grad``
    step computes and discards); inputs and constants are kept, effectful equations too.

    Example:
        >>> live(jax.make_jaxpr(lambda x: (jnp.sin(x), 2 * x)[1])(1.0))  # doctest: +SKIP
        { lambda ; a:f32[]. let b:f32[] = mul 2.0:f32[] a in (b,) }
    """
    inner = getattr(closed, "jaxpr", closed)
    kept, _ = pe.dce_jaxpr(inner, [True] * len(inner.outvars), instantiate=True)
    return kept if inner is closed else closed.replace(jaxpr=kept)
