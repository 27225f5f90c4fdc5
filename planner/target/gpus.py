"""Compile for a multi-GPU host from a machine without a GPU: a ``Mesh`` over compile-only GPUs.

XLA:GPU compiles for a GPU it is only told about: JAX's CUDA plugin (``pip install
"redist[gpu]"``, which is ``jax[cuda13-local]``: the plugin of the installed JAX, without the CUDA
libraries) makes compile-only devices from a description of the chip (an XLA
``GpuTargetConfigProto``, shipped beside the chip's calibration as
``redist/calibrations/<name>.gpu.txtpb``) and a topology of ``hosts`` x ``gpus per host``
(:func:`gpu_mesh`). A program jitted on a mesh over them compiles as it would for that machine,
collectives included; :func:`planner.compiled_report` reads its memory, and
:mod:`planner.target.compiled_time` prices its kernels by the calibration's roofline of the HLO (the GPU
compiler's ``cost_analysis()`` is missing there). Nothing runs on such devices.

With no GPU attached, the plugin's start-up check fails for want of cuDNN and JAX leaves it out
of its backends; importing :mod:`planner` therefore sets ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``
where no ``/dev/nvidia*`` exists (:func:`quiet_cuda_without_a_gpu`), which also keeps the plugin
from printing its traceback. It only helps where JAX's backends are not started yet.

Example:
    >>> mesh = planner.gpu_mesh({"data": 2, "fsdp": 2, "tensor": 2})   # 8 H100s on one host
    >>> p = planner.plan(step, *shapes, mesh=mesh)                      # priced as h100_sxm
    >>> print(p.compiled_report())                                      # doctest: +SKIP
"""

from __future__ import annotations

import functools
import glob
import importlib.resources
import importlib.util
import math
import os
from collections.abc import Mapping

import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh

GPU_EXTRA = 'pip install "redist[gpu]"'
SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


def quiet_cuda_without_a_gpu() -> None:
    """On a host without an NVIDIA GPU, let JAX's CUDA plugin load to compile only.

    Its start-up check looks for cuDNN and the CUDA libraries, finds none, prints a traceback
    and drops the plugin (nothing fails: JAX runs on its other backends). Skipping the check keeps
    it, for compile-only devices, and quiet. Values already set are kept, and nothing is set where
    a GPU is attached. Called on importing :mod:`planner`.
    """
    if glob.glob("/dev/nvidia[0-9]*"):
        return
    os.environ.setdefault(SKIP_CHECK, "1")


def gpu_target_config(gpu: str) -> str:
    """The XLA ``GpuTargetConfigProto`` (text) of the chip calibration ``gpu`` prices.

    Example:
        >>> "H100" in gpu_target_config("h100_sxm")
        True
    """
    files = importlib.resources.files("redist") / "calibrations"
    path = files / f"{gpu}.gpu.txtpb"
    if not path.is_file():
        known = sorted(
            p.name.split(".")[0] for p in files.iterdir() if p.name.endswith(".gpu.txtpb")
        )
        raise ValueError(f"gpu {gpu!r}: no compile-only description shipped; known: {known}")
    return path.read_text()


def xla_gpu_missing() -> bool:
    """Whether JAX's CUDA plugin (XLA:GPU, ``redist[gpu]``) is not installed.

    Example:
        >>> xla_gpu_missing()  # with the test extra on x86-64 Linux   # doctest: +SKIP
        False
    """
    return importlib.util.find_spec("jax_plugins.xla_cuda13") is None


@functools.cache
def _gpu_devices(gpu: str, hosts: int, per_host: int) -> tuple:
    try:
        desc = topologies.get_topology_desc(
            "gpu", "cuda", target_config=gpu_target_config(gpu), topology=f"1x{hosts}x{per_host}"
        )
    except NotImplementedError as e:  # the plugin is installed but JAX left it out
        raise ValueError(
            f"JAX did not load its CUDA plugin ({e}): without a GPU it loads to compile only when "
            f"{SKIP_CHECK}=1 is set before JAX starts its backends (importing planner first sets "
            "it)"
        ) from e
    return tuple(desc.devices)


def gpu_mesh(
    axes: Mapping[str, int],
    *,
    gpu: str = "h100_sxm",
    hosts: int = 1,
    axis_types: AxisType = AxisType.Auto,
) -> Mesh:
    """A ``Mesh`` with axes ``axes`` (``{name: size}``, major first) over compile-only GPUs of
    calibration ``gpu``: ``hosts`` hosts with the same number of GPUs each (their product is the
    axes'), device ids host-major, for compiling with :func:`planner.compiled_report` on any host.

    Example:
        >>> gpu_mesh({"data": 2, "tensor": 4}).devices.shape               # doctest: +SKIP
        (2, 4)

    Raises:
        ValueError: the CUDA plugin is not installed (``pip install "redist[gpu]"``), JAX did not
            load it, ``gpu`` has no shipped description, or the axis sizes do not split evenly
            over ``hosts``.
    """
    if xla_gpu_missing():
        raise ValueError(f"JAX's CUDA plugin (XLA:GPU) is not installed: {GPU_EXTRA}")
    axes = dict(axes)
    n = math.prod(axes.values())
    if hosts < 1 or n % hosts:
        raise ValueError(f"mesh axes {axes} make {n} GPUs, which do not split over {hosts} hosts")
    devices = _gpu_devices(gpu, hosts, n // hosts)
    grid = np.array(devices, dtype=object).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes), axis_types=(axis_types,) * len(axes))


quiet_cuda_without_a_gpu()  # on importing planner, before JAX starts its backends
