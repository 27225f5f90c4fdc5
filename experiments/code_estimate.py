"""The compiled estimate of a :mod:`experiments.maxtext_code` row: the kernels' seconds of its
layout, from the step at two small depths with its scans unrolled (the compiler's cost analysis
counts a loop body once), compiled and extended to the recipe's depth, plus the full step's
collectives as often as they run; and the MFU that estimate implies.

A layout is MaxText's own (its step jitted with its shardings) or a plan's (its schedule carried
onto the small step). ``build_at(depth)`` gives the recipe's step at ``depth`` layers
(:func:`experiments.maxtext_code.build`).

Example:
    >>> kernels(lambda d: build("qwen3_235b_v5p_512", d), 94, cal, (1, 2), plan)
    ...                                                                  # doctest: +SKIP
    26.1
"""

from __future__ import annotations

import dataclasses

from absl import logging

from experiments.pod_plans import extrapolated

PEAK_TFLOPS = {"v5p": 459.0, "v6e": 918.0, "v5e": 197.0, "v4": 275.0, "tpu7x": 2307.0 / 2}
"""Published bf16 peak TFLOP/s per device (Google Cloud's TPU pages): per chip, but for Ironwood
(``tpu7x``), whose chip is two devices (TensorCores) of 1,153.5 each."""

NO_RECOMPUTING = {"xla_tpu_rematerialization_min_size_in_bytes": 2**50}
"""The TPU compiler's options for the layer estimate's compiles: its rematerialization off (no
buffer is large enough to be computed again). A step at a few layers unrolled keeps more alive
than the whole step's scan, and where that is over the compiler's memory limit it computes what
it can again to fit (DeepSeek-V3 at 5 layers on v5p-1024: its logits three times over), which
the whole step, within HBM, does not (:func:`redist.hlo.recomputed` counts none in DeepSeek-V3's
and Qwen3-235B's compiles, ``row["recomputed"]`` where recorded). A program within the limit
compiles the same with or without it (Qwen3-235B's rows' estimates, made again with it, are the
same to the last digit)."""

SAME_PROGRAM = ("temp_bytes", "collectives", "compiled_collective_s", "compiled_bytes_accessed")
"""What a compile must repeat for a plan's program to count as the one a row compiled: its
temporaries, its collectives and its kernels' bytes (DeepSeek-V3's plan without its gradient sums
split repeats the memory and collectives of the plan with them, but not the copies those made).
Not the device's figure (``compiled_bytes``): that is how the program is judged, which changes
with the judge (:func:`planner.target.compiled.device_peak_bytes`). A row compiled before the
kernels' bytes were recorded matches no compile."""


def chip(topology: str) -> str:
    """``"v5p-128"`` -> ``"v5p"``."""
    return topology.split("-")[0]


def with_estimate(row: dict, kernels: float) -> dict:
    """``row`` with its estimate, in place: ``kernels`` (its kernels' seconds) plus its
    collectives, and the MFU that implies by its ``model_tflops`` against its chip's peak."""
    row["estimate_s"] = kernels + row["compiled_collective_s"]
    row["mfu"] = row["model_tflops"] / row["estimate_s"] / PEAK_TFLOPS[chip(row["topology"])]
    return row


def depths(config) -> tuple[int, int]:
    """The two depths whose compiles extend to the whole model: 1 and 2 layers, or for a model
    whose first layers are dense (DeepSeek-V3's 3), those and 1 and 2 of the others."""
    dense = config.first_num_dense_layers if config.num_experts > 1 else 0
    return dense + 1, dense + 2


def unroll_scans(jaxpr):
    """``jaxpr`` (a ``Jaxpr``, or a ``ClosedJaxpr`` of JAX <= 0.11) with every scan, nested ones
    too, unrolled: the same program, which the compiler's cost analysis counts layer by layer.

    Example:
        >>> unrolled = unroll_scans(jax.make_jaxpr(step)(*args))           # doctest: +SKIP
    """
    from jax._src import core

    from planner.program.jaxpr_params import map_jaxprs

    if not isinstance(jaxpr, core.Jaxpr):  # a ClosedJaxpr: its constants apart
        return jaxpr.replace(jaxpr=unroll_scans(jaxpr.jaxpr))
    eqns = []
    for eqn in jaxpr.eqns:
        params = {k: map_jaxprs(v, unroll_scans) for k, v in eqn.params.items()}
        if eqn.primitive.name == "scan":
            params["unroll"] = max(1, params["length"])
        eqns.append(eqn.replace(params=params))
    return jaxpr.replace(eqns=eqns)


def evaluate(jaxpr, *args) -> list:
    """``jaxpr`` (as :func:`unroll_scans` gives it) applied to ``args``."""
    import jax

    inner = getattr(jaxpr, "jaxpr", jaxpr)
    return jax.core.eval_jaxpr(inner, getattr(jaxpr, "consts", ()), *args)


def kernels(build_at, layers: int, cal, at: tuple[int, int], plan=None) -> float | None:
    """The kernels' seconds at ``layers`` of MaxText's layout (``plan`` None) or of ``plan``: the
    step at the depths ``at`` (:func:`depths`), its scans unrolled, laid out so, compiled with
    :data:`NO_RECOMPUTING`, each further layer costing the difference; None where the plan does
    not carry onto the small step (other ops than the plan's)."""
    times = []
    for depth in at:
        small = build_at(depth)
        with small.context():
            lowered = _authors_lowered(small) if plan is None else _plan_lowered(small, plan, cal)
            if lowered is None:
                logging.warning("at %d layers: other ops than the plan's", depth)
                return None
            times.append(_layer_seconds(lowered, cal))
    return extrapolated(times, layers - at[0] + 1)  # (depth at[0] counted as the first)


def _authors_lowered(small):
    """MaxText's step ``small``, its scans unrolled, jitted with its own shardings and lowered."""
    import jax

    jaxpr = unroll_scans(jax.make_jaxpr(small.step)(*small.args))
    out_tree = jax.tree.structure(jax.eval_shape(small.step, *small.args))

    def unrolled(*args):
        return jax.tree.unflatten(out_tree, evaluate(jaxpr, *jax.tree.leaves(args)))

    return jax.jit(unrolled, in_shardings=small.in_shardings, out_shardings=small.out_shardings,
                   donate_argnums=small.donate_argnums).lower(*small.args)  # fmt: skip


def _plan_lowered(small, plan, cal):
    """``plan``'s schedule carried onto the step ``small``, its scans unrolled, lowered on the
    small step's own mesh (its shard_maps name that mesh's devices); None where ``small`` has
    other ops than the plan's program."""
    import jax

    from planner.autoplan import AutoPlan
    from planner.calls import Signature
    from planner.program.analysis import analyze
    from planner.program.schedule import Schedule
    from planner.target.compiled import input_structs

    sig = Signature.of(small.args, {})
    traced, values = sig.traced(small.step, small.args, {})
    prog = analyze(traced, *values)
    if [o.name for o in prog.ops] != [o.name for o in plan.program.ops]:
        return None
    out_tree = jax.tree.structure(jax.eval_shape(traced, *values))
    # its scans unrolled (the compiler's cost analysis counts every layer): the same ops
    prog = dataclasses.replace(prog, regions=tuple(
        dataclasses.replace(r, eqn=r.eqn.replace(params={**r.eqn.params, "unroll": True}))
        if r.kind == "scan" else r for r in prog.regions))  # fmt: skip
    sched = plan.schedule
    target = Schedule(prog, sched.mesh, sched.assign, sched.stored)
    carried = AutoPlan.of(prog, target, small.mesh, calibration=cal, signature=sig,
                          out_tree=out_tree, donate_argnums=plan.donate_argnums)  # fmt: skip
    return carried.jit().lower(*input_structs(carried))


def _layer_seconds(lowered, cal) -> float:
    """The kernels' seconds of ``lowered`` (a small step of the layer estimate) compiled with
    :data:`NO_RECOMPUTING`; raises ``RuntimeError`` where the compiler still computed anything
    twice (an option libtpu stopped honouring)."""
    from planner.target.compiled_time import compiled_time
    from redist.hlo import recomputed

    compiled = lowered.compile(compiler_options=NO_RECOMPUTING)
    again = recomputed(compiled.as_text())
    if again:
        raise RuntimeError(
            f"the compiler computed {again} instructions again despite {NO_RECOMPUTING}"
        )
    return compiled_time(compiled, cal).optimal_seconds


def unless_over_hbm(row: dict, estimate, config) -> float | None:
    """``estimate()`` (the layer estimate's seconds) where ``config.layer_estimate``; ``None``
    where it is off, or where the compiler refuses the unrolled program as over HBM (an unrolled
    step keeps more alive than its scan: DeepSeek-V3's 4 layers on v5p-1024 need 105 GB, its 61
    scanned 102, which its recipe's ``--xla_tpu_no_crash_on_oom`` lets compile), which
    ``row["estimate_note"]`` then says."""
    if not config.layer_estimate:
        return None
    try:
        return estimate()
    except Exception as e:  # jax.errors.JaxRuntimeError; its class moved between JAX versions
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        row["estimate_note"] = "unrolled layers over HBM: " + str(e).splitlines()[0][:300]
        logging.warning("%s: %s", row["strategy"], row["estimate_note"])
        return None


def kernels_compiled_before(row: dict, previous) -> float | None:
    """The kernels' seconds of the ``previous`` row of ``row``'s recipe, strategy and variant
    whose compile ``row``'s repeats (:data:`SAME_PROGRAM`), or None.

    Example:
        >>> kernels_compiled_before(row, old_rows)                        # doctest: +SKIP
        57.1
    """
    for r in previous:
        if (
            (r["recipe"], r["strategy"], r.get("variant"))
            == (row["recipe"], row["strategy"], row.get("variant"))
            and "estimate_s" in r
            and all(r.get(k) == row.get(k) for k in SAME_PROGRAM)
        ):
            return r["estimate_s"] - r["compiled_collective_s"]
    return None
