"""MaxText's own training step at its recipes' full size (``experiments.maxtext_code``): MaxText's
ahead-of-time compile of each recipe against the planner's plan of the same step, both compiled
by the TPU compiler for the recipe's topology (minutes to an hour per recipe on 2 cores; a rerun
measures only missing rows). Needs Python >= 3.12 with MaxText and libtpu."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.source = "maxtext_code"
    # experiments/maxtext_code.py CODE_RECIPES
    c.recipes = "llama2_7b_v5p_128,llama2_70b_v5p_512"
    # the variant strategies run for recipes with variants only (Qwen3-235B's expert and tensor
    # parallelism); "on_its_own" (not run by default: results/recipes has no such rows yet) adds
    # the plan searched with nothing of MaxText's handed over (constraints dropped, no layouts)
    c.strategies = "recipe,searched,searched_variants,recipe_at_variant"
    c.depths = ""
    c.layer_estimate = True  # kernels' time per layer from 1- and 2-layer compiles
    # the estimate of compiled rows that have none (measured without it), added in place
    c.fill_estimates = False
    # strategies (of any names) whose rows of config.recipes have their estimate made again, the
    # previous one kept as estimate_before_s (after a change in how the layers are compiled)
    c.reestimate = ""
    # the searched rows' searches (and each variant's of the searched_variants rows) replayed on
    # today's planner, their compiles answered by what the rows recorded: the search seconds
    # measured again, without compiling
    c.replay_search = False
    # strategies (of config.strategies' names) whose rows of config.recipes are measured again,
    # replacing them; a plan whose compile repeats its previous row's takes that row's kernels'
    # estimate rather than compiling its layers again
    c.remeasure = ""
    return c
