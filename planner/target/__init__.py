"""The hardware a plan is compiled for from this host, and the compiler's verdict on it.

:func:`topology_mesh` is a TPU pod slice's devices (libtpu compiles for them on any host),
:func:`gpu_mesh` a multi-GPU host's (JAX's CUDA plugin compiles without a GPU);
:func:`compiled_report` compiles a jitted program or a plan for them and reads its memory, flops and
collectives (:mod:`planner.target.compiled`); :mod:`planner.target.compiled_time` prices the
compiled program's step time; :mod:`planner.target.confirm` compiles a plan to confirm that it fits
(``plan(check_memory=...)``).

>>> from planner.target import topology_mesh
>>> topology_mesh("v5p:2x2x1", {"data": 2, "model": 2}).shape  # doctest: +SKIP
{'data': 2, 'model': 2}
"""

from planner.target.compiled import CompiledReport, compiled_report, topology_mesh
from planner.target.gpus import gpu_mesh

__all__ = ["CompiledReport", "compiled_report", "gpu_mesh", "topology_mesh"]
