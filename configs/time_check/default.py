"""Time checked against the compiler: the flax language model on 256 TPU v5p chips (v5p:8x8x4 as
data:16, fsdp:4, tensor:4), the searched plan, hand baselines and random plans; each compiled by
the TPU compiler on this host (libtpu; about a minute per plan on 2 cores)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.topology = "v5p:8x8x4"
    c.mesh = "data:16,fsdp:4,tensor:4"
    c.calibration = "tpu_v5p"
    # batch x seq x d_model x heads x layers x vocab (experiments/language_model.py, scanned)
    c.lm = "256x512x512x8x4x8192"
    c.unroll = True  # compile with the layer scan unrolled: cost_analysis counts a loop body once
    c.searched = True
    c.baselines = "data_parallel,fsdp,fsdp_tensor,replicated,data,data_major,data_first"
    c.random_anchors = 30  # random points of the search's space (anchors' axes, propagated)
    c.random_ops = 0  # every op split at random (slow to compile: 10+ minutes each)
    c.seed = 0
    return c
