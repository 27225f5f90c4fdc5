"""Memory limits for the search: the default one from the calibration, and the error when no
schedule fits.

``planner.plan(..., memory_limit_bytes=...)``:

- ``"auto"`` (the default): the calibration's memory per device less :data:`MEMORY_RESERVE`
  (:func:`default_memory_limit`); no limit where the calibration states no memory. The search runs
  without a limit first and again under the limit only when its plan is predicted over it, so a
  plan that fits is the same (and found as fast) as without a limit.
- a number of bytes per device: plans predicted over it are refused.
- ``None`` or ``float("inf")``: no limit.

When nothing fits, :class:`MemoryLimitError` (a ``ValueError``) names the smallest predicted peak
the search saw, the op running then and its largest buffers per device.

Example:
    >>> default_memory_limit(Calibration.named("tpu_v5p"), 64)      # doctest: +SKIP
    92523040358
"""

from __future__ import annotations

import math

from redist.calibration import Calibration

MEMORY_RESERVE = 0.10
"""Fraction of a device's memory that the default limit leaves free. The simulator predicts the
buffers the compiler keeps (:mod:`planner.cost.buffers`), within about a quarter of the compiled
total; the compiled program also holds what it does not model: padding of arrays to the TPU's tiles,
the scratch of collectives and fusions, what imperfect packing of buffers wastes, generated code,
and on GPUs what the CUDA runtime and NCCL keep (the TPU files already give the memory the compiler
lets a program use)."""

AUTO = "auto"


def default_memory_limit(calibration: Calibration, num_devices: int) -> int | None:
    """The default limit per device on a mesh of ``num_devices``: the calibration's memory per
    device (:meth:`redist.calibration.Calibration.device_memory_bytes`; for the CPU file the host's
    memory over the mesh's devices on this host) less :data:`MEMORY_RESERVE`; None if the
    calibration states no memory."""
    per_host = num_devices
    if calibration.host_memory:
        import jax  # only here: the CPU calibration's memory is the host's; prices are pure

        try:
            per_host = min(num_devices, jax.local_device_count(backend="cpu"))
        except RuntimeError:  # no CPU backend in this process (JAX_PLATFORMS)
            pass
    capacity = calibration.device_memory_bytes(per_host)
    if capacity is None:
        return None
    return int(capacity * (1 - MEMORY_RESERVE))


def resolve_memory_limit(
    memory_limit_bytes, calibration: Calibration, num_devices: int
) -> int | float | None:
    """``plan``'s ``memory_limit_bytes`` as bytes per device, None for no limit (see the module
    docstring)."""
    if isinstance(memory_limit_bytes, str):
        if memory_limit_bytes != AUTO:
            raise ValueError(
                f"memory_limit_bytes={memory_limit_bytes!r}: give bytes per device, {AUTO!r} "
                "(the calibration's memory less a reserve) or None (no limit)"
            )
        return default_memory_limit(calibration, num_devices)
    if memory_limit_bytes is None or math.isinf(memory_limit_bytes):
        return None
    if memory_limit_bytes <= 0:
        raise ValueError(f"memory_limit_bytes={memory_limit_bytes} must be positive")
    return memory_limit_bytes


class MemoryLimitError(ValueError):
    """No schedule the search tried fits the memory limit.

    Attributes:
        limit: the limit, bytes per device.
        peak: the smallest predicted peak seen (:class:`planner.cost.simulator.Peak`: its bytes,
            the op running then, the buffers live then, largest first), or None.
        leanest: the plan of that peak, or None: from :func:`planner.plan` an
            :class:`planner.AutoPlan` (to run anyway, or to read: ``e.leanest.explain()``), from
            :func:`planner.solver.search` its ``(schedule, prediction)``.
    """

    def __init__(self, limit, peak=None, note: str = "", top: int = 5, leanest=None):
        self.limit, self.peak, self.note, self.leanest, self.top = limit, peak, note, leanest, top
        text = f"no schedule fits memory_limit_bytes={limit}"
        if note:
            text += f" ({note})"
        if peak is None:
            text += "; no schedule could be priced"
        else:
            where = f" while {peak.op} runs" if peak.op else " before the first op"
            text += (f"; the smallest predicted peak seen is {peak.bytes} bytes per device "
                     f"({peak.bytes / 2**20:.1f} MiB){where}; its largest buffers:")  # fmt: skip
            text += "".join(f"\n  {b}" for b in peak.buffers[:top])
        super().__init__(text)

    def replaced(self, **changes) -> MemoryLimitError:
        """This error with ``changes`` to its fields (``limit``, ``peak``, ``note``, ``leanest``).

        Example:
            >>> e.replaced(note="the default limit")   # doctest: +SKIP
        """
        fields = dict(limit=self.limit, peak=self.peak, note=self.note, top=self.top,
                      leanest=self.leanest)  # fmt: skip
        return MemoryLimitError(**{**fields, **changes})


def default_calibration(mesh) -> Calibration:
    """The calibration to price a plan on ``mesh`` by: the shipped one for its devices' kind when
    it has devices (a mesh over a TPU topology is priced as that TPU), else the one for
    ``jax.default_backend()``."""
    try:
        devices = mesh.devices
    except (AttributeError, NotImplementedError, ValueError):  # {name: size}, AbstractMesh
        devices = None
    if devices is not None and getattr(devices, "size", 0):
        cal = Calibration.for_device_kind(devices.flat[0].device_kind)
        if cal is not None:
            return cal
    return Calibration.for_backend()
