"""Hand-written parallel strategies as schedules, lowered like any other (so they compare fairly).

The expert strategies, complete schedules of a training step (:func:`expert_schedules` of an
analysed program; as plans that run: :func:`planner.expert_plans`); every op is laid
out by the program's logical axes, as MaxText's logical axis rules do, in scanned and unscanned
layers alike:

| name            | layouts                                                                   |
|-----------------|---------------------------------------------------------------------------|
| data_parallel   | batch over ``data_axes``; parameters and optimizer replicated             |
| fsdp            | and parameters, gradients and optimizer state split over ``data_axes`` on |
|                 | their embedding width (ZeRO-3: gathered per layer, reduce-scattered); one |
|                 | no layer product reads on its first dimension they divide                 |
| fsdp_tensor     | and heads, MLP hidden and vocabulary over ``tensor_axis`` (Megatron)      |
| ..._sequence    | and the residual stream's embedding width over ``tensor_axis`` (MaxText's |
|                 | ``activation_embed``; a seed of the search, no row of ``explain()``)      |

Partial strategies (a few ops named, everything else follows by propagation), also the search's
starting points:

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

Example:
    >>> scheds = expert_schedules(prog, mesh, data_axes=("data", "fsdp"))  # doctest: +SKIP
    >>> sched = prog.schedule(megatron(prog, ("a", "b", "c")), mesh)   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from planner.program.ir import Program
from planner.program.memo import PerObject
from planner.program.ops import ENTRIES, Op, Value
from planner.program.rules import COMBINABLE
from planner.program.schedule import Schedule, _try, make_schedule


def _dense(prog: Program) -> list[Op]:
    return [o for o in prog.ops if o.dense]


def _batch_op(prog: Program) -> Op | None:
    """The product whose batch loop is the program's batch: the first layer product ``x @ W``
    (:func:`_weight_ops`) with a row loop (``m0`` / ``m``; a ``dot_general``'s batch dimension
    ``b0`` does not count), else the first product. Not simply the first product: MaxText's
    RMSNorm scales its input by a ``dot_general`` batched over the embedding width
    (``256 @ 8x128x256``), whose batch loop ``b0`` is that width."""
    for op, _ in _weight_ops(prog):
        if any(name in op.loop for name in ("m0", "m")):
            return op
    dense = _dense(prog)
    return dense[0] if dense else None


def _batch_loop(op: Op) -> str:
    for name in (
        ("n", "m", "m0", "b0") if op.primitive == "conv_general_dilated" else ("m0", "m", "b0")
    ):
        if name in op.loop:
            return name
    raise ValueError(f"op {op.name!r} has no batch-like loop among {[lp.name for lp in op.loops]}")


def batch_extent(prog: Program) -> int | None:
    """The batch size the expert strategies split: the batch loop's extent of :func:`_batch_op`
    (None without a product). Raises ``ValueError`` if that product has no batch-like loop."""
    op = _batch_op(prog)
    return op.loop[_batch_loop(op)].extent if op is not None else None


def data_parallel(prog: Program, axes: Sequence[str]) -> dict:
    """Split the batch loop of the batch's product (:func:`_batch_op`) over ``axes``."""
    op = _batch_op(prog)
    if op is None:
        raise ValueError("data_parallel needs a dot_general or convolution in the program")
    return {op.name: {_batch_loop(op): tuple(axes)}}


def batch_and_channels(
    prog: Program, batch_axes: Sequence[str], channel_axes: Sequence[str], sizes: dict[str, int]
) -> dict:
    """What one splits a convolutional network by without spatial partitioning: every
    convolution's batch over ``batch_axes`` and its output channels (a grouped one's groups)
    over ``channel_axes`` (a kernel's gradient, whose batch is its reduction ``i``, splits that
    and its output channels), the other ops following. Loops whose extents the axes (of
    ``sizes``) do not divide stay whole.

    Example:
        >>> prog.schedule(batch_and_channels(prog, ("a",), ("b", "c"), sizes), sizes)  # doctest: +SKIP
    """
    convs = [o for o in prog.ops if o.primitive == "conv_general_dilated"]
    if not convs:
        raise ValueError("batch_and_channels needs a convolution in the program")
    out = {}
    for o in convs:
        by_window = any(not w.by_output for w in o.windows)
        channels = "g" if "g" in o.loop else "o"  # a grouped convolution's channels: its groups
        wanted = {"i" if by_window else "n": tuple(batch_axes), channels: tuple(channel_axes)}
        out[o.name] = _valid(o, {lp: axes for lp, axes in wanted.items() if axes}, sizes)
    return out


def batch_and_rows(
    prog: Program, batch_axes: Sequence[str], row_axes: Sequence[str], sizes: dict[str, int]
) -> dict:
    """Spatial partitioning as one writes it by hand: every windowed op (convolutions, pools
    and their gradients) with its batch over ``batch_axes`` and its first spatial dimension,
    the rows, over ``row_axes`` (with halos, :mod:`planner.program.halo`), the other ops following.
    Splits whose tiles do not line up, or whose extents the axes do not divide, stay whole.

    Example:
        >>> prog.schedule(batch_and_rows(prog, ("a",), ("b", "c"), sizes), sizes)  # doctest: +SKIP
    """
    windowed = [o for o in prog.ops if o.windows]
    if not windowed:
        raise ValueError("batch_and_rows needs a convolution or pooling in the program")
    out = {}
    for o in windowed:
        if o.primitive == "conv_general_dilated":
            batch = "n" if all(w.by_output for w in o.windows) else "i"
        else:  # pools and their gradients: one loop per dimension, the batch first
            batch = o.loops[0].name
        wanted = {batch: tuple(batch_axes), o.windows[0].owner: tuple(row_axes)}
        out[o.name] = _valid(o, {lp: axes for lp, axes in wanted.items() if axes}, sizes)
    return out


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
    casts), with that operand contracted on its leading dimensions is a layer of that weight.
    Made once per program (:func:`_batch_op` and :func:`_layers` both read it)."""
    return WEIGHT_OPS.get(prog, lambda: _find_weight_ops(prog))


WEIGHT_OPS: PerObject[list] = PerObject("layer products per program")


def _find_weight_ops(prog: Program) -> list[tuple[Op, int]]:
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
    is whole, ``row`` False) and row layers (their input derives from a column layer's output).
    A product whose input derives from no floating-point input (a one-hot of the tokens: MaxText's
    ``use_iota_embed``) is an embedding lookup, a row layer: its contraction is the vocabulary,
    its output the embedding width, whole after the lookup's sum."""
    layers = dict(_weight_ops(prog))  # op -> position of its weight operand
    floats = _from_floats(prog)
    split: set[str] = set()  # values derived from a column-split layer's output
    out = []
    for op in prog.ops:
        if op in layers:
            x = op.operands[1 - layers[op]].value.name
            row = x in split or x not in floats
            out.append((op, layers[op], row))
            if not row:
                split.update(r.value.name for r in op.results)
        elif any(a.value.name in split for a in op.operands):
            split.update(r.value.name for r in op.results)
    return out


def _from_floats(prog: Program) -> set[str]:
    """The names of the values that derive from a floating-point program input."""
    out = {v.name for v in prog.inputs if v.dtype.startswith(("float", "bfloat", "complex"))}
    for op in prog.ops:
        if any(a.value.name in out for a in op.operands):
            out.update(r.value.name for r in op.results)
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


# ----------------------------------------------------------------- expert strategies, MaxText-style


class _Classes:
    """Union-find over loops (``(op name, loop)``) and array dimensions (``(value name, dim)``):
    a dimension joins the major loop indexing it in its producer and in each of its consumers, so
    that a class is one logical axis of the program (its batch, its heads, its MLP hidden
    dimension, its embedding width), as MaxText names them by hand."""

    def __init__(self, prog: Program):
        self.parent: dict = {}
        for o in prog.ops:
            for acc in o.operands + o.results:
                for d, loops in enumerate(acc.dims):
                    if loops:
                        self.union((o.name, loops[0]), (acc.value.name, d))

    def find(self, node):
        root = node
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while node != root:  # path compression
            self.parent[node], node = root, self.parent.get(node, node)
        return root

    def union(self, a, b) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[b] = a


STRATEGIES = ("data_parallel", "fsdp", "fsdp_tensor")
"""The names :func:`expert_schedules` and :func:`planner.expert_plans` return, in order."""


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One strategy as MaxText's logical axis rules: logical axis (a class of
    :class:`_Classes`) -> mesh axes, for activations (values with a batch dimension) and for
    parameters, their gradients and optimizer state (values without one)."""

    batch: object  # the batch class: over ``data`` in activations
    data: tuple[str, ...]
    model: frozenset  # heads, MLP hidden, vocabulary: over ``tensor`` everywhere
    tensor: str | None
    width: frozenset  # the embedding width: over ``data`` in parameters (FSDP)
    stacked: frozenset  # the layer axes of weights stacked for a scan
    # MaxText's ``activation_embed`` -> ``tensor``: the embedding width of the activations
    # outside the tensor-parallel layers (the residual stream, its norms) over ``tensor``, so
    # that each column layer gathers its input and each row layer reduce-scatters its output
    sequence: bool = False

    def __call__(self, extents, classes) -> list[tuple[str, ...]]:
        """The mesh axes of each dimension (or loop) of the given extents and classes."""
        activation = self.batch in classes
        outside = self.sequence and activation and not any(c in self.model for c in classes)
        # A per-layer vector (a norm's scale, a bias) stays whole on the data axes, as ZeRO-3
        # keeps parameters under its persistence threshold and MaxText keeps norm scales off
        # its FSDP axes: a gather per tiny vector costs more than it saves.
        vector = sum(n > 1 and c not in self.stacked for n, c in zip(extents, classes)) < 2
        out: list[tuple[str, ...]] = []
        taken: set[str] = set()
        for c in classes:
            axes: tuple[str, ...] = ()
            if c in self.model:
                axes = (self.tensor,)
            elif activation and c == self.batch:
                axes = self.data
            elif outside and c in self.width:
                axes = (self.tensor,)
            elif not activation and not vector and c in self.width:
                axes = self.data
            if taken & set(axes):
                axes = ()
            taken.update(axes)
            out.append(axes)
        return out


def _valid(op: Op, wanted: dict[str, tuple[str, ...]], sizes) -> dict[str, tuple[str, ...]]:
    """The wanted loops ``op`` can take (partitionable, divisible, each mesh axis once, the major
    loop of merged dimensions, one kind of partitioned reduction), greedily in loop order."""
    out = _try(op, sizes, wanted)
    kinds = dict(op.reductions)
    kept = None
    for lp in list(out):
        if lp in kinds:
            if kinds[lp] not in COMBINABLE or kept not in (None, kinds[lp]):
                del out[lp]
            else:
                kept = kinds[lp]
    return out


def _schedule(prog: Program, classes: tuple[dict, dict], rule: _Rule, sizes) -> Schedule:
    """Every op and every parameter input laid out by ``rule`` (``classes``: the classes of each
    op's loops and of each input's dimensions, by name, :class:`_Classes`)."""
    assign = {}
    loops, dims = classes
    for o in prog.ops:
        axes = rule([lp.extent for lp in o.loops], loops[o.name])
        assign[o.name] = _valid(o, {lp.name: a for lp, a in zip(o.loops, axes) if a}, sizes)
    stored = {}
    for v in prog.inputs:
        cls = dims[v.name]
        if rule.batch in cls:
            continue  # a batch input: laid out as its first consumer reads it
        spec = rule(v.shape, cls)
        stored[v.name] = tuple(a if n % math.prod(sizes[x] for x in a) == 0 else ()
                               for n, a in zip(v.shape, spec))  # fmt: skip
    return make_schedule(prog, assign, sizes, default="replicate", stored=stored)


def expert_schedules(
    prog: Program,
    mesh,
    data_axes: Sequence[str] = ("data", "fsdp"),
    tensor_axis: str | None = "tensor",
    sequence: bool = False,
) -> dict[str, Schedule]:
    """The hand strategies an expert writes for a training step, as complete schedules of
    ``prog`` (name -> :class:`planner.program.schedule.Schedule`, see :func:`planner.expert_plans`).

    Every op is named, as MaxText's logical axis rules constrain every activation and parameter
    (:class:`_Rule`): the loops of one logical axis (:class:`_Classes`: the batch of the first
    product; the heads, MLP hidden and vocabulary dimensions Megatron splits; the embedding width
    FSDP stores split) take the same mesh axes wherever they occur, inside scans too.
    ``fsdp_tensor`` is left out when ``tensor_axis`` is ``None`` or not a mesh axis of size > 1;
    ``sequence`` adds ``fsdp_tensor_sequence``, ``fsdp_tensor`` with the activations' embedding
    width over ``tensor_axis`` outside the tensor-parallel layers, as MaxText's rules lay them
    out (``activation_embed``; Megatron's sequence parallelism splits the sequence instead).

    Raises:
        ValueError: a data or tensor axis that is not on the mesh, a program without a product
            with a batch loop, or (``fsdp_tensor``) one whose Megatron dimensions are its batch.
    """
    sizes = dict(getattr(mesh, "shape", mesh))
    data = tuple(data_axes)
    for a in (*data, *([tensor_axis] if tensor_axis else [])):
        if a not in sizes:
            raise ValueError(f"mesh axis {a!r} is not on the mesh {sizes}")
    if tensor_axis in data:
        raise ValueError(f"tensor axis {tensor_axis!r} is also a data axis")
    dense = _dense(prog)
    if not dense:
        raise ValueError("expert strategies need a dot_general or convolution in the program")
    classes = _Classes(prog)
    first = _batch_op(prog)
    batch = classes.find((first.name, _batch_loop(first)))
    model, width = set(), set()
    for op, pos, row in _layers(prog):
        contracted, free = _weight_loops(op, pos)
        # Column layers: heads / hidden are the weight's first free dimension, the embedding
        # width its contracted one; row layers the other way round.
        heads, embed = (contracted, free) if row else (free, contracted)
        if heads:
            model.add(classes.find((op.name, heads[0])))
        if embed:
            width.add(classes.find((op.name, embed[0])))
    width.discard(batch)
    stacked = frozenset(
        classes.find((o.operands[0].value.name, d))
        for o in prog.ops if o.how == "region" and o.primitive in ENTRIES
        for d, loops in enumerate(o.operands[0].dims) if not loops
    )  # fmt: skip
    width |= _unlayered_widths(prog, classes, batch, model | width, stacked,
                               math.prod(sizes[a] for a in data))  # fmt: skip
    rules = {
        "data_parallel": _Rule(batch, data, frozenset(), None, frozenset(), stacked),
        "fsdp": _Rule(batch, data, frozenset(), None, frozenset(width), stacked),
    }
    if tensor_axis and sizes.get(tensor_axis, 1) > 1:
        if batch in model:
            raise ValueError("the Megatron dimensions of this program are linked to its batch")
        rules["fsdp_tensor"] = _Rule(batch, data, frozenset(model), tensor_axis,
                                     frozenset(width - model), stacked)  # fmt: skip
        if sequence:
            rules["fsdp_tensor_sequence"] = dataclasses.replace(rules["fsdp_tensor"],
                                                                sequence=True)  # fmt: skip
    loops = {o.name: [classes.find((o.name, lp.name)) for lp in o.loops] for o in prog.ops}
    dims = {v.name: [classes.find((v.name, d)) for d in range(len(v.shape))] for v in prog.inputs}
    return {name: _schedule(prog, (loops, dims), rule, sizes) for name, rule in rules.items()}


def _unlayered_widths(prog: Program, classes: _Classes, batch, known: set, stacked: frozenset,
                      parts: int) -> set:  # fmt: skip
    """The classes FSDP stores split for the parameters no layer product reads (ZeRO-3 splits
    every parameter): for each program input without the batch, none of whose dimensions is
    in ``known`` (a layer's heads or width), and that is no vector (two dimensions > 1 beside
    a scan's layer axis), its first dimension ``parts`` (the data axes' devices) divides. An
    expert-stacked weight read only inside a ``shard_map`` (MaxText's mixture of experts:
    ``wi_0`` of ``[experts, layers, embed, mlp]``) or a convolution's kernel is such a one."""
    out: set = set()
    for v in prog.inputs:
        cls = [classes.find((v.name, d)) for d in range(len(v.shape))]
        if batch in cls or any(c in known or c in out for c in cls):
            continue
        free = [d for d, (n, c) in enumerate(zip(v.shape, cls)) if n > 1 and c not in stacked]
        if len(free) < 2:
            continue
        split = next((d for d in free if v.shape[d] % parts == 0), None)
        if split is not None:
            out.add(cls[split])
    return out


@dataclasses.dataclass(frozen=True)
class Experts:
    """The expert strategies of a program on a mesh, made once (:func:`experts`): ``rows``, label
    -> the schedule ``explain()`` prices beside a plan, or why the strategy does not apply
    (``"n/a: ..."``); ``seeds``, every expert schedule the search starts from (the rows',
    FSDP / data parallelism over all but the last axis, which FSDP x tensor leaves it, and FSDP
    x tensor with the residual stream over the tensor axis too, as MaxText lays it out)."""

    rows: dict[str, Schedule | str]
    seeds: tuple[Schedule, ...]


EXPERTS: PerObject[dict[tuple, Experts]] = PerObject("expert strategies per mesh")


def experts(prog: Program, sizes: dict[str, int]) -> Experts:
    """The expert strategies of ``prog`` on a mesh of ``sizes`` (its axes of size 1 ignored),
    for the search's seeds and the rows of ``explain()`` alike; cached per program and mesh.

    Example:
        >>> list(experts(prog, {"fsdp": 4, "tensor": 2}).rows)          # doctest: +SKIP
        ['data parallelism (8-way batch)', 'FSDP (8-way, weights split)', 'FSDP x tensor (fsdp x tensor)']
    """
    key = tuple(sizes.items())
    held = EXPERTS.get(prog, dict)
    if key not in held:
        held[key] = _experts(prog, dict(sizes))
    return held[key]


def _experts(prog: Program, sizes: dict[str, int]) -> Experts:
    axes = tuple(a for a, n in sizes.items() if n > 1)
    ways = math.prod(sizes.values())
    layouts = [(axes, None)] + ([(axes[:-1], axes[-1])] if len(axes) > 1 else [])
    made: list[dict[str, Schedule] | ValueError] = []
    for data_axes, tensor_axis in layouts if axes else ():
        try:
            made.append(expert_schedules(prog, sizes, data_axes, tensor_axis,
                                         sequence=tensor_axis is not None))  # fmt: skip
        except ValueError as e:  # no product with a batch loop, or heads linked to the batch
            made.append(e)
    seeds = tuple(s for m in made if isinstance(m, dict) for s in m.values())
    labels = {"data_parallel": f"data parallelism ({ways}-way batch)",
              "fsdp": f"FSDP ({ways}-way, weights split)"}  # fmt: skip
    try:
        batch = batch_extent(prog)
        if batch is not None and batch % ways:
            raise ValueError("not divisible")
        if made and isinstance(made[0], ValueError):
            raise made[0]
    except ValueError as e:
        return Experts({label: why_not(e, ways) for label in labels.values()}, seeds)
    found = made[0] if made else {}
    rows: dict[str, Schedule | str] = {
        label: found.get(name, "n/a") for name, label in labels.items()
    }
    if len(made) > 1:
        label = f"FSDP x tensor ({'x'.join(axes[:-1])} x {axes[-1]})"
        rows[label] = (
            made[1]["fsdp_tensor"] if isinstance(made[1], dict) else why_not(made[1], ways)
        )
    return Experts(rows, seeds)


def why_not(e: Exception, ways: int) -> str:
    """Why an expert strategy does not apply, as ``explain()`` says it (``"n/a: ..."``)."""
    text = str(e)
    if "not divisible" in text:
        return f"n/a: the batch does not split {ways} ways"
    if "a dot_general or convolution" in text:
        return "n/a: no matrix product"
    if "batch-like loop" in text:
        return "n/a: no batch loop"
    return "n/a"
