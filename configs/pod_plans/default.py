"""Planning a pod from a laptop: the language-model family on v5p-64, v5p-256, v5p-4096 and
v6e-256, the planner's plan against the expert strategies, each compiled by the TPU compiler on
this host (minutes per plan on 2 cores; a rerun measures only missing rows)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.models = "lm_134m,lm_6.6b,llama_1b,llama_8b"  # experiments/pod_plans.py MODELS
    # topology@mesh axes; ";"-separated
    c.topologies = (
        "v5p:4x4x4@data:4,fsdp:4,tensor:4;v5p:4x8x8@data:2,fsdp:32,tensor:4;"
        "v6e:16x16@data:4,fsdp:16,tensor:4;v5p:16x16x16@data:16,fsdp:16,tensor:16"
    )
    c.strategies = "searched,data_parallel,fsdp,fsdp_tensor"
    c.remat_fallback = True  # where nothing fits: the model again, layers under jax.checkpoint
    c.layer_estimate = True  # kernels' time per layer from 1- and 2-layer compiles
    return c
