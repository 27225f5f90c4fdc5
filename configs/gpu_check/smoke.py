"""Tiny workloads measured on this machine's device with its own calibration (what the tests run:
the measuring path a GPU run takes)."""

from configs.gpu_check import default


def get_config():
    c = default.get_config()
    c.calibration = "cpu"
    c.recorded = False
    c.workloads = "matmul=matmul:64x32x16;llama=llama:2x8x16x2x1x32x24"
    c.warmup = 1
    c.repeats = 2
    return c
