"""``analyze``: trace a function to a jaxpr and describe every equation as a loop nest.

Nested jaxprs (``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint`` / ``remat``,
``closed_call``) are inlined. Each primitive gets its iteration space from the rule table
(:mod:`planner.rules`), else from generic discovery (:mod:`planner.discover`), else it runs
replicated (and ``print(program)`` says so).

Example:
    >>> prog = planner.analyze(lambda x, w: jnp.tanh(x @ w), x, w)   # doctest: +SKIP
    >>> print(prog)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.extend import core as jcore

from planner import discover as discovery
from planner import rules
from planner.ir import Access, Loop, Op, Program, Value

CALLS = frozenset(
    "pjit jit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr "
    "checkpoint remat remat2 custom_lin".split()
)


def _nested(eqn):
    """The inner jaxpr of a call-like equation and its constants, or ``None``."""
    if eqn.primitive.name not in CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if inner is None:
            continue
        if hasattr(inner, "jaxpr") and hasattr(inner, "consts"):  # ClosedJaxpr
            jaxpr, consts = inner.jaxpr, inner.consts
        elif hasattr(inner, "eqns"):
            jaxpr, consts = inner, ()
        else:
            continue
        if len(jaxpr.invars) == len(eqn.invars):
            return jaxpr, consts
    return None


class _Builder:
    def __init__(self):
        self.ops: list[Op] = []
        self.consts: list[tuple[Value, object]] = []
        self.count = 0

    def value(self, var, prefix="v") -> Value:
        aval = var.aval
        v = Value(f"{prefix}{self.count}", tuple(int(n) for n in aval.shape), str(aval.dtype))
        self.count += 1
        return v

    def walk(self, jaxpr, env: dict) -> None:
        for eqn in jaxpr.eqns:
            ins = [None if isinstance(v, jcore.Literal) else env[v] for v in eqn.invars]
            nested = _nested(eqn)
            if nested is not None:
                inner, consts = nested
                inner_env = {}
                for var, c in zip(inner.constvars, consts):
                    inner_env[var] = self.value(var, "c")
                    self.consts.append((inner_env[var], c))
                for var, v in zip(inner.invars, ins):
                    inner_env[var] = v if v is not None else self.value(var, "lit")
                self.walk(inner, inner_env)
                for var, inner_out in zip(eqn.outvars, inner.outvars):
                    if isinstance(inner_out, jcore.Literal):
                        env[var] = self.value(var, "lit")
                    else:
                        env[var] = inner_env[inner_out]
                continue
            outs = [self.value(var) for var in eqn.outvars]
            for var, v in zip(eqn.outvars, outs):
                env[var] = v
            self.ops.append(self.describe(eqn, ins, outs))

    def describe(self, eqn, ins, outs) -> Op:
        name = f"{eqn.primitive.name}_{len(self.ops)}"
        rule = rules.rule_for(eqn.primitive.name)
        op = rule(name, eqn, ins, outs) if rule is not None else None
        if op is None:
            op = discovery.discover(name, eqn, ins, outs)
        if op is None:
            op = _replicated(name, eqn, ins, outs)
        return Op(op.name, op.primitive, op.loops, op.operands, op.results, op.reductions, op.how,
                  eqn)  # fmt: skip


def _replicated(name, eqn, ins, outs) -> Op:
    loops = tuple(Loop(f"i{d}", n, False) for d, n in enumerate(outs[0].shape)) if outs else ()
    return Op(
        name, eqn.primitive.name, loops,
        tuple(Access(v, ((),) * len(v.shape)) for v in ins if v is not None),
        tuple(Access(o, ((),) * len(o.shape)) for o in outs), how="replicated",
    )  # fmt: skip


def analyze(fn: Callable, *args, **kwargs) -> Program:
    """Trace ``fn(*args, **kwargs)`` and return its :class:`Program` of loop nests.

    Args:
        fn: a JAX-traceable function.
        *args, **kwargs: example arguments (arrays or ``jax.ShapeDtypeStruct``s, pytrees allowed).

    Returns:
        The program: ops in order, with loops, access maps and reductions.
    """
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    b = _Builder()
    env = {}
    for var, c in zip(closed.jaxpr.constvars, closed.consts):
        env[var] = b.value(var, "c")
        b.consts.append((env[var], c))
    inputs = []
    for var in closed.jaxpr.invars:
        env[var] = b.value(var, "in")
        inputs.append(env[var])
    b.walk(closed.jaxpr, env)
    outputs = tuple(
        env[v] if not isinstance(v, jcore.Literal) else Value("literal", np.shape(v.val), "")
        for v in closed.jaxpr.outvars
    )
    return Program(tuple(b.ops), tuple(inputs), outputs, closed, tuple(b.consts))
