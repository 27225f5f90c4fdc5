"""Smoke tests of the experiment runners on tiny configs."""

import importlib.util
import json
import os

import numpy as np
import pytest

from configs.random_benchmark import smoke
from experiments import paper_problems, random_benchmark


def test_random_benchmark_smoke(tmp_path):
    config = smoke.get_config()
    summary = random_benchmark.run(config, str(tmp_path))
    assert summary["problems"] == 3
    assert summary["ours_exact"] == 3 and summary["xla_exact"] == 3
    assert summary["ours_temp_over_bound_max"] <= 2.0 + 1e-3
    for name in ("config.json", "results.jsonl", "summary.json", "report.md"):
        assert os.path.getsize(tmp_path / name) > 0
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert len(rows) == 3 and all(r["speedup"] > 0 for r in rows)
    assert "Where we lose most" in (tmp_path / "report.md").read_text()


def test_random_benchmark_on_uneven_problems(tmp_path):
    config = smoke.get_config()
    config.uneven, config.repeats, config.num_problems = True, 1, 2
    summary = random_benchmark.run(config, str(tmp_path))
    assert summary["ours_exact"] == 2 and summary["xla_exact"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert all(r["uneven"] for r in rows)
    assert all(r["name"].startswith("u") for r in rows)


def test_named_problems_config():
    config = smoke.get_config()
    config.problems = "P2,ex4_9"
    config.scale = 0.25
    probs = random_benchmark.problems_of(config)
    assert [p.name for p in probs] == ["P2", "ex4_9"]
    assert probs[0].shape == (20, 20, 18, 16)


def test_paper_problems_side_by_side():
    text = paper_problems.describe("P2")
    assert "dynslice(" in text and "alltoall(" in text  # the plan (its lowering: by calibration)
    assert "redist collectives:" in text
    assert "XLA    collectives:" in text


def test_planner_benchmark_smoke(tmp_path):
    from configs.planner_benchmark import smoke as planner_smoke
    from experiments import planner_benchmark

    summary = planner_benchmark.run(planner_smoke.get_config(), str(tmp_path))
    assert summary["pairs"] == 12
    assert set(summary["workloads"]) == {"mm", "mlp", "tf"}
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in rows)
    assert all(r["max_error"] < 1e-4 for r in rows)  # against the unsharded program
    assert planner_benchmark.max_error([np.array([1.0, 2.0])], [np.array([1.0, 4.0])]) == 0.5
    assert [r["strategy"] for r in rows[:4]] == ["replicated", "data", "auto", "auto_memory"]
    limited = summary["workloads"]["mlp"]["auto_memory"]
    assert limited["predicted_peak_bytes"] <= limited["limit_bytes"]
    assert planner_benchmark.spearman([1, 2, 3], [10, 30, 20]) == 0.5
    assert "| mm | auto |" in (tmp_path / "report.md").read_text()


def test_memory_check_smoke(tmp_path):
    from configs.memory_check import smoke as memory_check_smoke
    from experiments import memory_check

    config = memory_check_smoke.get_config()
    config.tpu = False  # the TPU case has its own test (tests/planner/cost/test_buffers.py)
    config.gpu = False  # and the GPU cases theirs (tests/planner/target/test_gpu.py)
    summary = memory_check.run(config, str(tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert [(r["workload"], r["strategy"]) for r in rows] == [
        ("mlp", "auto"), ("mlp", "auto_donated"), ("mlp", "data"),
        ("lm", "auto"), ("lm", "auto_donated"), ("lm", "data"),
    ]  # fmt: skip
    assert all(r["compiled_bytes"] > 0 and r["ratio"] > 0 for r in rows)
    assert rows[1]["alias_bytes"] > 0  # the returned weights are written into the donated ones
    assert summary["cpu"]["all"]["cases"] == 6
    assert summary["cpu"]["planned"]["within_tolerance"] == 4
    report = (tmp_path / "report.md").read_text()
    assert "| cpu | lm | 8x16x32x2x2x64 | a:2,b:2,c:2 | auto |" in report


def test_search_scaling_smoke(tmp_path):
    from experiments import search_scaling

    meshes = [{"a": 2, "b": 2}, {"a": 4, "b": 4}]
    rows = search_scaling.run(["mlp:16x16"], [1, 2], meshes, 1000, str(tmp_path))
    assert [(r["layers"], r["devices"], r["method"]) for r in rows] == [
        (1, 4, "dp"), (1, 4, "greedy"), (1, 16, "dp"), (1, 16, "greedy"),
        (2, 4, "dp"), (2, 4, "greedy"), (2, 16, "dp"), (2, 16, "greedy"),
    ]  # fmt: skip
    assert all(r["search_s"] > 0 and r["predicted_s"] > 0 for r in rows)
    assert rows[4]["anchors"] == 2
    assert "| mlp 16x16 | 2 |" in (tmp_path / "report.md").read_text()


def test_weight_sync_smoke(tmp_path):
    from configs.weight_sync import default as ws_config
    from experiments import weight_sync

    config = ws_config.get_config()
    config.update(layers=1, d_model=64, ffn=128, vocab=256, repeats=1, warmup=0, min_time_s=0.0,
                  figures=False)  # fmt: skip
    result = weight_sync.run(config, str(tmp_path))
    for name in ("redist", "xla", "device_put"):
        assert result["methods"][name]["exact"] and result["methods"][name]["placed"], name
    assert "redist" in (tmp_path / "report.md").read_text()


def test_weight_sync_of_tunix_s_qwen3_against_tunix_s_own_sync(tmp_path):
    pytest.importorskip("tunix")
    from configs.weight_sync import tunix
    from experiments import weight_sync

    config = tunix.get_config()
    config.update(layers=1, d_model=64, ffn=128, vocab=64, repeats=1, warmup=0, min_time_s=0.0,
                  figures=False, memory_budget_kib=64.0, loop_steps=2, loop_rounds=1)  # fmt: skip
    result = weight_sync.run(config, str(tmp_path))
    for name in ("tunix", "redist", "redist_budget", "xla"):
        assert result["methods"][name]["exact"] and result["methods"][name]["placed"], name
    loop = result["loop"]
    assert loop["same_sampler_weights"] and loop["same_logps"] and loop["redist"]["syncs"] == 1
    assert "tunix's own GRPO loop" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("model", ["qwen3_235b", "deepseek_v3"])
def test_weight_sync_of_a_frontier_tree_shrunk_is_exact_within_its_budget(model, tmp_path):
    from configs.weight_sync import frontier_small
    from experiments import weight_sync

    config = frontier_small.get_config()
    config.update(model=model, repeats=1, warmup=0, min_time_s=0.0, figures=False)
    result = weight_sync.run(config, str(tmp_path))
    for name in ("redist", "xla", "device_put", "redist_budget"):
        assert result["methods"][name]["exact"] and result["methods"][name]["placed"], name
    assert result["budget_bytes"] == 3 * 2**20
    assert model in (tmp_path / "report.md").read_text()


def test_synthesis_scaling_smoke(tmp_path):
    from configs.synthesis_scaling import default as ss_config
    from experiments import synthesis_scaling

    config = ss_config.get_config()
    config.update(meshes="a:2,b:2,c:2;x:4,y:8,z:8", ranks="2,5", problems_per_cell=2,
                  figures=False)  # fmt: skip
    rows = synthesis_scaling.run(config, str(tmp_path))
    assert [(r["devices"], r["rank"]) for r in rows] == [(8, 2), (8, 5), (256, 2), (256, 5)]
    assert all(0 < r["p50_s"] <= r["max_s"] for r in rows)


def test_lowering_benchmark_smoke(tmp_path):
    from configs.lowering_benchmark import default as lowering
    from experiments import lowering_benchmark

    config = lowering.get_config()
    config.workloads = "mlp=mlp:16x16x2;attention=attention:2x8x2x4"
    config.repeats, config.warmup, config.min_time_s = 2, 1, 0.0
    summary = lowering_benchmark.run(config, str(tmp_path))
    assert set(summary) == {"xla", "xla again", "plan.jit", "explicit", "per-op"}
    assert summary["xla"]["geomean_over_xla"] == 1.0
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert len(rows) == 5 * 3  # mlp: auto and data; attention: auto (its batch does not split 8)
    assert all(r["measured_s"] > 0 for r in rows)


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the TPU compiler (libtpu) is not installed: pip install "redist[tpu]"',
)
def test_random_benchmark_compiles_for_a_tpu_topology(tmp_path):
    """Both sides compiled for v5p:2x2x2 (nothing runs): the paper's P2 at full size, whose plan
    (one all-to-all) needs less temporary memory than XLA's gather-then-slice (the README's
    figures; at a quarter size the plan is a permute and an all-gather, whose send buffer
    libtpu 0.0.50 counts as a temporary); and P3, where both sides make the same collectives and
    redist's all-to-all, written as XLA writes it, needs no more memory (it needed 1.15x when it
    split and concatenated inner dimensions). P3 at a quarter size: the same plan (a slice, an
    all-to-all and a permute) and the same collectives on both sides as at full size, compiled
    in a third of the time (P2's compile is most of this test)."""
    config = smoke.get_config()
    config.topology, config.problems, config.scale = "v5p:2x2x2", "P2", 1.0
    summary = random_benchmark.run(config, str(tmp_path / "P2"))
    assert summary["topology"] == "v5p:2x2x2" and summary["problems"] == 1
    (row,) = [json.loads(line) for line in open(tmp_path / "P2" / "results.jsonl")]
    assert row["ours"]["temp_bytes"] < row["xla"]["temp_bytes"]
    assert row["ours"]["collectives"] and row["xla"]["collectives"]
    assert "TPU compiler" in (tmp_path / "P2" / "report.md").read_text()
    config.problems, config.scale = "P3", 0.25
    assert random_benchmark.run(config, str(tmp_path / "P3"))["problems"] == 1
    (same,) = [json.loads(line) for line in open(tmp_path / "P3" / "results.jsonl")]
    assert same["plan_kinds"] == ["dynslice", "alltoall", "allpermute"], same
    assert [c[0] for c in same["ours"]["collectives"]] == [c[0] for c in same["xla"]["collectives"]]
    assert same["ours"]["temp_bytes"] <= 1.01 * same["xla"]["temp_bytes"], same


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the TPU compiler (libtpu) is not installed: pip install "redist[tpu]"',
)
def test_time_check_compiles_plans_and_ranks_them(tmp_path):
    """A tiny language model on v5p:2x2x1: the searched plan, replication and a random plan,
    compiled and ranked; a rerun compiles nothing new."""
    from configs.time_check import default as time_check_config
    from experiments import time_check

    config = time_check_config.get_config()
    # one layer (the scan and its unrolled twin still checked op for op: the unrolled program is
    # what compiles); seed 1's random plan compiles in about 60 % of the time of seed 0's
    config.topology, config.mesh, config.lm = "v5p:2x2x1", "data:2,tensor:2", "8x32x64x4x1x128"
    config.baselines, config.random_anchors, config.random_ops = "replicated", 1, 0
    config.seed = 1
    summary = time_check.run(config, str(tmp_path))
    assert summary["plans"] == 3 and summary["flops_within_10pct"] == 3
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert {r["kind"] for r in rows} == {"searched", "baseline", "random_anchors"}
    assert all(r["compiled_s"] > 0 and r["predicted_s"] > 0 for r in rows)
    assert "Spearman" in (tmp_path / "report.md").read_text()
    start = os.path.getmtime(tmp_path / "compiled.jsonl")
    assert time_check.run(config, str(tmp_path))["plans"] == 3
    assert os.path.getmtime(tmp_path / "compiled.jsonl") == start  # nothing compiled again


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the TPU compiler (libtpu) is not installed: pip install "redist[tpu]"',
)
def test_pod_plans_compares_the_plan_with_experts_on_a_topology(tmp_path):
    """A tiny language model on v5p:2x2x1: the searched plan and FSDP + tensor parallelism,
    compiled and compared; the plan kept; a rerun measures nothing new."""
    from configs.pod_plans import smoke as pod_plans_smoke
    from experiments import pod_plans

    config = pod_plans_smoke.get_config()
    config.strategies = "searched,fsdp_tensor"
    config.layer_estimate = False  # (the next test checks the per-layer estimate)
    summary = pod_plans.run(config, str(tmp_path))
    case = summary["lm_tiny @ v5p:2x2x1"]
    assert case["searched_fits"] and case["best_expert"] == "fsdp_tensor"
    assert case["searched_over_best_expert"] > 0
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert [r["strategy"] for r in rows] == ["searched", "fsdp_tensor"]
    for r in rows:
        assert r["fits"] and r["compiled_bytes"] > 0 and r["predicted_peak_bytes"] > 0
        assert r["estimate_s"] == r["compiled_optimal_s"] + r["compiled_collective_s"] > 0
    assert "| lm_tiny |" in (tmp_path / "report.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:  # (the figures extra)
        assert os.path.getsize(tmp_path / "pod_plans.png") > 0
    saved = tmp_path / "plans" / "lm_tiny@v5p_2x2x1.plan.json"
    assert json.loads(saved.read_text())["schedule"]
    assert "Plan for step" in (tmp_path / "plans" / "lm_tiny@v5p_2x2x1.txt").read_text()
    pod_plans.run(config, str(tmp_path))
    assert len(open(tmp_path / "results.jsonl").readlines()) == 2


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the TPU compiler (libtpu) is not installed: pip install "redist[tpu]"',
)
def test_per_layer_estimate_extrapolates_to_a_deeper_model():
    """The kernels' time of 3 layers from 1- and 2-layer compiles, against 3 layers unrolled and
    compiled: within 10%."""
    import planner
    from experiments import pod_plans
    from planner.baselines import expert_plans
    from planner.target.compiled import input_structs

    mesh = planner.topology_mesh("v5p:2x2x1", {"data": 1, "fsdp": 2, "tensor": 2})
    step, args = pod_plans.build("lm_tiny", 3, unroll=True)
    plan = expert_plans(step, *args, mesh=mesh)["fsdp_tensor"]
    compiled = plan.jit().lower(*input_structs(plan)).compile()
    whole = compiled.cost_analysis()["optimal_seconds"]
    estimate = pod_plans._layer_optimal(plan, "lm_tiny", 3, mesh, plan.calibration)
    assert estimate is not None and 0.9 <= estimate / whole <= 1.1


def test_pod_plans_measures_the_model_with_remat_where_nothing_fits(tmp_path, monkeypatch):
    """``+remat`` builds the model with its scanned layers under ``jax.checkpoint``; where the
    searched plan does not fit, ``remat_fallback`` measures that model on the topology too."""
    import jax

    from configs.pod_plans import smoke as pod_plans_smoke
    from experiments import pod_plans

    def forward_outputs(model):  # the forward scan's carry and the residuals it stacks
        step, args = pod_plans.build(model)
        jaxpr = jax.make_jaxpr(step)(*args).jaxpr
        return len(next(e for e in jaxpr.eqns if e.primitive.name == "scan").outvars)

    assert forward_outputs("lm_tiny+remat") < forward_outputs("lm_tiny") // 4
    with pytest.raises(ValueError, match="optionally \\+remat"):
        pod_plans.build("lm_huge")

    asked = []

    def measure(model, topology, axes, strategies, done, config, workdir):
        asked.append(model)
        yield {"model": model, "topology": topology, "strategy": "searched", "search_s": 1.0,
               "fits": model.endswith("+remat"), "parameters": 1, "mesh": "", "devices": 4}  # fmt: skip

    monkeypatch.setattr(pod_plans, "measure", measure)
    monkeypatch.setattr(pod_plans, "figure", lambda rows, path: None)
    config = pod_plans_smoke.get_config()
    summary = pod_plans.run(config, str(tmp_path))
    assert asked == ["lm_tiny", "lm_tiny+remat"]
    assert summary["lm_tiny+remat @ v5p:2x2x1"]["searched_fits"]
    config.remat_fallback = False
    asked.clear()
    pod_plans.run(config, str(tmp_path / "off"))
    assert asked == ["lm_tiny"]


def test_pipeline_search_smoke(tmp_path):
    """DistIR's grid on a small MLP, with planner.plan of the scanned model on every mesh: the
    planner's best plan is at least as fast as the best pure data, tensor and pipeline
    strategy the grid prices."""
    from configs.pipeline_search import default as ps_config
    from experiments import pipeline_search

    config = ps_config.get_config()
    # two layers: pipelines of 2 stages (the grid's 4 and 8 took the same path), a choice of two
    # microbatch counts
    config.update(models="mlp_tiny=2x1024x4096", microbatches="2,4")
    summary = pipeline_search.run(config, str(tmp_path))["mlp_tiny"]
    assert summary["planner"] is not None and summary["planner"]["fits"]
    for kind in ("data", "tensor", "pipeline"):
        if summary[kind] is not None:
            assert summary["planner"]["throughput"] >= summary[kind]["throughput"], kind
    assert "planner.plan, best mesh" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_calibrate_on_one_device_measures_rates_and_borrows_collectives(tmp_path):
    """A collective over one device moves no bytes: compute and memory rates are measured there,
    and the collectives' figures come from the shipped calibration, as the log says."""
    import subprocess
    import sys

    from redist.calibration import Calibration

    out = tmp_path / "one.json"
    # the tests' XLA flags but their 8 devices (cheaper compiles; the runner asks for its own
    # count): the measuring path is the same at any optimisation level, and at one timed round
    # (after the runner's two warm-up calls) as at more
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count=")]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    run = subprocess.run(
        [sys.executable, "-m", "experiments.calibrate", "--devices=1", "--repeats=1", f"--out={out}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "collectives need two or more devices" in run.stderr
    cal = Calibration.from_json(out.read_text())
    assert cal.flops_per_s > 0 and cal.copy_bytes_per_s > 0
    assert cal.bytes_per_s == Calibration.named("cpu").bytes_per_s
    assert set(cal.dense_flops_per_s) == {"float32", "float32:highest", "bfloat16"}
    assert set(cal.dense_half_flops) == set(cal.dense_flops_per_s)
    assert all(h >= 0 for h in cal.dense_half_flops.values())
    assert cal.dense_rate("float32") == cal.flops_per_s and cal.dense_rate("bfloat16") > 0


def test_hockney_recovers_a_rate_and_half_size_from_two_timings():
    """Times made from r_inf = 2e10, n_1/2 = 3e6 and a fixed 40 us give those back; a larger
    run that is not slower (noise) gives its own rate and no size effect."""
    from experiments.calibrate import hockney

    flops = (2.0 * 128**3, 2.0 * 512**3)
    times = tuple(40e-6 + (f + 3e6) / 2e10 for f in flops)
    rate, half = hockney(flops, times, overhead=40e-6)
    assert np.isclose(rate, 2e10) and np.isclose(half, 3e6)
    assert hockney(flops, (1e-3, 1e-3)) == (flops[1] / 1e-3, 0.0)


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the TPU compiler (libtpu) is not installed: pip install "redist[tpu]"',
)
def test_recipes_compiles_the_recipe_and_the_plans_on_its_topology(tmp_path):
    """A shrunken Llama 2 70B structure on v5p:2x2x1: MaxText's layout (GSPMD with its
    constraints), the same layout planned and the searched plan with the planner's choice of remat
    policy, compiled; a rerun adds nothing."""
    from configs.recipes import smoke as recipes_smoke
    from experiments import recipes

    config = recipes_smoke.get_config()
    rows = recipes.run(config, str(tmp_path))
    assert [r["strategy"] for r in rows] == ["recipe", "recipe_planned", "searched_remat"]
    candidates = rows[2]["remat_candidates"]  # the recipe's own policy and the others
    assert set(candidates) == {recipes.RECIPES["tiny_v5p_8"]["remat"], "full"}
    fitting = {n: c[0] for n, c in candidates.items() if c is not None}
    assert rows[2]["remat"] in fitting and fitting[rows[2]["remat"]] == min(fitting.values())
    for r in rows:
        assert r["fits"] and r["compiled_bytes"] > 0 and r["estimate_s"] > 0, r
    assert "predicted_peak_bytes" not in rows[0]
    assert all(r["predicted_peak_bytes"] > 0 for r in rows[1:])
    assert rows[0]["collectives"] > 0  # the recipe is sharded: FSDP gathers its weights
    table = (tmp_path / "report.md").read_text()
    assert "| tiny_v5p_8 | recipe | " in table and "1.00x" in table
    (swept,) = [json.loads(line) for line in open(tmp_path / "depths.jsonl")]
    assert swept["layers"] == 1 and swept["compiled_bytes"] > 0
    assert swept["predicted_peak_bytes"] > 0
    assert "| tiny_v5p_8 | 1 | " in (tmp_path / "depths.md").read_text()
    assert len(recipes.run(config, str(tmp_path))) == 3
    assert len(open(tmp_path / "results.jsonl").readlines()) == 3
    assert len(open(tmp_path / "depths.jsonl").readlines()) == 1  # a rerun adds no depth


def test_gpu_check_measures_here_and_compares_with_the_recorded_h100(tmp_path):
    """The measuring path (what a GPU run takes) on this machine's device with its own
    calibration, and the H100 calibration against the figures recorded on an H100."""
    from configs.gpu_check import default as gpu_check
    from configs.gpu_check import smoke as gpu_check_smoke
    from experiments import gpu_check as check

    summary = check.run(gpu_check_smoke.get_config(), str(tmp_path / "here"))
    rows = [json.loads(line) for line in open(tmp_path / "here" / "results.jsonl")]
    assert summary["workloads"] == 2 and summary["against"] == "cpu"
    assert all(r["measured_ms"] > 0 and r["compiled_mib"] > 0 for r in rows)
    recorded = gpu_check.get_config()
    # XLA:GPU's compile of three small ones (results/gpu_check compiles all ten)
    recorded.compile_here = "matmul,mlp,attention"
    summary = check.run(recorded, str(tmp_path / "recorded"))
    rows = [json.loads(line) for line in open(tmp_path / "recorded" / "results.jsonl")]
    assert all(r["source"].startswith("recorded") for r in rows)
    assert [r["measured_ms"] for r in rows[:3]] == [3.20, 5.72, 3.87]
    # the H100 file against what the H100 measured: time within the targets, memory
    # within 25 % on all (unrolled llama with XLA:GPU's cheap float math and inlined scans)
    assert 0.85 <= summary["time_ratio_geomean"] <= 1.15, summary
    assert summary["time_within_0.6_1.6"] == summary["workloads"] == 10, summary
    assert summary["spearman_time"] >= 0.95, summary
    assert summary["memory_within_25pct"] == summary["memory_workloads"] == 9, summary
    assert all(0.75 <= r["memory_ratio"] <= 1.25 for r in rows if r["compiled_mib"]), rows
    assert all(0.6 <= r["time_ratio"] <= 1.6 for r in rows), rows
    assert "recorded on an H100" in (tmp_path / "recorded" / "report.md").read_text()
    if check.compile_only_device(gpu_check.get_config()) is not None:  # XLA:GPU installed
        assert summary["memory_within_25pct_compiled_here"] == 3, summary  # every one compiled
        assert summary["memory_workloads_compiled_here"] == 3, summary
        assert all(0.75 <= r["memory_ratio_here"] <= 1.25 for r in rows if "memory_ratio_here" in r)


def test_real_code_report_lists_each_compiled_ranking():
    """The committed ranked rows (``results/real_code/ranked/``): the report has a line per case
    planned with ``rank_by="compiled"``, each candidate in it, the returned one starred."""
    from experiments import real_code

    path = os.path.join(os.path.dirname(__file__), "../../results/real_code/ranked/results.json")
    with open(path) as f:
        rows = json.load(f)
    lines = real_code.ranking_lines(rows)
    ranked = [r for r in rows if r.get("compiled_ranking")]
    assert ranked and len(lines) == 5 + len(ranked)
    for row, line in zip(ranked, lines[5:]):
        chosen = [c["label"] for c in row["compiled_ranking"] if c["chosen"]]
        assert len(chosen) == 1 and f"*{chosen[0]} " in line
        assert line.count(";") == len(row["compiled_ranking"]) - 1
    assert real_code.ranking_lines([{**r, "compiled_ranking": []} for r in rows]) == []
