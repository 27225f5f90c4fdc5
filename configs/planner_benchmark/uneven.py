"""A GPT-2-sized language model (d 768, 12 heads, vocabulary 50,257: no power of two divides it)
on 8 simulated CPU devices: the search with and without the splits only XLA's partitioner runs
(``auto`` / ``auto_even``: the vocabulary split into padded tiles, the cross-entropy's lookup
masked), against data parallelism and FSDP (a few minutes)."""

from configs.planner_benchmark import default


def get_config():
    c = default.get_config()
    c.mesh = "data:8"
    c.workloads = "gpt2_2l=lm_scan:8x256x768x12x2x50257"
    c.strategies = "data,fsdp,auto_even,auto"
    c.warmup = 1
    c.repeats = 3
    c.min_time_s = 0.0
    c.figures = False
    return c
