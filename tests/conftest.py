"""Force 8 host devices before JAX is imported anywhere in the tests."""

import os

# The tests compile hundreds of programs that then run once on small arrays: LLVM's optimisation
# of XLA:CPU's kernels costs more than it saves (the suite takes 8 minutes instead of 9.5). It
# changes no HLO pass: compiled memory and cost_analysis() are the same at either level, on CPU
# and for the TPU compiler.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Start the backends now, with these flags: a runner's force_host_devices, called by a test,
# changes nothing for the tests after it.
assert jax.device_count() == 8, jax.devices()
