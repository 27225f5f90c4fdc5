"""A quick run of experiments/ranking.py (the tests run it): the flax language model, one
random plan, one round."""

from configs.ranking import default


def get_config():
    c = default.get_config()
    c.case = "lm"
    c.lm = "8x16x32x2x1x64"  # batch x sequence x width x heads x layers x vocabulary
    c.random_plans = 1
    c.repeats = 1
    return c
