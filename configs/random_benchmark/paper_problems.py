"""The paper's named problems (Fig. 13's P1-P4) at full size on {a:2, b:2, c:2}."""

from configs.random_benchmark import default


def get_config():
    c = default.get_config()
    c.problems = "P1,P2,P3,P4"
    return c
