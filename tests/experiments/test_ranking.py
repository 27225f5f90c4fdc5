"""experiments/ranking.py: the cost model's order of plans against the measured order."""

import json
import math

import pytest

from configs.ranking import smoke
from experiments import ranking


def test_ranking_smoke_measures_every_plan_it_checked(tmp_path):
    """The search's choice, the three experts and the random plans, each compiled, computing the
    searched plan's step (the runner raises otherwise) and timed; the summary ranks them all."""
    config = smoke.get_config()
    summary = ranking.run(config, str(tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    names = [r["plan"] for r in rows]
    assert names[0] == "searched" and {"data_parallel", "fsdp", "fsdp_tensor"} <= set(names)
    assert sum(n.startswith("random_") for n in names) == config.random_plans
    assert len(set(names)) == len(names) == summary["plans"]
    for r in rows:
        assert r["difference"] <= config.tolerance, r
        assert r["measured_s"] > 0 and r["compiled_mib"] > 0 and r["predicted_s"] > 0
        assert r["compiled_priced_s"] > 0
    assert summary["pairs"] == summary["compiled_pairs"] == len(rows) * (len(rows) - 1) // 2
    assert -1 <= summary["spearman"] <= 1 and -1 <= summary["compiled_spearman"] <= 1
    assert f"{len(rows)} plans" in (tmp_path / "report.md").read_text()


def test_the_summary_compares_every_pair_of_plans():
    rows = [{"predicted_s": p, "measured_s": m} for p, m in ((1, 2), (2, 4), (3, 3), (4, 9))]
    s = ranking.summarize(rows)
    assert s["plans"] == 4 and s["pairs"] == 6
    assert s["spearman"] == pytest.approx(0.8)  # one swap: the third plan runs before the second
    # the last two: 3 / 4 predicted against 3 / 9 measured, 2.25x off; three pairs within 25 %
    # (1.0, 1.125, 1.125), three not (2.0, 2.0, 2.25)
    assert s["worst_pair_ratio"] == pytest.approx(2.25)
    assert s["pairs_within_25pct"] == 0.5
    assert math.isnan(ranking.summarize(rows[:1])["worst_pair_ratio"])
    assert "compiled_spearman" not in s  # no compiled prices in the rows
    priced = [{**r, "compiled_priced_s": r["measured_s"] * 2} for r in rows]  # the measured order
    s = ranking.summarize(priced)
    assert s["compiled_spearman"] == pytest.approx(1.0) and s["compiled_worst_pair_ratio"] == 1.0
