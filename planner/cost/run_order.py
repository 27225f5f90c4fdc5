"""The order a compiler runs a program's ops in, where it is not the program's (pure, no JAX).

The memory model (:mod:`planner.cost.buffers`) walks a program's ops in an order; the TPU
compiler's scheduler does not keep the jaxpr's. What it moves that matters for memory is a
checkpointed layer's recomputation in the backward pass: ``jax.checkpoint``'s transpose is one
call (a ``"checkpoint"`` region) that computes the layer's forward values again, all of them
first, then the backward pass through them in reverse. The compiler runs each recomputed value
just before the first op that reads it. MaxText's DeepSeek-V3 on 512 v5p chips (remat policy
``custom``, its attention's output and layer input offloaded): in program order a layer's
backward holds the attention's recomputed queries and keys (about 8 GB per chip) through the
whole mixture-of-experts backward; the compiler, from its buffers' live ranges, recomputes the
attention only after that, just before the attention's backward. So does it in a small layer
(an attention-like block whose output the policy saves, then an MLP, on 4 v5p chips): it runs
the MLP's recomputation and backward, then the queries' and keys' products. Predicted peak per
chip of MaxText's DeepSeek-V3 plans, in program order and in this order, against the
compiler's HBM live peak: at the recipe's own settings 101.0 and 95.2 GB (80.5), with the ring
of experts 86.2 and 80.4 GB (78.8); MaxText's other steps' plans move by 0.6 GB or less.

:func:`run_order` is that rule, as a memory-aware scheduler would take it: inside a checkpoint
region, an op (a ``shard_map`` too) whose results only later ops of the region read runs just
before the first of them, where the operands it then holds longer (read nowhere there or later)
are no larger than its results; ops are taken last first, so a recomputed chain moves together,
and a reduction of a large value stays. Ops moved to one place keep their program order; a
region nested in the checkpoint (a loop, a call) moves as a whole and is read where it starts.
Every region keeps its ops together.

Example:
    >>> order = run_order(prog)          # doctest: +SKIP
    >>> arranged = arranged_program(prog, order)
"""

from __future__ import annotations

import dataclasses
import math

from planner.program.ir import Program
from planner.program.memo import PerObject

SUNK = frozenset({"checkpoint"})
"""Kinds of region whose recomputation runs where it is read (:func:`run_order`)."""

ORDERS: PerObject[tuple[int, ...]] = PerObject("the order the compiler runs the ops in")


def run_order(prog: Program) -> tuple[int, ...]:
    """The op indices of ``prog`` in the order the compiler runs them (see the module docstring);
    ``tuple(range(len(prog.ops)))`` where nothing moves. Computed once per program.

    Example:
        >>> run_order(prog)[40:44]          # doctest: +SKIP
        (40, 57, 41, 42)
    """
    return ORDERS.get(prog, lambda: tuple(_arranged(prog, 0, len(prog.ops), _children(prog),
                                                    None)))  # fmt: skip


def arranged_program(prog: Program, order: tuple[int, ...]) -> Program:
    """``prog`` with its ops in ``order`` (a permutation that keeps every region's ops together,
    as :func:`run_order` makes) and its regions' bounds moved with them.

    Example:
        >>> arranged_program(prog, run_order(prog)).ops[41].name        # doctest: +SKIP
        'dot_general_57'
    """
    at = {k: p for p, k in enumerate(order)}
    regions = []
    for r in prog.regions:
        shift = min(at[k] for k in range(r.start, r.stop)) - r.start if r.stop > r.start else 0
        regions.append(dataclasses.replace(r, start=r.start + shift, body=r.body + shift,
                                           stop=r.stop + shift,
                                           parts=tuple(p + shift for p in r.parts)))  # fmt: skip
    return dataclasses.replace(prog, ops=tuple(prog.ops[k] for k in order),
                               regions=tuple(regions))  # fmt: skip


def _children(prog: Program) -> dict[int | None, list[int]]:
    """Region index -> the indices of the regions directly inside it (``None``: the program),
    by start; a region with another's bounds is inside the one listed first."""
    ranked = sorted(range(len(prog.regions)),
                    key=lambda i: (prog.regions[i].start, -prog.regions[i].stop, i))  # fmt: skip
    children: dict[int | None, list[int]] = {None: []}
    open_: list[int] = []
    for i in ranked:
        r = prog.regions[i]
        while open_ and prog.regions[open_[-1]].stop < r.stop:
            open_.pop()
        while open_ and not (prog.regions[open_[-1]].start <= r.start
                             and r.stop <= prog.regions[open_[-1]].stop):  # fmt: skip
            open_.pop()
        children.setdefault(open_[-1] if open_ else None, []).append(i)
        children.setdefault(i, [])
        open_.append(i)
    return children


def _arranged(prog: Program, start: int, stop: int, children: dict, region: int | None) -> list:
    """The ops ``[start, stop)`` of ``region`` (``None``: the program) in run order: its nested
    regions arranged within themselves, and its own ops sunk if it is :data:`SUNK`."""
    units: list[list[int]] = []  # single ops, or a nested region's ops, in program order
    k = start
    for c in children[region]:
        r = prog.regions[c]
        units += [[j] for j in range(k, r.start)]
        units.append(_arranged(prog, r.start, r.stop, children, c))
        k = r.stop
    units += [[j] for j in range(k, stop)]
    if region is None or prog.regions[region].kind not in SUNK:
        return [j for u in units for j in u]
    return _sunk(prog, units, stop)


def _sunk(prog: Program, units: list[list[int]], stop: int) -> list[int]:
    """``units`` (of a checkpoint region ending at op ``stop``) with each unit whose results only
    later units of the region read moved to just before the first of them, where the operands it
    then holds longer (read nowhere there or later) are no larger than its results (the module
    docstring's rule). Units are taken last first, so a chain moves together: an operand only
    the moved unit reads is held longer, as large as the result its producer then makes later."""
    unit_of = {k: u for u, ops in enumerate(units) for k in ops}
    held = {v.name for v in prog.outputs}
    place = list(range(len(units)))  # where each unit runs: before the unit of this index

    def readers(name: str, u: int) -> list[int] | None:
        """The places of the units but ``u`` reading ``name``; ``None`` if something outside
        the region reads it or it is an output (held past the region)."""
        out = []
        for op, _ in prog.uses.get(name, ()):
            w = unit_of.get(prog.index[op.name])
            if w is None:
                return None
            if w != u:
                out.append(place[w])
        return None if name in held else out

    def read_until(name: str, u: int) -> float:
        """The latest place where a unit but ``u`` reads ``name`` (``inf``: held past the
        region, as an input, a constant, an output or a value read after it)."""
        if name in held or prog.producer.get(name) is None:
            return math.inf
        last = -1.0
        for op, _ in prog.uses.get(name, ()):
            k = prog.index[op.name]
            if k >= stop:
                return math.inf
            if k in unit_of and unit_of[k] != u:
                last = max(last, place[unit_of[k]])
        return last

    for u in range(len(units) - 1, -1, -1):
        ops = [prog.ops[k] for k in units[u]]
        made = {r.value.name: r.value for op in ops for r in op.results}
        later = {n: readers(n, u) for n in made}
        later = {n: p for n, p in later.items() if p != []}  # (read only inside, or dead)
        if not later or any(p is None for p in later.values()):
            continue
        to = min(min(p) for p in later.values())
        if to <= u + 1:
            continue
        read = {a.value.name: a.value for op in ops for a in op.operands
                if a.value.name not in made}  # fmt: skip
        longer = sum(v.nbytes for n, v in read.items() if read_until(n, u) < to)
        if longer <= sum(made[n].nbytes for n in later):
            place[u] = to
    moved: dict[int, list[int]] = {}
    for u, p in enumerate(place):
        moved.setdefault(p, []).extend(units[u])  # (a unit left where it is: after those moved)
    return [k for u in range(len(units)) for k in moved.get(u, ())]
