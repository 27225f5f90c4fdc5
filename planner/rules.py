"""Iteration spaces of the core primitives, written as a table of rules.

| primitives                    | loops                                   | access maps                      |
|-------------------------------|-----------------------------------------|----------------------------------|
| elementwise (add, exp, ...)   | one per result dim                      | same loops; scalars read whole   |
| broadcast_in_dim              | one per result dim                      | operand dim -> its result dim    |
| transpose                     | one per result dim                      | permuted                         |
| reshape                       | the finer side of each split/merge      | merged dims list several loops   |
| squeeze / expand_dims         | one per kept dim                        | size-1 dims read whole           |
| dot_general                   | batch b*, free m*/n*, contracting k*    | reduction (sum) over k*          |
| reduce_sum/max/min/prod/...   | kept i*, reduced r*                     | reduction over r*                |
| argmax / argmin               | kept i*, reduced r* (not partitionable) |                                  |
| concatenate                   | one per result dim (axis not partit.)   | operands whole on the axis       |
| iota                          | one per result dim (counted one: not)   |                                  |
| dynamic_slice, gather, ...    | one per result dim (not partitionable)  | operands read whole              |
| conv_general_dilated          | n, o (features), i (in features, sum),  | spatial with halo (kernel - 1),  |
|                               | spatial s* (not partitionable yet)      |                                  |

A rule returns ``None`` when it does not apply; the analysis then tries generic discovery.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from planner.ir import Access, Loop, Op, Value

ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
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
READ_WHOLE = frozenset(
    "dynamic_slice dynamic_update_slice gather scatter scatter-add scatter_add sort cumsum "
    "cumprod cummax cummin pad rev slice top_k".split()
)

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
        else:  # an m:n regrouping: one loop over the group that cannot be split
            loops.append(Loop(f"i{len(loops)}", math.prod(v.shape[d] for d in ga), False))
    return Op(name, "reshape", tuple(loops), (_acc(v, in_dims),), (_acc(out, out_dims),))


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
    arg = kind in ("argmax", "argmin")
    loops, dims, kept = [], [], []
    for d, size in enumerate(v.shape):
        if d in axes:
            lp = Loop(f"r{d}", size, partitionable=not arg)
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


def read_whole(name, eqn, ins, outs):
    loops = _loops("i", outs[0].shape, partitionable=False)
    return Op(
        name, eqn.primitive.name, tuple(loops),
        _operands(ins, lambda v: [()] * len(v.shape)),
        tuple(_acc(o, [(lp.name,) for lp in loops] if o.shape == outs[0].shape else [()] * len(o.shape))
              for o in outs),
    )  # fmt: skip


def conv_general_dilated(name, eqn, ins, outs):
    p = eqn.params
    if p.get("feature_group_count", 1) != 1 or p.get("batch_group_count", 1) != 1:
        return None
    lhs, rhs = ins
    out = outs[0]
    dn = p["dimension_numbers"]
    lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    nsp = len(lspec) - 2
    loops = [Loop("n", lhs.shape[lspec[0]]), Loop("o", rhs.shape[rspec[0]])]
    loops += [Loop(f"s{k}", out.shape[ospec[2 + k]], False) for k in range(nsp)]
    loops += [Loop("i", lhs.shape[lspec[1]])]
    loops += [Loop(f"w{k}", rhs.shape[rspec[2 + k]], False) for k in range(nsp)]
    ldims: list = [()] * len(lhs.shape)
    rdims: list = [()] * len(rhs.shape)
    odims: list = [()] * len(out.shape)
    ldims[lspec[0]], ldims[lspec[1]] = ("n",), ("i",)
    rdims[rspec[0]], rdims[rspec[1]] = ("o",), ("i",)
    odims[ospec[0]], odims[ospec[1]] = ("n",), ("o",)
    halo = [(0, 0)] * len(lhs.shape)
    for k in range(nsp):
        ldims[lspec[2 + k]] = (f"s{k}",)
        rdims[rspec[2 + k]] = (f"w{k}",)
        odims[ospec[2 + k]] = (f"s{k}",)
        size = rhs.shape[rspec[2 + k]] - 1
        halo[lspec[2 + k]] = (size // 2, size - size // 2)
    reds = (("i", "sum"),) + tuple((f"w{k}", "sum") for k in range(nsp))
    return Op(
        name, "conv_general_dilated", tuple(loops),
        (Access(lhs, tuple(ldims), tuple(halo)), _acc(rhs, rdims)), (_acc(out, odims),),
        reductions=reds,
    )  # fmt: skip


def rule_for(primitive: str) -> Rule | None:
    if primitive in ELEMENTWISE:
        return elementwise
    if primitive in REDUCTIONS:
        return reduction
    if primitive in READ_WHOLE:
        return read_whole
    return {
        "broadcast_in_dim": broadcast_in_dim,
        "transpose": transpose,
        "reshape": reshape,
        "squeeze": squeeze,
        "expand_dims": expand_dims,
        "dot_general": dot_general,
        "concatenate": concatenate,
        "iota": iota,
        "conv_general_dilated": conv_general_dilated,
    }.get(primitive)
