"""The planner against MaxText's recipes (Llama 2 7B and 70B on v5p-128 = 64 chips, 70B on
v5p-512, Llama 3.1 8B on v6e-256 offloading to the host, Mixtral 8x7B on v5p-128): the recipe's
own layout, the same layout planned, the searched plan, and the searched plan with the planner's
choice of remat policy, each compiled by the TPU compiler on this host (minutes per row on 2
cores; a rerun measures only missing rows)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # experiments/recipes.py RECIPES
    c.recipes = (
        "llama2_7b_v5p_128,llama2_70b_v5p_128,llama2_70b_v5p_512,llama3_1_8b_v6e_256,"
        "mixtral_8x7b_v5p_128"
    )
    c.strategies = "recipe,recipe_planned,searched,searched_remat"
    # the policies searched_remat chooses among beside the recipe's own (MaxText's names)
    c.remat_candidates = "full,minimal,save_dot_except_mlpwi,save_dot_except_mlp,save_qkv_proj"
    # also the searched plan at these depths (layers cut), predicted against compiled, e.g.
    # "1,2,8,32" (depths.md); empty: none
    c.depths = ""
    c.layer_estimate = True  # kernels' time per layer from 1- and 2-layer compiles
    return c
