"""Which inputs of a nested jaxpr each of its outputs is computed from (analysis: reads jaxprs).

An opaque op with a body (a ``shard_map``) makes several results; the memory model holds, for a
result the compiler makes late, only the operands that result is computed from
(:attr:`planner.program.ops.Op.feeds`).

Example:
    >>> dependence(jax.make_jaxpr(lambda a, b: (a * 2, a + b))(1.0, 2.0).jaxpr)  # doctest: +SKIP
    [frozenset({0}), frozenset({0, 1})]
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.extend import core

from planner.program.jaxpr_params import inner_jaxpr


def dependence(jaxpr) -> list[frozenset[int]]:
    """Per output of ``jaxpr``, the indices of the inputs it is computed from: through the
    jaxprs of calls inside it (``jaxpr`` or ``call_jaxpr`` params whose inputs and outputs are
    the equation's); an equation without one makes each output from all its inputs."""
    deps = {v: frozenset({i}) for i, v in enumerate(jaxpr.invars)}

    def of(v) -> frozenset[int]:
        return frozenset() if isinstance(v, core.Literal) else deps.get(v, frozenset())

    for e in jaxpr.eqns:
        ins = [of(v) for v in e.invars]
        call = e.params.get("jaxpr") or e.params.get("call_jaxpr")
        sub = inner_jaxpr(call)[0] if call is not None else None
        if sub is not None and (len(sub.invars), len(sub.outvars)) == (len(ins), len(e.outvars)):
            outs = [frozenset().union(*(ins[i] for i in d)) for d in dependence(sub)]
        else:
            outs = [frozenset().union(*ins)] * len(e.outvars)
        deps.update(zip(e.outvars, outs))
    return [of(v) for v in jaxpr.outvars]


def result_operands(eqn, ins: Sequence[object | None]) -> tuple[tuple[int, ...], ...]:
    """Per result of ``eqn`` (one with a ``jaxpr`` param over its inputs and outputs: a
    ``shard_map``), the indices into its op's operands (its inputs less the literals, ``None``
    in ``ins``) that the result is computed from; ``()`` where the body does not say.

    Example:
        >>> result_operands(moe_backward_eqn, ins)                          # doctest: +SKIP
        ((0, 3), (1, 2, 3))
    """
    jaxpr = inner_jaxpr(eqn.params["jaxpr"])[0]
    if (len(jaxpr.invars), len(jaxpr.outvars)) != (len(ins), len(eqn.outvars)):
        return ()
    position = {k: p for p, k in enumerate(k for k, v in enumerate(ins) if v is not None)}
    return tuple(tuple(sorted(position[k] for k in d if k in position))
                 for d in dependence(jaxpr))  # fmt: skip
