"""Disaggregated weight sync (two processes x four CPU devices): a frontier model's shrunk tree
from the trainer's ``fsdp:2 x expert:2`` on process 0 to the server's ``ep:2 x tp:2`` on process 1.

Override on the command line, e.g. ``--config.model=deepseek_v3``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "qwen3_235b"  # or deepseek_v3 (experiments.frontier_weights.SHRUNK)
    c.dtype = "float32"
    c.train_mesh = "fsdp:2,expert:2"  # process 0's four devices, in device order
    c.serve_mesh = "ep:2,tp:2"  # process 1's four devices
    c.memory_budget_kib = 6144.0  # in flight per device: the embedding's move is 5 MiB
    c.warmup = 2
    c.repeats = 7
    return c
