"""DistIR's grid on two TPU v5p slices of 8 chips joined by the data-centre network (the
calibration's cross-slice figures): which parallelism should cross the slower link."""

from configs.pipeline_search import default


def get_config():
    c = default.get_config()
    c.calibration = "tpu_v5p"
    c.slice_devices = 8
    return c
