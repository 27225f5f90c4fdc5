"""Three tiny workloads and four strategies: what the tests run."""

from configs.planner_benchmark import default


def get_config():
    c = default.get_config()
    c.workloads = "mm=matmul:64x32x16;mlp=mlp:16x16x2;tf=transformer:8x8x2x4x1"
    c.strategies = "replicated,data,auto,auto_memory"
    c.warmup = 1
    c.repeats = 2
    c.min_time_s = 0.0
    c.memory_limit_fraction = 0.5
    c.figures = False
    return c
