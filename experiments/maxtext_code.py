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
calibration: :mod:`experiments.code_estimate`), the MFU that estimate implies by MaxText's own
count of a step's model flops (``calculate_tflops_training_per_device``) against the chip's
peak, next to the MFU MaxText publishes for the recipe, and the search seconds. The plan is
searched as :func:`experiments.code_replay.planned` searches it, which also replays committed
rows on a later planner.

Example:
    >>> rows = measure_code("llama2_7b_v5p_128", ("recipe", "searched"), set(), config)
    ...                                                                  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import re
import time

from absl import logging

from experiments import code_estimate, code_replay, recipe_rows

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
            p = own if variant is None and own is not None else code_replay.planned(step)
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


def measure_code(name: str, strategies, done: set, config,
                 previous: list[dict] = (), known: list[dict] = ()) -> list[dict]:  # fmt: skip
    """Rows of ``strategies`` (of :data:`CODE_STRATEGIES`) of recipe ``name`` not in ``done``
    (the variant strategies only for recipes with ``variants``). A compile (the plan's or
    MaxText's own) that repeats a ``previous`` row's of its strategy and variant
    (:data:`experiments.code_estimate.SAME_PROGRAM`: the same program) takes that row's kernels'
    estimate rather than compiling its layers again (``row["estimate_from"]`` says so). A variant
    search without the ``searched`` row takes the own settings' plan from that row among the
    ``known`` rows, replayed (:func:`experiments.code_replay.own_plan_replayed`), rather than
    searching and compiling it again."""
    from planner.cost.memory import MemoryLimitError, default_calibration
    from planner.target.compiled import compile_and_report, plan_compile_and_report

    recipe = CODE_RECIPES[name]
    todo = [s for s in strategies if (name, s) not in done]
    if "variants" not in recipe:
        todo = [s for s in todo if s in ("recipe", "searched", "on_its_own")]
    if not todo:
        return []
    built = build(name)
    mesh, layers = built.mesh, built.config.num_decoder_layers
    at = code_estimate.depths(built.config)
    cal = default_calibration(mesh)
    base = {"recipe": name, "source": "maxtext_code", "model": recipe["model"],
            "topology": recipe["topology"], "devices": mesh.size,
            "remat": built.config.remat_policy, "model_tflops": model_tflops(built),
            "published_mfu": recipe.get("published_mfu")}  # fmt: skip
    rows = []

    def estimated(row: dict, variant: str | None, plan=None) -> dict:
        """``row`` with its estimate: the kernels of the previous row whose program it compiled
        again, else its layers compiled (:func:`experiments.code_estimate.kernels`)."""
        kernels = code_estimate.kernels_compiled_before(row, previous)
        if kernels is not None:
            row["estimate_from"] = "the same program's kernels, compiled before"
        else:
            kernels = code_estimate.unless_over_hbm(row, lambda: code_estimate.kernels(
                lambda d: build(name, d, variant), layers, cal, at, plan), config)  # fmt: skip
        if kernels is not None and "compiled_collective_s" in row:
            code_estimate.with_estimate(row, kernels)
        logging.warning("%s", row)
        return row

    def authors_row(strategy: str, step, variant: str | None) -> dict:
        start = time.perf_counter()
        compiled, report = compile_and_report(step.authors_compile())
        row = {**base, "strategy": strategy, "search_s": 0.0, "variant": variant,
               "compile_s": time.perf_counter() - start,
               **recipe_rows.row_of(compiled, report, cal, mesh.size, None)}  # fmt: skip
        return estimated(row, variant)

    def plan_row(strategy: str, step, p, variant: str | None = None, extra=()) -> dict:
        start = time.perf_counter()
        with step.context():
            compiled, report = plan_compile_and_report(p)
        row = {**base, "strategy": strategy, "search_s": p.search_s, "variant": variant,
               "predicted_peak_bytes": p.prediction.peak_bytes, "predicted_s": p.prediction.time_s,
               "compile_s": time.perf_counter() - start,
               "memory_checks": [dataclasses.asdict(c) for c in p.memory_checks],
               "not_understood": sorted({o.primitive for o in p.program.ops
                                         if o.how == "replicated"}),
               **dict(extra), **recipe_rows.row_of(compiled, report, cal, mesh.size, None)}  # fmt: skip
        return estimated(row, variant, p)

    if "recipe" in todo:
        rows.append(authors_row("recipe", built, None))
    own = None  # the recipe's own step's plan, where searched in this run
    for strategy in ("searched", "on_its_own"):
        if strategy not in todo:
            continue
        start = time.perf_counter()
        try:
            p = code_replay.planned(built, on_its_own=strategy == "on_its_own")
        except MemoryLimitError as e:
            rows.append({**base, "strategy": strategy, "fits": False, "error": str(e)[:800],
                         "planning_s": time.perf_counter() - start})  # fmt: skip
            if strategy == "searched":
                return rows
            continue
        if strategy == "searched":
            own = p
        rows.append(plan_row(strategy, built, p))
    if {"searched_variants", "recipe_at_variant"} & set(todo):
        if own is None:
            own = code_replay.own_plan_replayed(name, built, known)
        variant, p, step, tried, seconds = _variant_search(name, built, own)
        searched = sum(t.get("search_s", 0.0) for t in tried.values())  # (their traces not counted)
        if variant is None:  # the recipe's own step: those rows are the searched and recipe rows
            return rows + [{**base, "strategy": s, "variant": None, "variants": tried,
                            "planning_s": seconds, "same_as": s.split("_")[0],
                            "search_s": searched if s == "searched_variants" else 0.0}
                           for s in ("searched_variants", "recipe_at_variant") if s in todo]  # fmt: skip
        if "searched_variants" in todo:
            extra = {"variants": tried, "planning_s": seconds}
            row = plan_row("searched_variants", step, p, variant, extra)
            row["search_s"] = searched  # every variant's search
            rows.append(row)
        if "recipe_at_variant" in todo:
            rows.append(authors_row("recipe_at_variant", step, variant))
    return rows


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
    measured (replayed: :func:`experiments.code_replay.replay_search_rows`), both, to the digits
    that tell them apart:
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
