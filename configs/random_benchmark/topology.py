"""The paper's problems and random ones compiled for TPU v5p:2x2x2 by the TPU compiler (the
compiler runs on any host with libtpu: pip install "redist[tpu]"); memory and collectives only."""

from configs.random_benchmark import default


def get_config():
    c = default.get_config()
    c.topology = "v5p:2x2x2"
    c.problems = "P1,P2,P3,P4"
    c.figures = False
    return c
