"""Spatial partitioning against batch and channel splits: two 256x256 images through the
training steps of a 3x3 convolutional network and of one with depthwise convolutions, max and
average pools, on 8 simulated CPU devices (the batch splits only 2 ways)."""

from configs.planner_benchmark import default


def get_config():
    c = default.get_config()
    c.workloads = "convnet_2_images=convnet:2x256x16x2;convpool_2_images=convpool:2x256x16x2"
    c.strategies = "replicated,batch_x_channels,batch_x_rows,xla_propagation,auto"
    return c
