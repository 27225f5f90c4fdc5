"""The layout the user's program already asks for, as a schedule the search prices and may keep.

Two things say it: the program's sharding constraints (:mod:`planner.program.constraints`) and
the layouts its inputs are given (``in_shardings``, or the arrays' own shardings:
``plan(..., compare=...)``, :func:`planner.price`). :class:`Requested` holds them with what
``plan(..., constraints=...)`` does with the constraints:

- ``"hint"`` (the default): the user's layout is priced as a whole-program strategy beside the
  experts' and seeds the search, which departs from it where it predicts better;
- ``"keep"``: every constraint holds in every schedule the search prices (its op's loops are
  fixed; the other ops follow);
- ``"drop"``: constraints are identities and nothing more (the inputs' layouts are still priced).

Example:
    >>> req = Requested("hint", stored=((("fsdp",), ()), None))
    >>> sched = req.schedule(prog, {"fsdp": 4, "tensor": 2})          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

from planner.cost.simulator import simulate
from planner.layout.donation import keep_state_layouts, kept_pairs
from planner.program.constraints import MODES, requested_assignment
from planner.program.ir import Program
from planner.program.schedule import (
    ORDERS,
    Schedule,
    Spec,
    check_assignment,
    make_schedule,
    want_loops,
)
from planner.solver.ties import best_of
from redist.calibration import Calibration
from redist.specs import mesh_shape
from redist.types import MeshShape

Assignment = dict[str, dict[str, tuple[str, ...]]]


def returned_as_given(
    prog: Program, stored: dict[str, Spec], shape: MeshShape, xla: bool = True
) -> Assignment:
    """The loops of the ops making state's outputs (:func:`planner.layout.donation.kept_pairs`:
    donated or returned in place of an argument) split so that each comes back in its input's
    given layout (``stored``: input name -> whole mesh axes per dimension); an op whose loops
    cannot lay its result out so is left to propagation.

    Example:
        >>> returned_as_given(prog, {"mu": (("fsdp",), ())}, MeshShape.of({"fsdp": 4}))  # doctest: +SKIP
        {'add_41': {'i0': ('fsdp#0', 'fsdp#1')}}
    """
    out: Assignment = {}
    for inp, res in kept_pairs(prog):
        spec, op = stored.get(inp.name), prog.producer.get(res.name)
        if not spec or op is None or op.how == "region" or op.name in out:
            continue
        access = next(r for r in op.results if r.value.name == res.name)
        loops: dict = {}
        want_loops(access, spec, loops)
        try:
            out[op.name] = check_assignment(shape, op, loops, xla)
        except ValueError:
            continue
    return out


@dataclasses.dataclass(frozen=True)
class Requested:
    """What the program asks for: ``mode`` (see the module) and ``stored``, per input of the
    program (its leaves in order), the layout it is given (``None``: none; whole mesh axes)."""

    mode: str = "hint"
    stored: tuple[Spec | None, ...] = ()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"constraints must be one of {MODES}, got {self.mode!r}")

    def assignment(self, prog: Program, shape: MeshShape, xla: bool = True) -> Assignment:
        """The constrained ops' loops as their constraints ask (none with ``"drop"``)."""
        if self.mode == "drop":
            return {}
        return requested_assignment(prog, shape, xla)[0]

    def pinned(self, prog: Program, shape: MeshShape, xla: bool = True) -> Assignment:
        """What every schedule priced must keep: the constraints under ``"keep"``, else nothing."""
        return self.assignment(prog, shape, xla) if self.mode == "keep" else {}

    def stored_specs(self, prog: Program) -> dict[str, Spec]:
        """Input name -> its given layout, for :func:`planner.program.schedule.make_schedule`."""
        return {v.name: s for v, s in zip(prog.inputs, self.stored) if s is not None}

    def asks(self, prog: Program, shape: MeshShape, xla: bool = True) -> bool:
        """Whether the program asks for any layout (a constraint that can hold, or an input's)."""
        return bool(self.assignment(prog, shape, xla) or self.stored_specs(prog))

    def completions(
        self, prog: Program, mesh: MeshShape | dict[str, int], xla: bool = True
    ) -> list[Schedule]:
        """The user's layout as whole schedules: the constrained ops as asked, the inputs stored
        as given, state returned as it was given (the op making each state input's paired
        output lays it out as the input: ``jax.jit(out_shardings=in_shardings)``, as MaxText's,
        Keras' and gemma's steps are jitted), every other op by propagation from them (as
        XLA's partitioner propagates), one schedule per way propagation may settle operands
        that want one axis (:data:`planner.program.schedule.ORDERS`; those that differ).
        Raises ``ValueError`` where the inputs' layouts do not fit the mesh."""
        shape = mesh_shape(mesh)
        stored = self.stored_specs(prog)
        assign = returned_as_given(prog, stored, shape, xla) | self.assignment(prog, shape, xla)
        out: list[Schedule] = []
        for order in ORDERS:
            sched = keep_state_layouts(
                prog, make_schedule(prog, assign, shape.sizes, stored=stored, xla=xla, order=order)
            )
            if all(sched.assign != s.assign or sched.stored != s.stored for s in out):
                out.append(sched)
        return out

    def schedule(
        self, prog: Program, mesh: MeshShape | dict[str, int], xla: bool = True,
        calibration: Calibration | None = None,
    ) -> Schedule:  # fmt: skip
        """The user's layout (:meth:`completions`): with a ``calibration``, the completion
        predicted fastest, or the leanest of those as fast (:func:`planner.solver.ties.best_of`),
        since XLA's own propagation, which knows more rules than ours, finds at least as good a
        layout (MaxText's DeepSeek-V3 tiny: 715.8 ms
        the fastest way, 779.5 XLA's rule for products); else that rule (``"largest"``)."""
        found = self.completions(prog, mesh, xla)
        if calibration is None or len(found) == 1:
            return found[0]
        predicted = [simulate(prog, s, calibration) for s in found]
        return best_of([(p.time_s, p.peak_bytes, s, p) for p, s in zip(predicted, found)])[2]

    def asked(
        self, prog: Program, mesh: MeshShape | dict[str, int], xla: bool = True,
        calibration: Calibration | None = None,
    ) -> Schedule | None:  # fmt: skip
        """:meth:`schedule` where the program asks for a layout that fits the mesh, else ``None``
        (no constraint that holds and no input's layout, or inputs' layouts the mesh does not
        divide)."""
        shape = mesh_shape(mesh)
        if not self.asks(prog, shape, xla):
            return None
        try:
            return self.schedule(prog, shape, xla, calibration)
        except ValueError:
            return None
