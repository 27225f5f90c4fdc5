"""Weight sync: a Llama-like parameter pytree from FSDP training to tensor-parallel serving.

Override on the command line, e.g. ``--config.layers=2 --config.d_model=256``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "llama"  # or a frontier model shrunk: qwen3_235b, deepseek_v3 (frontier_small.py)
    c.memory_budget_kib = 0.0  # > 0: also redist_budget, eager within this budget per device
    c.vocab = 8192
    c.d_model = 512
    c.ffn = 1408  # SwiGLU hidden size (about 8/3 d_model, a multiple of 32)
    c.layers = 4
    c.dtype = "float32"
    c.train_mesh = "fsdp:8"  # axis:size over the 8 devices, in device order
    c.serve_mesh = "dp:2,tp:4"
    c.warmup = 2
    c.repeats = 7
    c.min_time_s = 0.5
    c.figures = True
    return c
