"""Weight sync of a frontier model's tree shrunk to 8 CPU devices: MaxText's ``fsdp:4 x
expert:2`` training layout to vLLM's ``ep:4 x tp:2`` serving layout, timed against XLA and
``jax.device_put``, and eagerly within a memory budget.

Override on the command line, e.g. ``--config.model=deepseek_v3``.
"""

from configs.weight_sync.default import get_config as default


def get_config():
    c = default()
    c.model = "qwen3_235b"  # or deepseek_v3 (experiments.frontier_weights.SHRUNK)
    c.train_mesh = "fsdp:4,expert:2"
    c.serve_mesh = "ep:4,tp:2"
    c.memory_budget_kib = 3072.0  # the embedding: 2.5 MiB in flight, no dimension left unsplit
    return c
