"""What a checkpointed layer saves for the backward pass, chosen by the planner.

A ``jax.checkpoint`` policy decides which of a layer's values the forward pass keeps for the
backward pass (memory) and which the backward pass computes again (time). Users guess one
(MaxText's ``remat_policy``); :func:`remat_policy` lets the planner choose: pass it as the policy,
and :func:`planner.plan` plans the program once per candidate and keeps the fastest plan that fits
the memory limit (``plan.remat`` says which, and what each candidate was predicted to cost).

The choice is one candidate name for the whole program: every :class:`RematChoice` in it takes
that candidate (or, when it has none of that name, its first). Outside the planner a choice behaves
as its first candidate. Every policy computes the same values, so a choice changes memory and time,
never results.

Example:
    >>> layer = jax.checkpoint(block, policy=planner.remat_policy())        # doctest: +SKIP
    >>> p = planner.plan(step, params, batch, mesh=mesh)
    >>> p.remat.chosen, p.remat.candidates          # 'dots', {'everything': None, 'dots': ...}
    >>> planner.remat_policy(minimal=save_only_these_names("qkv"), full=nothing_saveable)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

import jax

_policies = jax.checkpoint_policies
DEFAULT_CANDIDATES: dict[str, Callable] = {
    "everything": _policies.everything_saveable,
    "dots": _policies.dots_saveable,
    "dots_no_batch": _policies.dots_with_no_batch_dims_saveable,
    "nothing": _policies.nothing_saveable,
}
"""From keeping every value (no recomputation) to keeping none (the layer runs twice)."""

_CHOSEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("remat", default=None)


class RematChoice:
    """A ``jax.checkpoint`` policy that is one of ``candidates`` (name -> policy), the one
    :func:`choosing` names while a program is traced, else the first."""

    def __init__(self, candidates: dict[str, Callable]):
        if not candidates:
            raise ValueError("remat_policy needs at least one candidate policy")
        for name, policy in candidates.items():
            if not callable(policy):
                raise TypeError(
                    f"remat_policy candidate {name!r} is a {type(policy).__name__}; give "
                    "jax.checkpoint policies (e.g. jax.checkpoint_policies.dots_saveable)"
                )
        self.candidates = dict(candidates)

    @property
    def current(self) -> str:
        chosen = _CHOSEN.get()
        return chosen if chosen in self.candidates else next(iter(self.candidates))

    def __call__(self, prim, *args, **params):
        return self.candidates[self.current](prim, *args, **params)

    def __repr__(self) -> str:
        return f"remat_policy({', '.join(self.candidates)})"


def remat_policy(**candidates: Callable) -> RematChoice:
    """A ``jax.checkpoint`` policy the planner chooses among ``candidates`` (name=policy, first the
    default outside the planner); without arguments, :data:`DEFAULT_CANDIDATES`."""
    return RematChoice(candidates or DEFAULT_CANDIDATES)


def choices_in(jaxpr) -> list[RematChoice]:
    """The :class:`RematChoice` policies of ``jaxpr``'s checkpoints (nested jaxprs included), each
    once, in order."""
    found: dict[int, RematChoice] = {}

    def walk(j):
        for eqn in j.eqns:
            policy = eqn.params.get("policy")
            if isinstance(policy, RematChoice):
                found.setdefault(id(policy), policy)
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(getattr(jaxpr, "jaxpr", jaxpr))
    return list(found.values())


def candidate_names(choices: list[RematChoice]) -> list[str]:
    """Every candidate name of ``choices``, in order of first appearance."""
    return list(dict.fromkeys(n for c in choices for n in c.candidates))


@contextlib.contextmanager
def choosing(name: str | None) -> Iterator[None]:
    """Trace with every :class:`RematChoice` taking candidate ``name``. JAX caches traced and
    partially evaluated jaxprs without regard to what a policy answers, so the caches are cleared
    on entry and exit (functions jitted elsewhere compile again once)."""
    token = _CHOSEN.set(name)
    jax.clear_caches()
    try:
        yield
    finally:
        _CHOSEN.reset(token)
        jax.clear_caches()


@dataclasses.dataclass(frozen=True)
class RematDecision:
    """What the planner chose: ``chosen`` among ``candidates`` (name -> the best plan's
    ``(predicted seconds, predicted peak bytes)``, ``None`` where nothing fitted, ``(seconds,
    None)`` where the candidate's fastest plan is over the memory limit and no faster than the
    chosen one, so it was not searched under the limit)."""

    chosen: str
    candidates: dict[str, tuple[float, int | None] | None]

    def describe(self) -> str:
        """``remat: 'dots' (1.20 s, 40.0 GB); everything: does not fit; nothing: 1.41 s, 21.3 GB``"""

        def cost(v):
            if v is None:
                return "does not fit"
            if v[1] is None:
                return f"at least {v[0]:.3g} s (its fastest plan is over the limit)"
            return f"{v[0]:.3g} s, {v[1] / 1e9:.3g} GB"

        others = "; ".join(
            f"{n}: {cost(v)}" for n, v in self.candidates.items() if n != self.chosen
        )
        return f"remat: {self.chosen!r} ({cost(self.candidates[self.chosen])})" + (
            f"; {others}" if others else ""
        )
