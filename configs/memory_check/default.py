"""Memory check: predicted peak per device against the compiled total, on 8 CPU devices (the
planner benchmark's workloads) and, with ``--config.tpu=True``, the flax LM compiled for TPU v5p
pods by the TPU compiler on this host (minutes per case; 4,096 chips take the longest), and with
``--config.gpu=True`` LM steps on 8 compile-only H100s compiled by XLA:GPU."""

import ml_collections

from configs.planner_benchmark import default as planner_benchmark


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.cpu = True
    c.mesh = "a:2,b:2,c:2"
    c.workloads = planner_benchmark.get_config().workloads
    # auto: the planner's plan; auto_donated: the same with the returned state donated; the
    # rest as in the planner benchmark (experiments/planner_benchmark.py)
    c.strategies = "auto,auto_donated,replicated,data,fsdp,megatron"
    c.tpu = False
    # name=kind:sizes@topology=axis:n,...  ';'-separated; lm_scan sizes: batch x seq x d x heads
    # x layers x vocab (experiments/workloads.py)
    lm = "lm=lm_scan:256x1024x1024x16x8x32768"
    c.tpu_cases = ";".join([
        f"{lm}@v5p:4x4x4=data:4,fsdp:4,tensor:4",
        f"{lm}@v5p:8x8x4=data:16,fsdp:4,tensor:4",
        f"{lm}@v5p:16x16x16=data:32,fsdp:16,tensor:8",
    ])  # fmt: skip
    c.tpu_calibration = "tpu_v5p"
    # name=kind:sizes@gpu=axis:n,...  ';'-separated: the searched and expert plans on compile-only
    # GPUs of one host (planner.gpu_mesh; gpu a calibration with a shipped description)
    c.gpu = False
    c.gpu_cases = ";".join([
        "lm=lm_scan:16x512x512x8x4x8192@h100_sxm=data:2,fsdp:2,tensor:2",
        "lm_big=lm_scan:32x1024x1024x16x8x32768@h100_sxm=data:2,fsdp:2,tensor:2",
        "lm_loop=lm:16x512x512x8x4x8192@h100_sxm=data:2,fsdp:2,tensor:2",
    ])  # fmt: skip
    c.tolerance = 0.25  # |predicted / compiled - 1| counted as within
    return c
