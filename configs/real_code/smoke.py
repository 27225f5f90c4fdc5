"""A quick run of experiments/real_code.py (the tests run it): MaxText's step on its own mesh,
keras-hub's and gemma's, float32 (MaxText's ring of experts in bfloat16), not timed."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.cases = (
        "maxtext:float32:maxtext:authors+none,maxtext_deepseek3:float32:maxtext,maxtext_qwen3:float32:maxtext,"
        "maxtext_qwen3sparse:float32:maxtext,"
        # in bfloat16: MaxText's reference ragged gather-reduce returns bfloat16 whatever it gets
        "maxtext_qwen3ring:bfloat16:maxtext,"
        "keras:float32:2axis:authors+none,"
        "gemma:float32:2axis"
    )
    c.given_layout = "authors"  # and, where a case says so, on its own ("none")
    c.repeats = 0
    return c
