"""The cost model's order of plans against the measured order (experiments/ranking.py): MaxText
0.2.5's tiny llama2-style step in float32 on its own 12-axis mesh (fsdp 4 x tensor 2), 8 CPU
devices; Python >= 3.12 with the libraries."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.case = "maxtext:float32:maxtext"  # or "lm", or another experiments/real_code.py case
    c.random_plans = 16  # beside the search's choice, the experts and the authors' layout
    c.seed = 0
    c.repeats = 9  # one step of every plan in turn, medians
    c.tolerance = 1e-5  # the second step's metrics, relative to the searched plan's
    return c
