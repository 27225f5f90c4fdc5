"""The planner's program: a traced function as a flat list of ops (:mod:`planner.program.ops`).

Nested jaxprs are inlined and their regions marked; ``Program.schedule`` splits its loops over a
mesh (:func:`planner.program.schedule.make_schedule`).

Example:
    >>> prog = planner.analyze(lambda x, w: jnp.tanh(x @ w), x, w)   # doctest: +SKIP
    >>> sched = prog.schedule({"dot_general_0": {"m": "a"}}, mesh)
"""

from __future__ import annotations

import dataclasses
import functools

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)

from planner.program.ops import ENTRIES, Access, Op, Region, Value
from planner.program.schedule import make_schedule


@dataclasses.dataclass(frozen=True)
class Program:
    """A traced function as a flat list of ops (nested jaxprs inlined, regions marked).

    ``ties`` pairs ops that must share one assignment: a scan's carry leaves the body in the
    layout it entered with ``(entry op, exit op)``. ``donated`` names the inputs whose buffers
    the caller donates (``jax.jit(donate_argnums=...)``): an output of the same shape, dtype and
    layout is written into one instead of a buffer of its own. ``returned`` pairs the state a
    step returns in place of an argument ``(input, output)`` by name (an output of the
    argument's tree position, shape and dtype: :func:`planner.report.leaves.state_pairs`),
    donated or not: it comes back in the layout it went in.
    """

    ops: tuple[Op, ...]
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    jaxpr: object = dataclasses.field(default=None, compare=False, repr=False)
    consts: tuple = dataclasses.field(default=(), compare=False, repr=False)  # (Value, array)
    regions: tuple[Region, ...] = ()
    ties: tuple[tuple[str, str], ...] = ()
    donated: frozenset[str] = frozenset()
    returned: tuple[tuple[str, str], ...] = ()

    def schedule(self, assign, mesh, default: str = "propagate", stored=None):
        """A :class:`planner.program.schedule.Schedule`: see
        :func:`planner.program.schedule.make_schedule`."""
        return make_schedule(self, assign, dict(getattr(mesh, "shape", mesh)), default, stored)

    @functools.cached_property
    def manual_assignment(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """Each of the user's ``shard_map`` ops (:mod:`planner.program.manual`) -> its loops and
        the mesh factors it splits them over, which every schedule keeps."""
        return {o.name: dict(o.manual) for o in self.ops if o.manual}

    @functools.cached_property
    def index(self) -> dict[str, int]:
        """Op name -> position in ``ops``."""
        return {o.name: k for k, o in enumerate(self.ops)}

    @functools.cached_property
    def producer(self) -> dict[str, Op]:
        """Value name -> the op producing it (inputs and constants have none)."""
        return {r.value.name: o for o in self.ops for r in o.results}

    @functools.cached_property
    def uses(self) -> dict[str, tuple[tuple[Op, Access], ...]]:
        """Value name -> the ops reading it and how, in program order (the def-use index)."""
        out: dict[str, list[tuple[Op, Access]]] = {}
        for o in self.ops:
            for acc in o.operands:
                out.setdefault(acc.value.name, []).append((o, acc))
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def through_elementwise(self) -> dict[str, tuple[tuple[Op, Access], ...]]:
        """Value name -> the ops reading it directly or at the end of a chain of up to four
        elementwise ops (each reading the value as it writes its one result, reducing nothing),
        and how they read that chain's last value, in the order found: where a sharding
        constraint on a product's activation reaches back to the product, as Shardy
        propagates through elementwise ops before products."""
        out: dict[str, tuple[tuple[Op, Access], ...]] = {}
        for name in self.uses:
            found, frontier = [], [name]
            for _ in range(5):
                step = []
                for v in frontier:
                    for o, acc in self.uses.get(v, ()):
                        found.append((o, acc))
                        if (
                            len(o.results) == 1
                            and not o.reductions
                            and acc.dims == o.results[0].dims
                        ):
                            step.append(o.results[0].value.name)
                frontier = step
            out[name] = tuple(found)
        return out

    @functools.cached_property
    def neighbours(self) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        """Op name -> the names of the ops producing its operands and of those reading its
        results, each in program order."""
        return {
            o.name: (
                tuple(self.producer[a.value.name].name for a in o.operands
                      if a.value.name in self.producer),
                tuple(c.name for r in o.results for c, _ in self.uses.get(r.value.name, ())),
            )
            for o in self.ops
        }  # fmt: skip

    @functools.cached_property
    def origin(self) -> dict[str, tuple[Value, int]]:
        """Value name -> ``(outer, k)`` for every value a region entry passes into a body
        (:data:`ENTRIES`): the outermost value of the program it is a view of, through nested
        regions, and how many leading dimensions of ``outer`` it drops (a weight stacked over a
        scan's layers enters the body as one layer: ``(the stacked input, 1)``)."""
        out: dict[str, tuple[Value, int]] = {}
        for o in self.ops:
            drop = ENTRIES.get(o.primitive)
            if drop is None or o.how != "region":
                continue
            src = o.operands[0].value
            outer, k = out.get(src.name, (src, 0))
            out[o.results[0].value.name] = (outer, k + drop)
        return out

    def op(self, name: str) -> Op:
        k = self.index.get(name)
        if k is None:
            raise KeyError(f"no op named {name!r}; ops: {[o.name for o in self.ops]}")
        return self.ops[k]

    def __str__(self) -> str:
        head = (
            f"inputs {', '.join(f'{v.name}:{v.dtype}{list(v.shape)}' for v in self.inputs)} -> "
            f"outputs {', '.join(v.name for v in self.outputs)}"
        )
        return "\n".join([head, *(str(o) for o in self.ops)])
