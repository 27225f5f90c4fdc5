"""Skip markers for tests that need an optional compiler."""

import pytest

from planner.target.gpus import GPU_EXTRA, xla_gpu_missing

needs_xla_gpu = pytest.mark.skipif(
    xla_gpu_missing(), reason=f"XLA:GPU (JAX's CUDA plugin) is not installed: {GPU_EXTRA}"
)
