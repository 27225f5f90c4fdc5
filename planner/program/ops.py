"""The planner's view of a program: operations with iteration spaces (loop nests) and access maps.

Every operation is a loop nest over named loop dimensions. Each operand and result says, for each
of its array dimensions, which loops index it: ``("m",)`` (one loop), ``("a", "b")`` (loops merged,
major first, as a reshape does), or ``()`` (read whole, e.g. a dimension of size 1 that is
broadcast, or a gathered operand). A loop that indexes no dimension of an operand broadcasts it;
a loop that indexes no dimension of a result is a reduction.

Example:
    >>> print(op)   # doctest: +SKIP
    dot_general_0: m=8 n=32 k=16 (sum over k) | x[m,k] w[k,n] -> h[m,n]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
import numpy as np

from planner.program.halo import Window

Dims = tuple[tuple[str, ...], ...]
SIGNATURES: dict[tuple, int] = {}  # Op.signature -> Op.signature_id, for every op made

DENSE = frozenset({"dot_general", "conv_general_dilated"})  # ops costing 2 flops per loop point
KEY_ITEMSIZE = {"fry": 8, "rbg": 16, "unsafe_rbg": 16}  # bytes of one PRNG key, by implementation
ENTRIES = {"scan_const": 0, "scan_xs": 1, "while_const": 0, "cond_operand": 0}
"""Region entries that pass an outer value into a body unchanged, with the number of leading
dimensions they drop (a scan's ``xs``: one slice of the stacked, layer axis per trip)."""


@functools.cache
def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name, PRNG key types included (``"key<fry>"`` -> 8).

    Example:
        >>> itemsize("float32"), itemsize("key<fry>")
        (4, 8)
    """
    key = re.fullmatch(r"key<(\w+)>", dtype)
    if key:
        return KEY_ITEMSIZE.get(key.group(1), 16)
    return np.dtype(dtype).itemsize


def is_key(dtype: str) -> bool:
    """Whether ``dtype`` names a typed PRNG key array (which runs whole, never split)."""
    return dtype.startswith("key<")


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop dimension: ``name``, ``extent``; ``partitionable`` is False where a local kernel could
    not compute a slice of it (concatenation axes, convolution windows, unknown ops). ``masked``:
    the looked-up dimension of a gather's operand or a scatter's (an embedding's vocabulary),
    which only XLA's partitioner splits: each device looks up, or writes, the indices in its own
    range and masks the others (a gather's partial results are then summed)."""

    name: str
    extent: int
    partitionable: bool = True
    masked: bool = False


@dataclasses.dataclass(frozen=True)
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Bytes of the value whole, as ``numpy``'s ``nbytes``."""
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class Access:
    """How an op reads an operand or writes a result: the loops indexing each array dimension."""

    value: Value
    dims: Dims
    halo: tuple[tuple[int, int], ...] = ()  # per dimension (lo, hi) extra elements read

    def __str__(self) -> str:
        parts = []
        for k, d in enumerate(self.dims):
            text = "*".join(d) if d else ":"
            if self.halo and self.halo[k] != (0, 0):
                text += f"±{self.halo[k]}"
            parts.append(text)
        return f"{self.value.name}[{','.join(parts)}]"


@dataclasses.dataclass(frozen=True)
class Op:
    """One equation of the jaxpr as a loop nest.

    Attributes:
        name: unique, ``<primitive>_<index>`` (e.g. ``dot_general_3``).
        primitive: the JAX primitive's name.
        loops: the iteration space.
        operands, results: access maps (literals are omitted from ``operands``).
        reductions: loop name -> combining op (``"sum"``, ``"max"``, ...), for loops no result uses.
        how: ``"rule"`` (the table), ``"discovered"`` (run on pieces), ``"replicated"`` (neither:
            the op runs whole on every device), or ``"region"`` (a boundary of a region such as a
            scan body: an identity that moves values in or out, see :class:`Region`).
        eqn: the jaxpr equation, for execution.
        trips: how often the op runs per call (the product of the enclosing scans' lengths).
        windows: the spatial dimensions of a convolution a split of their owner loop splits
            with a halo (:mod:`planner.program.halo`).
        source: where the user's code made it, ``(file, line, library)``: the innermost frame
            of the equation's traceback outside JAX and installed packages; ``library`` names
            the package (e.g. ``"optax"``) whose code the user's line called, or is ``None``.
            ``None`` when the trace kept no traceback.
        manual: for ``how == "manual"`` (a ``shard_map`` of the user's, :mod:`planner.program.
            manual`): each loop and the mesh factors the ``shard_map`` splits it over, which
            every schedule keeps.
        body: the ops one run of an opaque op performs on each device, analysed at the shapes
            they see (a ``shard_map``'s body on its tiles, a Pallas kernel's body times its
            grid), which price it; ``()`` for every other op.
        feeds: for an op with a body (a ``shard_map``), per result the indices of the operands
            it is computed from (:func:`planner.program.dependence.result_operands`); ``()``:
            each from all.
        kernel_flops: a Pallas kernel whose grid is sized at run time (megablox's grouped
            matmul: its row tiles follow the groups' sizes): ``(flops, transcendentals)`` of one
            run from the kernel's own cost estimate, as the compiler prices it, which its body
            (counted once per static grid point) cannot give; ``None`` otherwise.
    """

    name: str
    primitive: str
    loops: tuple[Loop, ...]
    operands: tuple[Access, ...]
    results: tuple[Access, ...]
    reductions: tuple[tuple[str, str], ...] = ()
    how: str = "rule"
    eqn: object = dataclasses.field(default=None, compare=False, repr=False)
    trips: int = 1
    source: tuple[str, int, str | None] | None = dataclasses.field(default=None, compare=False)
    windows: tuple[Window, ...] = ()
    manual: tuple[tuple[str, tuple[str, ...]], ...] = ()
    body: tuple[Op, ...] = dataclasses.field(default=(), compare=False, repr=False)
    kernel_flops: tuple[float, float] | None = None
    feeds: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), compare=False, repr=False)

    @functools.cached_property
    def operands_by_size(self) -> tuple[Access, ...]:
        """The operands, largest first (stable): where two want one mesh axis, the larger keeps
        its layout and the smaller moves, as XLA's propagation does (a norm's scale split as the
        weights are gathered, not the activations it scales)."""
        return tuple(sorted(self.operands, key=lambda a: -math.prod(a.value.shape)))

    @functools.cached_property
    def loop(self) -> dict[str, Loop]:
        """The loops by name (made once: a search reads it millions of times)."""
        return {lp.name: lp for lp in self.loops}

    @property
    def dense(self) -> bool:
        return self.primitive in DENSE

    @functools.cached_property
    def merged(self) -> tuple[tuple[str, ...], ...]:
        """The dimensions of its operands and results that merge several loops (a reshape's),
        each once, their loops major first."""
        accesses = (*self.operands, *self.results)
        return tuple(dict.fromkeys(d for a in accesses for d in a.dims if len(d) > 1))

    @functools.cached_property
    def signature(self) -> tuple:
        """The op without its names: ops with equal signatures cost the same under equal layouts
        (the layers of a deep network)."""

        def access(a: Access) -> tuple:
            return a.value.shape, a.value.dtype, a.dims, a.halo

        return (self.primitive, self.how, self.loops, self.reductions,
                tuple(map(access, self.operands)), tuple(map(access, self.results)),
                self.windows, self.manual,
                tuple((b.signature, b.trips) for b in self.body), self.kernel_flops)  # fmt: skip

    @functools.cached_property
    def signature_id(self) -> int:
        """A small integer naming :attr:`signature` (equal for equal signatures): a memo key
        that hashes and compares at once where the signature is a deep tuple."""
        return SIGNATURES.setdefault(self.signature, len(SIGNATURES))

    @property
    def flops(self) -> int:
        """Arithmetic of one run of the whole op: 2 per loop point for products, else 1 (a looked-up
        dimension, :attr:`Loop.masked`, adds none); an opaque op's, its :attr:`body`'s on every
        device of its mesh (``devices``: the product of its :attr:`manual` loops); a kernel
        sized at run time, its own estimate's (:attr:`kernel_flops`)."""
        if self.kernel_flops is not None:
            return int(self.kernel_flops[0])
        if self.body:
            devices = math.prod(self.loop[lp].extent for lp, _ in self.manual)
            return devices * sum(b.flops * b.trips for b in self.body)
        return (2 if self.dense else 1) * math.prod(lp.extent for lp in self.loops if not lp.masked)

    def __str__(self) -> str:
        loops = " ".join(
            f"{lp.name}={lp.extent}" + ("~" if lp.masked else "" if lp.partitionable else "!")
            for lp in self.loops
        )
        red = ", ".join(f"{kind} over {name}" for name, kind in self.reductions)
        ins = " ".join(str(a) for a in self.operands)
        outs = " ".join(str(a) for a in self.results)
        trips = f"x{self.trips}" if self.trips != 1 else ""
        tags = [t for t in (red, "" if self.how == "rule" else self.how, trips) if t]
        tag = f" ({'; '.join(tags)})" if tags else ""
        return f"{self.name}: {loops or '-'}{tag} | {ins} -> {outs}"


@dataclasses.dataclass(frozen=True)
class Region:
    """Ops ``[start, stop)`` of a program that the lowering runs inside one JAX construct.

    Ops ``[start, body)`` are boundary ops (identities, run once) that bring the construct's
    operands in, in its equation's order; the last ``len(outputs)`` ops hand its results out.

    - ``"scan"``: entry = loop-invariant operands, initial carry, stacked inputs (their layer
      axis whole); ``[body, stop)`` = the body, then the carry handed back (tied to its entry
      op, so it keeps one layout) and the stacked outputs; run ``length`` times.
    - ``"while"``: entry = the condition's and the body's invariant operands, the carry;
      ``[body, parts[0])`` = the condition (its result is ``predicate``); ``[parts[0], stop)`` =
      the body and the carry handed back. Run an unknown number of times: priced as once.
    - ``"cond"``: entry = the operands (the branch index is read directly); branch ``b`` is
      ``[parts[b], parts[b + 1])``; ``[parts[-1], stop)`` = one merge op per result, reading
      every branch's value. Priced as its dearest branch (the most flops): the other
      branches' ops run zero trips, as XLA's cost analysis prices a conditional.
    - a call kept as a call so that its semantics survive (no boundary ops, ``body == start``):
      ``"checkpoint"`` (rematerialisation and its optimisation barriers), ``"custom_jvp"`` /
      ``"custom_vjp"`` (the user's differentiation rules).

    ``inputs`` / ``outputs`` are the values the construct reads and produces, in its equation's
    order; ``eqn`` gives its parameters.
    """

    kind: str
    start: int
    body: int
    stop: int
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    eqn: object = dataclasses.field(default=None, compare=False, repr=False)
    parts: tuple[int, ...] = ()
    predicate: Value | None = None
