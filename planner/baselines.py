"""The experts' strategies, to compare plans with: hand-written schedules, and plans made of them.

:func:`expert_plans` gives data parallelism, FSDP and FSDP + tensor parallelism of a training step
as :class:`planner.autoplan.AutoPlan`s that run, compile and predict like a searched plan; the
schedules themselves (:func:`expert_schedules`, and the partial strategies the search starts
from: :func:`data_parallel`, :func:`megatron`, :func:`data_and_model`, :func:`fsdp_stored`, ...)
are :mod:`planner.solver.strategies`, named here too.

Example:
    >>> plans = expert_plans(step, *args, mesh=mesh, data_axes=("data", "fsdp"))  # doctest: +SKIP
    >>> sched = prog.schedule(megatron(prog, ("a", "b", "c")), mesh)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from planner.auto import _argnums, donating
from planner.autoplan import AutoPlan
from planner.cost.memory import default_calibration
from planner.cost.simulator import replicated, simulate
from planner.program.analysis import analyze
from planner.solver.strategies import (
    STRATEGIES,
    VIEWS,
    batch_and_channels,
    batch_and_rows,
    batch_extent,
    data_and_model,
    data_parallel,
    expert_schedules,
    fsdp_stored,
    megatron,
    weight_views,
)
from redist.specs import mesh_shape

__all__ = [
    "STRATEGIES",
    "VIEWS",
    "batch_and_channels",
    "batch_and_rows",
    "batch_extent",
    "data_and_model",
    "data_parallel",
    "expert_plans",
    "expert_schedules",
    "fsdp_stored",
    "megatron",
    "weight_views",
]


def expert_plans(
    fn,
    *args,
    mesh,
    data_axes: Sequence[str] = ("data", "fsdp"),
    tensor_axis: str | None = "tensor",
    calibration=None,
    donate_argnums: int | Sequence[int] = (),
) -> dict:
    """The hand strategies an expert writes, as plans of ``fn`` on ``args`` that run and compile
    exactly as a searched :func:`planner.plan` does (``plan(*args)`` / ``plan.jit()``,
    ``plan.lowered``, ``plan.compiled_report(mesh)``, ``plan.prediction``, ``plan.in_specs``).

    Returns ``{name: AutoPlan}`` (``search_s`` 0), in the order of :data:`STRATEGIES`:

    - ``"data_parallel"``: the batch over ``data_axes``; parameters, gradients and the optimizer
      replicated (gradients all-reduced).
    - ``"fsdp"``: FSDP / ZeRO-3: as ``data_parallel``, with parameters and optimizer state stored
      split over ``data_axes`` along their embedding width (MaxText's ``embed``: the contracted
      dimension of a column layer's weight, the output one of a row layer's), gathered before each
      use, inside a scan one layer at a time; gradients reduce-scattered, the update on shards.
      Per-layer vectors (norm scales, biases) stay whole; a parameter no layer product reads
      (a mixture of experts' stacked weight read inside a ``shard_map``, a convolution's
      kernel) is split on its first dimension the data axes divide.
    - ``"fsdp_tensor"``: MaxText's FSDP + tensor parallelism: as ``fsdp``, and heads, MLP hidden
      and vocabulary over ``tensor_axis`` (Megatron: column layers split on their outputs, row
      layers on their contraction, then an all-reduce), in activations and in the stored
      parameters (``mlp``, ``heads``, ``vocab`` -> ``tensor``; ``embed`` -> ``data_axes``). Left
      out when ``tensor_axis`` is ``None`` or not an axis of size > 1.

    Layouts follow the program's logical axes (see :func:`expert_schedules`), found from its data
    flow: scanned layers (flax ``nn.scan``, nnx with ``lax.scan``, ``hk.layer_stack``) and Python
    loops of layers are treated alike. ``calibration`` prices the predictions (default: as
    :func:`planner.plan` does for ``mesh``). ``donate_argnums`` as :func:`planner.plan`'s: the
    predictions count on the donated buffers, and ``plan.jit()`` donates them.

    Example:
        >>> plans = expert_plans(step, params, opt_state, batch, mesh=mesh,
        ...                      data_axes=("data", "fsdp"), tensor_axis="tensor")  # doctest: +SKIP
        >>> {name: p.prediction.time_s for name, p in plans.items()}
        >>> plans["fsdp_tensor"].in_specs
    """

    prog = donating(analyze(fn, *args), args, donate_argnums)
    donated = _argnums(donate_argnums, len(args))
    sizes = mesh_shape(mesh).sizes
    cal = calibration or default_calibration(mesh)
    whole = replicated(prog, sizes, cal)
    in_tree = jax.tree.structure(args)
    out_tree = jax.tree.structure(jax.eval_shape(fn, *args))
    return {
        name: AutoPlan.of(
            prog,
            sched,
            mesh,
            prediction=simulate(prog, sched, cal),
            calibration=cal,
            in_tree=in_tree,
            out_tree=out_tree,
            replicated=whole,
            donate_argnums=donated,
        )  # fmt: skip
        for name, sched in expert_schedules(prog, sizes, data_axes, tensor_axis).items()
    }
