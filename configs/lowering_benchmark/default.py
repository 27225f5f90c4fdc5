"""Lowering benchmark: the planner-benchmark workloads, each plan run four ways (a few minutes)."""

import ml_collections

from configs.planner_benchmark import default as planner_benchmark


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mesh = "a:2,b:2,c:2"
    c.workloads = planner_benchmark.get_config().workloads  # name=kind:sizes, ';'-separated
    c.schedules = "auto,data"  # the searched plan; plain data parallelism for reference
    c.warmup = 2
    c.repeats = 9
    c.min_time_s = 0.5
    c.seed = 0
    return c
