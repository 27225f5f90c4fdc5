"""The collectives of an optimized HLO module, read from its text: kind, result bytes, group size.

Pure (no JAX): what a compiled program will send, counted without running it. The planner uses it
to see how XLA would carry out a layout change and to price a compiled step
(:func:`counted_collectives`: each collective with how often it runs, through loops); the
experiments to count what XLA and redist send.

Example:
    >>> hlo_collectives(jax.jit(f).lower(x).compile().as_text())    # doctest: +SKIP
    (Collective(kind='all-gather', bytes=4096, group_size=2),)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import tempfile

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
KINDS = ("all-to-all", "all-gather", "collective-permute", "all-reduce", "reduce-scatter")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z\-]+)(?:-start)?\(")
_SHAPE = re.compile(r"(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
# replica_groups={{0,1},{2,3}} | replica_groups=[4,2]<=[8] | replica_groups=mesh['x'=2,...] ... {'x'}
_EXPLICIT = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\].*?\{([^{}]*)\}")
_AXIS = re.compile(r"'([^']+)'=(\d+)")
# computations, the calls between them and the trip counts of loops
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEES = re.compile(r"(?:body|condition|calls|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_BOUND = re.compile(r"s32\[\]\S*\s+constant\((\d+)\)")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int  # bytes of the instruction's result per device (tuple results summed)
    group_size: int = 0  # devices per group (0: not stated in the text)


def _group_size(line: str) -> int:
    m = _MESH.search(line)
    if m:
        sizes = {name: int(n) for name, n in _AXIS.findall(m.group(1))}
        return math.prod(sizes.get(a.strip().strip("'"), 1) for a in m.group(2).split(","))
    m = _IOTA.search(line)
    if m:
        return int(m.group(1))
    m = _EXPLICIT.search(line)
    if m:
        return len([d for d in m.group(1).split(",") if d])
    return 0


def hlo_collectives(hlo_text: str) -> tuple[Collective, ...]:
    """Collectives of an optimized HLO module in program order, with their result bytes."""
    out = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        result, op = m.groups()
        kind = op.removesuffix("-start")
        if kind not in KINDS or "-done" in op:
            continue
        nbytes = sum(
            DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
            for dt, dims in _SHAPE.findall(result)
        )
        out.append(Collective(kind, nbytes, _group_size(line)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class CountedCollective:
    """A collective of the optimized HLO and how often it runs per call of the program."""

    collective: Collective
    runs: int


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "\t", "}")) and line.rstrip().endswith("{"):
            m = _COMPUTATION.match(line)
            if m:
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
                continue
        if current is not None and line.startswith((" ", "\t")):
            comps[current].append(line)
    return comps, entry


def _trips(line: str, comps: dict[str, list[str]]) -> int:
    """A ``while``'s trip count: its ``known_trip_count``, else a condition that compares the loop
    counter with a constant (``i < N``, the counter starting at 0 as JAX's scans do), else 1."""
    m = _TRIPS.search(line)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", line)
    body = comps.get(cond.group(1), ()) if cond else ()
    bounds = [int(c) for ln in body for c in _BOUND.findall(ln)]
    if len(bounds) == 1 and any("direction=LT" in ln for ln in body):
        return bounds[0]
    return 1


def counted_collectives(hlo_text: str) -> tuple[CountedCollective, ...]:
    """The collectives of an optimized HLO module, each with how often it runs: a collective in
    a ``while`` body runs the loop's trip count times (loops within loops multiply; see
    :func:`_trips`); one in a loop of unknown trip count is counted once."""
    comps, entry = _computations(hlo_text)
    if entry is None:
        return tuple(CountedCollective(c, 1) for c in hlo_collectives(hlo_text))
    runs: dict[str, int] = {entry: 1}
    stack = [entry]
    while stack:
        name = stack.pop()
        for line in comps.get(name, ()):
            callees = _CALLEES.findall(line)
            m = _BRANCHES.search(line)
            if m:
                callees += [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
            if not callees:
                continue
            times = _trips(line, comps) if " while(" in line else 1
            for callee in callees:
                if callee in comps and callee not in runs:
                    runs[callee] = runs[name] * times
                    stack.append(callee)
    out = []
    for name, lines in comps.items():
        for c in hlo_collectives("\n".join(lines)):
            out.append(CountedCollective(c, runs.get(name, 1)))
    return tuple(out)


@contextlib.contextmanager
def captured_stderr():
    """Capture what C++ code writes to file descriptor 2 (XLA's logs) into ``buf[0]``."""
    buf = [""]
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield buf
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            buf[0] = tmp.read().decode(errors="replace")
