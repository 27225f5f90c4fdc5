"""The recipes pipeline end to end on a shrunken Llama 2 70B structure on v5p:2x2x1 (a minute)."""

from configs.recipes import default


def get_config():
    c = default.get_config()
    c.recipes = "tiny_v5p_8"
    c.strategies = "recipe,recipe_planned,searched_remat"  # searched_remat runs the searched path
    c.remat_candidates = "full"  # a choice of two: the recipe's policy and full remat
    c.depths = "1"  # the depth sweep: the searched plan cut to one layer
    return c
