"""Iteration spaces of the core primitives, written as a table of rules.

| primitives                      | loops                                  | access maps                      |
|---------------------------------|----------------------------------------|----------------------------------|
| elementwise (add, exp, ...)     | one per result dim                     | same loops; scalars read whole   |
| broadcast_in_dim                | one per result dim                     | operand dim -> its result dim    |
| transpose                       | one per result dim                     | permuted                         |
| reshape                         | the finer side of each split/merge;    | merged dims list several loops   |
|                                 | m:n regroupings: the sizes both merge  |                                  |
| tile                            | one per result dim (repeated: whole,   | from size 1: read whole          |
|                                 | unless repeated from size 1)           |                                  |
| squeeze / expand_dims           | one per kept dim                       | size-1 dims read whole           |
| dot_general                     | batch b*, free m*/n*, contracting k*   | reduction (sum) over k*          |
| reduce_sum/max/min/and/or       | kept i*, reduced r*                    | reduction over r* (combined by   |
|                                 |                                        | psum / pmax / pmin)              |
| reduce_prod/xor, argmax/argmin  | kept i*, reduced r* (not partitionable)|                                  |
| concatenate, split, cumsum,     | one per result dim; the axis they work | operands whole on that axis      |
| sort, top_k, rev                | along is not partitionable             |                                  |
| slice, pad, dynamic_slice,      | one per result dim; dims not taken     | operands whole on those dims     |
| dynamic_update_slice            | whole are not partitionable            |                                  |
| gather                          | index batch dims, whole-slice offsets; | indexed operand dims whole, but  |
|                                 | a dim looked up one element at a time: | those masked loops split (XLA's  |
|                                 | a masked loop, summed over             | partitioner only)                |
| scatter, scatter-add            | window dims; scatter dims (scatter-add:| indexed operand dims whole, but  |
|                                 | a sum, the operand added once); dims   | masked ones split (XLA only)     |
|                                 | written one element at a time: masked  |                                  |
| iota                            | one per result dim (counted one: not)  |                                  |
| sharding_constraint, reshard,   | one per dim (identities; the layouts   | same loops                       |
| mesh_cast, name (checkpoint)    | asked for: program.constraints)        |                                  |
| stack / unstack                 | one per result dim                     | the stacked dim whole            |
| optimization_barrier            | one per dim of each operand            | each operand as its result       |
| random ops, PRNG key values     | whole (a split would draw other bits)  | read whole                       |
| conv_general_dilated            | n, g (groups), o (features), i (in     | the input's spatial dims split   |
|                                 | features, sum), spatial s*, windows w* | by s* (or w*) with a halo        |
| reduce_window_sum/max/min       | one per result dim                     | windowed dims split with a halo  |

A rule returns ``None`` when it does not apply; the analysis then tries generic discovery.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence

import numpy as np

from planner.program.halo import Window
from planner.program.ops import Access, Loop, Op, Value

ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp complex conj
    convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag add_any
    bitcast_convert_type threefry2x32 polygamma igamma igammac igamma_grad_a random_gamma_grad
    bessel_i0e bessel_i1e zeta regularized_incomplete_beta clz square one_minus_square
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
    population_count pow real reduce_precision rem round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient sub tan
    tanh xor""".split()
)
REDUCTIONS = {
    "reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
    "reduce_and": "and", "reduce_or": "or", "reduce_xor": "xor",
    "argmax": "argmax", "argmin": "argmin",
}  # fmt: skip
COMBINABLE = frozenset({"sum", "max", "min", "and", "or"})  # partial results the lowering combines
READ_WHOLE = frozenset(
    "random_bits random_seed random_split random_fold_in random_wrap random_unwrap "
    "rng_bit_generator rng_uniform".split()
)
CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
SCATTERS = frozenset("scatter scatter-add scatter_add scatter-mul scatter_mul scatter-min "
                     "scatter_min scatter-max scatter_max".split())  # fmt: skip
SCATTER_ADD = frozenset({"scatter-add", "scatter_add"})
# Parameters listing sizes of operand 0's dimensions: where an entry is the whole dimension,
# the lowering replaces it by the local size (the dimension may be split).
OPERAND_SIZE_PARAMS = {
    "gather": "slice_sizes",
    "dynamic_slice": "slice_sizes",
    "slice": "limit_indices",
}

Rule = Callable[[str, object, Sequence[Value | None], Sequence[Value]], Op | None]


def _loops(prefix: str, shape: Sequence[int], partitionable=True) -> list[Loop]:
    return [Loop(f"{prefix}{k}", n, partitionable) for k, n in enumerate(shape)]


def _acc(v: Value, dims) -> Access:
    return Access(v, tuple(tuple(d) for d in dims))


def _operands(ins, dims_of) -> tuple[Access, ...]:
    return tuple(_acc(v, dims_of(v)) for v in ins if v is not None)


def elementwise(name, eqn, ins, outs):
    shape = outs[0].shape
    if any(o.shape != shape for o in outs):
        return None
    for v in ins:
        if (
            v is not None
            and v.shape
            and (len(v.shape) != len(shape) or any(a not in (b, 1) for a, b in zip(v.shape, shape)))
        ):
            return None
    loops = _loops("i", shape)

    def dims(v: Value):
        if not v.shape:
            return []
        return [(lp.name,) if n == lp.extent else () for n, lp in zip(v.shape, loops)]

    return Op(
        name, eqn.primitive.name, tuple(loops), _operands(ins, dims),
        tuple(_acc(o, [(lp.name,) for lp in loops]) for o in outs),
    )  # fmt: skip


def broadcast_in_dim(name, eqn, ins, outs):
    out = outs[0]
    loops = _loops("i", out.shape)
    bd = eqn.params["broadcast_dimensions"]
    (v,) = ins
    if v is None:  # a broadcast literal
        return Op(name, "broadcast_in_dim", tuple(loops), (),
                  (_acc(out, [(lp.name,) for lp in loops]),))  # fmt: skip
    dims = [
        (loops[bd[k]].name,) if v.shape[k] == out.shape[bd[k]] else () for k in range(len(v.shape))
    ]
    return Op(name, "broadcast_in_dim", tuple(loops), (_acc(v, dims),),
              (_acc(out, [(lp.name,) for lp in loops]),))  # fmt: skip


def transpose(name, eqn, ins, outs):
    out, (v,) = outs[0], ins
    perm = eqn.params["permutation"]
    loops = _loops("i", out.shape)
    dims = [None] * len(perm)
    for k, p in enumerate(perm):
        dims[p] = (loops[k].name,)
    return Op(name, "transpose", tuple(loops), (_acc(v, dims),),
              (_acc(out, [(lp.name,) for lp in loops]),))  # fmt: skip


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Align the dims (of size > 1) of two shapes of equal size into groups of equal product."""
    ia = [d for d, n in enumerate(a) if n != 1]
    ib = [d for d, n in enumerate(b) if n != 1]
    out, i, j = [], 0, 0
    while i < len(ia) and j < len(ib):
        ga, gb = [ia[i]], [ib[j]]
        pa, pb = a[ia[i]], b[ib[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(ia[i])
                pa *= a[ia[i]]
                i += 1
            else:
                gb.append(ib[j])
                pb *= b[ib[j]]
                j += 1
        out.append((ga, gb))
    return out


def reshape(name, eqn, ins, outs):
    out, v = outs[0], ins[0]
    if eqn.params.get("dimensions") not in (None, ()):
        return None
    loops: list[Loop] = []
    in_dims: list = [()] * len(v.shape)
    out_dims: list = [()] * len(out.shape)
    for ga, gb in _groups(v.shape, out.shape):
        if len(ga) == 1 or len(gb) == 1:
            split = len(ga) == 1  # one input dim split into several output dims (or merged back)
            fine, coarse = (gb, ga) if split else (ga, gb)
            fine_shape, fine_dims, coarse_dims = (
                (out.shape, out_dims, in_dims) if split else (v.shape, in_dims, out_dims)
            )
            names = []
            for d in fine:
                names.append(f"i{len(loops)}")
                loops.append(Loop(names[-1], fine_shape[d]))
                fine_dims[d] = (names[-1],)
            coarse_dims[coarse[0]] = tuple(names)
        elif factors := _common_factors([v.shape[d] for d in ga], [out.shape[d] for d in gb]):
            names = []  # an m:n regrouping, one loop per size both sides merge:
            for n in factors:  # (4, 2M) -> (1024, 8K) through (4, 256, 8K)
                names.append(f"i{len(loops)}")
                loops.append(Loop(names[-1], n))
            for shape_, group, dims in ((v.shape, ga, in_dims), (out.shape, gb, out_dims)):
                it = iter(zip(names, factors))
                for d in group:
                    covered, size = [], 1
                    while size < shape_[d]:
                        lp, n = next(it)
                        covered.append(lp)
                        size *= n
                    dims[d] = tuple(covered)
        else:  # an m:n regrouping of sizes that do not divide: one loop that cannot be split
            loops.append(Loop(f"i{len(loops)}", math.prod(v.shape[d] for d in ga), False))
    return Op(name, "reshape", tuple(loops), (_acc(v, in_dims),), (_acc(out, out_dims),))


def _common_factors(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    """The sizes two groups of dimensions of equal product both merge, major first, or None
    where a dimension's boundary does not divide the next one's.

    Example:
        >>> _common_factors([4, 2097152], [1024, 8192])
        (4, 256, 8192)
    """
    bounds = sorted(
        {*itertools.accumulate(a, operator.mul), *itertools.accumulate(b, operator.mul)}
    )
    if any(hi % lo for lo, hi in zip(bounds, bounds[1:])):
        return None
    return tuple(hi // lo for lo, hi in zip([1, *bounds], bounds))


def squeeze(name, eqn, ins, outs):
    out, v = outs[0], ins[0]
    gone = {d % len(v.shape) for d in eqn.params["dimensions"]}
    loops = _loops("i", out.shape)
    it = iter(loops)
    dims = [() if k in gone else (next(it).name,) for k in range(len(v.shape))]
    return Op(name, "squeeze", tuple(loops), (_acc(v, dims),),
              (_acc(out, [(lp.name,) for lp in loops]),))  # fmt: skip


def expand_dims(name, eqn, ins, outs):
    out, v = outs[0], ins[0]
    new = {d % len(out.shape) for d in eqn.params["dimensions"]}
    loops = _loops("i", [n for k, n in enumerate(out.shape) if k not in new])
    it = iter(loops)
    odims = [() if k in new else (next(it).name,) for k in range(len(out.shape))]
    return Op(name, "expand_dims", tuple(loops), (_acc(v, [(lp.name,) for lp in loops]),),
              (_acc(out, odims),))  # fmt: skip


def dot_general(name, eqn, ins, outs):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    out = outs[0]
    lfree = [d for d in range(len(lhs.shape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs.shape)) if d not in rc and d not in rb]
    b = [Loop(f"b{k}", lhs.shape[d]) for k, d in enumerate(lb)]
    m = [Loop("m" if len(lfree) == 1 else f"m{k}", lhs.shape[d]) for k, d in enumerate(lfree)]
    n = [Loop("n" if len(rfree) == 1 else f"n{k}", rhs.shape[d]) for k, d in enumerate(rfree)]
    k_ = [Loop("k" if len(lc) == 1 else f"k{q}", lhs.shape[d]) for q, d in enumerate(lc)]
    ldims: list = [()] * len(lhs.shape)
    rdims: list = [()] * len(rhs.shape)
    for lp, d in zip(b, lb):
        ldims[d] = (lp.name,)
    for lp, d in zip(b, rb):
        rdims[d] = (lp.name,)
    for lp, d in zip(m, lfree):
        ldims[d] = (lp.name,)
    for lp, d in zip(n, rfree):
        rdims[d] = (lp.name,)
    for lp, dl, dr in zip(k_, lc, rc):
        ldims[dl] = (lp.name,)
        rdims[dr] = (lp.name,)
    odims = [(lp.name,) for lp in b + m + n]
    return Op(
        name, "dot_general", tuple(b + m + n + k_), (_acc(lhs, ldims), _acc(rhs, rdims)),
        (_acc(out, odims),), reductions=tuple((lp.name, "sum") for lp in k_),
    )  # fmt: skip


def reduction(name, eqn, ins, outs):
    v = ins[0]
    axes = {a % len(v.shape) for a in eqn.params["axes"]}
    kind = REDUCTIONS[eqn.primitive.name]
    # and / or combine as min / max only on booleans (on integers they are bitwise)
    split = kind in COMBINABLE and (kind not in ("and", "or") or v.dtype == "bool")
    loops, dims, kept = [], [], []
    for d, size in enumerate(v.shape):
        if d in axes:
            lp = Loop(f"r{d}", size, partitionable=split)
        else:
            lp = Loop(f"i{d}", size)
            kept.append((lp.name,))
        loops.append(lp)
        dims.append((lp.name,))
    reds = tuple((lp.name, kind) for lp in loops if lp.name.startswith("r"))
    return Op(name, eqn.primitive.name, tuple(loops), (_acc(v, dims),),
              tuple(_acc(o, kept) for o in outs), reductions=reds)  # fmt: skip


def concatenate(name, eqn, ins, outs):
    out = outs[0]
    axis = eqn.params["dimension"]
    loops = [Loop(f"i{d}", n, d != axis) for d, n in enumerate(out.shape)]
    full = [(lp.name,) for lp in loops]
    odims = list(full)
    return Op(
        name, "concatenate", tuple(loops),
        _operands(ins, lambda v: [() if d == axis else full[d] for d in range(len(full))]),
        (_acc(out, odims),),
    )  # fmt: skip


def iota(name, eqn, ins, outs):
    # Values count along ``dimension``: a slice of it would need an offset, so it is not split.
    d = eqn.params.get("dimension", 0)
    loops = [Loop(f"i{k}", n, k != d) for k, n in enumerate(outs[0].shape)]
    return Op(name, "iota", tuple(loops), (), (_acc(outs[0], [(lp.name,) for lp in loops]),))


def _aligned(name, eqn, ins, outs, whole: set[int], reductions=()) -> Op | None:
    """One loop per dimension of the first result; the dimensions in ``whole`` are not
    partitionable and read (and written) whole; operands of another rank are read whole."""
    shape = outs[0].shape
    loops = [Loop(f"i{d}", n, d not in whole) for d, n in enumerate(shape)]

    def dims(v: Value) -> list | None:
        if len(v.shape) != len(shape):
            return [()] * len(v.shape)
        out = []
        for d, (n, lp) in enumerate(zip(v.shape, loops)):
            if d in whole:
                out.append(())
            elif n == lp.extent:
                out.append((lp.name,))
            else:
                return None
        return out

    operands = [dims(v) for v in ins if v is not None]
    results = [dims(o) for o in outs]
    if any(d is None for d in operands + results):
        return None
    return Op(name, eqn.primitive.name, tuple(loops),
              tuple(_acc(v, d) for v, d in zip([v for v in ins if v is not None], operands)),
              tuple(_acc(o, d) for o, d in zip(outs, results)), reductions)  # fmt: skip


def along_axis(name, eqn, ins, outs):
    """cumsum & co, sort, top_k, split: the dimension they work along stays whole."""
    p, rank = eqn.params, len(outs[0].shape)
    axis = p.get("axis", p.get("dimension", rank - 1))
    return _aligned(name, eqn, ins, outs, {axis % rank} if rank else set())


def rev(name, eqn, ins, outs):
    return _aligned(name, eqn, ins, outs, set(eqn.params["dimensions"]))


def tile(name, eqn, ins, outs):
    """``jnp.tile``: a dimension repeated from size 1 is a broadcast (the result split, the
    operand read whole); one repeated from a larger size is whole; the others split alike.

    MaxText's flash-attention segment ids are ``jnp.tile`` of ``int32[1, 1, 1, 128]`` to
    ``[batch, length, heads, 128]``: split by batch, they are 1/512 of their size per chip.
    """
    reps, (v,), out = eqn.params["reps"], ins, outs[0]
    loops = [Loop(f"i{d}", n, r == 1 or k == 1)
             for d, (n, k, r) in enumerate(zip(out.shape, v.shape, reps))]  # fmt: skip
    dims = [(lp.name,) if r == 1 else () for lp, r in zip(loops, reps)]
    return Op(name, eqn.primitive.name, tuple(loops), (_acc(v, dims),),
              (_acc(out, [(lp.name,) for lp in loops]),))  # fmt: skip


def pad(name, eqn, ins, outs):
    padded = {d for d, cfg in enumerate(eqn.params["padding_config"]) if tuple(cfg) != (0, 0, 0)}
    return _aligned(name, eqn, ins, outs, padded)


def slice_(name, eqn, ins, outs):
    p, v = eqn.params, ins[0]
    strides = p.get("strides") or (1,) * len(v.shape)
    cut = {d for d, (lo, hi, st, n) in enumerate(zip(p["start_indices"], p["limit_indices"],
                                                     strides, v.shape))
           if (lo, hi, st or 1) != (0, n, 1)}  # fmt: skip
    return _aligned(name, eqn, ins, outs, cut)


def dynamic_slice(name, eqn, ins, outs):
    v = ins[0]
    cut = {d for d, (k, n) in enumerate(zip(eqn.params["slice_sizes"], v.shape)) if k != n}
    return _aligned(name, eqn, ins, outs, cut)


def dynamic_update_slice(name, eqn, ins, outs):
    v, update = ins[0], ins[1]
    if v is None or update is None:
        return None
    cut = {d for d, (k, n) in enumerate(zip(update.shape, v.shape)) if k != n}
    return _aligned(name, eqn, ins, outs, cut)


def _indexed(
    operand: Value, indices: Value, dropped, batching
) -> tuple[list[int], list[int], list]:
    """What a gather and a scatter share: the operand dimensions their slices (update windows) run
    along, all but the ``dropped`` ones (collapsed / inserted: size 1 in the window) and the
    batching ones; the indices' batch dimensions, all but the last (the index vector); and the
    indices' dimensions, whole until a rule splits them."""
    window = [d for d in range(len(operand.shape)) if d not in dropped and d not in batching]
    return window, list(range(len(indices.shape) - 1)), [()] * len(indices.shape)


def gather(name, eqn, ins, outs):
    """Output batch dims share loops with the indices (and operand batching dims); offset dims
    that take a whole operand dimension share loops with it; an indexed dimension read one element
    at a time (an embedding's vocabulary, ``take_along_axis``'s axis) is a masked loop summed
    over (:attr:`planner.program.ops.Loop.masked`: each device looks up its own range, XLA's
    partitioner masks the rest and sums); other indexed dimensions stay whole."""
    v, idx = ins
    out = outs[0]
    if v is None or idx is None:
        return None
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    loops = _loops("i", out.shape)
    odims = [(lp.name,) for lp in loops]
    vdims: list = [()] * len(v.shape)
    window, batch_idx, idims = _indexed(v, idx, dn.collapsed_slice_dims, dn.operand_batching_dims)
    batch_out = [d for d in range(len(out.shape)) if d not in dn.offset_dims]
    if len(window) != len(dn.offset_dims) or len(batch_out) != len(batch_idx):
        return None
    for od, vd in zip(dn.offset_dims, window):
        if sizes[vd] == v.shape[vd] and vd not in dn.start_index_map:
            vdims[vd] = (loops[od].name,)
        else:
            loops[od] = Loop(loops[od].name, loops[od].extent, False)
    for od, jd in zip(batch_out, batch_idx):
        idims[jd] = (loops[od].name,)
        if jd in dn.start_indices_batching_dims:
            vd = dn.operand_batching_dims[dn.start_indices_batching_dims.index(jd)]
            vdims[vd] = (loops[od].name,)
    reductions = []
    for vd in dn.start_index_map:
        if sizes[vd] == 1 and v.shape[vd] > 1 and not vdims[vd]:
            lp = Loop(f"r{len(reductions)}", v.shape[vd], masked=True)
            loops.append(lp)
            vdims[vd] = (lp.name,)
            reductions.append((lp.name, "sum"))
    return Op(name, "gather", tuple(loops), (_acc(v, vdims), _acc(idx, idims)),
              (_acc(out, odims),), tuple(reductions))  # fmt: skip


def scatter(name, eqn, ins, outs):
    """Window dims covering a whole operand dimension and batching dims split; scatter dims are
    a sum for scatter-add (each device adds its updates; the operand is added once), else whole."""
    if len(ins) != 3 or any(v is None for v in ins):
        return None
    v, idx, upd = ins
    out = outs[0]
    dn = eqn.params["dimension_numbers"]
    loops = _loops("i", v.shape)
    vdims = [(lp.name,) for lp in loops]
    window, batch_idx, idims = _indexed(v, idx, dn.inserted_window_dims, dn.operand_batching_dims)
    scatter_upd = [d for d in range(len(upd.shape)) if d not in dn.update_window_dims]
    udims: list = [()] * len(upd.shape)
    if len(window) != len(dn.update_window_dims) or len(scatter_upd) != len(batch_idx):
        return None
    shared = set()
    for ud, vd in zip(dn.update_window_dims, window):
        if upd.shape[ud] == v.shape[vd] and vd not in dn.scatter_dims_to_operand_dims:
            udims[ud] = (loops[vd].name,)
            shared.add(vd)
    reductions = []
    for ud, jd in zip(scatter_upd, batch_idx):
        if jd in dn.scatter_indices_batching_dims:
            vd = dn.operand_batching_dims[dn.scatter_indices_batching_dims.index(jd)]
            udims[ud] = idims[jd] = (loops[vd].name,)
            shared.add(vd)
            continue
        add = eqn.primitive.name in SCATTER_ADD
        lp = Loop(f"r{len(reductions)}" if add else f"s{ud}", upd.shape[ud], add)
        loops.append(lp)
        udims[ud] = idims[jd] = (lp.name,)
        if add:
            reductions.append((lp.name, "sum"))
    looked_up = set(dn.inserted_window_dims) & set(dn.scatter_dims_to_operand_dims)
    for vd in range(len(v.shape)):
        if vd in looked_up and vd not in shared and v.shape[vd] > 1:
            # each device writes the updates whose index falls in its range (XLA masks the rest)
            loops[vd] = Loop(loops[vd].name, loops[vd].extent, masked=True)
        elif vd not in shared:
            loops[vd] = Loop(loops[vd].name, loops[vd].extent, False)
            vdims[vd] = ()
    return Op(name, eqn.primitive.name, tuple(loops),
              (_acc(v, vdims), _acc(idx, idims), _acc(upd, udims)), (_acc(out, vdims),),
              tuple(reductions))  # fmt: skip


def read_whole(name, eqn, ins, outs):
    loops = _loops("i", outs[0].shape, partitionable=False)
    return Op(
        name, eqn.primitive.name, tuple(loops),
        _operands(ins, lambda v: [()] * len(v.shape)),
        tuple(_acc(o, [(lp.name,) for lp in loops] if o.shape == outs[0].shape else [()] * len(o.shape))
              for o in outs),
    )  # fmt: skip


def conv_general_dilated(name, eqn, ins, outs):
    """Batch ``n``, output features ``o``, input features ``i`` (a sum), and per spatial dimension
    an output loop ``s*`` and a window loop ``w*`` (a sum). The larger of the two owns the input's
    spatial dimension: split, it splits the input with a halo (:mod:`planner.program.halo`); the
    other stays whole. Grouped convolutions (``feature_group_count`` ``G > 1``, depthwise ones too)
    add a group loop ``g``, major in the input's and output's features; so do the kernel gradients
    of grouped convolutions (``batch_group_count`` ``G > 1``: group ``g`` of the output features
    reads block ``g`` of the input's batch), major in the input's batch."""
    p = eqn.params
    batch_groups = p.get("batch_group_count", 1)
    groups = max(p.get("feature_group_count", 1), batch_groups)
    lhs, rhs = ins
    out = outs[0]
    dn = p["dimension_numbers"]
    lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    nsp = len(lspec) - 2
    feats = ("g",) if groups > 1 and batch_groups == 1 else ()
    blocks = ("g",) if batch_groups > 1 else ()
    loops = [Loop("n", lhs.shape[lspec[0]] // batch_groups), *(Loop("g", groups) for _ in feats + blocks),
             Loop("o", rhs.shape[rspec[0]] // groups)]  # fmt: skip
    windows, spatial = [], []
    for k in range(nsp):
        size, o_ext, w_ext = (
            lhs.shape[lspec[2 + k]],
            out.shape[ospec[2 + k]],
            rhs.shape[rspec[2 + k]],
        )
        by_output = o_ext >= w_ext
        spatial += [Loop(f"s{k}", o_ext, by_output), Loop(f"w{k}", w_ext, not by_output)]
        windows.append(Window(
            lspec[2 + k], f"s{k}" if by_output else f"w{k}", by_output, size, o_ext, w_ext,
            p["window_strides"][k], p["lhs_dilation"][k], p["rhs_dilation"][k],
            tuple(p["padding"][k]),
        ))  # fmt: skip
    loops += [lp for lp in spatial if lp.name.startswith("s")]
    loops += [Loop("i", rhs.shape[rspec[1]])]
    loops += [lp for lp in spatial if lp.name.startswith("w")]
    ldims: list = [()] * len(lhs.shape)
    rdims: list = [()] * len(rhs.shape)
    odims: list = [()] * len(out.shape)
    ldims[lspec[0]], ldims[lspec[1]] = (*blocks, "n"), (*feats, "i")
    rdims[rspec[0]], rdims[rspec[1]] = (*feats, *blocks, "o"), ("i",)
    odims[ospec[0]], odims[ospec[1]] = ("n",), (*feats, *blocks, "o")
    halo = [(0, 0)] * len(lhs.shape)
    for k, w in enumerate(windows):
        ldims[w.dim] = (w.owner,)
        rdims[rspec[2 + k]] = (f"w{k}",)
        odims[ospec[2 + k]] = (f"s{k}",)
        reach = (w.window - 1) * w.rhs_dilation if w.by_output else (w.out - 1) * w.stride
        halo[w.dim] = (reach // 2, reach - reach // 2)
    reds = (("i", "sum"),) + tuple((f"w{k}", "sum") for k in range(nsp))
    return Op(
        name, "conv_general_dilated", tuple(loops),
        (Access(lhs, tuple(ldims), tuple(halo)), _acc(rhs, rdims)), (_acc(out, odims),),
        reductions=reds, windows=tuple(windows),
    )  # fmt: skip


POOLS = {"reduce_window_sum": 0.0, "reduce_window_max": -np.inf, "reduce_window_min": np.inf}
"""Pooling primitives and the value their windows read past the input's ends (their padding)."""


def reduce_window(name, eqn, ins, outs):
    """Pooling: one loop per output dimension; a windowed one (window, stride, dilation or
    padding) splits the input with a halo like a convolution's rows
    (:mod:`planner.program.halo`)."""
    p = eqn.params
    x, out = ins[0], outs[0]
    loops, dims, halo, windows = [], [], [], []
    for d, (n_in, n_out) in enumerate(zip(x.shape, out.shape)):
        loops.append(Loop(f"i{d}", n_out))
        dims.append((f"i{d}",))
        w = Window(d, f"i{d}", True, n_in, n_out, p["window_dimensions"][d],
                   p["window_strides"][d], p["base_dilation"][d], p["window_dilation"][d],
                   tuple(p["padding"][d]))  # fmt: skip
        trivial = (w.window, w.stride, w.lhs_dilation, w.pad) == (1, 1, 1, (0, 0))
        reach = (w.window - 1) * w.rhs_dilation
        halo.append((reach // 2, reach - reach // 2))
        if not trivial:
            windows.append(w)
    return Op(name, eqn.primitive.name, tuple(loops), (Access(x, tuple(dims), tuple(halo)),),
              (_acc(out, dims),), windows=tuple(windows))  # fmt: skip


def select_and_scatter_add(name, eqn, ins, outs):
    """A max-pool's gradient: the source (one value per window) added where each window of the
    operand has its maximum. One loop per operand (and result) dimension; a windowed one splits
    the operand and the source with halos (:func:`planner.program.halo.scatter_split`)."""
    p = eqn.params
    source, x, out = ins[0], ins[1], outs[0]
    loops, dims, windows = [], [], []
    for d, (n, n_src) in enumerate(zip(x.shape, source.shape)):
        loops.append(Loop(f"i{d}", n))
        dims.append((f"i{d}",))
        w = Window(d, f"i{d}", True, n, n_src, p["window_dimensions"][d], p["window_strides"][d],
                   1, 1, tuple(p["padding"][d]), scatters=True)  # fmt: skip
        if (w.window, w.stride, w.pad) != (1, 1, (0, 0)):
            windows.append(w)
    halo = [(0, 0)] * len(x.shape)
    for w in windows:
        reach = w.window - 1
        halo[w.dim] = (reach // 2, reach - reach // 2)
    return Op(name, eqn.primitive.name, tuple(loops),
              (_acc(source, dims), Access(x, tuple(dims), tuple(halo))), (_acc(out, dims),),
              windows=tuple(windows))  # fmt: skip


IDENTITIES = frozenset({"sharding_constraint", "reshard", "mesh_cast", "name", "pvary"})
"""Primitives whose result is their operand: layout requests (:mod:`planner.program.constraints`)
and names (``checkpoint_name``, read by remat policies)."""


def unstack(name, eqn, ins, outs):
    """``unstack`` (the transpose of ``stack``): one loop per result dimension, each result's
    dimensions those of the operand less the unstacked one, which is read whole."""
    axis = eqn.params["axis"]
    loops = _loops("i", outs[0].shape)
    dims = [(lp.name,) for lp in loops]
    return Op(name, "unstack", tuple(loops), (_acc(ins[0], [*dims[:axis], (), *dims[axis:]]),),
              tuple(_acc(o, dims) for o in outs))  # fmt: skip


def stack(name, eqn, ins, outs):
    """``stack``: one loop per result dimension; the stacked one is not partitionable (each
    operand is one of its rows), the others are the operands'."""
    if any(v is None for v in ins):
        return None
    axis = eqn.params["axis"]
    loops = [Loop(f"i{d}", n, d != axis) for d, n in enumerate(outs[0].shape)]
    dims = [(lp.name,) for lp in loops]
    return Op(name, "stack", tuple(loops),
              tuple(_acc(v, dims[:axis] + dims[axis + 1 :]) for v in ins),
              (_acc(outs[0], dims),))  # fmt: skip


def optimization_barrier(name, eqn, ins, outs):
    """An identity on several values at once: loops ``a<k>_<d>`` for dimension ``d`` of operand
    ``k``, each operand read as its result is written (XLA keeps them together)."""
    if any(v is None for v in ins):
        return None
    loops, accs = [], []
    for k, v in enumerate(ins):
        own = _loops(f"a{k}_", v.shape)
        loops += own
        accs.append([(lp.name,) for lp in own])
    return Op(name, eqn.primitive.name, tuple(loops),
              tuple(_acc(v, d) for v, d in zip(ins, accs)),
              tuple(_acc(o, d) for o, d in zip(outs, accs)))  # fmt: skip


def rule_for(primitive: str) -> Rule | None:
    if primitive in ELEMENTWISE or primitive in IDENTITIES:
        return elementwise
    if primitive in REDUCTIONS:
        return reduction
    if primitive in READ_WHOLE:
        return read_whole
    if primitive in CUMULATIVE:
        return along_axis
    if primitive in SCATTERS:
        return scatter
    return {
        "sort": along_axis,
        "top_k": along_axis,
        "split": along_axis,
        "unstack": unstack,
        "stack": stack,
        "optimization_barrier": optimization_barrier,
        "device_put": optimization_barrier,  # each value as it is, in another memory or place
        "rev": rev,
        "tile": tile,
        "pad": pad,
        "slice": slice_,
        "dynamic_slice": dynamic_slice,
        "dynamic_update_slice": dynamic_update_slice,
        "gather": gather,
        "broadcast_in_dim": broadcast_in_dim,
        "transpose": transpose,
        "reshape": reshape,
        "squeeze": squeeze,
        "expand_dims": expand_dims,
        "dot_general": dot_general,
        "concatenate": concatenate,
        "iota": iota,
        "conv_general_dilated": conv_general_dilated,
        **dict.fromkeys(POOLS, reduce_window),
        "select_and_scatter_add": select_and_scatter_add,
    }.get(primitive)
