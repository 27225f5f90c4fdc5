"""Hand-written parallel strategies as schedules, lowered like any other (so they compare fairly).

| strategy        | what it names                                                             |
|-----------------|---------------------------------------------------------------------------|
| data_parallel   | the batch (first free) loop of the first dense op, over the given axes    |
| megatron        | dense ops whose weight is a program input: by output columns (``n``), or |
|                 | by the contraction (``k``, then an all-reduce) when their input derives   |
|                 | from a column-split layer (MLPs alternate; attention: heads, then rows)   |
| data_and_model  | both: batch over ``data_axes``, Megatron over ``model_axes``              |
| fsdp_stored     | with data_parallel: weights stored split on their first dim (ZeRO-3)      |

Everything else follows by propagation.

Example:
    >>> sched = prog.schedule(megatron(prog, ("a", "b", "c")), mesh)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.ir import Op, Program


def _dense(prog: Program) -> list[Op]:
    return [o for o in prog.ops if o.dense]


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
    """Forward layer products ``x @ W`` as ``(op, weight operand position)``: a program input whose
    first use is as an operand of a product contracted on its leading dimensions is a weight."""
    out = []
    for v in prog.inputs:
        uses = prog.uses.get(v.name)
        if not uses or uses[0][0].primitive != "dot_general" or len(uses[0][0].operands) != 2:
            continue
        o = uses[0][0]
        pos = next(k for k, a in enumerate(o.operands) if a is uses[0][1])
        contract = o.eqn.params["dimension_numbers"][0][pos]
        if contract and sorted(contract) == list(range(len(contract))):
            out.append((o, pos))
    return sorted(out, key=lambda op_pos: prog.index[op_pos[0].name])


def megatron(prog: Program, axes: Sequence[str]) -> dict:
    """Column (``n``) splits for layers whose input is whole, row (``k``) splits for layers whose
    input derives from a column-split layer's output (then an all-reduce): an MLP alternates; in
    attention the q, k, v projections are split by heads and the output projection by rows."""
    layers = dict(_weight_ops(prog))  # op -> position of its weight operand
    split: set[str] = set()  # values derived from a column-split layer's output
    out = {}
    for op in prog.ops:
        if op in layers:
            row = op.operands[1 - layers[op]].value.name in split
            # Row: the weight's leading (contracted) dimension; column: its first free one.
            summed = {name for name, _ in op.reductions}
            dims = [d[0] for d in op.operands[layers[op]].dims if d]
            loops = [d for d in dims if (d in summed) == row]
            if loops:
                out[op.name] = {loops[0]: tuple(axes)}
            if not row:
                split.update(r.value.name for r in op.results)
        elif any(a.value.name in split for a in op.operands):
            split.update(r.value.name for r in op.results)
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
    for op, pos in _weight_ops(prog):
        w = op.operands[pos].value
        if w.shape[0] % parts == 0:
            out[w.name] = (tuple(axes),) + ((),) * (len(w.shape) - 1)
    return out


def data_and_model(prog: Program, data_axes: Sequence[str], model_axes: Sequence[str]) -> dict:
    """Batch over ``data_axes`` on the first dense op, Megatron over ``model_axes``."""
    out = megatron(prog, model_axes)
    first, loops = next(iter(data_parallel(prog, data_axes).items()))
    out.setdefault(first, {}).update(loops)
    return out
