"""Force 8 host devices before JAX is imported anywhere in the tests."""

import os
from importlib.metadata import version

# The tests compile hundreds of programs that then run once on small arrays: LLVM's optimisation
# of XLA:CPU's kernels costs more than it saves (the suite takes 8 minutes instead of 9.5). It
# changes no HLO pass: compiled memory and cost_analysis() are the same at either level, on CPU
# and for the TPU compiler. XLA:CPU's MLIR fusion emitters cost about 20 ms of codegen a kernel,
# its older emitters a quarter of that: a random schedule of MaxText's step (2,400 kernels)
# compiles in 16 s instead of 58. Its fusions differ a little (temporaries 338,920 against 338,856
# bytes there, flops 0.02 % apart); the TPU and GPU compilers ignore the flag. jaxlib 0.12 has
# only the MLIR emitters, and XLA aborts on a flag it does not know: the flag goes to 0.10 alone.
OLDER_EMITTERS = (
    " --xla_cpu_use_fusion_emitters=false"
    if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11)
    else ""
)
# XLA:GPU's autotuning, off for the compile-only H100s (planner.gpu_mesh), which cannot time the
# configs it tries: jaxlib 0.12 then compiles the 8-GPU LM plans of
# tests/planner/target/test_gpu.py in 6 s each instead of 9-13 s, to the same memory_analysis()
# bytes on both jaxlibs (the GPU time tests, which count the HLO's flops, pass as before).
NO_GPU_AUTOTUNING = " --xla_gpu_autotune_level=0"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    + OLDER_EMITTERS
    + NO_GPU_AUTOTUNING
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Start the backends now, with these flags: a runner's force_host_devices, called by a test,
# changes nothing for the tests after it.
assert jax.device_count() == 8, jax.devices()
