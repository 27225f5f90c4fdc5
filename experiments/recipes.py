"""The planner against MaxText's own published recipes, each compiled for the recipe's topology.

Usage:
    python -m experiments.recipes --config=configs/recipes/default.py --workdir=workdir/recipes

For every recipe (``config.recipes``, :data:`RECIPES`: MaxText's ``benchmarks/`` v5p recipes):
the training step MaxText runs, written from its public configs
(:func:`experiments.maxtext_model.maxtext_step`: float32 weights cast to bfloat16 in each layer,
grouped-query attention, the recipe's named remat policy, clipping, AdamW), built from shapes, is
laid out four ways and each compiled by the TPU compiler for the recipe's topology:

- ``recipe``: as MaxText lays it out: parameters, optimizer state and batch sharded by MaxText's
  logical axis rules (:data:`RULES`, ``base.yml`` with the model file's override) and every
  activation MaxText constrains pinned with ``jax.lax.with_sharding_constraint``; XLA's SPMD
  partitioner does the rest (``jax.jit`` with those shardings, state donated).
- ``recipe_planned``: the same layout as the planner's own plan (``expert_plans``' ``fsdp``,
  which lays every op out by the program's logical axes), to price it and to compare what the
  planner's lowering compiles to with what the recipe does.
- ``searched``: ``planner.plan`` with its defaults (memory limit from the chip's HBM, the plan
  compiled and searched again while the compiler counts it over the limit), state donated.
- ``searched_remat``: the same, the layer's remat policy chosen by the planner
  (``planner.remat_policy`` over the recipe's own and :data:`REMAT_CANDIDATES`): the fastest
  plan predicted to fit.

Each row: compiled GB per chip and whether it fits HBM, the planner's predicted GB, the compiled
estimate (the compiler's kernel time of the step at 1 and 2 layers unrolled, extended to the
recipe's depth, plus the HLO's collectives as often as they run, priced by the calibration, as
:mod:`experiments.pod_plans` does), and the search seconds. Rows go to ``results.jsonl`` as they
are measured (a rerun measures only the missing ones); ``report.md`` has the table.

``config.depths`` (e.g. ``"1,2,8,32"``): also the searched plan of each recipe with its layers cut
to each depth, predicted and compiled (``depths.jsonl``, ``depths.md``): where the memory model
departs from the compiler, whether the gap grows with the layers or sits in the rest of the step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import recipe_rows
from experiments.maxtext_model import MODELS, maxtext_step, remat_policy
from experiments.pod_plans import extrapolated, layer_optimal

STRATEGIES = ("recipe", "recipe_planned", "searched", "searched_remat")
REMAT_CANDIDATES = ("full", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp",
                    "save_qkv_proj")  # fmt: skip
"""The remat policies ``searched_remat`` lets the planner choose among, beside the recipe's own
(MaxText's names, :data:`experiments.maxtext_model.REMAT_POLICIES`)."""

RECIPES = {
    # MaxText benchmarks/maxtext_v5p_model_configs.py: v5p-128 = 64 chips, ici_fsdp_parallelism -1
    "llama2_7b_v5p_128": dict(model="llama2-7b", topology="v5p:4x4x4", per_device_batch=4,
                              seq=4096, remat="minimal"),
    "llama2_70b_v5p_128": dict(model="llama2-70b", topology="v5p:4x4x4", per_device_batch=2,
                               seq=4096, remat="save_dot_except_mlpwi"),
    # src/maxtext/configs/tpu/v5p/llama2_70b.sh: v5p-512 = 256 chips, a 4M-token global batch
    "llama2_70b_v5p_512": dict(model="llama2-70b", topology="v5p:8x8x4", per_device_batch=4,
                               seq=4096, remat="save_dot_except_mlpwi"),
    # MaxText benchmarks/maxtext_trillium_model_configs.py llama3_1_8b_8192 on v6e-256:
    # ici_fsdp_parallelism -1, flash attention, remat_policy custom with the layer's input and
    # its q, k, v and out projections offloaded to the host
    "llama3_1_8b_v6e_256": dict(model="llama3.1-8b", topology="v6e:16x16", per_device_batch=4,
                                seq=8192, remat="offload_qkvo"),
    # Mixtral 8x7B as the v6e recipe mixtral_8x7b_dropped runs it (top-2 of 8 experts, capacity
    # factor 1.25, per-device batch 12, sequence 4096, flash attention, pure FSDP), with the
    # remat policy "full" of its dropless and int8 variants (the dropped one offloads to the
    # host), on the v5p-128 the Llama 2 recipes use
    "mixtral_8x7b_v5p_128": dict(model="mixtral-8x7b", topology="v5p:4x4x4",
                                 per_device_batch=12, seq=4096, remat="full"),
    # the same with expert parallelism: the experts over an axis of 4 (MaxText's
    # ici_expert_parallelism), the rest FSDP over 16; the batch over both
    "mixtral_8x7b_v5p_128_ep": dict(model="mixtral-8x7b", topology="v5p:4x4x4",
                                    per_device_batch=12, seq=4096, remat="full",
                                    axes={"data": 1, "fsdp": 16, "expert": 4, "tensor": 1}),
    # the 70B structure at 1 / 8 of its width and 4 layers on 4 chips: the memory model's gaps
    # at the scale of minutes (its remat policy varied by hand: full, minimal, ...)
    "mid_v5p_8": dict(model=dataclasses.replace(MODELS["llama2-70b"], emb=1024, heads=8,
                                                 kv_heads=2, head_dim=128, mlp=2816, layers=4,
                                                 vocab=8192),
                      topology="v5p:2x2x1", per_device_batch=4, seq=1024,
                      remat="save_dot_except_mlpwi"),
    # Llama 3.1 8B's structure shrunk, its layer's input and projections offloaded to the host
    "offload_v6e_4": dict(model=dataclasses.replace(MODELS["llama3.1-8b"], emb=1024, heads=8,
                                                     kv_heads=2, head_dim=128, mlp=3584,
                                                     layers=4, vocab=16384),
                          topology="v6e:2x2", per_device_batch=4, seq=2048,
                          remat="offload_qkvo"),
    # the same structure shrunk, for the smoke config and the tests (the TPU compiler takes
    # 2.3x as long at emb 256, mlp 512, vocab 1024, seq 256)
    "tiny_v5p_8": dict(model=dataclasses.replace(MODELS["llama2-70b"], emb=64, heads=4,
                                                  kv_heads=2, head_dim=16, mlp=128, layers=2,
                                                  vocab=256),
                       topology="v5p:2x2x1", per_device_batch=2, seq=64,
                       remat="save_dot_except_mlpwi"),
}  # fmt: skip

RULES = {
    # MaxText base.yml logical_axis_rules (the mesh axes these recipes use; 'norm' -> 'fsdp' is
    # the llama2 model files' override, kept for Mixtral too: its norm scales are under a MB),
    # first match wins, an axis used once per array; 'exp' and 'embed_no_exp' lay out the
    # experts' weights (MaxText's RoutedMoE kernel axes)
    "activation_batch": ("data", "fsdp", "expert"),
    "activation_length": (),
    "activation_embed": ("tensor",),
    "activation_heads": ("tensor",),
    "activation_kv": ("tensor",),
    "activation_mlp": ("tensor",),
    "activation_vocab": ("tensor",),
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "kv": (),
    "mlp": ("tensor",),
    "norm": ("fsdp",),
    "layers": (),
    "exp": ("expert",),
    "embed_no_exp": ("fsdp",),
    "unmodeled": (),
}
PARAMETER_AXES = {
    "embedding": ("vocab", "embed"),
    "attention_norm": ("layers", "norm"),
    "query": ("layers", "embed", "q_heads", "kv"),
    "key": ("layers", "embed", "kv_heads", "kv"),
    "value": ("layers", "embed", "kv_heads", "kv"),
    "out": ("layers", "heads", "kv", "embed"),
    "mlp_norm": ("layers", "norm"),
    "wi_0": ("layers", "embed", "mlp"),
    "wi_1": ("layers", "embed", "mlp"),
    "wo": ("layers", "mlp", "embed"),
    "gate": ("layers", "embed", "unmodeled"),
    "moe_wi_0": ("layers", "exp", "embed_no_exp", "mlp"),
    "moe_wi_1": ("layers", "exp", "embed_no_exp", "mlp"),
    "moe_wo": ("layers", "exp", "mlp", "embed_no_exp"),
    "final_norm": ("norm",),
    "logits": ("embed", "vocab"),
}
"""Each parameter's logical axes, as MaxText's layers name them (by the parameter's key)."""


def logical_spec(axes: tuple, mesh):
    """The ``PartitionSpec`` of an array with logical ``axes`` under :data:`RULES` on ``mesh``:
    each logical axis takes its rule's mesh axes of size > 1 not taken by an earlier dimension.

    Example:
        >>> logical_spec(("activation_batch", "activation_length", "activation_embed"), mesh)
        ...                                                                  # doctest: +SKIP
        PartitionSpec(('data', 'fsdp'), None, None)
    """
    from jax.sharding import PartitionSpec

    used, out = set(), []
    for name in axes:
        mesh_axes = tuple(a for a in RULES[name] if mesh.shape.get(a, 1) > 1 and a not in used)
        used.update(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*out)


def recipe_shardings(args, mesh):
    """``NamedSharding``s of ``(params, opt_state, tokens, targets)`` by :data:`RULES`: a
    parameter (and its optimizer moments) by its key's :data:`PARAMETER_AXES`; tokens and
    targets by ``activation_batch``; scalars replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def sharding(path, leaf):
        keys = [getattr(k, "key", None) for k in path]
        names = [k for k in keys if k in PARAMETER_AXES]
        if names and len(PARAMETER_AXES[names[-1]]) == len(leaf.shape):
            return NamedSharding(mesh, logical_spec(PARAMETER_AXES[names[-1]], mesh))
        if len(leaf.shape) == 2 and leaf.dtype == jax.numpy.int32:  # tokens, targets
            return NamedSharding(mesh, logical_spec(("activation_batch", "activation_length"),
                                                    mesh))  # fmt: skip
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(sharding, args)


def recipe_step(recipe: dict, mesh, layers: int | None = None, unroll: int | bool = 1,
                remat=None):  # fmt: skip
    """``(step, args)`` of ``recipe`` with MaxText's activation constraints on ``mesh``
    (``mesh=None``: unconstrained, as the planner gets it); ``layers`` overrides the depth,
    ``remat`` the recipe's remat policy (a name or a ``jax.checkpoint`` policy)."""
    import jax
    from jax.sharding import NamedSharding

    model = recipe["model"]
    model = MODELS[model] if isinstance(model, str) else model
    if layers is not None:
        model = dataclasses.replace(model, layers=layers)
    batch = recipe["per_device_batch"] * mesh_size(recipe)

    def constrain(x, axes):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_spec(axes, mesh)))

    kwargs = {} if mesh is None else {"constrain": constrain}
    remat = recipe["remat"] if remat is None else remat
    return maxtext_step(model, batch, recipe["seq"], remat=remat, shapes_only=True,
                        unroll=unroll, attention=attention_of(recipe),
                        **kwargs)  # fmt: skip


def remat_choice(recipe: dict, candidates: tuple[str, ...] = REMAT_CANDIDATES):
    """``planner.remat_policy`` over the recipe's remat policy and ``candidates`` (MaxText's
    names; by default :data:`REMAT_CANDIDATES`)."""
    import planner

    names = dict.fromkeys((recipe["remat"], *candidates))
    return planner.remat_policy(**{n: remat_policy(n) for n in names})


def attention_of(recipe: dict) -> str:
    """The recipe's attention: ``blockwise`` unless it says (MaxText's TPU default is flash)."""
    return recipe.get("attention", "blockwise")


def mesh_size(recipe: dict) -> int:
    """Chips of the recipe's topology (``"v5p:4x4x4"`` -> 64)."""
    return math.prod(int(d) for d in recipe["topology"].split(":")[1].split("x"))


def topology_axes(recipe: dict) -> dict[str, int]:
    """The recipe's ``axes``, by default pure FSDP over every chip, as the recipes'
    ``ici_fsdp_parallelism: -1``."""
    return dict(recipe.get("axes") or {"data": 1, "fsdp": mesh_size(recipe), "tensor": 1})


def _compile_recipe(recipe: dict, mesh, layers: int | None = None, unroll=1):
    import jax

    from planner.target.compiled import compile_and_report

    step, args = recipe_step(recipe, mesh, layers, unroll)
    shardings = recipe_shardings(args, mesh)
    loss = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    jitted = jax.jit(step, in_shardings=shardings, out_shardings=(*shardings[:2], loss),
                     donate_argnums=(0, 1))  # fmt: skip
    return compile_and_report(jitted.lower(*args))


def measure(name: str, strategies, done: set, config) -> list[dict]:
    """Rows of the ``strategies`` of recipe ``name`` not yet in ``done``."""
    import planner
    from planner.baselines import expert_plans
    from planner.cost.memory import MemoryLimitError, default_calibration
    from planner.target.compiled import plan_compile_and_report
    from planner.target.compiled_time import compiled_time

    recipe = RECIPES[name]
    todo = [s for s in strategies if (name, s) not in done]
    if not todo:
        return []
    axes = topology_axes(recipe)
    mesh = planner.topology_mesh(recipe["topology"], axes)
    cal = default_calibration(mesh)
    model = recipe["model"]
    layers = (MODELS[model] if isinstance(model, str) else model).layers
    base = {"recipe": name, "model": model if isinstance(model, str) else name,
            "topology": recipe["topology"], "devices": mesh.size, "seq": recipe["seq"],
            "per_device_batch": recipe["per_device_batch"], "remat": recipe["remat"],
            "attention": attention_of(recipe)}  # fmt: skip
    rows = []
    if "recipe" in todo:
        start = time.perf_counter()
        compiled, report = _compile_recipe(recipe, mesh)
        optimal = None
        if config.layer_estimate and compiled is not None:
            times = [compiled_time(_compile_recipe(recipe, mesh, d, True)[0], cal).optimal_seconds
                     for d in (1, 2)]  # fmt: skip
            optimal = extrapolated(times, layers)
        rows.append({**base, "strategy": "recipe", "search_s": 0.0,
                     "compile_s": time.perf_counter() - start,
                     **recipe_rows.row_of(compiled, report, cal, mesh.size, optimal)})  # fmt: skip
    step, args = recipe_step(recipe, None)
    plans = {}
    if "recipe_planned" in todo:
        data_axes = tuple(a for a in ("data", "fsdp", "expert") if a in axes)
        made = expert_plans(step, *args, mesh=mesh, data_axes=data_axes,
                            tensor_axis="tensor", calibration=cal, donate_argnums=(0, 1))  # fmt: skip
        plans["recipe_planned"] = made["fsdp"]
    if "searched" in todo:
        start = time.perf_counter()
        try:
            plans["searched"] = planner.plan(step, *args, mesh=mesh, donate_argnums=(0, 1))
        except MemoryLimitError as e:
            rows.append({**base, "strategy": "searched", "planning_s": time.perf_counter() - start,
                         "fits": False, "error": str(e)[:800]})  # fmt: skip
    if "searched_remat" in todo:
        candidates = tuple(c for c in config.remat_candidates.split(",") if c)
        step_r, args_r = recipe_step(recipe, None, remat=remat_choice(recipe, candidates))
        start = time.perf_counter()
        try:
            plans["searched_remat"] = planner.plan(step_r, *args_r, mesh=mesh,
                                                   donate_argnums=(0, 1))  # fmt: skip
        except MemoryLimitError as e:
            rows.append({**base, "strategy": "searched_remat", "fits": False,
                         "planning_s": time.perf_counter() - start, "error": str(e)[:800]})  # fmt: skip
    for strategy, p in plans.items():
        start = time.perf_counter()
        compiled, report = plan_compile_and_report(p)
        optimal = None
        remat = recipe["remat"] if p.remat is None else p.remat.chosen
        if config.layer_estimate and compiled is not None:
            # the policy as the plan's program was traced with it: by name for a fixed one, as a
            # policy object for a chosen one (MaxText's step names more values for those)
            policy = remat if p.remat is None else remat_policy(remat)
            optimal = layer_optimal(
                p, lambda d, r=policy: recipe_step(recipe, None, d, True, r), layers, mesh, cal,
                name)  # fmt: skip
        extra = {} if p.remat is None else {"remat": remat, "remat_candidates": p.remat.candidates}
        if p.memory_checks:
            extra["memory_checks"] = [dataclasses.asdict(c) for c in p.memory_checks]
        rows.append({**base, **extra, "strategy": strategy, "search_s": p.search_s,
                     "predicted_peak_bytes": p.prediction.peak_bytes,
                     "predicted_s": p.prediction.time_s, "compile_s": time.perf_counter() - start,
                     **recipe_rows.row_of(compiled, report, cal, mesh.size, optimal)})  # fmt: skip
    for row in rows:
        logging.info("%s", json.dumps(row))
    return rows


def depth_rows(name: str, depths: list[int], done: set) -> list[dict]:
    """The searched plan of recipe ``name`` (its own remat policy, the default memory limit,
    trusting the model: no compile rounds) at each depth of ``depths`` not in ``done``: its
    predicted peak and the compiler's."""
    import planner
    from planner.target.compiled import plan_compile_and_report

    recipe = RECIPES[name]
    mesh = planner.topology_mesh(recipe["topology"], topology_axes(recipe))
    rows = []
    for layers in depths:
        if (name, layers) in done:
            continue
        step, args = recipe_step(recipe, None, layers=layers)
        p = planner.plan(step, *args, mesh=mesh, donate_argnums=(0, 1), check_memory="predicted")
        start = time.perf_counter()
        _, report = plan_compile_and_report(p)
        rows.append({"recipe": name, "layers": layers, "remat": recipe["remat"],
                     "predicted_peak_bytes": p.prediction.peak_bytes,
                     "compiled_bytes": report.total_bytes, "fits": report.fits,
                     "search_s": p.search_s, "compile_s": time.perf_counter() - start})  # fmt: skip
        logging.info("%s", json.dumps(rows[-1]))
    return rows


def depth_report(rows: list[dict]) -> str:
    """The depth sweep's table: per recipe and depth, predicted and compiled GB per chip."""
    lines = ["| recipe | layers | remat | predicted GB | compiled GB / chip | predicted / compiled |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["recipe"], r["layers"])):
        pred, comp = r["predicted_peak_bytes"], r["compiled_bytes"]
        ratio = f"{pred / comp:.2f}" if pred and comp else "n/a"
        lines.append(f"| {r['recipe']} | {r['layers']} | {r['remat']} | {recipe_rows.gb(pred)} | "
                     f"{recipe_rows.gb(comp)} | {ratio} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def report(rows: list[dict]) -> str:
    """The table: per recipe and strategy, compiled and predicted GB per chip, whether it fits,
    the compiled estimate against the recipe's, and the search seconds."""
    recipe_s = {r["recipe"]: r.get("estimate_s") for r in rows if r["strategy"] == "recipe"}
    lines = [
        "| recipe | strategy | remat | compiled GB / chip | fits | predicted GB "
        "| predicted / compiled | estimate s | / recipe | search s | compile checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {name: k for k, name in enumerate(dict.fromkeys(r["recipe"] for r in rows))}
    ranked = sorted(rows, key=lambda r: (order[r["recipe"]], STRATEGIES.index(r["strategy"])))
    for r in ranked:
        pred, comp = r.get("predicted_peak_bytes"), r.get("compiled_bytes")
        ratio = f"{pred / comp:.2f}" if pred and comp else "n/a"
        est, ref = r.get("estimate_s"), recipe_s.get(r["recipe"])
        vs = f"{est / ref:.2f}x" if est and ref else "n/a"
        sec = f"{est:.3g}" if est else "n/a"
        lines.append(f"| {r['recipe']} | {r['strategy']} | {r.get('remat', '')} | {recipe_rows.gb(comp)} | "
                     f"{'yes' if r.get('fits') else 'no'} | {recipe_rows.gb(pred)} | {ratio} | {sec} | {vs} | "
                     f"{recipe_rows.seconds(r)} | {recipe_rows.checks(r.get('memory_checks'))} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _read_rows(path: str) -> list[dict]:
    """The rows of a ``.jsonl`` file (none if it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _write_rows(path: str, rows: list[dict], mode: str = "w") -> None:
    """``rows`` as the lines of a ``.jsonl`` file (``mode="a"``: after the lines it has)."""
    with open(path, mode) as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _drop_estimates(rows: list[dict], name: str, strategies: set[str]) -> None:
    """Recipe ``name``'s rows of ``strategies`` without their estimate (kept as
    ``estimate_before_s``), in place, for the estimate to be made again."""
    for r in rows:
        if r["recipe"] == name and r["strategy"] in strategies and "estimate_s" in r:
            r["estimate_before_s"] = r.pop("estimate_s")
            r.pop("mfu", None)
            r.pop("estimate_from", None)


def _carry_earlier_estimates(new: list[dict], previous: list[dict]) -> None:
    """``new`` rows (measured again) keep the ``estimate_before_s`` of the ``previous`` row of
    their strategy and variant they replace, in place: an estimate kept beside by an earlier
    re-estimate is history a re-measure does not make again.

    Example:
        >>> new = [{"strategy": "recipe", "estimate_s": 2.0}]
        >>> _carry_earlier_estimates(new, [{"strategy": "recipe", "estimate_before_s": 3.0}])
        >>> new[0]["estimate_before_s"]
        3.0
    """
    kept = {(r["strategy"], r.get("variant")): r["estimate_before_s"]
            for r in previous if "estimate_before_s" in r}  # fmt: skip
    for r in new:
        key = (r["strategy"], r.get("variant"))
        if key in kept and "estimate_before_s" not in r:
            r["estimate_before_s"] = kept[key]


def run(config, workdir: str) -> list[dict]:
    """Measure ``config.recipes`` (``config.source``: ``"model"``, :data:`RECIPES` on the
    step written here; ``"maxtext_code"``, :data:`experiments.maxtext_code.CODE_RECIPES` on
    MaxText's own step) into ``workdir``; a rerun measures only the missing rows."""
    os.makedirs(workdir, exist_ok=True)
    source = config.get("source", "model")
    code = source == "maxtext_code"
    if code:
        from experiments.code_replay import estimate_rows, replay_search_rows, replay_variant_rows
        from experiments.maxtext_code import CODE_RECIPES, build, measure_code, report_code
    elif source != "model":
        raise ValueError(f"config.source must be 'model' or 'maxtext_code', not {source!r}")
    known = CODE_RECIPES if code else RECIPES
    path = os.path.join(workdir, "code_results.jsonl" if code else "results.jsonl")
    rows = _read_rows(path)
    names = [s for s in config.recipes.split(",") if s]
    strategies = [s for s in config.strategies.split(",") if s]
    again = {(n, s) for n in names for s in config.get("remeasure", "").split(",")
             if s in strategies}  # fmt: skip
    done = {(r["recipe"], r["strategy"]) for r in rows} - again
    again_estimated = {s for s in config.get("reestimate", "").split(",") if s}
    for name in names:
        if name not in known:
            raise ValueError(f"recipe {name!r} is unknown; known: {sorted(known)}")
        previous = [r for r in rows if r["recipe"] == name and (name, r["strategy"]) in again]
        if code:
            new = measure_code(name, strategies, done, config, previous, known=rows)
        else:
            new = measure(name, strategies, done, config)
        _carry_earlier_estimates(new, previous)
        rows = [r for r in rows if not any(r is x for x in previous)] + new
        _write_rows(path, rows)  # (rows measured again replace the previous ones)
        if code and again_estimated:
            earlier = [r for r in rows if not any(r is x for x in new)]  # not those just measured
            _drop_estimates(earlier, name, again_estimated)
        if code and (config.get("fill_estimates", False) or again_estimated):
            try:
                estimate_rows(name, rows, build)
            finally:  # the estimates filled before an error are kept
                _write_rows(path, rows)
        if code and config.get("replay_search", False):
            replay_search_rows(name, rows, build)  # seconds, or a note saying why not
            replay_variant_rows(name, rows, build)
            _write_rows(path, rows)
    with open(os.path.join(workdir, "code_report.md" if code else "report.md"), "w") as f:
        f.write(report_code(rows) if code else report(rows))
    depths = [int(d) for d in config.get("depths", "").split(",") if d]
    if depths:
        path = os.path.join(workdir, "depths.jsonl")
        swept = _read_rows(path)
        for name in names:
            new = depth_rows(name, depths, {(r["recipe"], r["layers"]) for r in swept})
            _write_rows(path, new, "a")
            swept += new
        with open(os.path.join(workdir, "depths.md"), "w") as f:
            f.write(depth_report(swept))
    with open(os.path.join(workdir, "code_config.json" if code else "config.json"), "w") as f:
        f.write(config.to_json())
    print(f"recipes: {len(rows)} rows; see {workdir}/{'code_report.md' if code else 'report.md'}")
    return rows


def main(argv):
    del argv
    run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", "configs/recipes/default.py", "Config file.")
    flags.DEFINE_string("workdir", "workdir/recipes", "Where outputs go.")
    app.run(main)
