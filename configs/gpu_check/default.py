"""The workloads measured on one H100 80GB HBM3 (JAX 0.11.2), predicted with ``h100_sxm``
(``recorded``: against those figures; on a GPU set it False to measure)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.calibration = "h100_sxm"
    c.recorded = True  # compare with the recorded H100 figures (no GPU here); False: measure
    # name=kind:sizes; kinds as experiments.gpu_check.build.
    c.workloads = (
        "matmul=matmul:8192x8192x8192;mlp=mlp:4096x4096x4;attention=attention:8x2048x16x64;"
        "transformer=transformer:8x1024x16x64x4;lm=lm:32x512x768x12x6x32000;"
        "lm_scan=lm_scan:8x2048x1024x16x4x32000;lm_unrolled=lm_unrolled:8x2048x1024x16x4x32000;"
        "llama_bf16=llama:8x512x512x8x2x8192x1376;llama_scan=llama:8x2048x2048x16x4x32000x5632;"
        "llama_unrolled=llama_unrolled:8x2048x2048x16x4x32000x5632"
    )
    c.compile_here = ""  # with recorded, the workloads XLA:GPU compiles here (names; "": all)
    c.warmup = 3
    c.repeats = 15
    c.seed = 0
    return c
