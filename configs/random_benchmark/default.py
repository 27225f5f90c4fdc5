"""Default random benchmark: a few minutes on 2 CPU cores with 8 simulated devices.

Override any field on the command line, e.g. ``--config.num_problems=10``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mesh = "a:2,b:2,c:2"  # axis:size, major to minor; e.g. "a:4,b:2" or "a:2,b:3,c:2"
    c.num_problems = 60
    c.min_mb = 4.0  # global array size, log-uniform in [min_mb, max_mb]
    c.max_mb = 64.0
    c.max_rank = 6
    c.dtype = "float32"
    c.seed = 0
    c.problems = ""  # comma-separated named problems (P1,P2,P3,P4,ex3_1,...) instead of random
    c.scale = 1.0  # scale factor for the named problems' dimensions (kept divisible)
    c.warmup = 2
    c.repeats = 7  # interleaved repetitions per program (at least)
    c.min_time_s = 0.3  # ... and more until each program ran this long in all
    # what our search minimizes: "auto" (redistribute's default: the calibrated model of the
    # mesh's devices), "bytes" (paper), "bytes+copies", "calibrated", "calibrated:<name>"
    c.cost_model = "auto"
    c.check = True  # compare both outputs with the input, element for element
    c.figures = True  # PNG figures (needs matplotlib: pip install -e ".[figures]")
    c.report_rows = 10
    c.uneven = False  # cut every extent by 1-7 elements: layouts whose splits do not divide
    # a TPU topology ("v5p:2x2x2") or "gpu:h100_sxm" (8 GPUs of one host, XLA:GPU installed):
    # compile both sides for it, time nothing
    c.topology = ""
    return c
