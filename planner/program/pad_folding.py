"""A zero ``pad`` feeding a window sum folds into the sum's base dilation and padding.

JAX differentiates an average pool (``reduce_window_sum``) into a ``pad`` of the output
gradient (its interior padding the pool's stride) followed by a stride-1 window sum. The pad's
result is longer than anything a neighbour's tile lines up with, so split alone it would keep
its rows whole. Folded, the two are one ``reduce_window_sum`` with ``base_dilation`` (interior
+ 1) and the pad's edges added to its padding, which splits its rows with a halo like a
transposed convolution (:mod:`planner.program.halo`).

Example (the gradient of a 3x3, stride-2 'SAME' average pool of 16 rows)::

    k = pad[padding_config=((0, 0, 0), (2, 1, 1), ...)] j 0.0
    l = reduce_window_sum[window_dimensions=(1, 3, ...), base_dilation=(1, 1, ...),
                          padding=((0, 0), (0, 0), ...)] k
    # folds into
    l = reduce_window_sum[..., base_dilation=(1, 2, ...), padding=((0, 0), (2, 1), ...)] j
"""

from __future__ import annotations

import collections

import numpy as np
from jax.extend import core as jcore


def _is_zero(var) -> bool:
    return isinstance(var, jcore.Literal) and np.ndim(var.val) == 0 and var.val == 0


def _folds(pad, window_sum) -> bool:
    config = pad.params["padding_config"]
    return (
        _is_zero(pad.invars[1])
        and all(lo >= 0 and hi >= 0 and interior >= 0 for lo, hi, interior in config)
        and all(d == 1 for d in window_sum.params["base_dilation"])
    )


def _folded(pad, window_sum):
    config = pad.params["padding_config"]
    params = dict(window_sum.params)
    params["base_dilation"] = tuple(int(interior) + 1 for _, _, interior in config)
    params["padding"] = tuple((int(lo) + a, int(hi) + b)
                              for (lo, hi, _), (a, b) in zip(config, params["padding"]))  # fmt: skip
    return window_sum.replace(invars=[pad.invars[0]], params=params)


def fold_zero_pads(jaxpr) -> list:
    """``jaxpr``'s equations with every zero pad read only by a ``reduce_window_sum`` folded
    into it (the pad dropped, the sum reading the pad's operand)."""
    uses = collections.Counter(
        v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jcore.Literal)
    )
    uses.update(v for v in jaxpr.outvars if not isinstance(v, jcore.Literal))
    pads = {e.outvars[0]: e for e in jaxpr.eqns if e.primitive.name == "pad"}
    if not pads:
        return list(jaxpr.eqns)
    folded, dropped = {}, set()
    for e in jaxpr.eqns:
        if e.primitive.name != "reduce_window_sum" or isinstance(e.invars[0], jcore.Literal):
            continue
        pad = pads.get(e.invars[0])
        if pad is not None and uses[e.invars[0]] == 1 and _folds(pad, e):
            folded[id(e)] = _folded(pad, e)
            dropped.add(id(pad))
    return [folded.get(id(e), e) for e in jaxpr.eqns if id(e) not in dropped]
