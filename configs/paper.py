"""The paper's §8 experiment: 1000 random problems of 64-800 MB on the mesh {a:2, b:2, c:2}.

On 2 CPU cores with 8 simulated devices this takes hours (each problem compiles two programs and runs
each 2 + 5 times; XLA's replicate-then-slice plans hold the whole array on every device), and needs
up to ~8x the largest array in host memory (6.4 GB at 800 MB): use a machine with >= 24 GB.
"""

from configs import default


def get_config():
    c = default.get_config()
    c.num_problems = 1000
    c.min_mb = 64.0
    c.max_mb = 800.0
    c.repeats = 5
    c.figures = True
    return c
