"""The ``maxtext_code`` source of :mod:`experiments.recipes`: MaxText's own training step at its
recipes' full size, planned by :func:`planner.plan` and judged against MaxText's own
ahead-of-time compile of the recipe, both by the TPU compiler for the recipe's topology.

For each recipe of :data:`CODE_RECIPES` (MaxText's ``benchmarks/maxtext_v5p_model_configs.py``
tuning, less what only a cluster run reads: datasets, profilers, tokenizers, GCS metrics; the
recipe's ``LIBTPU_INIT_ARGS`` are left out, as some exist only on TPU hardware):

- ``recipe``: MaxText's layout (its ``ici_*`` parallelism, logical axis rules and remat policy)
  compiled by ``train_compile.jit_and_compile`` (:mod:`experiments.libraries.maxtext_aot`);
- ``searched``: the same step (the same ``jax.ShapeDtypeStruct``s, traced under the same mesh and
  rules) planned with the planner's defaults (memory limit from the chip's HBM, confirmed by
  compiling), its ``plan.jit()`` compiled.

Each row: the compiler's peak per chip and whether it fits, the planner's prediction, the
compiled estimate (the kernels' seconds of the layout at 1 and 2 layers, unrolled, extended to
the recipe's depth, plus the full step's collectives as often as they run, priced by the
calibration: :mod:`experiments.recipes`' estimate), the MFU that estimate implies by MaxText's own
count of a step's model flops (``calculate_tflops_training_per_device``) against the chip's
peak, next to the MFU MaxText publishes for the recipe, and the search seconds.

Example:
    >>> rows = measure_code("llama2_7b_v5p_128", ("recipe", "searched"), set(), config)
    ...                                                                  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import re
import time

from absl import logging

from experiments import recipe_rows

CODE_STRATEGIES = ("recipe", "searched", "searched_variants", "recipe_at_variant", "on_its_own")
"""``searched``: the plan searched with MaxText's layout handed over (its constraints as hints,
its ``in_shardings`` priced beside); ``on_its_own``: the plan searched from the step alone
(``constraints="drop", compare=None``: what a user without MaxText's rules gets);
``searched_variants``: for a recipe with ``variants`` (MaxText settings that change what its
``shard_map`` bodies compute, such as the expert-parallel degree: each device's experts and the
sizes of its all-to-alls are fixed when the step is traced, so no plan of one trace can change
them), the step traced at the recipe's own settings and at each variant, each trace planned, and
the plan predicted fastest among those that fit kept; ``recipe_at_variant``: MaxText's own layout
at the variant that plan chose (what the variant alone gives, without the planner's layout)."""

PEAK_TFLOPS = {"v5p": 459.0, "v6e": 918.0, "v5e": 197.0, "v4": 275.0, "tpu7x": 2307.0 / 2}
"""Published bf16 peak TFLOP/s per device (Google Cloud's TPU pages): per chip, but for Ironwood
(``tpu7x``), whose chip is two devices (TensorCores) of 1,153.5 each."""


def tensor_variants(tensor: int, devices: int) -> dict[str, dict]:
    """Qwen3-235B at fsdp ``devices / tensor`` x ``tensor`` with the recipe's remat ("full") and the
    two of MaxText's remat policies predicted fastest at tensor 4 on v5p-512 that fit (of eleven:
    "minimal" and the ``moe_x_sorted`` customs are predicted over HBM, "save_qkv_proj" and
    "save_out_proj" slower).

    Example:
        >>> sorted(tensor_variants(4, 256))[0]
        'tensor 4'
    """
    fsdp = dict(ici_fsdp_parallelism=devices // tensor, ici_tensor_parallelism=tensor)
    return {f"tensor {tensor}": fsdp,
            **{f"tensor {tensor}, remat {r}": dict(fsdp, remat_policy=r)
               for r in ("save_dot_except_mlp", "save_dot_with_context_except_mlp")}}  # fmt: skip


RING_BUFFER = 1.5
"""The ragged buffer of MaxText's ring of experts, in balanced loads (its ``ragged_buffer_factor``;
1.5 as in MaxText's own ring-of-experts DeepSeek-V3 recipes)."""


def ring_variants(experts: int, devices: int, remats: tuple[str, ...] = ("save_dot_except_mlp",),
                  chunks: int = 1) -> dict[str, dict]:  # fmt: skip
    """MaxText's ring of experts over ``experts`` devices (fsdp over the rest): each expert shard
    gathers every token of its ring, computes its own experts' share in a buffer of
    :data:`RING_BUFFER` balanced loads and sums the outputs back (reduce-scatter), with MaxText's
    step-level dropless fallback (``moe_dropless_fallback="step"``): a step in which some shard's
    tokens overflow the buffer returns the state unchanged and is run again by MaxText's dropless
    program, so the training is the recipe's, dropless. With the recipe's remat and with each of
    ``remats``; ``chunks``: MaxText's ``num_moe_token_chunks``, the ring run over that many
    pieces of each chip's tokens (one by default).

    Example:
        >>> sorted(ring_variants(8, 256))[0]
        'expert 8 ring'
    """
    ring = dict(ici_fsdp_parallelism=devices // experts, ici_expert_parallelism=experts,
                use_ring_of_experts=True, use_ragged_sort=True, ragged_buffer_factor=RING_BUFFER,
                moe_dropless_fallback="step", num_moe_token_chunks=chunks)  # fmt: skip
    return {
        f"expert {experts} ring": ring,
        **{f"expert {experts} ring, remat {r}": dict(ring, remat_policy=r) for r in remats},
    }


CODE_RECIPES = {
    # MaxText benchmarks/maxtext_v5p_model_configs.py llama2_7b_v5p_128 (64 chips)
    "llama2_7b_v5p_128": dict(model="llama2-7b", topology="v5p-128", overrides=dict(
        ici_fsdp_parallelism=-1, per_device_batch_size=4, remat_policy="minimal",
        max_target_length=4096, use_iota_embed=True)),
    # the same file's llama2_70b_v5p_128
    "llama2_70b_v5p_128": dict(model="llama2-70b", topology="v5p-128", overrides=dict(
        ici_fsdp_parallelism=-1, per_device_batch_size=2, remat_policy="save_dot_except_mlpwi",
        max_target_length=4096, use_iota_embed=True)),
    # MaxText configs/tpu/v5p/llama2_70b.sh: v5p-512 (256 chips), published 65.4 % MFU
    "llama2_70b_v5p_512": dict(model="llama2-70b", topology="v5p-512", overrides=dict(
        ici_fsdp_parallelism=-1, per_device_batch_size=4, remat_policy="save_dot_except_mlpwi",
        max_target_length=4096, use_iota_embed=True), published_mfu=0.654),
    # llama3_1_405b_8192_v5p_1024 (512 chips): 314.5 TFLOP/s per chip published
    "llama3_1_405b_v5p_1024": dict(model="llama3.1-405b", topology="v5p-1024", overrides=dict(
        per_device_batch_size=2, ici_fsdp_parallelism=-1, max_target_length=8192,
        attention="flash", use_iota_embed=True, remat_policy="custom", context="offload",
        mlpwo="offload", num_vocab_tiling=4, sa_block_q=2048, sa_block_kv=2048,
        sa_block_kv_compute=2048, sa_block_q_dkv=2048, sa_block_kv_dkv=2048,
        sa_block_kv_dkv_compute=2048, sa_block_q_dq=2048, sa_block_kv_dq=2048),
        published_mfu=314.5 / 459.0,
        # the recipe's DENSE_VMEM_LIMIT_FLAG: without it the splash kernel runs out of scoped VMEM
        libtpu_flags=("--xla_tpu_scoped_vmem_limit_kib=98304",)),
    # maxtext_trillium_model_configs.py llama3_1_405b_8192_fsdp_dcn: two v6e-256 slices (512
    # chips; fsdp 64 x tensor 4 in a slice, fsdp over the slices), 38.6 % MFU published
    "llama3_1_405b_v6e_256": dict(model="llama3.1-405b", topology="v6e-256", overrides=dict(
        compile_topology_num_slices=2, per_device_batch_size=1, ici_fsdp_parallelism=64,
        ici_tensor_parallelism=4, dcn_fsdp_parallelism=2, allow_split_physical_axes=True,
        custom_mesh="hybrid_ring_64x4", remat_policy="custom", decoder_layer_input="offload",
        query_proj="offload", key_proj="offload", value_proj="offload", out_proj="offload",
        max_target_length=8192, attention="flash", use_iota_embed=True, sa_block_q=1024,
        sa_block_q_dkv=2048, sa_block_q_dq=2048), published_mfu=0.386,
        libtpu_flags=("--xla_tpu_scoped_vmem_limit_kib=98304",)),
    # MaxText's Qwen3 MoE guide (tests/end_to_end/tpu/qwen/moe/run_qwen_moe.md): training on
    # v5p-512 (256 chips) with fsdp over all of them; no published MFU on v5p (about 27 % on
    # Ironwood)
    # The variants: MaxText's expert parallelism (its ``ici_expert_parallelism``, experts split
    # over that axis in its MoE shard_map, tokens sent by all-to-all) at 8 and 64 chips (sizes
    # v5p-512's 8 x 8 x 4 torus makes of whole physical axes), fsdp over the rest. (Its capped
    # ragged buffer with the in-layer dropless fallback is no variant: the compiler's estimate, as
    # XLA's cost analysis of any conditional, counts the dearer branch, the dropless one.)
    "qwen3_235b_v5p_512": dict(model="qwen3-235b-a22b", topology="v5p-512", overrides=dict(
        per_device_batch_size=1, max_target_length=8192, ici_fsdp_parallelism=256),
        variants={**{f"expert {e}": dict(ici_fsdp_parallelism=256 // e, ici_expert_parallelism=e)
                     for e in (8, 64)},
                  # tensor parallelism over v5p's 4-chip axis (8 is past Qwen3's 4 KV heads),
                  # with the recipe's remat ("full") and two other of MaxText's policies
                  **tensor_variants(4, 256), **ring_variants(8, 256), **ring_variants(4, 256)}),
    # The same guide's settings on Ironwood: tpu7x-256 is 128 chips, two devices (TensorCores)
    # each. No published recipe of its settings there (tpu-recipes has DeepSeek-V3's, not
    # Qwen3's), and no published MFU found to set beside it. Its variants: v5p's at tensor 4
    # (expert parallelism lost there by 1.3-2.4x, predicted), and the same at tensor 2, a chip's
    # two devices
    "qwen3_235b_tpu7x_256": dict(model="qwen3-235b-a22b", topology="tpu7x-256", overrides=dict(
        per_device_batch_size=1, max_target_length=8192, ici_fsdp_parallelism=256),
        variants={**tensor_variants(4, 256), **tensor_variants(2, 256)}),
    # deepseek3_671b_v5p_1024 (512 chips): 152.4 TFLOP/s per chip published; its megablox tile
    # sizes (tile_batch_seq 512, tile_embed_dim 1024, tile_mlp_dim 1024) are not options of
    # MaxText 0.2.5, which tiles by its own defaults
    "deepseek3_671b_v5p_1024": dict(model="deepseek3-671b", topology="v5p-1024", overrides=dict(
        ici_fsdp_parallelism=-1, ici_tensor_parallelism=1, per_device_batch_size=6,
        max_target_length=8192, dtype="bfloat16", weight_dtype="float32", megablox=True,
        sparse_matmul=True, scan_layers=True, use_custom_sort_vjp=True, sa_block_q=2048,
        sa_block_kv=2048, sa_block_kv_compute=2048, sa_block_q_dkv=2048, sa_block_kv_dkv=2048,
        sa_block_kv_dkv_compute=2048, sa_block_q_dq=2048, sa_block_kv_dq=2048,
        remat_policy="custom", decoder_layer_input="offload", out_proj="offload",
        sa_use_fused_bwd_kernel=False), published_mfu=152.4 / 459.0,
        # MaxText's ring of experts over v5p-1024's 8-chip axis, with the recipe's remat and
        # offloads (over 64 chips it gathers every token of 64: no plan fits, predicted 119 GB),
        # in 4 chunks: a chip's 49,152 tokens in one piece overflow the SparseCore memory of
        # MaxText's ragged gather-reduce kernel (6.3 M words of 2.1 M; compiled at 4 layers, 4
        # chunks fit, as do its reference gathers on the TensorCore, in 21 GB more)
        variants=ring_variants(8, 512, remats=(), chunks=4),
        # the recipe's MOE_VMEM_LIMIT_FLAG: without it the splash kernel runs out of scoped VMEM.
        # no_crash_on_oom: the compiler finishes a program over HBM rather than refusing it (its
        # unrolled 4 and 5 layers, which keep more alive than the 61 scanned, for the estimate);
        # whether a program fits is still its compiled bytes against the chip's HBM
        libtpu_flags=("--xla_tpu_scoped_vmem_limit_kib=81920", "--xla_tpu_no_crash_on_oom=true")),
}  # fmt: skip


def chip(topology: str) -> str:
    """``"v5p-128"`` -> ``"v5p"``."""
    return topology.split("-")[0]


def build(name: str, layers: int | None = None, variant: str | None = None):
    """Recipe ``name``'s step (:func:`experiments.libraries.maxtext_aot.build`); ``layers``
    overrides the depth, ``variant`` (a key of the recipe's ``variants``) its settings."""
    from experiments.libraries import maxtext_aot

    recipe = CODE_RECIPES[name]
    overrides = dict(recipe["overrides"])
    if variant is not None:
        overrides.update(recipe["variants"][variant])
    if layers is not None:
        overrides.update(base_num_decoder_layers=layers, override_model_config=True)
    return maxtext_aot.build(recipe["model"], recipe["topology"],
                             recipe.get("libtpu_flags", ()), **overrides)  # fmt: skip


def model_tflops(built) -> float:
    """MaxText's own count of one step's model TFLOPs per device (no recomputation)."""
    from maxtext.utils import maxtext_utils

    return float(maxtext_utils.calculate_tflops_training_per_device(built.config, log=False)[0])


def _unrolled(prog):
    """``prog`` with its scans run unrolled (so that the compiler's cost analysis counts every
    layer); the same ops, so a schedule of ``prog`` carries over."""
    regions = tuple(
        dataclasses.replace(r, eqn=r.eqn.replace(params={**r.eqn.params, "unroll": True}))
        if r.kind == "scan" else r for r in prog.regions
    )  # fmt: skip
    return dataclasses.replace(prog, regions=regions)


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


def depths(config) -> tuple[int, int]:
    """The two depths whose compiles extend to the whole model: 1 and 2 layers, or for a model
    whose first layers are dense (DeepSeek-V3's 3), those and 1 and 2 of the others."""
    dense = config.first_num_dense_layers if config.num_experts > 1 else 0
    return dense + 1, dense + 2


def _extended(times: list[float], at: tuple[int, int], layers: int) -> float:
    """Seconds at ``layers`` from ``times`` at depths ``at`` (``d, d + 1``): each further layer
    costs the difference."""
    return times[0] + (layers - at[0]) * (times[1] - times[0])


NO_RECOMPUTING = {"xla_tpu_rematerialization_min_size_in_bytes": 2**50}
"""The TPU compiler's options for the layer estimate's compiles: its rematerialization off (no
buffer is large enough to be computed again). A step at a few layers unrolled keeps more alive
than the whole step's scan, and where that is over the compiler's memory limit it computes what
it can again to fit (DeepSeek-V3 at 5 layers on v5p-1024: its logits three times over), which
the whole step, within HBM, does not (:func:`redist.hlo.recomputed` counts none in DeepSeek-V3's
and Qwen3-235B's compiles, ``row["recomputed"]`` where recorded). A program within the limit compiles the same with or without
it (Qwen3-235B's rows' estimates, made again with it, are the same to the last digit)."""


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


def _authors_kernels(name: str, layers: int, cal, at: tuple[int, int],
                     variant: str | None = None) -> float:  # fmt: skip
    """The kernels' seconds of MaxText's layout at ``layers``: its own step at the depths ``at``
    (:func:`depths`), its scans unrolled (as the plan's are, :func:`_plan_kernels`), jitted with its own
    shardings, compiled, extended."""
    import jax

    times = []
    for depth in at:
        small = build(name, depth, variant)
        with small.context():
            jaxpr = unroll_scans(jax.make_jaxpr(small.step)(*small.args))
            out_tree = jax.tree.structure(jax.eval_shape(small.step, *small.args))

            def unrolled(*args, j=jaxpr, tree=out_tree):
                flat = evaluate(j, *jax.tree.leaves(args))
                return jax.tree.unflatten(tree, flat)

            fn = jax.jit(unrolled, in_shardings=small.in_shardings,
                         out_shardings=small.out_shardings, donate_argnums=small.donate_argnums)  # fmt: skip
            times.append(_layer_seconds(fn.lower(*small.args), cal))
    return _extended(times, at, layers)


def _plan_kernels(name: str, plan, layers: int, cal, at: tuple[int, int],
                  variant: str | None = None) -> float | None:  # fmt: skip
    """The kernels' seconds of ``plan`` at ``layers``: its schedule carried onto the same step
    at the depths ``at``, the layers unrolled, compiled, extended; None where it does not
    carry."""
    import jax

    from planner.autoplan import AutoPlan
    from planner.calls import Signature
    from planner.program.analysis import analyze
    from planner.program.schedule import Schedule
    from planner.target.compiled import input_structs

    times = []
    for depth in at:
        small = build(name, depth, variant)
        with small.context():
            sig = Signature.of(small.args, {})
            traced, values = sig.traced(small.step, small.args, {})
            prog = analyze(traced, *values)
            if [o.name for o in prog.ops] != [o.name for o in plan.program.ops]:
                logging.warning("%s at %d layers: other ops than the plan's", name, depth)
                return None
            out_tree = jax.tree.structure(jax.eval_shape(traced, *values))
            sched = plan.schedule
            prog = _unrolled(prog)
            target = Schedule(prog, sched.mesh, sched.assign, sched.stored)
            # on the small step's own mesh: its shard_maps name that mesh's devices
            carried = AutoPlan.of(prog, target, small.mesh, calibration=cal, signature=sig,
                                  out_tree=out_tree, donate_argnums=plan.donate_argnums)  # fmt: skip
            times.append(_layer_seconds(carried.jit().lower(*input_structs(carried)), cal))
    return _extended(times, at, layers)


def _unless_over_hbm(row: dict, kernels, config) -> float | None:
    """``kernels()`` (the layer estimate's seconds) where ``config.layer_estimate``; ``None``
    where it is off, or where the compiler refuses the unrolled program as over HBM (an unrolled
    step keeps more alive than its scan: DeepSeek-V3's 4 layers on v5p-1024 need 105 GB, its 61
    scanned 102, which its recipe's ``--xla_tpu_no_crash_on_oom`` lets compile), which
    ``row["estimate_note"]`` then says."""
    if not config.layer_estimate:
        return None
    try:
        return kernels()
    except Exception as e:  # jax.errors.JaxRuntimeError; its class moved between JAX versions
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        row["estimate_note"] = "unrolled layers over HBM: " + str(e).splitlines()[0][:300]
        logging.warning("%s: %s", row["strategy"], row["estimate_note"])
        return None


def estimate_rows(name: str, rows: list[dict]) -> int:
    """Add, in place, the compiled estimate to recipe ``name``'s compiled ``rows`` that have none
    (measured with ``layer_estimate`` off, or refused as over HBM before the recipe's flags let
    the compiler finish such programs), from their layouts at the depths :func:`depths`: MaxText's
    own, or the plan searched again under the row's searched limit, which must predict what the
    row's plan predicted (where it does not, ``row["estimate_note"]`` says so and the row is left
    to be measured again). Returns how many rows it filled."""
    from planner.cost.memory import default_calibration

    todo = [r for r in rows if r["recipe"] == name and "compiled_collective_s" in r
            and "estimate_s" not in r]  # fmt: skip
    if not todo:
        return 0
    built = build(name)
    cal = default_calibration(built.mesh)
    layers, at = built.config.num_decoder_layers, depths(built.config)
    peak = PEAK_TFLOPS[chip(CODE_RECIPES[name]["topology"])]
    filled = 0
    for row in todo:
        variant = row.get("variant")
        if row["strategy"].startswith("recipe"):
            kernels = _authors_kernels(name, layers, cal, at, variant)
        else:
            step = built if variant is None else build(name, variant=variant)
            try:
                again = _planned_again(step, row)
            except PlanChanged as e:  # the row is to be measured again
                row["estimate_note"] = str(e)[:300]
                logging.warning("%s", row["estimate_note"])
                continue
            kernels = _plan_kernels(name, again, layers, cal, at, variant)
        if kernels is None:
            continue
        row.pop("estimate_note", None)
        row["estimate_s"] = kernels + row["compiled_collective_s"]
        row["mfu"] = row["model_tflops"] / row["estimate_s"] / peak
        logging.warning("%s %s: estimate %.2f s", name, row["strategy"], row["estimate_s"])
        filled += 1
    return filled


def replay_search_rows(name: str, rows: list[dict]) -> int:
    """Search recipe ``name``'s ``searched`` rows again on today's planner, in place, without
    compiling: each compile of the plan's memory check (:mod:`planner.target.confirm`) answers
    what the row recorded for that plan (the same layout, predicted at the same bytes), so the
    search takes the row's path. Where it finds the row's plan (its predicted seconds and bytes),
    ``row["search_s"]`` becomes today's seconds (the first measurement kept as
    ``"search_s_measured"``); where it asks for a compile the row did not record or finds another
    plan, ``row["replay_note"]`` says so and the row keeps its seconds. Returns how many rows
    it replayed. (The search is what the planner's changes make faster; the compiles are the
    compiler's, minutes to half an hour each here.)

    A memory model changed since predicts the plans at other bytes: where no check of the row
    has the bytes a compiled plan is predicted at, the search's k-th compile of a layout is
    answered by the row's k-th check of that layout (the search takes the row's path); a final
    plan predicted at the row's seconds is the row's plan (:func:`_same_plan`), and the row's
    predicted bytes become today's (the measured ones kept as
    ``"predicted_peak_bytes_measured"``: :func:`_repredicted`)."""
    todo = [r for r in rows if r["recipe"] == name and r["strategy"] == "searched"
            and "predicted_s" in r]  # fmt: skip
    if not todo:
        return 0
    built = build(name)
    replayed = 0
    for row in todo:
        try:
            p = replayed_plan(name, built, row)
        except PlanChanged as e:
            row["replay_note"] = str(e)[:300]
            logging.warning("%s", row["replay_note"])
            continue
        _repredicted(row, p.prediction.peak_bytes)
        _replayed(row, p.search_s)
        replayed += 1
    return replayed


def replayed_plan(name: str, built, row: dict):
    """The plan of ``row`` (a ``searched`` row of recipe ``name``, step ``built``) searched
    again with each compile of its memory check answered by what the row recorded
    (:func:`replay_search_rows`); raises :class:`PlanChanged` where the search asks for a compile
    the row did not record or finds another plan."""
    from unittest import mock

    from planner.target import confirm

    recorded = {(c.get("layout", "searched"), c["predicted_bytes"]): c
                for c in row.get("memory_checks") or []}  # fmt: skip
    tape: dict[str, list] = {}  # per layout, the row's checks in their order
    for c in row.get("memory_checks") or []:
        tape.setdefault(c.get("layout", "searched"), []).append(c)
    asked: dict[str, int] = {}

    def compiled(plan, searched, target, layout="searched"):
        k = asked[layout] = asked.get(layout, -1) + 1
        check = recorded.get((layout, plan.prediction.peak_bytes))
        if check is None and k < len(tape.get(layout, ())):
            check = tape[layout][k]  # (the memory model predicts the plan otherwise now)
        if check is None:
            raise PlanChanged(
                f"{name}: the replayed search compiles a plan the row did not ({layout}, "
                f"predicted {plan.prediction.peak_bytes} bytes); measure the row again"
            )
        return confirm.MemoryCheck(searched, plan.prediction.peak_bytes,
                                   check["compiled_bytes"], 0.0, target, layout)  # fmt: skip

    with mock.patch.object(confirm, "_compiled_check", compiled):
        p = _planned(built)
    if not _same_plan(p, row):
        got = (p.prediction.time_s, p.prediction.peak_bytes)
        raise PlanChanged(
            f"{name}: the replayed search finds a plan predicting {got} (seconds, bytes), "
            f"the row's {(row['predicted_s'], row['predicted_peak_bytes'])}"
        )
    return p


def _replayed(row: dict, seconds: float) -> None:
    """``row``'s search seconds replaced by today's ``seconds`` (its first measurement kept as
    ``"search_s_measured"``), its replay note dropped."""
    row.setdefault("search_s_measured", row["search_s"])
    row["search_s"] = seconds
    row.pop("replay_note", None)
    logging.warning("%s %s: searches replayed in %.1f s (measured %.1f s)", row["recipe"],
                    row["strategy"], seconds, row["search_s_measured"])  # fmt: skip


def _same_plan(plan, row: dict) -> bool:
    """Whether ``plan`` is taken for ``row``'s plan: it predicts the row's seconds (the memory
    model may have changed the bytes it predicts since, not the time; two plans of one step
    predicted at the same seconds to the last bit are taken for one)."""
    return plan.prediction.time_s == row["predicted_s"]


def _repredicted(row: dict, peak_bytes: int) -> None:
    """``row``'s predicted bytes replaced by today's ``peak_bytes`` for its plan (the measured
    ones kept as ``"predicted_peak_bytes_measured"``)."""
    if peak_bytes != row["predicted_peak_bytes"]:
        row.setdefault("predicted_peak_bytes_measured", row["predicted_peak_bytes"])
        row["predicted_peak_bytes"] = peak_bytes
        logging.warning("%s %s: its plan now predicted at %d bytes (measured: %d)", row["recipe"],
                        row["strategy"], peak_bytes, row["predicted_peak_bytes_measured"])  # fmt: skip


def replay_variant_rows(name: str, rows: list[dict]) -> int:
    """Search each variant of recipe ``name``'s ``searched_variants`` rows again on today's
    planner, in place, without compiling: every variant the row planned
    (``row["variants"]``) is searched again under the limit it was searched under (the chosen
    one's last memory check's, trusted; the others' the default, whose compile checks the row
    did not record). Where the chosen variant finds the plan it found (its predicted seconds)
    and no other variant's plan is now predicted faster, ``row["search_s"]`` becomes today's
    sum (the first measurement kept as ``"search_s_measured"``); else ``row["replay_note"]``
    says why not. A plan predicted at the seconds it was is the one it found
    (:func:`_same_plan`): the bytes it is predicted at today replace the variant's and, for the
    chosen one, the row's (:func:`_repredicted`). An unchosen variant that finds another plan,
    still slower than the chosen one, takes today's figures (the measured ones kept as
    ``"predicted_s_measured"`` and ``"predicted_peak_bytes_measured"``): the row's choice
    stands. Returns how many rows it replayed. A variant whose plan was the searched row's
    (``"from"``) takes that row's replay (:func:`replay_search_rows`, run first), as the variant
    search took its plan; where that row did not replay, it is searched again as the others."""
    todo = [r for r in rows if r["recipe"] == name and r["strategy"] == "searched_variants"
            and r.get("variant") and r.get("variants")]  # fmt: skip
    searched = next((r for r in rows if r["recipe"] == name and r["strategy"] == "searched"), {})
    replayed = 0
    for row in todo:
        seconds, found = 0.0, {}  # found: per variant, today's (seconds, bytes)
        try:
            for key, tried in row["variants"].items():
                if "predicted_s" not in tried:  # no plan fitted: not counted in the row's sum
                    continue
                taken = tried.get("from") == "the searched row"
                if taken and "replay_note" not in searched and \
                        searched.get("predicted_s") == tried["predicted_s"]:  # fmt: skip
                    seconds += searched["search_s"]  # replayed with that row, above
                    found[key] = (tried["predicted_s"], searched["predicted_peak_bytes"])
                    continue
                variant = None if key == "None" else key
                chosen = variant == row["variant"]
                p = _planned_again(build(name, variant=variant), {
                    "recipe": name, "strategy": f"searched_variants ({key})",
                    "memory_checks": row.get("memory_checks") if chosen else [],
                    "predicted_s": tried["predicted_s"],
                    "predicted_peak_bytes": tried["predicted_peak_bytes"]}, exact=chosen)  # fmt: skip
                seconds += p.search_s
                found[key] = (p.prediction.time_s, p.prediction.peak_bytes)
                if not chosen and p.prediction.time_s < row["predicted_s"]:
                    raise PlanChanged(f"{name} searched_variants ({key}): searched again, its "
                                      f"plan predicts {p.prediction.time_s} s, faster than the "
                                      "chosen variant's; measure the row again")  # fmt: skip
        except PlanChanged as e:
            row["replay_note"] = str(e)[:300]
            logging.warning("%s", row["replay_note"])
            continue
        for key, (time_s, peak) in found.items():
            tried = row["variants"][key]
            if time_s != tried["predicted_s"]:
                tried.setdefault("predicted_s_measured", tried["predicted_s"])
                tried.setdefault("predicted_peak_bytes_measured", tried["predicted_peak_bytes"])
                tried["predicted_s"] = time_s
                tried.pop("from", None)  # (searched again here, not the searched row's plan)
            tried["predicted_peak_bytes"] = peak
        _repredicted(row, found[str(row["variant"])][1])
        _replayed(row, seconds)
        replayed += 1
    return replayed


class PlanChanged(ValueError):
    """A row's plan searched again predicts other than it did: the planner changed since."""


def _planned_again(built, row: dict, exact: bool = True):
    """The plan of ``row`` searched again (the limit of its last memory check, trusted): raises
    :class:`PlanChanged` where no plan fits or, ``exact``, where it is not the row's plan
    (:func:`_same_plan`: it predicts other seconds than the row's did)."""
    import planner
    from planner.cost.memory import MemoryLimitError

    checks = row.get("memory_checks") or []
    limit = checks[-1]["searched_limit"] if checks else "auto"
    try:
        with built.context():
            p = planner.plan(built.step, *built.args, mesh=built.mesh, memory_limit_bytes=limit,
                             check_memory="predicted", donate_argnums=built.donate_argnums,
                             compare=built.in_shardings)  # fmt: skip
    except MemoryLimitError as e:
        raise PlanChanged(f"{row['recipe']} {row['strategy']}: searched again, no plan fits "
                          f"({str(e)[:120]}); measure the row again") from e  # fmt: skip
    got = (p.prediction.time_s, p.prediction.peak_bytes)
    if exact and not _same_plan(p, row):
        raise PlanChanged(
            f"{row['recipe']} {row['strategy']}: searched again, the plan predicts {got} (seconds, "
            f"bytes), the row's {(row['predicted_s'], row['predicted_peak_bytes'])}; measure "
            "the row again"
        )
    return p


def _planned(built, on_its_own: bool = False):
    """The planner's plan of ``built``'s step with its defaults (memory limit from the chip's
    HBM, confirmed by compiling), MaxText's input layouts priced beside it; ``on_its_own``: with
    nothing of MaxText's handed over (its constraints dropped, no input layouts to compare)."""
    import planner

    given = (dict(constraints="drop", compare=None) if on_its_own
             else dict(compare=built.in_shardings))  # fmt: skip
    with built.context():
        return planner.plan(built.step, *built.args, mesh=built.mesh,
                            donate_argnums=built.donate_argnums, **given)  # fmt: skip


def _variant_search(name: str, built, own=None) -> tuple[str | None, object, object, dict, float]:
    """``(variant, plan, its step, tried, seconds)``: the plan predicted fastest among the plans
    of the recipe's own step (variant ``None``; ``own``: its plan, searched already in this run)
    and of each of its ``variants`` that fit; ``tried``: per variant, the plan's predicted seconds
    and peak bytes, or the planner's error."""
    from planner.cost.memory import MemoryLimitError

    best, tried, seconds = None, {}, 0.0
    for variant in [None, *CODE_RECIPES[name].get("variants", {})]:
        start = time.perf_counter()
        step = built if variant is None else build(name, variant=variant)
        try:
            p = own if variant is None and own is not None else _planned(step)
        except MemoryLimitError as e:
            tried[str(variant)] = {"error": str(e)[:300]}
            continue
        finally:
            seconds += time.perf_counter() - start
        pred = p.prediction
        tried[str(variant)] = {"predicted_s": pred.time_s, "predicted_peak_bytes": pred.peak_bytes,
                               "search_s": p.search_s}  # fmt: skip
        if p is own:
            tried[str(variant)]["from"] = "the searched row"
        logging.warning("%s %s: %s", name, variant, tried[str(variant)])
        if best is None or pred.time_s < best[1].prediction.time_s:
            best = (variant, p, step)
    if best is None:
        raise ValueError(f"{name}: no variant has a plan that fits: {tried}")
    return best[0], best[1], best[2], tried, seconds


SAME_PROGRAM = ("temp_bytes", "collectives", "compiled_collective_s", "compiled_bytes_accessed")
"""What a compile must repeat for a plan's program to count as the one a row compiled: its
temporaries, its collectives and its kernels' bytes (DeepSeek-V3's plan without its gradient sums
split repeats the memory and collectives of the plan with them, but not the copies those made).
Not the device's figure (``compiled_bytes``): that is how the program is judged, which changes
with the judge (:func:`planner.target.compiled.device_peak_bytes`). A row compiled before the
kernels' bytes were recorded matches no compile."""


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


def measure_code(name: str, strategies, done: set, config,
                 previous: list[dict] = (), known: list[dict] = ()) -> list[dict]:  # fmt: skip
    """Rows of ``strategies`` (of :data:`CODE_STRATEGIES`) of recipe ``name`` not in ``done``
    (the variant strategies only for recipes with ``variants``). A compile (the plan's or
    MaxText's own) that repeats a ``previous`` row's of its strategy and variant
    (:data:`SAME_PROGRAM`: the same program) takes that row's kernels' estimate rather than
    compiling its layers again (``row["estimate_from"]`` says so). A variant search without the
    ``searched`` row takes the own settings' plan from that row among the ``known`` rows,
    replayed (:func:`_own_plan_replayed`), rather than searching and compiling it again."""
    from planner.cost.memory import MemoryLimitError, default_calibration
    from planner.target.compiled import compile_and_report, plan_compile_and_report

    recipe = CODE_RECIPES[name]
    todo = [s for s in strategies if (name, s) not in done]
    if "variants" not in recipe:
        todo = [s for s in todo if s in ("recipe", "searched", "on_its_own")]
    if not todo:
        return []
    built = build(name)
    mesh, layers, at = built.mesh, built.config.num_decoder_layers, depths(built.config)
    cal = default_calibration(mesh)
    peak = PEAK_TFLOPS[chip(recipe["topology"])]
    base = {"recipe": name, "source": "maxtext_code", "model": recipe["model"],
            "topology": recipe["topology"], "devices": mesh.size,
            "remat": built.config.remat_policy, "model_tflops": model_tflops(built),
            "published_mfu": recipe.get("published_mfu")}  # fmt: skip
    rows = []

    def finish(row: dict, kernels: float | None) -> dict:
        if kernels is not None and "compiled_collective_s" in row:
            row["estimate_s"] = kernels + row["compiled_collective_s"]
            row["mfu"] = base["model_tflops"] / row["estimate_s"] / peak
        logging.warning("%s", row)
        return row

    def estimated(row: dict, kernels_of) -> dict:
        """``row`` with its estimate: the kernels of the previous row whose program it compiled
        again, else ``kernels_of()`` (its layers compiled)."""
        kernels = kernels_compiled_before(row, previous)
        if kernels is not None:
            row["estimate_from"] = "the same program's kernels, compiled before"
            return finish(row, kernels)
        return finish(row, _unless_over_hbm(row, kernels_of, config))

    def authors(strategy: str, step, variant: str | None) -> dict:
        start = time.perf_counter()
        compiled, report = compile_and_report(step.authors_compile())
        row = {**base, "strategy": strategy, "search_s": 0.0, "variant": variant,
               "compile_s": time.perf_counter() - start,
               **recipe_rows.row_of(compiled, report, cal, mesh.size, None)}  # fmt: skip
        return estimated(row, lambda: _authors_kernels(name, layers, cal, at, variant))

    def planned(strategy: str, step, p, variant: str | None, extra: dict) -> dict:
        start = time.perf_counter()
        with step.context():
            compiled, report = plan_compile_and_report(p)
        row = {**base, "strategy": strategy, "search_s": p.search_s, "variant": variant,
               "predicted_peak_bytes": p.prediction.peak_bytes, "predicted_s": p.prediction.time_s,
               "compile_s": time.perf_counter() - start,
               "memory_checks": [dataclasses.asdict(c) for c in p.memory_checks],
               "not_understood": sorted({o.primitive for o in p.program.ops
                                         if o.how == "replicated"}),
               **extra, **recipe_rows.row_of(compiled, report, cal, mesh.size, None)}  # fmt: skip
        return estimated(row, lambda: _plan_kernels(name, p, layers, cal, at, variant))

    if "recipe" in todo:
        rows.append(authors("recipe", built, None))
    own = None  # the recipe's own step's plan, where searched in this run
    if "searched" in todo:
        start = time.perf_counter()
        try:
            own = _planned(built)
        except MemoryLimitError as e:
            rows.append({**base, "strategy": "searched", "fits": False, "error": str(e)[:800],
                         "planning_s": time.perf_counter() - start})  # fmt: skip
            return rows
        rows.append(planned("searched", built, own, None, {}))
    if "on_its_own" in todo:
        start = time.perf_counter()
        try:
            alone = _planned(built, on_its_own=True)
        except MemoryLimitError as e:
            rows.append({**base, "strategy": "on_its_own", "fits": False, "error": str(e)[:800],
                         "planning_s": time.perf_counter() - start})  # fmt: skip
        else:
            rows.append(planned("on_its_own", built, alone, None, {}))
    if {"searched_variants", "recipe_at_variant"} & set(todo):
        if own is None:
            own = _own_plan_replayed(name, built, known)
        variant, p, step, tried, seconds = _variant_search(name, built, own)
        if variant is None:  # the recipe's own step: those rows are the searched and recipe rows
            searched = sum(t.get("search_s", 0.0) for t in tried.values())
            return rows + [{**base, "strategy": s, "variant": None, "variants": tried,
                            "planning_s": seconds, "same_as": s.split("_")[0],
                            "search_s": searched if s == "searched_variants" else 0.0}
                           for s in ("searched_variants", "recipe_at_variant") if s in todo]  # fmt: skip
        if "searched_variants" in todo:
            # the search's seconds: every variant's search (their traces not counted)
            extra = {"variants": tried, "planning_s": seconds}
            row = planned("searched_variants", step, p, variant, extra)
            row["search_s"] = sum(t.get("search_s", 0.0) for t in tried.values())
            rows.append(row)
        if "recipe_at_variant" in todo:
            rows.append(authors("recipe_at_variant", step, variant))
    return rows


def _own_plan_replayed(name: str, built, rows):
    """The plan of recipe ``name``'s own settings from its ``searched`` row among ``rows``,
    searched again with the row's compiles answered (:func:`replayed_plan`: a variant search
    measured again need not compile the own settings' plan, which that row did), or None where
    there is no such row or it does not replay."""
    row = next((r for r in rows if r["recipe"] == name and r["strategy"] == "searched"
                and "predicted_s" in r), None)  # fmt: skip
    if row is None:
        return None
    try:
        return replayed_plan(name, built, row)
    except PlanChanged as e:
        logging.warning("%s; the own settings are searched with compiles", e)
        return None


def _strategy(row: dict) -> str:
    """``searched_variants (expert 8)``: the row's strategy and the variant it ran."""
    if "variants" in row or row.get("variant"):
        return f"{row['strategy']} ({row.get('variant') or 'its own settings'})"
    return row["strategy"]


def report_code(rows: list[dict]) -> str:
    """The table of the ``maxtext_code`` rows: per recipe, MaxText's compile against the plan."""

    by_strategy = {(r["recipe"], r["strategy"]): r for r in rows}
    rows = [{**by_strategy.get((r["recipe"], r["same_as"]), {}), **r} if "same_as" in r else r
            for r in rows]  # fmt: skip
    recipe_s = {r["recipe"]: r.get("estimate_s") for r in rows if r["strategy"] == "recipe"}
    lines = [
        "| recipe | strategy | compiled GB / chip | fits | predicted GB | predicted / compiled "
        "| estimate s | / recipe | MFU implied | MFU published | search s | compile checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {name: k for k, name in enumerate(CODE_RECIPES)}
    for r in sorted(rows, key=lambda r: (order.get(r["recipe"], len(order)),
                                         CODE_STRATEGIES.index(r["strategy"]))):  # fmt: skip
        pred, comp = r.get("predicted_peak_bytes"), r.get("compiled_bytes")
        ratio = f"{pred / comp:.2f}" if pred and comp else "n/a"
        est, ref = r.get("estimate_s"), recipe_s.get(r["recipe"])
        vs = f"{est / ref:.2f}x" if est and ref else "n/a"
        mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") else "n/a"
        pub = f"{100 * r['published_mfu']:.1f} %" if r.get("published_mfu") else "n/a"
        lines.append(
            f"| {r['recipe']} | {_strategy(r)} | {recipe_rows.gb(comp)} | "
            f"{'yes' if r.get('fits') else 'no'} | {_predicted_gb(r)} | {ratio} | "
            f"{f'{est:.4g}' if est else 'n/a'} | {vs} | {mfu} | {pub} | {recipe_rows.seconds(r)} | "
            f"{recipe_rows.checks(r.get('memory_checks'))} |"
        )
    lines += [
        _variants_line(r)
        for r in rows
        if r["strategy"] == "searched_variants" and r.get("variants")
    ]
    return "\n".join(lines) + "\n"


def _predicted_gb(row: dict) -> str:
    """The row's predicted GB; where its plan is predicted otherwise today than when it was
    measured (:func:`_repredicted`), both, to the digits that tell them apart:
    ``"95.2 (101 measured)"``, ``"105.13 (105.19 measured)"``."""

    measured, today = row.get("predicted_peak_bytes_measured"), row.get("predicted_peak_bytes")
    if measured is None or today is None:
        return recipe_rows.gb(today)
    digits = next(d for d in range(3, 13) if f"{today:.{d}g}" != f"{measured:.{d}g}" or d == 12)
    return f"{today / 1e9:.{digits}g} ({measured / 1e9:.{digits}g} measured)"


def _variants_line(row: dict) -> str:
    """``- r, variants planned: its own settings 26.4 s (34.7 GB); expert 8: no plan fits
    (smallest predicted peak 170 GB)``: what the variant search found, variant by variant."""

    parts = []
    for name, found in row["variants"].items():
        label = "its own settings" if name == "None" else name
        if "predicted_s" in found:
            parts.append(
                f"{label} {found['predicted_s']:.3g} s ({recipe_rows.gb(found['predicted_peak_bytes'])} GB)"
            )
        else:
            peak = re.search(r"smallest predicted peak seen is (\d+)", found.get("error", ""))
            least = (
                f" (smallest predicted peak {recipe_rows.gb(int(peak.group(1)))} GB)"
                if peak
                else ""
            )
            parts.append(f"{label}: no plan fits{least}")
    return f"\n- {row['recipe']}, variants planned (predicted step, peak): " + "; ".join(parts)
