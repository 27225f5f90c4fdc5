"""The collectives and the kernels of an optimized HLO module, read from its text.

Pure (no JAX): what a compiled program will send and compute, counted without running it. Each
collective with its kind, result bytes and group size; the planner uses them to see how XLA
would carry out a layout change and to price a compiled step (:func:`counted_collectives`: each
collective with how often it runs, through loops); the experiments to count what XLA and redist
send. Each kernel with its matmuls' flops by dtype and the bytes it reads and writes
(:func:`hlo_kernels`, :func:`kernel_counts`), to price a compiled step where the compiler's cost
analysis is missing (XLA:GPU's).

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

from redist.collectives import CollectiveKind

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e4m3": 1, "f8e3m4": 1,
}  # fmt: skip
KINDS = tuple(CollectiveKind)  # the collectives counted, as HLO names them
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z\-]+)(?:-start)?\(")
_SHAPE = re.compile(r"(pred|bf16|c64|c128|f8e\d+m\d+[a-z]*|[suf]\d+)\[([\d,]*)\]")
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


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape's text (a tuple's elements summed; a dtype of unknown width: 1 byte).

    Example:
        >>> shape_bytes("(f32[8,64]{1,0}, bf16[16]{0})")
        2080
    """
    return sum(
        DTYPE_BYTES.get(dt, 1) * math.prod(int(d) for d in dims.split(",") if d)
        for dt, dims in _SHAPE.findall(shape)
    )


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


RAGGED = "ragged-all-to-all"


def ragged_bytes(operand_bytes: tuple[int, ...], result_bytes: int) -> int:
    """The bytes a ragged all-to-all is priced at: the smaller of its input and output buffers
    (its first two operands), what each device sends and receives when the rows it routes are
    spread evenly over the group (MaxText sizes one buffer for the worst case: every row to one
    device); its result's bytes where the operands are not known.

    Example:
        >>> ragged_bytes((4096, 65536, 256, 256), 65536)
        4096
    """
    if len(operand_bytes) >= 2 and all(operand_bytes[:2]):
        return min(operand_bytes[:2])
    return result_bytes


def hlo_collectives(hlo_text: str) -> tuple[Collective, ...]:
    """Collectives of an optimized HLO module in program order, with their result bytes (a ragged
    all-to-all as an all-to-all of :func:`ragged_bytes`)."""
    out = []
    lines = hlo_text.splitlines()
    known = _instructions(lines) if RAGGED in hlo_text else {}  # operands' shapes, by name
    for line in lines:
        m = _INSTR.match(line)
        if not m:
            continue
        result, op = m.groups()
        kind = op.removesuffix("-start")
        if kind == RAGGED and "-done" not in op:
            instr = known.get(_LINE.match(line).group(1))
            sizes = tuple(map(shape_bytes, instr.operand_shapes)) if instr else ()
            nbytes = ragged_bytes(sizes, shape_bytes(result))
            out.append(Collective(CollectiveKind.ALL_TO_ALL.value, nbytes, _group_size(line)))
            continue
        if kind not in KINDS or "-done" in op:
            continue
        out.append(Collective(kind, shape_bytes(result), _group_size(line)))
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


def _call_edges(line: str, comps: dict[str, list[str]]) -> list[tuple[str, int]]:
    """The computations one instruction calls and how often per run of it: a ``while``'s body
    (and condition) its trip count (:func:`_trips`), any other callee once."""
    callees = _CALLEES.findall(line)
    m = _BRANCHES.search(line)
    if m:
        callees += [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
    times = _trips(line, comps) if callees and " while(" in line else 1
    return [(c, times) for c in callees if c in comps]


def _runs(comps: dict[str, list[str]], entry: str, follow=None) -> dict[str, int]:
    """How often each computation reachable from ``entry`` runs per call of the module: the sum
    over its call sites of the caller's runs times the site's (:func:`_call_edges`); ``follow``
    (a predicate on an instruction's line) restricts the calls followed."""
    edges = {
        name: [e for ln in lines if follow is None or follow(ln) for e in _call_edges(ln, comps)]
        for name, lines in comps.items()
    }
    order: list[str] = []  # callers before callees (HLO's calls form a DAG)
    seen: set[str] = set()

    def visit(name: str) -> None:
        seen.add(name)
        for callee, _ in edges[name]:
            if callee not in seen:
                visit(callee)
        order.append(name)

    visit(entry)
    runs = dict.fromkeys(order, 0)
    runs[entry] = 1
    for name in reversed(order):
        for callee, times in edges[name]:
            runs[callee] += runs[name] * times
    return runs


def counted_collectives(hlo_text: str) -> tuple[CountedCollective, ...]:
    """The collectives of an optimized HLO module, each with how often it runs: a collective in
    a ``while`` body runs the loop's trip count times (loops within loops multiply; see
    :func:`_trips`); one in a loop of unknown trip count is counted once."""
    comps, entry = _computations(hlo_text)
    if entry is None:
        return tuple(CountedCollective(c, 1) for c in hlo_collectives(hlo_text))
    runs = _runs(comps, entry)
    out = []
    for name, lines in comps.items():
        for c in hlo_collectives("\n".join(lines)):
            out.append(CountedCollective(c, runs.get(name, 1)))
    return tuple(out)


# Kernels: the instructions that launch one (not data plumbing, loops, calls or collectives),
# what each reads and writes, and the matmuls it runs.
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
NOT_KERNELS = frozenset(
    "parameter tuple get-tuple-element bitcast constant while conditional call after-all "
    "add-dependency opt-barrier partition-id replica-id domain get-dimension-size async-start "
    "async-update async-done copy-start copy-done send recv send-done recv-done infeed outfeed "
    "collective-broadcast ragged-all-to-all all-reduce-done all-gather-done "
    "collective-permute-done".split()
)  # and the collectives of KINDS, with their -start
_SLICING = ("dynamic-slice", "slice", "gather")  # read only their result's bytes of operand 0
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_PRECISION = re.compile(r"operand_precision\W*([^\]}]*)[\]}]")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_KERNEL_CALLS = re.compile(r"(?:body|condition)=|branch_computations=| (?:call|async-start)\(")


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: str  # the result's shape text
    op: str
    operands: tuple[str, ...]  # names
    operand_shapes: tuple[str, ...]  # their shapes' text ("" where neither given nor known)
    attrs: str  # the text after the operands
    root: bool = False  # the computation's ROOT


def _split_args(rest: str) -> tuple[list[str], str]:
    """The top-level comma-separated operands of ``rest`` (the text after ``op(``) and the text
    after their closing parenthesis."""
    depth, start, args = 0, 0, []
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                args.append(rest[start:i])
                return [a.strip() for a in args if a.strip()], rest[i + 1 :]
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(rest[start:i])
            start = i + 1
    return [a.strip() for a in args if a.strip()], ""


def _instructions(lines: list[str]) -> dict[str, _Instr]:
    """The instructions of one computation by name, in order, operands' shapes looked up."""
    out: dict[str, _Instr] = {}
    for line in lines:
        m = _LINE.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        args, attrs = _split_args(rest)
        names, shapes = [], []
        for a in args if op not in ("constant", "parameter") else ():
            *given, ref = a.split()
            names.append(ref.lstrip("%"))
            shapes.append(" ".join(given) or (out[names[-1]].shape if names[-1] in out else ""))
        if op == "parameter":
            names = args
        root = line.lstrip().startswith("ROOT")
        out[name] = _Instr(name, shape, op, tuple(names), tuple(shapes), attrs, root)
    return out


def jax_dtype(hlo_dtype: str) -> str:
    """JAX's name of an HLO element type.

    Example:
        >>> jax_dtype("bf16"), jax_dtype("f32"), jax_dtype("s8"), jax_dtype("f8e4m3fn")
        ('bfloat16', 'float32', 'int8', 'float8_e4m3fn')
    """
    if hlo_dtype in ("pred", "bf16") or hlo_dtype[:1] == "c":
        return {"pred": "bool", "bf16": "bfloat16"}.get(hlo_dtype, f"complex{hlo_dtype[1:]}")
    if hlo_dtype.startswith("f8"):
        return f"float8_{hlo_dtype[2:]}"
    return {"s": "int", "u": "uint", "f": "float"}[hlo_dtype[0]] + hlo_dtype[1:]


def _dims(shape: str) -> tuple[str, list[int]]:
    """The element type and dimensions of a shape's text (a tuple's first element)."""
    m = _SHAPE.search(shape)
    if not m:
        return "", []
    return m.group(1), [int(d) for d in m.group(2).split(",") if d]


def _matmul(ins: _Instr) -> tuple[str, float] | None:
    """``(rate key, flops)`` of a ``dot`` or a cuBLAS gemm custom-call, else None: 2 x the
    result's elements x the contracted size, keyed by the wider operand's JAX dtype, with
    ``:highest`` / ``:high`` where its operand precision asks (the keys of
    :attr:`redist.calibration.Calibration.dense_flops_per_s`)."""
    if ins.op == "dot":
        m = _CONTRACTING.search(ins.attrs)
    elif ins.op == "custom-call" and "__cublas" in "".join(_TARGET.findall(ins.attrs)):
        m = _GEMM_CONTRACTING.search(ins.attrs)
    else:
        return None
    if not m or not ins.operand_shapes:
        return None
    _, lhs = _dims(ins.operand_shapes[0])
    contracted = [int(d.strip().strip('"')) for d in m.group(1).split(",") if d.strip()]
    _, out = _dims(ins.shape)
    flops = 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracted if d < len(lhs))
    dtypes = [_dims(s)[0] for s in ins.operand_shapes[:2] if _dims(s)[0]]
    key = jax_dtype(max(dtypes, key=lambda d: DTYPE_BYTES.get(d, 0)))
    p = _PRECISION.search(ins.attrs)
    levels = [x.strip(' "').lower() for x in p.group(1).split(",")] if p else []
    for level in ("highest", "high"):
        if level in levels:
            return f"{key}:{level}", flops
    return key, flops


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of an optimized HLO module: a top-level instruction (of the entry, a loop's
    body, a branch; not of a fused computation) that launches one, per run, and how often it
    runs per call of the module.

    ``read_bytes``: its operands' bytes, but only the slice read of an operand that it only
    slices, and none of the buffer it updates in place (a ``dynamic-update-slice``'s operand 0);
    ``written_bytes``: its result's, but only the update's of an in-place update. ``dots``: a
    ``(rate key, flops)`` per matmul it runs (a ``dot`` of it or of its fused computations, or a
    cuBLAS gemm), keyed by the operands' JAX dtype (``"bfloat16"``, ``"float32:highest"``).
    Convolutions and library calls other than cuBLAS's gemms (cuDNN's attention) count no flops.
    """

    name: str
    op: str
    runs: int
    read_bytes: int
    written_bytes: int
    dots: tuple[tuple[str, float], ...] = ()

    @property
    def flops(self) -> float:
        return sum(f for _, f in self.dots)


_Fused = tuple[tuple[tuple[str, float], ...], dict[int, "int | None"], "int | None"]


def _fused(comps: dict[str, list[str]], instrs: dict, name: str, memo: dict) -> _Fused:
    """``(dots, bytes read of each parameter (None: all of it), bytes written)`` of the fused
    computation ``name``, the dots of fusions nested in it included."""
    if name in memo:
        return memo[name]
    memo[name] = ((), {}, None)  # a cycle (none in valid HLO) reads as empty
    body = instrs.setdefault(name, _instructions(comps.get(name, [])))
    dots: list[tuple[str, float]] = []
    users: dict[str, list[tuple[_Instr, int]]] = {}
    for ins in body.values():
        if mm := _matmul(ins):
            dots.append(mm)
        if ins.op == "fusion" and (callee := _CALLEES.search(ins.attrs)):
            dots += _fused(comps, instrs, callee.group(1), memo)[0]
        for k, operand in enumerate(ins.operands):
            users.setdefault(operand, []).append((ins, k))

    def read(value: str) -> int | None:
        total = 0
        for user, k in users.get(value, ()):
            if user.op == "bitcast":
                sub = read(user.name)
                if sub is None:
                    return None
                total += sub
            elif user.op in _SLICING and k == 0:
                total += shape_bytes(user.shape)
            elif user.op != "dynamic-update-slice" or k != 0:
                return None
        return total

    params = {int(i.operands[0]): read(i.name) for i in body.values() if i.op == "parameter"}
    root = next((i for i in body.values() if i.root), None)
    memo[name] = (tuple(dots), params, _written(root, body) if root else None)
    return memo[name]


def _written(ins: _Instr, body: dict[str, _Instr]) -> int:
    """Bytes a fused result writes: an in-place ``dynamic-update-slice`` its update's."""
    while ins.op == "bitcast" and ins.operands[0] in body:
        ins = body[ins.operands[0]]
    if ins.op == "tuple":
        return sum(_written(body[o], body) for o in ins.operands if o in body)
    if ins.op == "dynamic-update-slice" and len(ins.operand_shapes) > 1:
        return shape_bytes(ins.operand_shapes[1])
    return shape_bytes(ins.shape)


def _kernel(
    ins: _Instr, runs: int, comps: dict[str, list[str]], instrs: dict, memo: dict
) -> Kernel:
    """One top-level instruction as a :class:`Kernel`."""
    reads = [shape_bytes(s) for s in ins.operand_shapes]
    written = shape_bytes(ins.shape)
    mm = _matmul(ins)
    dots: tuple[tuple[str, float], ...] = (mm,) if mm else ()
    if ins.op == "fusion" and (callee := _CALLEES.search(ins.attrs)):
        dots, params, root = _fused(comps, instrs, callee.group(1), memo)
        reads = [r if params.get(k) is None else params[k] for k, r in enumerate(reads)]
        written = written if root is None else root
    elif ins.op == "dynamic-update-slice" and len(reads) > 1:
        reads[0], written = 0, reads[1]
    elif ins.op in _SLICING and reads:
        reads[0] = written
    elif mm and ins.shape.startswith("("):  # a cuBLAS gemm: its result, not its workspace
        written = shape_bytes(_SHAPE.search(ins.shape).group(0))
    return Kernel(ins.name, ins.op, runs, sum(reads), written, dots)


def hlo_kernels(hlo_text: str) -> tuple[Kernel, ...]:
    """The kernels of an optimized HLO module (:class:`Kernel`), each with how often it runs per
    call: one of a ``while`` body the loop's trip count times, as :func:`counted_collectives`
    counts; the instructions of a fused computation are its fusion's kernel.

    Example:
        >>> text = '''
        ... %f (p0: f32[8,4], p1: f32[4,2]) -> f32[8,2] {
        ...   %p0 = f32[8,4]{1,0} parameter(0)
        ...   %p1 = f32[4,2]{1,0} parameter(1)
        ...   ROOT %d = f32[8,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ... }
        ...
        ... ENTRY %main (a: f32[8,4], b: f32[4,2]) -> f32[8,2] {
        ...   %a = f32[8,4]{1,0} parameter(0)
        ...   %b = f32[4,2]{1,0} parameter(1)
        ...   ROOT %k = f32[8,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%f
        ... }'''
        >>> hlo_kernels(text)  # 2 x 8 x 2 x 4 flops; 128 + 32 bytes read, 64 written
        (Kernel(name='k', op='fusion', runs=1, read_bytes=160, written_bytes=64, dots=(('float32', 128.0),)),)
    """
    comps, entry = _computations(hlo_text)
    if entry is None:
        return ()
    instrs: dict[str, dict[str, _Instr]] = {}
    memo: dict[str, _Fused] = {}
    out = []
    for name, runs in _runs(comps, entry, _KERNEL_CALLS.search).items():
        body = instrs.setdefault(name, _instructions(comps[name]))
        for ins in body.values():
            if ins.op in NOT_KERNELS or ins.op.removesuffix("-start") in KINDS:
                continue
            out.append(_kernel(ins, runs, comps, instrs, memo))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class KernelCounts:
    """What the kernels of an optimized HLO module do per call (:func:`kernel_counts`)."""

    dot_flops: dict[str, float]  # matmul flops by rate key (JAX dtype[:precision])
    read_bytes: float
    written_bytes: float
    launches: int

    @property
    def flops(self) -> float:
        return sum(self.dot_flops.values())

    @property
    def bytes_accessed(self) -> float:
        return self.read_bytes + self.written_bytes


def kernel_counts(hlo: str | tuple[Kernel, ...]) -> KernelCounts:
    """The matmul flops (by operand dtype), bytes read and written, and kernel launches of an
    optimized HLO module per call, loops counted by their trip counts: its :func:`hlo_kernels`
    (or those given) summed.

    Example:
        >>> kernel_counts('''ENTRY %main (a: bf16[8,4], b: bf16[4,2]) -> bf16[8,2] {
        ...   %a = bf16[8,4]{1,0} parameter(0)
        ...   %b = bf16[4,2]{1,0} parameter(1)
        ...   ROOT %d = bf16[8,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ... }''')
        KernelCounts(dot_flops={'bfloat16': 128.0}, read_bytes=80.0, written_bytes=32.0, launches=1)
    """
    flops: dict[str, float] = {}
    read = written = launches = 0
    for k in hlo_kernels(hlo) if isinstance(hlo, str) else hlo:
        for key, f in k.dots:
            flops[key] = flops.get(key, 0.0) + k.runs * f
        read += k.runs * k.read_bytes
        written += k.runs * k.written_bytes
        launches += k.runs
    return KernelCounts(flops, float(read), float(written), launches)


# an instruction the compiler's rematerialization copied: %fusion.9.remat, %gte.remat.1,
# %all-gather.3.remat2, %fusion.4.remat_compressed.q_ref
_RECOMPUTED = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w\-]+(?:\.[\w\-]+)*?\.remat(?:\d+|_\w+?)?(?:\.[\w\-]+)*\s*=", re.M
)


def recomputed(hlo_text: str) -> int:
    """How many instructions of an optimized HLO module the compiler's rematerialization added
    (it names each copy ``<name>.remat``, ``.remat2``, ``.remat_compressed``, ...): what a
    compiler over its memory limit computes again to fit, which the program does not ask for.

    Example:
        >>> recomputed("%fusion.2.remat = bf16[8]{0} fusion(%p), kind=kLoop, calls=%f")
        1
    """
    return len(_RECOMPUTED.findall(hlo_text))


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
