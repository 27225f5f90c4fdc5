"""Hand-written parallel strategies as schedules, lowered like any other (so they compare fairly).

| strategy        | what it names                                                             |
|-----------------|---------------------------------------------------------------------------|
| data_parallel   | the batch (first free) loop of the first dense op, over the given axes    |
| megatron        | dense ops whose weight is a program input, alternately by output columns |
|                 | (``n``) and by the contraction (``k``, then an all-reduce)                |
| data_and_model  | both: batch over ``data_axes``, Megatron over ``model_axes``              |
| fsdp_stored     | with data_parallel: weights stored split on their first dim (ZeRO-3)      |

Everything else follows by propagation.

Example:
    >>> sched = prog.schedule(megatron(prog, ("a", "b", "c")), mesh)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.ir import Op, Program

DENSE = ("dot_general", "conv_general_dilated")


def _dense(prog: Program) -> list[Op]:
    return [o for o in prog.ops if o.primitive in DENSE]


def _batch_loop(op: Op) -> str:
    for name in (
        ("n", "m", "m0", "b0") if op.primitive == "conv_general_dilated" else ("m0", "m", "b0")
    ):
        if name in op.loop:
            return name
    raise ValueError(f"op {op.name!r} has no batch-like loop among {[lp.name for lp in op.loops]}")


def data_parallel(prog: Program, axes: Sequence[str]) -> dict:
    """Split the batch loop of the first dense op over ``axes``."""
    dense = _dense(prog)
    if not dense:
        raise ValueError("data_parallel needs a dot_general or convolution in the program")
    return {dense[0].name: {_batch_loop(dense[0]): tuple(axes)}}


def _weight_ops(prog: Program) -> list[Op]:
    """Forward layer products ``x @ W``: a program input whose first use is as the right operand
    of a product, contracted on its first dimension, is a weight; those first uses are layers."""
    first_use: dict = {}
    for o in prog.ops:
        for pos, acc in enumerate(o.operands):
            first_use.setdefault(acc.value, (o, pos))
    out = []
    for v in prog.inputs:
        o, pos = first_use.get(v, (None, None))
        if o is None or o.primitive != "dot_general" or pos != 1:
            continue
        (_, rhs_contract), _ = o.eqn.params["dimension_numbers"]
        if tuple(rhs_contract) == (0,):
            out.append(o)
    return sorted(out, key=prog.ops.index)


def megatron(prog: Program, axes: Sequence[str]) -> dict:
    """Alternate column (``n``) and row (``k``) splits over the layers' weight products."""
    out = {}
    for k, op in enumerate(_weight_ops(prog)):
        free = [lp.name for lp in op.loops if lp.name.startswith("n")]
        contracting = [lp.name for lp in op.loops if lp.name.startswith("k")]
        loop = (free or contracting)[0] if k % 2 == 0 else (contracting or free)[0]
        out[op.name] = {loop: tuple(axes)}
    if not out:
        raise ValueError("megatron needs products with a program input (a weight) as right operand")
    return out


def fsdp_stored(prog: Program, axes: Sequence[str], mesh_sizes: dict[str, int]) -> dict:
    """FSDP / ZeRO-3: the layers' weights stored split along their first dimension over ``axes``
    (gathered before use by the data flow); use with :func:`data_parallel`."""
    parts = 1
    for a in axes:
        parts *= mesh_sizes[a]
    out = {}
    for op in _weight_ops(prog):
        w = op.operands[1].value
        if w.shape[0] % parts == 0:
            out[w.name] = (tuple(axes),) + ((),) * (len(w.shape) - 1)
    return out


def data_and_model(prog: Program, data_axes: Sequence[str], model_axes: Sequence[str]) -> dict:
    """Batch over ``data_axes`` on the first dense op, Megatron over ``model_axes``."""
    out = megatron(prog, model_axes)
    first, loops = next(iter(data_parallel(prog, data_axes).items()))
    out.setdefault(first, {}).update(loops)
    return out
