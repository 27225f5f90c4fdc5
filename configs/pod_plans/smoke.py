"""A tiny language model on v5p:2x2x1: the pod_plans pipeline end to end in a minute."""

from configs.pod_plans import default


def get_config():
    c = default.get_config()
    c.models = "lm_tiny"
    c.topologies = "v5p:2x2x1@data:1,fsdp:2,tensor:2"
    return c
