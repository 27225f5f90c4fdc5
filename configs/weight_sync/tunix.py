"""Weight sync in tunix: tunix's own Qwen3 from its trainer's FSDP mesh to its sampler's mesh.

``--config.disjoint=True``: the trainer on 4 devices, the sampler on the other 4;
``--config.experts=8``: Qwen3's mixture of experts.
"""

from configs.weight_sync import default


def get_config():
    c = default.get_config()
    c.model = "tunix_qwen3"
    c.vocab = 8192
    c.d_model = 256
    c.ffn = 768
    c.heads = 4
    c.layers = 4
    c.experts = 0
    c.disjoint = False
    c.train_mesh = "fsdp:8,tp:1"  # tunix's axis names; 4 devices each where disjoint
    c.serve_mesh = "fsdp:2,tp:4"  # the sampler's data x tensor
    c.memory_budget_kib = 4096.0
    c.loop_steps = 4  # > 0: also tunix's GRPO loop with each sync, its syncs timed
    c.loop_rounds = 2  # runs of the loop with each sync, alternately
    return c
