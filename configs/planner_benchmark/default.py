"""Planner benchmark: workloads x strategies on 8 simulated CPU devices (a few minutes)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mesh = "a:2,b:2,c:2"
    # name=kind:sizes, ';'-separated. Kinds: mlp = L-layer MLP training step (batch x hidden x
    # layers); transformer = pre-norm blocks training step (batch x seq x heads x head_dim x
    # layers); moe = top-1 mixture-of-experts training step (tokens x d x experts x hidden);
    # matmul = tanh(x @ w) (m x k x n); attention = heads-splittable attention forward
    # (batch x seq x heads x head_dim); lm / lm_scan = flax nnx language-model training step with
    # adamw, layers as a loop / scanned (batch x seq x d x heads x layers x vocab). See
    # experiments/workloads.py.
    c.workloads = (
        "mlp_big_batch=mlp:1024x64x2;mlp_big_hidden=mlp:32x512x2;"
        "matmul_tall=matmul:8192x256x64;matmul_wide=matmul:64x256x8192;"
        "attention=attention:4x64x8x16;"
        "tf_many_tokens=transformer:16x64x8x16x1;tf_wide=transformer:8x16x8x64x1;"
        "moe=moe:512x64x8x256;"
        "lm=lm:8x32x64x4x2x256;lm_scan=lm_scan:8x32x64x4x2x256"
    )
    c.strategies = "replicated,data,fsdp,megatron,data_x_model,xla_propagation,auto,auto_memory"
    # auto_memory: the search under a memory limit of this fraction of the replicated program's
    # predicted peak per device.
    c.memory_limit_fraction = 0.3
    c.warmup = 2
    c.repeats = 7
    c.min_time_s = 0.3
    c.seed = 0
    c.figures = True
    return c
