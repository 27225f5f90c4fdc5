"""The paper's §8 experiment: 1000 random problems of 64-800 MB on the mesh {a:2, b:2, c:2}.

Not yet run on a 2-core machine. Estimate from the default config (60 problems of 4-64 MB in
~75 s): a few hours. Host memory: the input, both outputs and XLA's replicate-then-slice programs
(which hold the whole array on each of the 8 simulated devices) need up to ~10x the largest array,
about 8 GB at 800 MB; use a machine with >= 24 GB.
"""

from configs.random_benchmark import default


def get_config():
    c = default.get_config()
    c.num_problems = 1000
    c.min_mb = 64.0
    c.max_mb = 800.0
    c.repeats = 5
    c.min_time_s = 0.0
    return c
