"""Plans the compiler confirms: the searched plan compiled, and searched again where it does not fit.

The memory model predicts XLA's buffer assignment, and on TPUs the compiler's peak can exceed it,
so a plan predicted under the limit may not fit. Where the mesh's devices are TPUs (attached, or
a :func:`planner.topology_mesh`), the compiler runs on this host: :func:`confirmed` compiles the
plan (under ``"auto"`` one predicted over half the limit) and, while its compiled peak is over
the compiled limit, searches again under the limit scaled by that plan's compiled / predicted
ratio (the same plan is then excluded), at most :data:`ROUNDS` compiles. Where no searched plan
compiles within the limit, the layout the program asks for (its sharding constraints and inputs'
layouts, :func:`planner.price`'s plan) is compiled last and is the plan where it fits: a plan
fits wherever the user's own layout, as the planner completes it, does. (Not yet on MaxText's
Llama 3.1 405B on two v6e-256 slices: the searched plans compile 5 % over the chip, and the
completion of MaxText's fsdp x tensor layout leaves the attention weights' stacked gradients
split by tensor alone, priced at 131-414 GB, where XLA's fits in 31.1.) The compiled limit is
the user's ``memory_limit_bytes``, or under the default the device's whole memory: the default's
reserve stands for what the model does not see, and the compiler's peak sees all of it (MaxText's
Llama 3.1 8B recipe runs at 30.4 GB of a v6e's 31.25 GiB, over the default's 90 %). Each round is
a :class:`MemoryCheck`; ``plan.memory_checks`` keeps them.

Example:
    >>> p = planner.plan(step, *shapes, mesh=planner.topology_mesh("v5p:4x4x4", axes))  # doctest: +SKIP
    >>> p.memory_checks   # (MemoryCheck(searched_limit=86e9, predicted=83e9, compiled=105e9), ...)
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable

from planner.cost.memory import MemoryLimitError

ROUNDS = 4
CHECKS = ("auto", "compiled", "predicted")
UNSEEN = 1.15
"""Where no plan is predicted within the limit, the plan of least predicted memory is compiled
(the compiler decides) if it is predicted within this factor of the compiled limit: the model has
been measured up to 9 % high (MaxText's Llama 3.1 405B on 512 v5p chips)."""
MARGIN = 2.0
"""``"auto"`` compiles a plan predicted above ``1 / MARGIN`` of the limit: the model has been
measured up to 1.7x low on the TPU compiler (Mixtral's steps), never 2x."""


@dataclasses.dataclass(frozen=True)
class MemoryCheck:
    """One compile of a searched plan: the limit its search ran under (predicted bytes per
    device), its predicted and compiled bytes per device (compiled None: the compiler failed),
    and the seconds the compile took."""

    searched_limit: float
    predicted_bytes: int
    compiled_bytes: int | None
    compile_s: float = 0.0
    compiled_limit: float | None = None  # what the compiled bytes are held to (None: limit)
    layout: str = "searched"  # or "yours": the layout the program asks for, not searched

    def describe(self, limit: float) -> str:
        """``searched under 86.2 GB: predicted 83.4 GB, compiled 105 GB (over 86.2 GB)``; the
        program's own layout: ``your layout: predicted ..., compiled ...``."""
        limit = self.compiled_limit or limit
        what = (
            "your layout"
            if self.layout == "yours"
            else f"searched under {_gb(self.searched_limit)}"
        )
        if self.compiled_bytes is None:
            return f"{what}: the compiler failed"
        verdict = "over" if self.compiled_bytes > limit else "within"
        return (f"{what}: predicted {_gb(self.predicted_bytes)}, compiled "
                f"{_gb(self.compiled_bytes)} ({verdict} {_gb(limit)})")  # fmt: skip


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB"


def checks_compiled(check: str, devices, limit) -> bool:
    """Whether ``plan(check_memory=check)`` compiles: ``"compiled"``, or ``"auto"`` where the
    mesh's ``devices`` are TPUs and there is a ``limit`` (and then only plans predicted over
    ``limit / MARGIN``, see :func:`confirmed`)."""
    if check not in CHECKS:
        raise ValueError(f"check_memory={check!r}: choose one of {CHECKS}")
    if check == "predicted" or limit is None:
        return False
    if check == "compiled":
        if devices is None:
            raise ValueError(
                "check_memory='compiled' needs a mesh with devices to compile for (a "
                "jax.sharding.Mesh, e.g. planner.topology_mesh(...)); got an abstract mesh"
            )
        return True
    return devices is not None and all(d.platform == "tpu" for d in devices.flat)


def confirmed(search_under: Callable, plan_of: Callable, limit: float, margin: float | None = None,
              compiled_limit: float | None = None, yours: Callable | None = None):  # fmt: skip
    """The plan of ``search_under(limit)`` (``plan_of`` makes it an AutoPlan) whose compiled
    memory is within ``compiled_limit`` (default ``limit``), and the rounds it took (see the
    module docstring). Where the scaled limit leaves no plan, the round after takes the plan of
    least predicted memory (the search's smallest peak), the last one the model can offer. Given
    a ``margin``, a first plan predicted within ``limit / margin`` is not compiled (no rounds).
    ``yours()``: the plan of the layout the program asks for (``None`` where it asks for none),
    compiled where no searched plan fits (if predicted within :data:`UNSEEN` of the compiled
    limit), and kept where it fits (with a warning saying so).
    Raises :class:`MemoryLimitError` when no plan the rounds find compiles within it."""
    target = limit if compiled_limit is None else compiled_limit
    rounds: list[MemoryCheck] = []
    try:
        return _searched_rounds(search_under, plan_of, limit, margin, target, rounds)
    except MemoryLimitError as e:
        plan = None if yours is None else yours()
        if plan is None or plan.prediction.peak_bytes > target * UNSEEN:
            raise
        check = _compiled_check(plan, limit, target, "yours")
        rounds.append(check)
        if check.compiled_bytes is None or check.compiled_bytes > target:
            raise e.replaced(limit=limit, note=_compiled_note(rounds, target)) from None
        warnings.warn(
            "planner: no searched plan compiles within the memory limit; the layout the program "
            f"asks for does, and is the plan ({describe_checks(rounds)})",
            stacklevel=3,
        )
        return plan, tuple(rounds)


def _compiled_check(plan, searched: float, target: float, layout: str = "searched") -> MemoryCheck:
    """``plan`` compiled: its :class:`MemoryCheck` (compiled bytes None where the compiler
    failed for another reason than memory, which is warned)."""
    start = time.perf_counter()
    try:
        compiled = plan.compiled_report().total_bytes
    except Exception as e:  # noqa: BLE001  (a compile error other than memory: say, keep the plan)
        warnings.warn(f"the plan could not be compiled to check its memory: {e}", stacklevel=4)
        compiled = None
    return MemoryCheck(searched, plan.prediction.peak_bytes, compiled,
                       time.perf_counter() - start, target, layout)  # fmt: skip


def _searched_rounds(search_under: Callable, plan_of: Callable, limit: float, margin, target,
                     rounds: list):  # fmt: skip
    """:func:`confirmed`'s rounds over searched plans, each appended to ``rounds``."""
    searched, frugal = limit, False
    for _ in range(ROUNDS):
        try:
            plan = plan_of(search_under(searched))
        except MemoryLimitError as e:
            if not rounds:
                if e.peak is None or e.peak.bytes > target * UNSEEN:
                    raise
                # nothing predicted within the limit, the least memory a plan is predicted at
                # within the model's error of the compiled limit: the compiler decides
                searched, frugal = e.peak.bytes, True
                plan = plan_of(search_under(searched))
            elif frugal or e.peak is None or e.peak.bytes >= rounds[-1].predicted_bytes:
                raise e.replaced(limit=limit, note=_compiled_note(rounds, target)) from None
            else:
                searched, frugal = e.peak.bytes, True  # the least memory any plan is predicted at
                plan = plan_of(search_under(searched))
        if not rounds and margin and plan.prediction.peak_bytes * margin <= limit:
            return plan, ()
        rounds.append(_compiled_check(plan, searched, target))
        compiled = rounds[-1].compiled_bytes
        if compiled is None:
            return plan, tuple(rounds)
        if compiled <= target or frugal:
            break
        searched = min(limit, target * plan.prediction.peak_bytes / compiled)
    if rounds[-1].compiled_bytes is None or rounds[-1].compiled_bytes <= target:
        return plan, tuple(rounds)
    raise MemoryLimitError(limit, None, note=_compiled_note(rounds, target))


def describe_checks(rounds) -> str:
    """The rounds of one plan's check in a line (the first round's limit is the user's)."""
    limit = rounds[0].searched_limit
    return "memory checked by compiling: " + "; ".join(r.describe(limit) for r in rounds)


def _compiled_note(rounds, limit) -> str:
    return "the compiler's memory of the plans searched: " + "; ".join(
        r.describe(limit) for r in rounds
    )
