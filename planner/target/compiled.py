"""Compile for a TPU pod from a laptop: a mesh over a TPU topology's devices, and the compiler's
verdict on a plan or any jitted program compiled for it.

The TPU compiler (``libtpu``, ``pip install "redist[tpu]"``) runs on a CPU host:
:func:`topology_mesh` gives a ``Mesh`` over the compile-only devices of a topology such as
``"v5p:4x4x4"``, and :func:`compiled_report` compiles a program for it and reads what the compiler
says per device: memory (``memory_analysis()``), whether it fits in HBM (a program over HBM fails
to compile with ``RESOURCE_EXHAUSTED``: that becomes a report with ``fits=False``, not an
exception), flops and bytes accessed, the compiler's own time estimate (``optimal_seconds``), and
the collectives of the optimized HLO. Nothing runs: the devices exist only to compile for.

Example:
    >>> mesh = planner.topology_mesh("v5p:2x2x2", {"data": 2, "fsdp": 2, "tensor": 2})
    >>> p = planner.plan(step, *shapes, mesh={"data": 2, "fsdp": 2, "tensor": 2},
    ...                  calibration=Calibration.named("tpu_v5p"))   # doctest: +SKIP
    >>> print(p.compiled_report(mesh))                               # doctest: +SKIP
    >>> f = jax.jit(step, in_shardings=..., out_shardings=...)      # a hand sharding on `mesh`
    >>> print(planner.compiled_report(f, *shapes))                   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import math
import os
import re
import weakref
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import mesh_utils, topologies
from jax.sharding import AxisType, Mesh

from planner.program.ops import is_key
from redist.calibration import Calibration
from redist.hlo import hlo_collectives

TPU_EXTRA = 'pip install "redist[tpu]"'


def quiet_libtpu_without_a_tpu() -> None:
    """On a host without TPU chips, tell libtpu the host it would look for as it loads.

    Installed (the test extra has it, for compiling ahead of time for TPU topologies), libtpu
    loads with JAX's backends and, finding no TPU host, prints alarming lines ("Failed to find
    host bounds for accelerator type", "E0000 ... unexpected worker hostname") though nothing
    fails. Naming a single local host silences them and changes nothing libtpu compiles for a
    topology (the same memory and HLO on v5p and v6e). Values already set are kept, and nothing
    is set where TPU chips are attached (``/dev/accel*``, ``/dev/vfio``). Called on importing
    :mod:`planner`; it only helps where JAX's backends are not started yet.
    """
    if glob.glob("/dev/accel*") or os.path.isdir("/dev/vfio"):
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")


def _libtpu_missing() -> bool:
    return importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH")


@functools.cache
def _topology_devices(topology: str, kwargs: tuple) -> tuple:
    if jax.default_backend() != "tpu":
        # No TPU attached: libtpu only compiles here, so it need not hold the host-wide lock
        # that keeps two processes off one TPU (other processes may have libtpu loaded).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **dict(kwargs))
    except RuntimeError as e:  # JaxRuntimeError is one
        if "not installed" in str(e):
            raise ValueError(f"the TPU compiler (libtpu) is not installed: {TPU_EXTRA}") from e
        raise ValueError(f"no TPU topology {topology!r}: {e}") from e
    return tuple(desc.devices)


def topology_mesh(
    topology: str,
    axes: Mapping[str, int],
    *,
    axis_types: AxisType = AxisType.Auto,
    **topology_kwargs,
) -> Mesh:
    """A ``Mesh`` with axes ``axes`` (``{name: size}``, major first) over the devices of the TPU
    ``topology`` (``"v5p:2x2x2"``, ``"v5e:16x16"``, ``"v6e:4x4"``, ``"v4:8x8x8"``; one device
    per chip, v4 as megacore), for compiling with :func:`compiled_report` on any host.

    Mesh axes are laid on the physical torus as ``jax.make_mesh`` lays them
    (``mesh_utils.create_device_mesh``), or in device order where that finds no assignment.
    ``topology_kwargs`` go to ``jax.experimental.topologies.get_topology_desc`` (for v4,
    ``chip_config_name="default"`` gives one device per TensorCore). Off a TPU host this sets
    ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (unless set) so that several processes can compile at once.

    Raises:
        ValueError: libtpu is missing (``pip install "redist[tpu]"``), the topology is unknown,
            or the axis sizes do not multiply to the topology's device count.
    """
    if _libtpu_missing():
        raise ValueError(f"the TPU compiler (libtpu) is not installed: {TPU_EXTRA}")
    axes = dict(axes)
    if topology.lower().startswith("v4") and "chip_config_name" not in topology_kwargs:
        topology_kwargs["chip_config_name"] = "megacore"  # one JAX device per chip, as on a v4
    devices = _topology_devices(topology, tuple(sorted(topology_kwargs.items())))
    sizes = tuple(axes.values())
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh axes {axes} multiply to {math.prod(sizes)} devices; topology {topology!r} "
            f"has {len(devices)} ({devices[0].device_kind})"
        )
    try:
        grid = mesh_utils.create_device_mesh(sizes, list(devices))
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.array(devices, dtype=object).reshape(sizes)
    return Mesh(grid, tuple(axes), axis_types=(axis_types,) * len(axes))


def on_context_devices(mesh):
    """``mesh`` over the device objects of the context's mesh (``jax.set_mesh``) where the two
    name the same devices (platform and ids) as other objects: compile-only TPU devices made by
    two topology descriptions (:func:`topology_mesh`'s and MaxText's ``train_compile``), which
    one ``jax.jit`` refuses to mix ("Received incompatible devices"). Any other ``mesh`` is
    returned as it is.

    Example:
        >>> with jax.set_mesh(maxtext_mesh):                         # doctest: +SKIP
        ...     on_context_devices(planner.topology_mesh("v5p:4x4x4")).devices.flat[0] is \
        ...         maxtext_mesh.devices.flat[0]
        True
    """
    ambient = jax.sharding.get_mesh()
    if not isinstance(mesh, Mesh) or ambient.empty:
        return mesh
    theirs = {(d.platform, d.id): d for d in ambient.devices.flat}
    ours = list(mesh.devices.flat)
    if all(theirs.get((d.platform, d.id)) is d for d in ours) or {
        (d.platform, d.id) for d in ours
    } != set(theirs):
        return mesh
    devices = np.empty(mesh.devices.shape, dtype=object)
    for index, d in np.ndenumerate(mesh.devices):
        devices[index] = theirs[(d.platform, d.id)]
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


@dataclasses.dataclass(frozen=True)
class CollectiveCount:
    """The collectives of one kind in the optimized HLO: how many instructions, their result
    bytes per device summed, and their group sizes. A collective inside a loop (a scan's body)
    counts once, as written."""

    kind: str
    count: int
    bytes: int
    group_sizes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class CompiledReport:
    """The compiler's verdict on one program, per device.

    ``total_bytes``: what the device must hold at once. Where the compiler reports its own peak
    (``peak_bytes``: ``memory_analysis().peak_memory_in_bytes``, the live arguments, outputs and
    temporaries at the worst point of its schedule; the TPU compiler refuses a program on that
    figure where it holds no host memory), that peak (for a program holding host memory, the
    device's part: :func:`device_peak_bytes`); elsewhere arguments + outputs + temporaries - aliased (donated inputs
    reused as outputs; XLA:CPU's peak counts arguments and outputs alone, and XLA:GPU's has not
    been held against a GPU). The TPU's temporaries are no bound: MaxText's
    Llama 2 70B step on 256 v5p chips has arguments + outputs + temporaries - aliased of 105 GB,
    a peak of 88.9 GB, and the compiler accepts it for a 95.74 GiB chip. ``hbm_bytes``: the
    device's memory as the compiler reports it (from the calibration file of the device kind,
    or from the compiler's error), None if unknown. ``fits``: compiled, and ``total_bytes <=
    hbm_bytes``. When compiling failed with ``RESOURCE_EXHAUSTED``, ``fits`` is False,
    ``error`` is the compiler's message, ``total_bytes`` what it says it needed (its peak), and
    the fields only a compiled program has are None.
    """

    device_kind: str
    num_devices: int
    fits: bool
    total_bytes: int | None
    hbm_bytes: int | None
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    alias_bytes: int | None = None
    peak_bytes: int | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    optimal_seconds: float | None = None
    collectives: tuple[CollectiveCount, ...] = ()
    error: str | None = None

    @property
    def collectives_by_kind(self) -> dict[str, CollectiveCount]:
        return {c.kind: c for c in self.collectives}

    def __str__(self) -> str:
        cap = f" of {_size(self.hbm_bytes)}" if self.hbm_bytes else ""
        verdict = "fits" if self.fits else "does NOT fit"
        used = f"{_size(self.total_bytes)}{cap} per device"
        head = f"{self.device_kind} x{self.num_devices}: {verdict} ({used})"
        if self.error is not None:
            return f"{head}\n  compiler: {self.error}"
        lines = [
            head,
            f"  per device: arguments {_size(self.argument_bytes)}, outputs "
            f"{_size(self.output_bytes)}, temporaries {_size(self.temp_bytes)}, aliased "
            f"{_size(self.alias_bytes)}"
            + (f"; compiler's peak {_size(self.peak_bytes)}" if self.peak_bytes else ""),
            f"  flops {_num(self.flops)}, bytes accessed {_num(self.bytes_accessed)} per device; "
            f"compiler's optimal time {_seconds(self.optimal_seconds)}",
        ]
        if self.collectives:
            parts = [
                f"{c.kind} x{c.count} ({_size(c.bytes)}"
                + (f"; groups of {'/'.join(map(str, c.group_sizes))}" if c.group_sizes else "")
                + ")"
                for c in self.collectives
            ]
            lines.append("  collectives: " + ", ".join(parts))
        else:
            lines.append("  collectives: none")
        return "\n".join(lines)


def _size(n) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _num(x) -> str:
    return "?" if x is None else f"{x:.3g}"


def _seconds(s) -> str:
    if s is None:
        return "?"
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_NEEDED = re.compile(r"required for [^(]*\(([\d.]+)([KMGT]?)\)")
_AVAILABLE = re.compile(r"available HBM \(([\d.]+)([KMGT]?)\)")


def _parse_bytes(pattern: re.Pattern, text: str) -> int | None:
    m = pattern.search(text)
    return None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)])


def device_memory_bytes(device) -> int | None:
    """The memory the compiler lets a program use on one ``device`` (a TPU's from the shipped
    calibration of its kind; a CPU device's share of the host), None if unknown."""
    cal = Calibration.for_device_kind(device.device_kind)
    if cal is None:
        return None
    mem = cal.device_memory_bytes(jax.local_device_count(backend="cpu") if cal.host_memory else 1)
    return None if mem is None else int(mem)


def _devices_of(compiled_or_lowered, args) -> list:
    for get in (
        lambda: jax.tree.leaves(compiled_or_lowered.input_shardings),
        lambda: jax.tree.leaves(compiled_or_lowered.output_shardings),
        lambda: [compiled_or_lowered._lowering.compile_args["device_assignment"]],
        lambda: [a.sharding for a in jax.tree.leaves(args) if getattr(a, "sharding", None)],
    ):
        try:
            for s in get():
                devices = list(getattr(s, "_device_assignment", None) or s)
                if devices:
                    return devices
        except Exception:  # best effort: the report says "unknown"
            continue
    return []


def compiler_peak_bytes(compiled, devices=None, memory=None) -> int | None:
    """The TPU compiler's peak memory per device for ``compiled`` (live arguments, outputs and
    temporaries at the worst point of its schedule: what it refuses programs on), None on other
    backends (XLA:CPU's ``peak_memory_in_bytes`` counts arguments and outputs alone).

    Example:
        >>> compiler_peak_bytes(jax.jit(f).lower(x_on_tpu_topology).compile())  # doctest: +SKIP
        54525952
    """
    devices = devices or _devices_of(compiled, ())
    if not devices or devices[0].platform != "tpu":
        return None
    return device_peak_bytes(memory or compiled.memory_analysis())


def host_bytes(memory) -> int:
    """The bytes a program keeps in the host's memory (activations offloaded by a remat policy,
    host arguments and outputs), from ``memory_analysis()``."""
    fields = ("host_argument_size_in_bytes", "host_output_size_in_bytes", "host_temp_size_in_bytes")
    held = sum(int(getattr(memory, f, 0) or 0) for f in fields)
    return held - int(getattr(memory, "host_alias_size_in_bytes", 0) or 0)


def device_peak_bytes(memory) -> int | None:
    """The device's peak from a TPU program's ``memory_analysis()``: ``peak_memory_in_bytes``,
    except where the program holds host memory. That peak then counts more than the device's
    memory (MaxText's Llama 3.1 405B on two v6e-256 slices, activations offloaded: a peak of
    115.2 GB on a 33.6 GB chip, 105.7 GB of it host temporaries, and the compiler accepts it;
    DeepSeek-V3 on v5p-1024: 101.7 GB whatever the program allocates, and the same 101.7 GB
    when compiled for 94.4 GB of HBM), and the device's own bounds it instead: its arguments +
    outputs + temporaries - aliased (31.1 GB there), and the HBM the program allocates
    (``total_allocation_bytes``, where JAX reports it: arguments and the temporaries' heap;
    92.2 GB for the DeepSeek-V3 program whose arguments + outputs + temporaries - aliased are
    105.7 GB), whichever is less.

    Example:
        >>> device_peak_bytes(compiled.memory_analysis())  # doctest: +SKIP
        31138059104
    """
    peak = int(getattr(memory, "peak_memory_in_bytes", 0) or 0) or None
    if peak is None or host_bytes(memory) <= 0:
        return peak
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
    device = sum(int(getattr(memory, f, 0) or 0) for f in fields)
    device -= int(getattr(memory, "alias_size_in_bytes", 0) or 0)
    allocated = int(getattr(memory, "total_allocation_bytes", 0) or 0) or device
    return min(peak, device, allocated)


def compiled_report(fn, *args, hbm_bytes: int | None = None, **kwargs) -> CompiledReport:
    """Compile ``fn`` and return the compiler's verdict per device (:class:`CompiledReport`).

    ``fn``: a ``jax.jit``-ed function (lowered on ``args``, typically ``jax.ShapeDtypeStruct``s;
    its shardings or theirs say which devices, e.g. of a :func:`topology_mesh`), a plain function
    (jitted here), a ``Lowered`` or a ``Compiled``. ``hbm_bytes`` overrides the device's memory.
    A ``RESOURCE_EXHAUSTED`` compile error gives a report with ``fits=False``; other errors raise.
    """
    return compile_and_report(fn, *args, hbm_bytes=hbm_bytes, **kwargs)[1]


def compile_and_report(
    fn, *args, hbm_bytes: int | None = None, **kwargs
) -> tuple[object | None, CompiledReport]:
    """``(compiled, report)``: :func:`compiled_report` and the ``Compiled`` it read (None when the
    program does not fit), for callers that read more of it (:mod:`planner.target.compiled_time`)."""
    if hasattr(fn, "memory_analysis"):  # Compiled
        stage, compiled = fn, fn
    else:
        if hasattr(fn, "compile") and not hasattr(fn, "lower"):  # Lowered
            stage = fn
        else:
            stage = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args, **kwargs)
        try:
            compiled = stage.compile()
        except Exception as e:  # JaxRuntimeError: re-raised unless out of memory
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            devices = _devices_of(stage, args)
            capacity = hbm_bytes or (device_memory_bytes(devices[0]) if devices else None)
            capacity = capacity or _parse_bytes(_AVAILABLE, str(e))  # rounded to 0.01 GiB
            return None, CompiledReport(
                device_kind=devices[0].device_kind if devices else "unknown",
                num_devices=len(devices),
                fits=False,
                total_bytes=_parse_bytes(_NEEDED, str(e)),
                hbm_bytes=capacity,
                error=str(e).strip(),
            )
    devices = _devices_of(compiled, args)
    mem = compiled.memory_analysis()
    arg, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
    temp, alias = mem.temp_size_in_bytes, mem.alias_size_in_bytes
    peak = compiler_peak_bytes(compiled, devices, mem)
    total = peak or arg + out + temp - alias
    capacity = hbm_bytes or (device_memory_bytes(devices[0]) if devices else None)
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    cost = cost or {}
    by_kind: dict[str, list] = {}
    for c in hlo_collectives(compiled.as_text()):
        by_kind.setdefault(c.kind, []).append(c)
    collectives = tuple(
        CollectiveCount(kind, len(cs), sum(c.bytes for c in cs),
                        tuple(sorted({c.group_size for c in cs if c.group_size})))
        for kind, cs in sorted(by_kind.items())
    )  # fmt: skip
    return compiled, CompiledReport(
        device_kind=devices[0].device_kind if devices else "unknown",
        num_devices=len(devices),
        fits=capacity is None or total <= capacity,
        total_bytes=total,
        hbm_bytes=capacity,
        argument_bytes=arg,
        output_bytes=out,
        temp_bytes=temp,
        alias_bytes=alias,
        peak_bytes=peak,
        flops=cost.get("flops"),
        bytes_accessed=cost.get("bytes accessed"),
        optimal_seconds=cost.get("optimal_seconds"),
        collectives=collectives,
    )


def input_structs(plan) -> tuple:
    """The plan's positional arguments as ``plan.jit()`` takes them: ``jax.ShapeDtypeStruct``s
    for arrays, static arguments as they were (see :func:`keyword_structs` for keywords)."""
    return _structs(plan)[0]


def keyword_structs(plan) -> dict:
    """The plan's keyword arguments, as :func:`input_structs` gives positional ones."""
    return _structs(plan)[1]


def program_structs(prog) -> list:
    """``prog``'s inputs as ``jax.ShapeDtypeStruct``s of their traced types: typed PRNG keys keep
    their implementation (``key<fry>``, MaxText's ``key<urbg>``), which a dtype's name does not
    give back."""
    invars = getattr(getattr(prog.jaxpr, "jaxpr", None), "invars", None)
    if invars is not None and len(invars) == len(prog.inputs):
        return [jax.ShapeDtypeStruct(var.aval.shape, var.aval.dtype) for var in invars]

    def struct(v):
        if is_key(v.dtype):
            impl = {"fry": "threefry2x32", "rbg": "rbg", "urbg": "unsafe_rbg"}.get(
                v.dtype[4:-1], v.dtype[4:-1]
            )
            dtype = jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
            return jax.ShapeDtypeStruct(v.shape, dtype)
        return jax.ShapeDtypeStruct(v.shape, np.dtype(v.dtype))

    return [struct(v) for v in prog.inputs]


def _structs(plan) -> tuple[tuple, dict]:
    leaves = iter(program_structs(plan.program))
    sig = plan._signature
    values = [a.value if a.static else jax.tree.unflatten(a.tree, [next(leaves) for _ in a.leaves])
              for a in sig.every]  # fmt: skip
    n = len(sig.args)
    return tuple(values[:n]), dict(zip(sig.names, values[n:]))


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per live plan, ``{moves: (compiled, report)}`` of its program compiled on its own mesh: the
compile ``plan()``'s memory check made is the one :meth:`planner.AutoPlan.compiled_report` reads
(DeepSeek-V3's step takes 20 minutes to compile for v5p-1024)."""


def plan_compile_and_report(
    plan, mesh=None, moves: str = "auto"
) -> tuple[object | None, CompiledReport]:
    """``(compiled, report)`` of ``plan.jit(moves)`` bound to ``mesh`` (default: the plan's own
    mesh) compiled on the plan's argument shapes (:func:`compile_and_report`); on the plan's own
    mesh compiled once per plan and kept while the plan lives.

    Example:
        >>> compiled, report = plan_compile_and_report(p)       # doctest: +SKIP
        >>> plan_compile_and_report(p)[1] is report             # doctest: +SKIP
        True
    """
    own = mesh is None or mesh is plan.mesh
    kept = _COMPILED.get(plan, {}) if own else {}
    if moves not in kept:
        bound = plan if own else plan.bind(mesh)
        args, kwargs = _structs(bound)
        kept[moves] = compile_and_report(bound.jit(moves), *args, **kwargs)
        if own:
            _COMPILED[plan] = kept
    return kept[moves]


def keep_compiled(source, plan) -> None:
    """``plan`` (a ``dataclasses.replace`` of ``source``: the same program) keeps what
    ``source`` compiled (:func:`plan_compile_and_report`)."""
    if source in _COMPILED:
        _COMPILED[plan] = dict(_COMPILED[source])


def plan_compiled_report(plan, mesh=None, moves: str = "auto") -> CompiledReport:
    """:meth:`planner.AutoPlan.compiled_report`: ``plan.jit(moves)`` bound to ``mesh`` (default:
    the plan's own mesh), compiled on the plan's argument shapes (on its own mesh, once)."""
    return plan_compile_and_report(plan, mesh, moves)[1]


quiet_libtpu_without_a_tpu()  # on importing planner, before JAX starts its backends
