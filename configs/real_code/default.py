"""The planner on the code people run (experiments/real_code.py): MaxText 0.2.5's own llama2-style
step (tiny) in float32 and bfloat16 on MaxText's 12-axis mesh and on a 2-axis one, keras-hub's
Llama and gemma's Gemma 3 (tiny) on the 2-axis one, each against its authors' layout, planned
handed that layout and on its own."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.cases = ",".join([
        "maxtext:float32:maxtext", "maxtext:float32:2axis",
        "maxtext:bfloat16:maxtext", "maxtext:bfloat16:2axis",
        "keras:float32:2axis", "keras:bfloat16:2axis",
        "gemma:float32:2axis", "gemma:bfloat16:2axis",
    ])  # fmt: skip
    c.given_layout = "authors,none"  # handed the authors' layout, and on its own
    c.repeats = 7  # one step of each program in turn, medians
    c.rank_by = "model"  # or "compiled": the compiler ranks the best candidates
    return c
