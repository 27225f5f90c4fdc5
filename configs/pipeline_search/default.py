"""DistIR's MLP family (its Table 1 and Figure 5: 1 B and 17 B parameters at batch 65,536, 103 B
at batch 256; 16-bit) over data x tensor x pipeline degrees on 16 simulated H100s."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.models = "mlp_1b=16x8192x65536;mlp_17b=64x16384x65536;mlp_103b=96x32768x256"
    c.microbatches = "2,4,8,16,32,64,128"  # K for pipelines (P > 1), as DistIR's grid
    c.dtype = "bfloat16"
    c.calibration = "h100_sxm"
    c.memory_gb = 0.0  # memory per device; 0: the calibration's (80 GB)
    c.slice_devices = 0  # devices joined by the fast network; 0: the calibration's (8 per host)
    c.planner = True  # also planner.plan of the scanned model on every mesh of the grid
    return c
