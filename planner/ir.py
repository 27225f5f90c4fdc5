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

Dims = tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop dimension: ``name``, ``extent``; ``partitionable`` is False where a local kernel could
    not compute a slice of it (gathers, concatenation axes, convolution windows, unknown ops)."""

    name: str
    extent: int
    partitionable: bool = True


@dataclasses.dataclass(frozen=True)
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: str


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
        how: ``"rule"`` (the table), ``"discovered"`` (run on pieces), or ``"replicated"`` (neither:
            the op runs whole on every device).
        eqn: the jaxpr equation, for execution.
    """

    name: str
    primitive: str
    loops: tuple[Loop, ...]
    operands: tuple[Access, ...]
    results: tuple[Access, ...]
    reductions: tuple[tuple[str, str], ...] = ()
    how: str = "rule"
    eqn: object = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def loop(self) -> dict[str, Loop]:
        return {lp.name: lp for lp in self.loops}

    def __str__(self) -> str:
        loops = " ".join(
            f"{lp.name}={lp.extent}" + ("" if lp.partitionable else "!") for lp in self.loops
        )
        red = ", ".join(f"{kind} over {name}" for name, kind in self.reductions)
        ins = " ".join(str(a) for a in self.operands)
        outs = " ".join(str(a) for a in self.results)
        tags = [t for t in (red, "" if self.how == "rule" else self.how) if t]
        tag = f" ({'; '.join(tags)})" if tags else ""
        return f"{self.name}: {loops or '-'}{tag} | {ins} -> {outs}"


@dataclasses.dataclass(frozen=True)
class Program:
    """A traced function as a flat list of ops (nested jaxprs inlined)."""

    ops: tuple[Op, ...]
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    jaxpr: object = dataclasses.field(default=None, compare=False, repr=False)
    consts: tuple = dataclasses.field(default=(), compare=False, repr=False)  # (Value, array)

    def schedule(self, assign, mesh, default: str = "propagate", stored=None):
        """A :class:`planner.schedule.Schedule`: see :func:`planner.schedule.make_schedule`."""
        from planner.schedule import make_schedule

        return make_schedule(self, assign, dict(getattr(mesh, "shape", mesh)), default, stored)

    def op(self, name: str) -> Op:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(f"no op named {name!r}; ops: {[o.name for o in self.ops]}")

    def __str__(self) -> str:
        head = (
            f"inputs {', '.join(f'{v.name}:{v.dtype}{list(v.shape)}' for v in self.inputs)} -> "
            f"outputs {', '.join(v.name for v in self.outputs)}"
        )
        return "\n".join([head, *(str(o) for o in self.ops)])
