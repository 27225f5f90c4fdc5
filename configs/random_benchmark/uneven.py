"""The default benchmark's recipe with uneven extents: every dimension of a random problem is cut
by 1-7 elements, so most layouts split dimensions that their axes do not divide (XLA pads the last
tiles). Both programs run inside ``jit`` (JAX holds uneven arrays nowhere else) on the source's
padded array. Add ``--config.topology=v5p:2x2x2`` to compile both for TPU instead of timing.
"""

from configs.random_benchmark import default


def get_config():
    c = default.get_config()
    c.uneven = True
    return c
