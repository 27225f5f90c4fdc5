"""Two tiny workloads, two strategies, and a small scanned LM on TPU v5p:2x2x1 when the TPU
compiler is installed, and on 8 compile-only H100s when XLA:GPU is: what the tests run."""

import importlib.util

from configs.memory_check import default


def get_config():
    c = default.get_config()
    c.workloads = "mlp=mlp:64x32x2;lm=lm_scan:8x16x32x2x2x64"
    c.strategies = "auto,auto_donated,data"
    c.tpu = importlib.util.find_spec("libtpu") is not None
    c.tpu_cases = "lm=lm_scan:16x128x128x4x2x512@v5p:2x2x1=data:2,tensor:2"
    c.gpu = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    c.gpu_cases = "lm=lm_scan:16x128x128x4x2x512@h100_sxm=data:2,fsdp:2,tensor:2"
    return c
