"""The transformation harness: random problems per mesh and axis kind."""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.problems_per_mesh = 6
    return c
