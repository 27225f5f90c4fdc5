"""The committed benchmark rows are today's: every row of the redistribution benchmarks in
``results/`` records the plan (its steps and bytes) that today's code makes for its problem, so
that a change to the search or a calibration cannot leave the README quoting plans no longer
made. Regenerate with ``python -m experiments.results --only=<folder>``. Pure: no devices."""

import json
import pathlib

import pytest
from jax.sharding import PartitionSpec

import redist

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "results"
FOLDERS = sorted(
    p.name
    for p in RESULTS.iterdir()
    if (p / "results.jsonl").exists() and p.name.startswith(("random_", "topology_"))
)


def cost_model(config: dict) -> str:
    """The model the folder's run planned with: ``auto`` resolved as on its devices (the CPU's
    here, a topology's own calibration where it compiled for one)."""
    topology = config.get("topology", "")
    if config["cost_model"] not in ("auto", "calibrated"):
        return config["cost_model"]
    if topology.startswith("gpu:"):
        return f"calibrated:{topology.partition(':')[2]}"
    if topology:
        return f"calibrated:tpu_{topology.partition(':')[0]}"
    return "calibrated:cpu"


def test_every_benchmark_folder_is_checked():
    assert {"random_benchmark", "random_uneven", "topology_random"} <= set(FOLDERS), FOLDERS


@pytest.mark.parametrize("folder", FOLDERS)
def test_committed_rows_record_the_plans_made_today(folder):
    config = json.loads((RESULTS / folder / "config.json").read_text())
    model = cost_model(config)
    rows = [json.loads(line) for line in (RESULTS / folder / "results.jsonl").open()]
    stale = []
    for row in rows:
        src, dst = (eval(row[k], {"P": PartitionSpec}) for k in ("src", "dst"))
        plan = redist.plan(tuple(row["shape"]), src, dst, row["mesh"], row.get("dtype", "float32"),
                           cost_model=model)  # fmt: skip
        recorded = (tuple(row["plan_kinds"]), row.get("plan_cost_bytes", plan.cost_bytes))
        if (plan.kinds, plan.cost_bytes) != recorded:
            stale.append(
                f"{row['name']}: {recorded} recorded, {(plan.kinds, plan.cost_bytes)} today"
            )
    assert not stale, (
        f"{folder} is stale (python -m experiments.results --only={folder}):\n" + "\n".join(stale)
    )
