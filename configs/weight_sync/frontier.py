"""Weight sync at frontier size (``experiments.frontier_sync``): Qwen3-235B-A22B and
DeepSeek-V3's parameters, MaxText-style training layout to vLLM-style serving layout on the same
v5p chips, compiled by the TPU compiler on this host (``--config.layouts=tunix``: MaxText RL's
trainer and vLLM sampler layouts, tunix's). Override e.g.
``--config.cases=qwen3_235b@v5p-128 --config.budget_gib=2``."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.cases = "qwen3_235b@v5p-1024,deepseek_v3@v5p-1024"  # model@topology
    c.budget_gib = 4.0  # bytes in flight per chip beyond the two trees (redist.buckets)
    # "vllm": MaxText-style training layout to vLLM-style serving layout (ep x tp); "tunix":
    # MaxText RL's trainer (fsdp x expert) and its vLLM sampler (data x tensor), see the runner
    c.layouts = "vllm"
    # tunix layouts only: the sampler's tensor parallelism (0: the smallest power of two whose
    # weights and KV cache fit in hbm_utilization of a chip), vLLM's share of HBM (MaxText's
    # rl.yml hbm_utilization_vllm), and the serving configuration whose KV cache is checked:
    # resident sequences per sampler replica (vLLM's max_num_seqs default) of kv_tokens tokens
    # (MaxText RL's kv_cache_size: max_target_length 1024 + kv_cache_buffer 256)
    c.rollout_tp = 0
    c.hbm_utilization = 0.72
    c.kv_sequences = 256
    c.kv_tokens = 1280
    return c
