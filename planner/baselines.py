"""Hand-written parallel strategies as schedules, lowered like any other (so they compare fairly).

| strategy        | what it names                                                             |
|-----------------|---------------------------------------------------------------------------|
| data_parallel   | the batch (first free) loop of the first dense op, over the given axes    |
| megatron        | dense ops whose weight is a program input (or a view of one: a scan's     |
|                 | stacked weight one layer at a time, a transpose, a cast): by output       |
|                 | columns (``n``), or by the contraction (``k``, then an all-reduce) when   |
|                 | their input derives from a column-split layer (MLPs alternate;            |
|                 | attention: heads, then rows)                                              |
| data_and_model  | both: batch over ``data_axes``, Megatron over ``model_axes``              |
| fsdp_stored     | with data_parallel: weights stored split on their first dim (ZeRO-3)      |

Everything else follows by propagation.

Example:
    >>> sched = prog.schedule(megatron(prog, ("a", "b", "c")), mesh)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.ir import ENTRIES, Op, Program, Value


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


VIEWS = frozenset({"transpose", "convert_element_type", "copy", "copy_p", "reduce_precision"})
"""Ops whose result is their operand relabelled (dims permuted, elements cast): a weight read
through them (``embedding.T``, a cast to bfloat16) is still the weight."""


def weight_views(prog: Program) -> dict[str, tuple[Value, tuple[int, ...]]]:
    """Value name -> ``(program input, input dimension of each of the value's dimensions)`` for
    every value that is a program input or a view of one: entered into a region's body (a scan's
    stacked ``xs`` lose their leading, layer axis, so a stacked weight is seen one layer at a
    time), transposed or cast (:data:`VIEWS`)."""
    out = {v.name: (v, tuple(range(len(v.shape)))) for v in prog.inputs}
    for o in prog.ops:
        entry = o.how == "region" and o.primitive in ENTRIES
        if not (entry or (o.primitive in VIEWS and len(o.operands) == 1 and len(o.results) == 1)):
            continue
        src, dst = o.operands[0], o.results[0]
        if src.value.name not in out or any(len(d) > 1 for d in src.dims + dst.dims):
            continue
        where = {d[0]: k for k, d in enumerate(src.dims) if d}
        if not all(d and d[0] in where for d in dst.dims):
            continue
        weight, dims = out[src.value.name]
        out[dst.value.name] = (weight, tuple(dims[where[d[0]]] for d in dst.dims))
    return out


def _weight_ops(prog: Program) -> list[tuple[Op, int]]:
    """Forward layer products ``x @ W`` as ``(op, weight operand position)``: the first product
    that reads a program input, or a view of one (:func:`weight_views`: through scans, transposes,
    casts), with that operand contracted on its leading dimensions is a layer of that weight."""
    views = weight_views(prog)
    seen: set[str] = set()
    out = []
    for o in prog.ops:
        if o.primitive != "dot_general" or len(o.operands) != 2:
            continue
        for pos, acc in enumerate(o.operands):
            view = views.get(acc.value.name)
            if view is None or view[0].name in seen:
                continue
            seen.add(view[0].name)
            contract = o.eqn.params["dimension_numbers"][0][pos]
            if contract and sorted(contract) == list(range(len(contract))):
                out.append((o, pos))
                break
    return out


def _layers(prog: Program) -> list[tuple[Op, int, bool]]:
    """The layer products as ``(op, weight position, row)``: Megatron's column layers (their input
    is whole, ``row`` False) and row layers (their input derives from a column layer's output)."""
    layers = dict(_weight_ops(prog))  # op -> position of its weight operand
    split: set[str] = set()  # values derived from a column-split layer's output
    out = []
    for op in prog.ops:
        if op in layers:
            row = op.operands[1 - layers[op]].value.name in split
            out.append((op, layers[op], row))
            if not row:
                split.update(r.value.name for r in op.results)
        elif any(a.value.name in split for a in op.operands):
            split.update(r.value.name for r in op.results)
    return out


def _weight_loops(op: Op, pos: int) -> tuple[list[str], list[str]]:
    """The loops indexing the weight operand's dimensions: ``(contracted, free)``, in its order."""
    summed = {name for name, _ in op.reductions}
    dims = [d[0] for d in op.operands[pos].dims if d]
    return [d for d in dims if d in summed], [d for d in dims if d not in summed]


def megatron(prog: Program, axes: Sequence[str]) -> dict:
    """Column (``n``) splits for layers whose input is whole, row (``k``) splits for layers whose
    input derives from a column-split layer's output (then an all-reduce): an MLP alternates; in
    attention the q, k, v projections are split by heads and the output projection by rows.
    Weights inside scans (stacked over layers) count: the body's products are the layers."""
    out = {}
    for op, pos, row in _layers(prog):
        # Row: the weight's leading (contracted) dimension; column: its first free one.
        contracted, free = _weight_loops(op, pos)
        loops = contracted if row else free
        if loops:
            out[op.name] = {loops[0]: tuple(axes)}
    if not out:
        raise ValueError("megatron needs products with a program input (a weight) as right operand")
    return out


def fsdp_stored(prog: Program, axes: Sequence[str], mesh_sizes: dict[str, int]) -> dict:
    """FSDP / ZeRO-3: the layers' weights stored split along their first dimension over ``axes``
    (gathered before use by the data flow); use with :func:`data_parallel`. A weight stacked over
    a scan's layers is split along its first dimension within a layer (its layer axis stays
    whole, so that each layer is gathered inside the scan, when it runs)."""
    parts = 1
    for a in axes:
        parts *= mesh_sizes[a]
    views = weight_views(prog)
    out = {}
    for op, pos in _weight_ops(prog):
        w, dims = views[op.operands[pos].value.name]
        for d in sorted(dims):
            if w.shape[d] % parts == 0:
                out[w.name] = tuple(tuple(axes) if k == d else () for k in range(len(w.shape)))
                break
    return out


def data_and_model(prog: Program, data_axes: Sequence[str], model_axes: Sequence[str]) -> dict:
    """Batch over ``data_axes`` on the first dense op, Megatron over ``model_axes``."""
    out = megatron(prog, model_axes)
    first, loops = next(iter(data_parallel(prog, data_axes).items()))
    out.setdefault(first, {}).update(loops)
    return out
