"""The planner against MaxText's v5p recipes (Llama 2 7B and 70B on v5p-128, 64 chips): the
recipe's own layout, the same layout planned, and the searched plan, each compiled by the TPU
compiler on this host (minutes per row on 2 cores; a rerun measures only missing rows)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.recipes = "llama2_7b_v5p_128,llama2_70b_v5p_128"  # experiments/recipes.py RECIPES
    c.strategies = "recipe,recipe_planned,searched"
    c.layer_estimate = True  # kernels' time per layer from 1- and 2-layer compiles
    return c
