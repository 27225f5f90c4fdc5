"""redist as tunix's weight sync: ``tunix.rl.reshard.reshard_pytree`` with redist's moves.

tunix (PyPI ``google-tunix``) moves the actor's weights into the sampler's layout after every
policy update through one function, ``tunix.rl.reshard.reshard_pytree(source, target, ...)``:
the rollouts' ``update_params`` (vanilla, vLLM, SGLang), ``RLCluster``'s model loading and
MaxText's RL trainer, which runs on ``RLCluster``. Outside Pathways it is one
``jax.device_put`` of the whole tree. :func:`reshard_pytree` here has tunix's signature and
semantics and moves each array with :func:`redist.redistribute`: every intermediate tile at most
the larger of the trainer's and the sampler's tile, and with ``memory_budget`` at most that many
bytes in flight per device.

Switching over is one call, before the ``RLCluster`` is built; importing this module changes
nothing::

    from redist.integrations import tunix as redist_tunix
    redist_tunix.install(memory_budget=512 << 20)  # every reshard_pytree call now runs redist's
    ...
    redist_tunix.uninstall()                      # tunix's own again

tunix 0.1.7 (the newest release) has no hook for another backend (a newer tunix takes a list
of backend factories, ``reshard_fns=``, where :func:`backend` fits): :func:`install` replaces
``tunix.rl.reshard.reshard_pytree`` and every module-level name already bound to it (a module
that ran ``from tunix.rl.reshard import reshard_pytree``, as MaxText's vLLM integration does). A
caller that passes tunix's own ``reshard_fns`` backend list (newer tunix) and any call under
Pathways (``JAX_PLATFORMS`` naming ``proxy``, where tunix uses pathwaysutils' reshard) go to
tunix's function unchanged.

Which leaves redist moves: a ``jax.Array`` on a mesh (``NamedSharding``) going to a
``NamedSharding`` in the same memory kind and another layout. The others go through
``jax.device_put``, as tunix does: a move to or from host memory (``memory_kind="pinned_host"``,
tunix's offloading), single-device arrays, host values, and leaves already in place. Between
meshes over the same devices in the same order all of redist's moves run as one jitted program
(compiled once per tree and layouts, then cached); otherwise (another device order, other
devices: a sampler on its own 4 of 8) they run eagerly (:func:`redist.redistribute`: made on the
trainer's devices, then every tile copied to its device), never through the host.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
from absl import logging
from jax.sharding import NamedSharding, SingleDeviceSharding

from redist.api import checked_budget, redistribute
from redist.cost import AUTO
from redist.linear import device_ids

_TUNIX = "tunix.rl.reshard"
_bound: list[tuple[Any, str, Any]] = []  # (module, name, tunix's function) that install() replaced


def _target_sharding(t) -> jax.sharding.Sharding:
    """A leaf of ``target`` as tunix reads it: a sharding as given, an array's own sharding."""
    if isinstance(t, (NamedSharding, SingleDeviceSharding)):
        return t
    s = getattr(t, "sharding", None)
    if isinstance(s, NamedSharding):
        return NamedSharding(s.mesh, s.spec, memory_kind=s.memory_kind)
    if isinstance(s, jax.sharding.Sharding):
        return s
    raise TypeError(
        f"target leaves must be jax.Array or jax.sharding.Sharding (as tunix's reshard_pytree "
        f"takes), got {type(t).__name__}"
    )


def _why_not_redist(x, d) -> str | None:
    """Why leaf ``x`` goes to ``d`` by ``jax.device_put`` rather than redist (``None``: redist)."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return "not a placed jax.Array"
    return _why_not_between(x.sharding, d, x.ndim)


@functools.lru_cache(maxsize=4096)
def _why_not_between(s, d, ndim: int) -> str | None:
    """:func:`_why_not_redist` of a placed array (cached: a sync asks it of every leaf)."""
    if not isinstance(s, NamedSharding) or not isinstance(d, NamedSharding):
        return "not on a mesh"
    if d.memory_kind not in (None, s.memory_kind):
        return f"to memory kind {d.memory_kind}"
    if device_ids(s.mesh) == device_ids(d.mesh) and s.is_equivalent_to(d, ndim):
        return "already in place"
    return None


def _spread(dst, source) -> list:
    """``dst`` (a pytree prefix of ``source``, of shardings) as one sharding per leaf."""
    leaves, treedef = jax.tree.flatten(source)
    flat, structure = jax.tree.flatten(dst)
    if structure == treedef:  # one sharding per leaf already
        return flat
    try:
        full = jax.tree.map(lambda d, x: jax.tree.map(lambda _: d, x), dst, source)
        return treedef.flatten_up_to(full)
    except (ValueError, TypeError):
        raise ValueError(
            f"target must have the structure of source ({treedef}) or be a prefix of it; got "
            f"{jax.tree.structure(dst)}"
        ) from None


_programs: dict = {}  # what _one_program compiled, by tree, layouts, shapes and options


def _one_program(sub, mine: list, dsts: list, donate: bool, cost_model: str):
    """``(program, temporary bytes per device)``: the compiled program moving the tree ``sub``
    (its leaves ``mine``) to ``dsts``, compiled at the first sync of this tree, its layouts and
    shapes, and run at every later one."""
    treedef = jax.tree.structure(sub)
    srcs = tuple(x.sharding for x in mine)
    key = (treedef, srcs, tuple(dsts), tuple((x.shape, x.dtype) for x in mine), donate,
           cost_model)  # fmt: skip
    if key not in _programs:
        src_tree, dst_tree = jax.tree.unflatten(treedef, srcs), jax.tree.unflatten(treedef, dsts)

        def move(tree):
            return jax.tree.leaves(redistribute(tree, src_tree, dst_tree, cost_model=cost_model))

        jitted = jax.jit(move, out_shardings=list(dsts), donate_argnums=(0,) if donate else ())
        compiled = jitted.lower(sub).compile()
        memory = compiled.memory_analysis()  # 7 ms a call on CPU: read once
        _programs[key] = compiled, int(getattr(memory, "temp_size_in_bytes", 0))
    return _programs[key]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _one_order(leaves: list, dsts: list) -> bool:
    """Whether every leaf's mesh and its target's list the same devices in the same order."""
    return all(device_ids(x.sharding.mesh) == device_ids(d.mesh) for x, d in zip(leaves, dsts))


def reshard_pytree(
    source: Any,
    target: Any,
    cache_plan: bool = True,
    donate_input: bool = False,
    use_experimental_pre_reshard: bool = True,
    *,
    reshard_fns: list | None = None,
    memory_budget: int | None = None,
    cost_model: str = AUTO,
) -> Any:
    """``source`` laid out as ``target``, moved by redist: tunix's ``reshard_pytree``, drop-in.

    Args:
        source: a pytree of arrays (an ``nnx.State``, a dict of arrays).
        target: a pytree of ``jax.Array`` (their shardings are read) or shardings, with the
            structure of ``source`` or a prefix of it; any mesh.
        cache_plan: accepted for tunix's signature; redist caches its plans and programs always.
        donate_input: give ``source``'s buffers to the move (they are deleted).
        use_experimental_pre_reshard: accepted for tunix's signature; redist's moves never
            gather more than the larger tile, which is what tunix's pre-reshard heuristic is for.
        reshard_fns: tunix's backend list (newer tunix): given, the call is tunix's own.
        memory_budget: bytes per device the moves may hold in flight at once (``None``: no bound;
            see :func:`redist.redistribute`); moves then run eagerly, bucket by bucket.
        cost_model: what redist's plan search minimizes (see :func:`redist.redistribute`).

    Returns:
        ``source``'s values in ``target``'s layouts, with ``source``'s structure.

    Example:
        >>> sampler_state = reshard_pytree(actor_state, nnx.state(sampler_model))  # doctest: +SKIP
    """
    if reshard_fns is not None or "proxy" in os.getenv("JAX_PLATFORMS", ""):
        kwargs = {} if reshard_fns is None else {"reshard_fns": reshard_fns}
        return tunix_reshard_pytree()(source, target, cache_plan, donate_input,
                                      use_experimental_pre_reshard, **kwargs)  # fmt: skip
    del cache_plan, use_experimental_pre_reshard
    start = time.time()
    leaves, treedef = jax.tree.flatten(source)
    dsts = _spread(jax.tree.map(_target_sharding, target), source)
    why = [_why_not_redist(x, d) for x, d in zip(leaves, dsts)]
    ours = [w is None for w in why]
    out = list(leaves)
    rest = [k for k, mine in enumerate(ours) if not mine]
    if rest:
        put = jax.device_put([leaves[k] for k in rest], [dsts[k] for k in rest],
                             donate=donate_input)  # fmt: skip
        for k, y in zip(rest, put):
            out[k] = y
    if any(ours):
        # the leaves redist moves, in source's structure (the others None), so errors name them
        sub = source if all(ours) else \
            jax.tree.unflatten(treedef, [x if m else None for x, m in zip(leaves, ours)])  # fmt: skip
        mine = [x for x, m in zip(leaves, ours) if m]
        mine_dsts = [d for d, m in zip(dsts, ours) if m]
        if memory_budget is None and _one_order(mine, mine_dsts):
            with warnings.catch_warnings():  # the buffers XLA cannot reuse are freed below
                warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                program, temp = _one_program(sub, mine, mine_dsts, donate_input, cost_model)
                moved = program(sub)
            how = f"in one program, {_mib(temp)} of temporaries per device"
            if donate_input:
                for x in mine:
                    if not x.is_deleted():
                        x.delete()  # freed once the program has read it
        else:
            sub_dst = jax.tree.unflatten(treedef, [d if m else None for d, m in zip(dsts, ours)])
            moved = jax.tree.leaves(redistribute(sub, sub_dst, donate=donate_input,
                                                 memory_budget=memory_budget,
                                                 cost_model=cost_model))  # fmt: skip
            how = ("eagerly" if memory_budget is None else
                   f"eagerly within {_mib(memory_budget)} in flight per device")  # fmt: skip
        it = iter(moved)
        out = [next(it) if m else y for y, m in zip(out, ours)]
    reasons = ", ".join(f"{why.count(w)} {w}" for w in dict.fromkeys(w for w in why if w))
    logging.info(
        "redist reshard_pytree: %d of %d leaves moved by redist%s, %d by jax.device_put%s; "
        "dispatched in %.3f s", sum(ours), len(leaves), f" {how}" if any(ours) else "",
        len(rest), f" ({reasons})" if reasons else "", time.time() - start,
    )  # fmt: skip
    return jax.tree.unflatten(treedef, out)


def backend(
    *,
    cache_resharding_plans: bool = True,
    donate: bool = False,
    use_experimental_pre_reshard: bool = False,
    memory_budget: int | None = None,
    cost_model: str = AUTO,
) -> Callable:
    """redist as one of tunix's reshard backends: a factory of the kind tunix's
    ``_get_reshard_fn`` tries in order (newer tunix takes a list of them as ``reshard_fns=``),
    returning ``(tree, shardings) -> tree moved`` (:func:`reshard_pytree`).

    Example:
        >>> reshard.reshard_pytree(src, dst, reshard_fns=[backend])  # doctest: +SKIP
    """
    del cache_resharding_plans, use_experimental_pre_reshard  # see reshard_pytree
    return functools.partial(reshard_pytree, donate_input=donate, memory_budget=memory_budget,
                             cost_model=cost_model)  # fmt: skip


def tunix_reshard_pytree() -> Callable:
    """tunix's own ``reshard_pytree`` (the one :func:`install` replaced, if it did)."""
    for module, name, original in _bound:
        if module.__name__ == _TUNIX and name == "reshard_pytree":
            return original
    import tunix.rl.reshard as tunix_reshard  # noqa: PLC0415 (tunix is optional)

    return tunix_reshard.reshard_pytree


def install(*, memory_budget: int | None = None, cost_model: str = AUTO) -> None:
    """Make every call of tunix's ``reshard_pytree`` run :func:`reshard_pytree` (with these
    options) until :func:`uninstall`. Call it before building tunix's ``RLCluster``.

    Raises:
        ModuleNotFoundError: if tunix (``google-tunix``) is not installed.
    """
    import tunix.rl.reshard as tunix_reshard  # noqa: PLC0415, F401 (loads the module)

    checked_budget(memory_budget)  # a bad budget fails here, not at the first sync
    uninstall()
    original = tunix_reshard_pytree()
    ours = functools.update_wrapper(
        functools.partial(reshard_pytree, memory_budget=memory_budget, cost_model=cost_model),
        reshard_pytree,
    )
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", {})
        for name, value in list(names.items()):
            if value is original:
                setattr(module, name, ours)
                _bound.append((module, name, original))


def uninstall() -> None:
    """Put back tunix's ``reshard_pytree`` wherever :func:`install` replaced it."""
    while _bound:
        module, name, original = _bound.pop()
        setattr(module, name, original)


@contextmanager
def installed(*, memory_budget: int | None = None, cost_model: str = AUTO) -> Iterator[None]:
    """:func:`install` for the ``with`` block, then :func:`uninstall`.

    Example:
        >>> with installed(memory_budget=512 << 20):  # doctest: +SKIP
        ...     learner.train(dataset)
    """
    install(memory_budget=memory_budget, cost_model=cost_model)
    try:
        yield
    finally:
        uninstall()
