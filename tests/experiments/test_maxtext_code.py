"""experiments.maxtext_code's pieces that need no MaxText: the unrolled program it estimates
kernels from, the depths it extends from, the compiler options of those compiles (with the TPU
compiler; experiments.code_estimate), its table, and the replay of its rows
(experiments.code_replay)."""

import importlib.util
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from experiments.code_estimate import (
    NO_RECOMPUTING,
    _layer_seconds,
    depths,
    evaluate,
    unroll_scans,
)
from experiments.maxtext_code import (
    CODE_RECIPES,
    RING_BUFFER,
    report_code,
    ring_variants,
    tensor_variants,
)


def _layers(ws, x):
    """Scanned layers inside a jit, a remat and a cond: every scan must unroll."""

    def layer(h, w):
        return jax.checkpoint(lambda h: jnp.tanh(h @ w))(h), h.sum()

    def body(x):
        h, sums = jax.lax.scan(layer, x, ws)
        return jax.lax.cond(sums.sum() > 0, lambda: h, lambda: -h)

    return jax.jit(body)(x)


def _scans(jaxpr, found):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn.params["unroll"])
        for sub in jax._src.core.jaxprs_in_params(eqn.params):
            _scans(sub, found)
    return found


def test_unrolled_scans_compute_the_same():
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(3, 8, 8)) / 3, jnp.float32)
    x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    traced = jax.make_jaxpr(_layers)(ws, x)
    unrolled = unroll_scans(traced)
    assert _scans(getattr(traced, "jaxpr", traced), []) == [1]
    assert _scans(getattr(unrolled, "jaxpr", unrolled), []) == [3]
    np.testing.assert_allclose(evaluate(unrolled, ws, x)[0], _layers(ws, x), rtol=1e-6)


def _recomputing_step(x, w, w2, w3, v):
    """Over v5p's memory limit unless ``y`` (422 TFLOP) is computed again after the products
    that read ``x2``."""
    y = x @ w
    x2 = x + y[:, : x.shape[1]]
    u = ((x2 @ w2) * (x2 @ w3)) @ v
    return (y * (u @ v.T)[:, :1]).sum()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_the_layer_estimate_compiles_without_computing_anything_twice():
    """Left to itself the TPU compiler computes a step's largest product again to fit its memory
    (flops 1.4x the program's); the layer estimate's options stop it, so the kernels' seconds
    count what the step asks for, once."""
    import planner
    from planner.cost.memory import default_calibration
    from redist.hlo import recomputed

    mesh = planner.topology_mesh("v5p:2x2x1", {"x": 4})
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shapes = [(65536, 8192), (8192, 393216), (8192, 262144), (8192, 262144), (262144, 1024)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=whole) for s in shapes]
    lowered = jax.jit(_recomputing_step).lower(*args)
    # three products of x's, one by v (u @ v.T's one column kept is a product the compiler shrinks)
    asked = 2.0 * 65536 * 8192 * (393216 + 2 * 262144) + 2.0 * 65536 * 262144 * 1024
    left = lowered.compile()
    assert recomputed(left.as_text()) > 0
    assert left.cost_analysis()["flops"] > 1.3 * asked
    kept = lowered.compile(compiler_options=NO_RECOMPUTING)
    assert recomputed(kept.as_text()) == 0
    assert kept.cost_analysis()["flops"] == pytest.approx(asked, rel=0.01)
    cal = default_calibration(mesh)
    assert _layer_seconds(lowered, cal) < left.cost_analysis()["optimal_seconds"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_the_kernels_of_a_layout_extend_its_small_steps_unrolled():
    """MaxText's layout (the step's own shardings) and a plan's, each compiled at 1 and 2
    layers with the scans unrolled (the second layer costs its own) and extended, each further
    layer costing the difference; a plan of other ops does not carry (None)."""
    import contextlib

    import planner
    from experiments import code_estimate
    from planner.cost.memory import default_calibration

    mesh = planner.topology_mesh("v5p:2x2x1", {"x": 4})
    whole, rows = jax.sharding.NamedSharding(mesh, P()), jax.sharding.NamedSharding(mesh, P("x"))

    def step(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return (h * h).sum()

    def build_at(depth):
        args = (jax.ShapeDtypeStruct((depth, 512, 512), jnp.float32, sharding=whole),
                jax.ShapeDtypeStruct((4096, 512), jnp.float32, sharding=rows))  # fmt: skip
        return types.SimpleNamespace(step=step, args=args, mesh=mesh, in_shardings=(whole, rows),
                                     out_shardings=whole, donate_argnums=(),
                                     context=contextlib.nullcontext)  # fmt: skip

    cal = default_calibration(mesh)
    one, two = (_layer_seconds(code_estimate._authors_lowered(build_at(d)), cal) for d in (1, 2))
    assert two > 1.2 * one
    assert code_estimate.kernels(build_at, 2, cal, (1, 2)) == pytest.approx(two)
    assert code_estimate.kernels(build_at, 10, cal, (1, 2)) == pytest.approx(one + 9 * (two - one))
    deep = build_at(4)
    plan = planner.plan(step, *deep.args, mesh=mesh, check_memory="predicted")
    assert code_estimate.kernels(build_at, 4, cal, (1, 2), plan) > 0
    other = planner.plan(lambda ws, x: step(ws, x) + x.sum(), *deep.args, mesh=mesh,
                         check_memory="predicted")  # fmt: skip
    assert code_estimate.kernels(build_at, 4, cal, (1, 2), other) is None


def test_depths_skip_the_dense_first_layers_of_a_mixture_of_experts():
    assert depths(types.SimpleNamespace(num_experts=1, first_num_dense_layers=0)) == (1, 2)
    assert depths(types.SimpleNamespace(num_experts=256, first_num_dense_layers=3)) == (4, 5)


def test_tensor_variants_keep_every_device_and_name_their_settings():
    variants = tensor_variants(2, 256)
    assert sorted(variants) == ["tensor 2", "tensor 2, remat save_dot_except_mlp",
                                "tensor 2, remat save_dot_with_context_except_mlp"]  # fmt: skip
    for name, settings in variants.items():
        assert settings["ici_fsdp_parallelism"] * settings["ici_tensor_parallelism"] == 256
        assert settings.get("remat_policy", "full") in name or "remat" not in name
    ironwood = CODE_RECIPES["qwen3_235b_tpu7x_256"]["variants"]
    assert {"tensor 2", "tensor 4"} <= set(ironwood)


def test_ring_variants_keep_every_device_and_maxtexts_dropless_fallback():
    """A ring of experts splits the devices between fsdp and experts and caps its buffer only with
    MaxText's step-level fallback, which replays an overflowing step dropless: no token dropped."""
    variants = ring_variants(8, 256)
    assert sorted(variants) == ["expert 8 ring", "expert 8 ring, remat save_dot_except_mlp"]
    for settings in variants.values():
        assert settings["ici_fsdp_parallelism"] * settings["ici_expert_parallelism"] == 256
        assert settings["use_ring_of_experts"] and settings["ragged_buffer_factor"] == RING_BUFFER
        assert settings["moe_dropless_fallback"] == "step"
    assert set(ring_variants(8, 512, remats=())) == {"expert 8 ring"}
    assert ring_variants(8, 256)["expert 8 ring"]["num_moe_token_chunks"] == 1
    assert CODE_RECIPES["deepseek3_671b_v5p_1024"]["variants"]["expert 8 ring"][
        "num_moe_token_chunks"] == 4  # fmt: skip
    assert set(CODE_RECIPES["deepseek3_671b_v5p_1024"]["variants"]) == {"expert 8 ring"}
    assert {"expert 8 ring", "expert 4 ring"} <= set(CODE_RECIPES["qwen3_235b_v5p_512"]["variants"])


def test_the_table_compares_each_plan_with_its_recipe():
    rows = [
        {"recipe": "r", "strategy": "recipe", "compiled_bytes": 50e9, "fits": True,
         "estimate_s": 2.0, "mfu": 0.64, "published_mfu": 0.65, "search_s": 0.0},
        {"recipe": "r", "strategy": "searched", "compiled_bytes": 40e9, "fits": True,
         "predicted_peak_bytes": 38e9, "estimate_s": 1.8, "mfu": 0.71, "search_s": 12.0},
    ]  # fmt: skip
    table = report_code(rows[::-1]).splitlines()  # the recipe's row first
    assert table[2].startswith("| r | recipe | 50 | yes | n/a | n/a | 2 | 1.00x | 64.0 % | 65.0 %")
    assert table[3].startswith("| r | searched | 40 | yes | 38 | 0.95 | 1.8 | 0.90x | 71.0 % | n/a")
    rows[1]["predicted_peak_bytes_measured"] = 41e9  # its plan predicted otherwise when measured
    assert "| 40 | yes | 38 (41 measured) | 0.95 |" in report_code(rows).splitlines()[3]
    rows[1]["predicted_peak_bytes_measured"] = 38.04e9  # to the digits that tell them apart
    assert "| 38 (38.04 measured) |" in report_code(rows).splitlines()[3]


def test_variant_rows_name_their_variant_or_repeat_the_rows_they_are():
    """A variant search that kept the recipe's own settings repeats the searched and recipe rows
    (``same_as``); one that chose a variant shows it, against the recipe's own estimate."""
    rows = [
        {"recipe": "r", "strategy": "recipe", "compiled_bytes": 50e9, "fits": True,
         "estimate_s": 2.0, "search_s": 0.0},
        {"recipe": "r", "strategy": "searched", "compiled_bytes": 40e9, "fits": True,
         "estimate_s": 1.8, "search_s": 12.0},
        {"recipe": "r", "strategy": "searched_variants", "variant": None, "same_as": "searched",
         "variants": {"None": {"predicted_s": 1.0, "predicted_peak_bytes": 34.7e9},
                      "expert 8": {"error": "no schedule fits memory_limit_bytes=9; the smallest "
                                            "predicted peak seen is 169754566564 bytes per"},
                      "expert 64": {"predicted_s": 1.5, "predicted_peak_bytes": 51.4e9}},
         "search_s": 30.0},
        {"recipe": "r", "strategy": "recipe_at_variant", "variant": None, "same_as": "recipe",
         "variants": {}, "search_s": 30.0},
        {"recipe": "s", "strategy": "recipe", "compiled_bytes": 30e9, "fits": True,
         "estimate_s": 4.0, "search_s": 0.0},
        {"recipe": "s", "strategy": "searched_variants", "variant": "expert 8",
         "compiled_bytes": 30e9, "fits": True, "estimate_s": 3.0, "search_s": 20.0},
    ]  # fmt: skip
    text = report_code(rows[::-1])
    assert (
        "- r, variants planned (predicted step, peak): its own settings 1 s (34.7 GB); "
        "expert 8: no plan fits (smallest predicted peak 170 GB); expert 64 1.5 s (51.4 GB)" in text
    )
    table = [t for t in text.splitlines()[2:] if t.startswith("|")]
    (own,) = [t for t in table if t.startswith("| r | searched_variants (its own settings) | ")]
    assert own.startswith("| r | searched_variants (its own settings) | 40 | yes |")
    assert "| 1.8 | 0.90x |" in own and own.split(" | ")[-2] == "30.0"
    assert "| r | recipe_at_variant (its own settings) | 50 | yes |" in "\n".join(table)
    (chosen,) = [t for t in table if t.startswith("| s | searched_variants (expert 8) | ")]
    assert "| 30 | yes |" in chosen and "| 3 | 0.75x |" in chosen


def test_rows_without_an_estimate_get_one_in_place(monkeypatch):
    """``fill_estimates``: a compiled row with no estimate gets its layout's kernels (MaxText's
    for a recipe row, the plan searched again for a searched row) plus its collectives; rows
    with one, rows that did not compile and other recipes' rows are left as they are."""
    from experiments import code_estimate, code_replay

    config = types.SimpleNamespace(num_decoder_layers=61, num_experts=256, first_num_dense_layers=3)
    step = types.SimpleNamespace(mesh={"d": 8}, config=config)
    monkeypatch.setattr(code_replay, "planned_again", lambda step, row: "plan")
    monkeypatch.setattr(code_estimate, "kernels",
                        lambda build_at, layers, cal, at, p=None: 8.0 if p else 10.0)  # fmt: skip
    name = "deepseek3_671b_v5p_1024"
    base = {"recipe": name, "model_tflops": 6.0, "topology": "v5p-1024"}
    rows = [{**base, "strategy": "recipe", "compiled_collective_s": 50.0},
            {**base, "strategy": "searched", "compiled_collective_s": 40.0},
            {**base, "strategy": "searched", "fits": False},
            {**base, "strategy": "recipe", "compiled_collective_s": 1.0, "estimate_s": 3.0},
            {"recipe": "other", "strategy": "recipe", "compiled_collective_s": 1.0}]  # fmt: skip
    assert code_replay.estimate_rows(name, rows, lambda *a, **k: step) == 2
    assert [r.get("estimate_s") for r in rows] == [60.0, 48.0, None, 3.0, None]
    assert rows[0]["mfu"] == 6.0 / 60.0 / code_estimate.PEAK_TFLOPS["v5p"]


def test_a_row_whose_plan_changed_is_noted_and_the_others_still_estimated(monkeypatch):
    """A searched row whose plan the planner no longer makes is left for measuring again, with a
    note saying why; the recipe's other rows are still estimated."""
    from experiments import code_estimate, code_replay

    config = types.SimpleNamespace(num_decoder_layers=61, num_experts=256, first_num_dense_layers=3)
    step = types.SimpleNamespace(mesh={"d": 8}, config=config)

    def again(step, row):
        if row["predicted_s"] == 1.0:
            raise code_replay.PlanChanged("searched again, its plan predicts 2.0; measure it again")
        return "plan"

    monkeypatch.setattr(code_replay, "planned_again", again)
    monkeypatch.setattr(code_estimate, "kernels", lambda build_at, layers, cal, at, p: 8.0)
    name = "deepseek3_671b_v5p_1024"
    base = {"recipe": name, "model_tflops": 6.0, "strategy": "searched", "topology": "v5p-1024",
            "compiled_collective_s": 4.0}  # fmt: skip
    rows = [{**base, "predicted_s": 1.0}, {**base, "predicted_s": 3.0}]
    assert code_replay.estimate_rows(name, rows, lambda *a, **k: step) == 1
    assert "estimate_s" not in rows[0] and "measure it again" in rows[0]["estimate_note"]
    assert rows[1]["estimate_s"] == 12.0


def test_a_plan_searched_again_must_predict_what_its_row_did(monkeypatch):
    import contextlib

    import planner
    from experiments.code_replay import PlanChanged, planned_again
    from planner.cost.memory import MemoryLimitError

    predicted = types.SimpleNamespace(time_s=117.0, peak_bytes=108)
    limits = []

    def plan(*args, memory_limit_bytes, **kwargs):
        limits.append(memory_limit_bytes)
        return types.SimpleNamespace(prediction=predicted)

    monkeypatch.setattr(planner, "plan", plan)
    built = types.SimpleNamespace(context=contextlib.nullcontext, step=None, args=(), mesh=None,
                                  donate_argnums=(), in_shardings=None)  # fmt: skip
    row = {"recipe": "r", "strategy": "searched", "predicted_s": 117.0,
           "predicted_peak_bytes": 108, "memory_checks": [{"searched_limit": 100}]}  # fmt: skip
    assert planned_again(built, row).prediction is predicted and limits == [100]
    row["predicted_s"] = 116.0
    with pytest.raises(ValueError, match="measure the row again"):
        planned_again(built, row)

    def no_fit(*args, memory_limit_bytes, **kwargs):
        raise MemoryLimitError(memory_limit_bytes)

    monkeypatch.setattr(planner, "plan", no_fit)  # a plan no longer found: noted, not raised
    with pytest.raises(PlanChanged, match="no plan fits"):
        planned_again(built, row)


def test_a_search_is_replayed_with_the_compiles_its_row_recorded(monkeypatch):
    """The replay answers each compile of the memory check from the row (the plan's layout and
    predicted bytes) and records today's search seconds only where it finds the row's plan."""
    from experiments import code_replay as cr
    from experiments.recipe_rows import seconds as _seconds
    from planner.target import confirm

    def plan_of(peak, seconds):
        return types.SimpleNamespace(search_s=12.5, prediction=types.SimpleNamespace(
            time_s=seconds, peak_bytes=peak))  # fmt: skip

    answered = []

    def planned(built):  # a searched plan compiled over the limit, then the program's own layout
        first = confirm._compiled_check(plan_of(90, 2.0), 100, 95)
        yours = confirm._compiled_check(plan_of(80, 2.1), 100, 95, "yours")
        answered.append((first.compiled_bytes, yours.compiled_bytes))
        return plan_of(80, 2.1)

    monkeypatch.setattr(cr, "planned", planned)
    check = {"searched_limit": 100, "compile_s": 600.0, "compiled_limit": 95}
    checks = [{**check, "predicted_bytes": 90, "compiled_bytes": 99, "layout": "searched"},
              {**check, "predicted_bytes": 80, "compiled_bytes": 94, "layout": "yours"}]  # fmt: skip
    row = {"recipe": "r", "strategy": "searched", "predicted_s": 2.1, "predicted_peak_bytes": 80,
           "search_s": 600.0, "memory_checks": checks}  # fmt: skip
    unrecorded = {**row, "memory_checks": checks[1:]}  # the first compile is not the row's
    other_plan = {**row, "predicted_s": 2.2}
    recipe = {**row, "strategy": "recipe"}
    rows = [row, unrecorded, other_plan, recipe]
    assert cr.replay_search_rows("r", rows, lambda *a, **k: "built") == 1
    assert answered == [(99, 94), (99, 94)]
    assert row["search_s"] == 12.5 and row["search_s_measured"] == 600.0
    assert _seconds(row) == "12.5 (replayed; 600.0 measured)"
    assert "did not" in unrecorded["replay_note"] and unrecorded["search_s"] == 600.0
    assert "the row's (2.2, 80)" in other_plan["replay_note"] and other_plan["search_s"] == 600.0
    assert "replay_note" not in recipe and recipe["search_s"] == 600.0


def test_a_replayed_plan_the_memory_model_predicts_otherwise_now_takes_todays_bytes(monkeypatch):
    """The memory model changed since the row was measured: the search's compiles, of plans now
    predicted at other bytes, are answered by the row's checks in their order, and where the
    search ends at the row's plan (its seconds) the row's predicted bytes become today's."""
    from experiments import code_replay as cr
    from planner.target import confirm

    def plan_of(peak, seconds):
        return types.SimpleNamespace(search_s=12.5, prediction=types.SimpleNamespace(
            time_s=seconds, peak_bytes=peak))  # fmt: skip

    answered = []

    def planned(built):  # the first plan compiled over the limit, the second fits
        answered.append(confirm._compiled_check(plan_of(85, 2.0), 100, 95).compiled_bytes)
        answered.append(confirm._compiled_check(plan_of(75, 2.1), 90, 95).compiled_bytes)
        return plan_of(75, 2.1)

    monkeypatch.setattr(cr, "planned", planned)
    check = {"compile_s": 600.0, "compiled_limit": 95, "layout": "searched"}
    checks = [{**check, "searched_limit": 100, "predicted_bytes": 90, "compiled_bytes": 99},
              {**check, "searched_limit": 90, "predicted_bytes": 80, "compiled_bytes": 94}]  # fmt: skip
    row = {"recipe": "r", "strategy": "searched", "predicted_s": 2.1, "predicted_peak_bytes": 80,
           "search_s": 600.0, "memory_checks": checks}  # fmt: skip
    other = {**row, "predicted_s": 2.2}  # another plan: not re-predicted
    one_check = {**row, "memory_checks": checks[1:]}  # the search compiles more than the row did
    assert cr.replay_search_rows("r", [row, other, one_check], lambda *a, **k: "built") == 1
    assert answered[:2] == [99, 94]
    assert row["predicted_peak_bytes"] == 75 and row["predicted_peak_bytes_measured"] == 80
    assert other["predicted_peak_bytes"] == 80 and "the row's (2.2, 80)" in other["replay_note"]
    assert (
        "did not" in one_check["replay_note"] and "predicted_peak_bytes_measured" not in one_check
    )


def _variant(name, variant=None):
    """A recipe's step at ``variant``, as the replay's fakes know it: the variant itself."""
    return variant


def test_a_variant_search_is_replayed_variant_by_variant(monkeypatch):
    """Each variant the row planned is searched again (the chosen one under its memory check's
    limit, the others under the default; one whose plan was the searched row's takes that row's
    replay); today's sum replaces the row's seconds where the chosen variant finds the plan it
    found and no other is now faster. An unchosen variant finding a slower plan than the chosen
    takes today's figures; one finding a faster plan stops the replay."""
    from experiments import code_replay as cr

    predicted = {None: (3.0, 30), "a": (2.0, 60), "b": (2.5, 40)}
    limits = []

    def again(built, row, exact=True):
        limits.append((built, [c["searched_limit"] for c in row["memory_checks"]]))
        if exact and predicted[built][0] != row["predicted_s"]:
            raise cr.PlanChanged(f"{row['strategy']}: measure the row again")
        return types.SimpleNamespace(search_s=10.0, prediction=types.SimpleNamespace(
            time_s=predicted[built][0], peak_bytes=peaks[built]))  # fmt: skip

    monkeypatch.setattr(cr, "planned_again", again)
    peaks = {None: 30, "a": 60, "b": 40}
    tried = {"None": {"predicted_s": 3.0, "predicted_peak_bytes": 30},
             "a": {"predicted_s": 2.0, "predicted_peak_bytes": 60},
             "b": {"predicted_s": 2.5, "predicted_peak_bytes": 40},
             "c": {"error": "no plan fits"}}  # fmt: skip
    row = {"recipe": "r", "strategy": "searched_variants", "variant": "a", "variants": tried,
           "search_s": 400.0, "memory_checks": [{"searched_limit": 90}], "predicted_s": 2.0,
           "predicted_peak_bytes": 60}  # fmt: skip
    moved = {**row, "variants": {**tried, "b": {"predicted_s": 2.4, "predicted_peak_bytes": 41}}}
    lost = {**row, "variant": "b", "predicted_s": 2.5, "predicted_peak_bytes": 40,
            "variants": {**tried}}  # fmt: skip
    own = {**row, "variant": None}  # the recipe's own settings chosen: the searched row's
    peaks["a"] = 55  # the memory model changed since: the chosen variant's plan is leaner
    assert cr.replay_variant_rows("r", [row, moved, lost, own], _variant) == 2
    assert row["search_s"] == 30.0 and row["search_s_measured"] == 400.0
    assert row["predicted_peak_bytes"] == 55 and row["predicted_peak_bytes_measured"] == 60
    assert row["variants"]["a"]["predicted_peak_bytes"] == 55 and "predicted_peak_bytes" not in \
        row["variants"]["c"]  # fmt: skip
    assert limits[:3] == [(None, []), ("a", [90]), ("b", [])]
    # b, unchosen, now finds a plan at 2.5 s (the row had 2.4), still slower than a's 2.0
    assert moved["variants"]["b"] == {"predicted_s": 2.5, "predicted_peak_bytes": 40,
                                      "predicted_s_measured": 2.4,
                                      "predicted_peak_bytes_measured": 41}  # fmt: skip
    assert "replay_note" not in moved and moved["search_s"] == 30.0
    # chosen b, a unchosen is faster today (2.0 s): the row's choice no longer stands
    assert "searched_variants (a)" in lost["replay_note"] and lost["search_s"] == 400.0
    assert "search_s_measured" not in own

    # the own settings' plan taken from the searched row: its replay, not a search of its own
    limits.clear()
    searched = {"recipe": "r", "strategy": "searched", "predicted_s": 3.0,
                "predicted_peak_bytes": 28, "search_s": 5.0}  # fmt: skip
    mine = {"None": {**tried["None"], "from": "the searched row"}, "a": {**tried["a"]}}
    taken = {**row, "variants": mine, "search_s": 400.0}
    taken.pop("search_s_measured")
    assert cr.replay_variant_rows("r", [searched, taken], _variant) == 1
    assert limits == [("a", [90])] and taken["search_s"] == 15.0
    assert taken["variants"]["None"]["predicted_peak_bytes"] == 28
    # the searched row did not replay: the own settings searched again like any other variant
    limits.clear()
    unreplayed = {**taken, "variants": {k: dict(v) for k, v in mine.items()}}
    assert (
        cr.replay_variant_rows("r", [{**searched, "replay_note": "no"}, unreplayed], _variant) == 1
    )
    assert limits == [(None, []), ("a", [90])] and unreplayed["search_s"] == 20.0


def test_a_plan_compiled_again_to_the_same_program_keeps_its_rows_kernels():
    """Measured again, a plan whose compile repeats its previous row's (temporaries, collectives,
    kernels' bytes) is that program: the row's kernels' estimate is reused, also where the
    device's figure was judged otherwise; any difference, another strategy or another variant,
    or a row without the kernels' bytes, and the layers are compiled again."""
    from experiments.code_estimate import SAME_PROGRAM, kernels_compiled_before

    program = dict(zip(SAME_PROGRAM, (90, 2015, 59.7, 3.2e12), strict=True))
    old = {"recipe": "r", "strategy": "searched", "variant": None, **program, "estimate_s": 151.2,
           "compiled_bytes": 101}  # fmt: skip
    row = {"recipe": "r", "strategy": "searched", "variant": None, **program}
    assert kernels_compiled_before(row, [old]) == pytest.approx(151.2 - 59.7)
    rejudged = {**row, "compiled_bytes": 91}  # the same program's allocation, not its peak
    assert kernels_compiled_before(rejudged, [old]) == pytest.approx(151.2 - 59.7)
    for key, value in (("collectives", 2016), ("temp_bytes", 91), ("strategy", "recipe"),
                       ("variant", "tensor 2"), ("compiled_bytes_accessed", 3.3e12)):  # fmt: skip
        assert kernels_compiled_before({**row, key: value}, [old]) is None, key
    unestimated = {k: v for k, v in old.items() if k != "estimate_s"}
    assert kernels_compiled_before(row, [unestimated]) is None
    unrecorded = {k: v for k, v in old.items() if k != "compiled_bytes_accessed"}
    assert kernels_compiled_before(row, [unrecorded]) is None


def test_maxtexts_own_compile_measured_again_to_the_same_program_keeps_its_rows_kernels(
    monkeypatch,
):
    """A recipe row measured again (a new judge of the device's figure) whose compile repeats its
    previous row's program takes that row's kernels; a changed program compiles its layers."""
    import experiments.recipe_rows as recipe_rows
    import planner.cost.memory as memory
    import planner.target.compiled as compiled
    from experiments import code_estimate
    from experiments import maxtext_code as mc

    config = types.SimpleNamespace(num_decoder_layers=61, num_experts=256, first_num_dense_layers=3,
                                   remat_policy="custom")  # fmt: skip
    step = types.SimpleNamespace(mesh=types.SimpleNamespace(size=512), config=config,
                                 authors_compile=lambda: "lowered")  # fmt: skip
    program = dict(zip(code_estimate.SAME_PROGRAM, (90, 1892, 59.7, 3.2e12), strict=True))
    compiles = [dict(program, compiled_bytes=97), dict(program, collectives=1893)]
    layers = []
    monkeypatch.setattr(mc, "build", lambda name, variant=None: step)
    monkeypatch.setattr(mc, "model_tflops", lambda built: 6.0)
    monkeypatch.setattr(code_estimate, "kernels", lambda *a: layers.append(a) or 50.0)
    monkeypatch.setattr(memory, "default_calibration", lambda mesh: "cal")
    monkeypatch.setattr(compiled, "compile_and_report", lambda lowered: (None, None))
    monkeypatch.setattr(recipe_rows, "row_of", lambda *a: compiles.pop(0))
    name = "deepseek3_671b_v5p_1024"
    old = {"recipe": name, "strategy": "recipe", "variant": None, **program,
           "compiled_bytes": 101, "estimate_s": 115.6}  # fmt: skip
    run = types.SimpleNamespace(layer_estimate=True)
    (row,) = mc.measure_code(name, ["recipe"], set(), run, [old])
    assert row["compiled_bytes"] == 97 and row["estimate_s"] == pytest.approx(115.6)
    assert row["estimate_from"] == "the same program's kernels, compiled before" and not layers
    (row,) = mc.measure_code(name, ["recipe"], set(), run, [old])
    assert row["estimate_s"] == pytest.approx(50.0 + 59.7) and "estimate_from" not in row
    assert len(layers) == 1


def test_a_variant_search_takes_the_plan_of_the_recipes_own_step_searched_in_the_run(monkeypatch):
    """The recipe's own step (variant ``None``) is not planned again where the run's searched
    row planned it: its plan is a candidate as found, marked as the searched row's; each other
    variant is planned, and the fastest that fits is chosen."""
    from experiments import code_replay
    from experiments import maxtext_code as mc
    from planner.cost.memory import MemoryLimitError

    def plan(seconds, peak):
        return types.SimpleNamespace(prediction=types.SimpleNamespace(time_s=seconds,
                                                                      peak_bytes=peak),
                                     search_s=5.0)  # fmt: skip

    planned = []

    def planned_of(step):
        planned.append(step)
        if step == "b":
            raise MemoryLimitError(10, None)
        return plan(2.0, 60)

    monkeypatch.setitem(mc.CODE_RECIPES, "r", {"variants": {"a": {}, "b": {}}})
    monkeypatch.setattr(mc, "build", lambda name, variant=None: variant)
    monkeypatch.setattr(code_replay, "planned", planned_of)
    own = plan(3.0, 30)
    variant, best, step, tried, _ = mc._variant_search("r", "own step", own)
    assert planned == ["a", "b"] and (variant, step) == ("a", "a") and best is not own
    assert tried["None"] == {"predicted_s": 3.0, "predicted_peak_bytes": 30, "search_s": 5.0,
                             "from": "the searched row"}  # fmt: skip
    assert "error" in tried["b"]
    planned.clear()
    assert mc._variant_search("r", "own step")[3]["None"].get("from") is None
    assert planned == ["own step", "a", "b"]


def test_remeasured_rows_replace_the_previous_ones_and_see_them(monkeypatch, tmp_path):
    """``config.remeasure``: the named strategies' rows of the recipes run are measured again
    (their previous rows handed to the measurement) and replace them; other rows stay."""
    import json

    import ml_collections

    import experiments.maxtext_code as mc
    from experiments import recipes

    rows = [{"recipe": "qwen3_235b_v5p_512", "strategy": s, "v": 1, "estimate_before_s": 9.0}
            for s in ("recipe", "searched")]  # fmt: skip
    rows.append({"recipe": "llama2_7b_v5p_128", "strategy": "searched", "v": 1})
    (tmp_path / "code_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []

    def measure(name, strategies, done, config, previous=(), known=()):
        seen.append((name, sorted(done), [r["strategy"] for r in previous]))
        return [{"recipe": name, "strategy": s, "v": 2} for s in strategies
                if (name, s) not in done]  # fmt: skip

    monkeypatch.setattr(mc, "measure_code", measure)
    monkeypatch.setattr(mc, "report_code", lambda rows: "")
    config = ml_collections.ConfigDict({"source": "maxtext_code", "recipes": "qwen3_235b_v5p_512",
                                        "strategies": "recipe,searched", "remeasure": "searched"})  # fmt: skip
    out = recipes.run(config, str(tmp_path))
    assert seen == [("qwen3_235b_v5p_512", [("llama2_7b_v5p_128", "searched"),
                                            ("qwen3_235b_v5p_512", "recipe")], ["searched"])]  # fmt: skip
    on_disk = [json.loads(line) for line in (tmp_path / "code_results.jsonl").read_text().split("\n")
               if line]  # fmt: skip
    for got in (out, on_disk):
        assert sorted((r["recipe"], r["strategy"], r["v"]) for r in got) == [
            ("llama2_7b_v5p_128", "searched", 1), ("qwen3_235b_v5p_512", "recipe", 1),
            ("qwen3_235b_v5p_512", "searched", 2)]  # fmt: skip
        # the estimate an earlier re-estimate kept beside is carried to the row measured again
        assert all(r.get("estimate_before_s") == 9.0 for r in got if r["recipe"].startswith("q"))


def test_reestimated_rows_keep_their_previous_estimate_beside_the_new_one(monkeypatch, tmp_path):
    """``config.reestimate``: the named strategies' rows of the recipes run lose their estimate
    (kept as ``estimate_before_s``) and have it made again; other rows keep theirs."""
    import json

    import ml_collections

    import experiments.maxtext_code as mc
    from experiments import code_replay, recipes

    rows = [{"recipe": "deepseek3_671b_v5p_1024", "strategy": s, "estimate_s": 1.0, "mfu": 0.5,
             "compiled_collective_s": 0.5} for s in ("recipe", "searched")]  # fmt: skip
    rows.append({"recipe": "llama2_7b_v5p_128", "strategy": "searched", "estimate_s": 1.0})
    (tmp_path / "code_results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def estimate(name, rows, build):
        for r in rows:
            if r["recipe"] == name and "estimate_s" not in r:
                r["estimate_s"] = 2.0

    monkeypatch.setattr(mc, "measure_code", lambda *a, **k: [])
    monkeypatch.setattr(code_replay, "estimate_rows", estimate)
    monkeypatch.setattr(mc, "report_code", lambda rows: "")
    config = ml_collections.ConfigDict({"source": "maxtext_code", "strategies": "",
                                        "recipes": "deepseek3_671b_v5p_1024,llama2_7b_v5p_128",
                                        "reestimate": "searched"})  # fmt: skip
    recipes.run(config, str(tmp_path))
    got = {(r["recipe"], r["strategy"]): r for r in map(json.loads,
           (tmp_path / "code_results.jsonl").read_text().split("\n")[:-1])}  # fmt: skip
    again = got[("deepseek3_671b_v5p_1024", "searched")]
    assert (again["estimate_s"], again["estimate_before_s"], "mfu" in again) == (2.0, 1.0, False)
    assert got[("deepseek3_671b_v5p_1024", "recipe")]["estimate_s"] == 1.0
    assert got[("llama2_7b_v5p_128", "searched")]["estimate_s"] == 2.0
    assert "estimate_before_s" not in got[("deepseek3_671b_v5p_1024", "recipe")]


def test_a_variant_search_measured_again_takes_the_own_plan_from_the_searched_row(monkeypatch):
    """The own settings' plan in a variant search without the ``searched`` strategy is that
    row's, replayed (no compile); where it does not replay, or there is no such row, it is
    searched (None)."""
    from experiments import code_replay as cr

    plan = types.SimpleNamespace(prediction=types.SimpleNamespace(time_s=3.0, peak_bytes=30))
    replays = []

    def replayed(built, row):
        replays.append(row["strategy"])
        if row.get("changed"):
            raise cr.PlanChanged("another plan")
        return plan

    monkeypatch.setattr(cr, "replayed_plan", replayed)
    rows = [{"recipe": "r", "strategy": "recipe"},
            {"recipe": "r", "strategy": "searched", "predicted_s": 3.0},
            {"recipe": "q", "strategy": "searched", "predicted_s": 1.0}]  # fmt: skip
    assert cr.own_plan_replayed("r", "step", rows) is plan and replays == ["searched"]
    rows[1]["changed"] = True
    assert cr.own_plan_replayed("r", "step", rows) is None
    assert cr.own_plan_replayed("r", "step", rows[:1]) is None and len(replays) == 2


def test_on_its_own_plans_hand_nothing_of_maxtexts_over(monkeypatch):
    """``on_its_own`` plans the step with MaxText's constraints dropped and no input layouts to
    compare; ``searched`` hands MaxText's ``in_shardings`` over and keeps its constraints as
    hints."""
    import contextlib

    import planner
    from experiments import code_replay
    from experiments import maxtext_code as mc

    asked = []
    monkeypatch.setattr(planner, "plan", lambda *a, **kw: asked.append(kw))
    built = types.SimpleNamespace(step=None, args=(), mesh="mesh", donate_argnums=(0,),
                                  in_shardings="theirs", context=contextlib.nullcontext)  # fmt: skip
    code_replay.planned(built, on_its_own=True)
    code_replay.planned(built)
    assert asked[0] == {"mesh": "mesh", "donate_argnums": (0,), "constraints": "drop",
                        "compare": None}  # fmt: skip
    assert asked[1] == {"mesh": "mesh", "donate_argnums": (0,), "compare": "theirs"}
    assert "on_its_own" in mc.CODE_STRATEGIES
