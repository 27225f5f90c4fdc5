"""Weight sync at frontier size (``experiments.frontier_sync``): Qwen3-235B-A22B and
DeepSeek-V3's parameters, MaxText-style training layout to vLLM-style serving layout on the same
v5p chips, compiled by the TPU compiler on this host. Override e.g.
``--config.cases=qwen3_235b@v5p-128 --config.budget_gib=2``."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.cases = "qwen3_235b@v5p-1024,deepseek_v3@v5p-1024"  # model@topology
    c.budget_gib = 4.0  # bytes in flight per chip beyond the two trees (redist.buckets)
    return c
