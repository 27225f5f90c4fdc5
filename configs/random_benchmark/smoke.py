"""Three tiny problems: what the tests run."""

from configs.random_benchmark import default


def get_config():
    c = default.get_config()
    c.num_problems = 3
    c.min_mb = 0.01
    c.max_mb = 0.05
    c.warmup = 1
    c.repeats = 2
    c.figures = False
    return c
