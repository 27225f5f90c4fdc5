"""Calibrate the planner's cost model on the current backend and write a JSON file.

Usage:
    python -m experiments.calibrate --out=redist/calibrations/cpu.json [--devices=8]

Measures per-device dense matmul throughput (float32, float32 at "highest", bfloat16: the
file's ``dense_flops_per_s``, and ``dense_half_flops``, the size at which a matmul reaches half of
it, from two sizes), local copy bandwidth (read + write a fresh buffer)
and streaming read bandwidth (a column sum of a resident buffer) with all devices working at
once (simulated CPU devices share the host's cores), and for every collective kind over all
devices and over groups of half of them the time at three sizes, fitting latency + bytes / bandwidth
(wire bytes as in ``redist.calibration``). Collectives need two devices or more: on one, compute and memory rates
are measured and the collectives' figures are those of the shipped calibration for the device
(or the backend's default), as the log says. Fixed costs (a kernel's, a program call's, a rolled
loop's slowdown: :func:`fixed_costs`) are measured on the first device;
``--update=kernel_s,step_s,loop_body_factor`` (or ``dense_flops_per_s,dense_half_flops``, or
``collectives``: every kind's latency and bandwidth) measures only those into the existing file.
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags, logging

_OUT = flags.DEFINE_string("out", "redist/calibrations/cpu.json", "Where to write the file.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Simulated host devices (CPU).")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Repetitions per measurement (median).")
_UPDATE = flags.DEFINE_list(
    "update",
    [],
    "Measure only these fields (of kernel_s, step_s, loop_body_factor, dense_flops_per_s, "
    "dense_half_flops) and write "
    "them into the existing --out file, keeping the rest.",
)


def measure(repeats: int):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from experiments.measure import interleaved_times
    from redist.calibration import Calibration

    def seconds(f, *args):
        return interleaved_times([lambda: f(*args)], repeats, 2)[0]["median"]

    # Per-device rates with every device busy at once (devices may share the host's cores).
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",), axis_types=(AxisType.Auto,))

    def on_all(body, x):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                     check_vma=False)), x  # fmt: skip

    fixed = fixed_costs(seconds)
    rates, halves = dense_rates(mesh, seconds)
    flops = rates["float32"]
    big = jax.device_put(np.ones((n * 2**21,), np.float32), NamedSharding(mesh, P("d")))
    copy, big = on_all(lambda t: t * 1.5, big)
    copy_bw = 2 * (big.nbytes // n) / seconds(copy, big)
    wide = jax.device_put(np.ones((n * 2048, 1024), np.float32), NamedSharding(mesh, P("d")))
    reduce, wide = on_all(lambda t: jnp.sum(t, axis=0, keepdims=True), wide)
    read_bw = (wide.nbytes // n) / seconds(reduce, wide)

    latency, bandwidth = _collectives(mesh, n, seconds) if n > 1 else _shipped_collectives()
    cal = Calibration(jax.default_backend(), flops, copy_bw, latency, bandwidth, read_bw,
                      dense_flops_per_s=rates, dense_half_flops=halves, **fixed)  # fmt: skip
    return _with_memory(cal, jax.devices()[0].device_kind)


FIXED = ("kernel_s", "step_s", "loop_body_factor")
DENSE = ("dense_flops_per_s", "dense_half_flops")
DENSE_SIZES = (128, 512)


def hockney(flops: tuple[float, float], seconds: tuple[float, float], overhead: float = 0.0):
    """``(r_inf, n_1/2)`` of the line through two ``(flops, seconds)`` of one kernel, less the
    fixed ``overhead`` (a program call, a kernel) in each: time = overhead + (f + n_1/2) / r_inf.
    Where the larger run is not the slower (noise), ``(f / t of the larger, 0.0)``.

    Example:
        >>> [round(x) for x in hockney((1e6, 1e8), (4e-6, 103e-6), overhead=2e-6)]
        [1000000000000, 1000000]
    """
    (f1, f2), (t1, t2) = flops, seconds
    if t2 <= t1 or f2 <= f1:
        return f2 / t2, 0.0
    rate = (f2 - f1) / (t2 - t1)
    return rate, max(0.0, (t1 - overhead) * rate - f1)


def dense_rates(mesh, seconds) -> tuple[dict[str, float], dict[str, float]]:
    """``dense_flops_per_s`` and ``dense_half_flops`` per device with every device of ``mesh``
    busy (float32, float32 at "highest", bfloat16): an n-cube matmul per device at each of
    :data:`DENSE_SIZES`, fit by :func:`hockney` less the same program's time at n = 1 (its call
    and launch on every device)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def matmul_seconds(s, dtype, precision):
        a = jax.device_put(np.ones((mesh.size * s, s), dtype), NamedSharding(mesh, P("d")))
        b = jnp.ones((s, s), dtype)
        mm = jax.jit(jax.shard_map(lambda t: jnp.dot(t, b, precision=precision), mesh=mesh,
                                   in_specs=P("d"), out_specs=P("d"), check_vma=False))  # fmt: skip
        return seconds(mm, a)

    rates, halves = {}, {}
    for key, dtype, precision in (("float32", np.float32, None),
                                  ("float32:highest", np.float32, "highest"),
                                  ("bfloat16", jnp.bfloat16, None)):  # fmt: skip
        overhead = matmul_seconds(1, dtype, precision)
        times = tuple(matmul_seconds(s, dtype, precision) for s in DENSE_SIZES)
        flops = tuple(2.0 * s**3 for s in DENSE_SIZES)
        rates[key], halves[key] = hockney(flops, times, overhead)
    return rates, halves


def fixed_costs(seconds) -> dict[str, float]:
    """On the first device: ``step_s``, a tiny jitted op called back to back (less one kernel);
    ``kernel_s``, what each of 50 chained reductions in one program adds; ``loop_body_factor``,
    a 4-layer training step of the language model with its layers scanned over the same step
    unrolled, less what runs outside the loop (the step measured with no layers), as the
    simulator applies it (:func:`planner.cost.simulator.rolled_ops`)."""
    import jax
    import jax.numpy as jnp

    from experiments.language_model import lm_step

    x = jax.device_put(jnp.ones((8, 128), jnp.float32), jax.devices()[0])
    one = jax.jit(lambda t: jnp.sum(t, axis=0, keepdims=True) + t)

    @jax.jit
    def chain(t):
        for i in range(50):
            t = jnp.sum(t * (i + 1), axis=0, keepdims=True) + t
        return t

    t_one, t_chain = seconds(one, x), seconds(chain, x)
    kernel = max(0.0, (t_chain - t_one) / 49)
    times = {}
    for layers, unroll in ((4, 1), (4, True), (0, 1)):
        step, args = lm_step(8, 128, 128, 4, layers, 512, scan=True, unroll=unroll)
        args = jax.device_put(args, jax.devices()[0])
        times[layers, unroll] = seconds(jax.jit(step), *args)
    outside = times[0, 1]
    factor = (times[4, 1] - outside) / max(times[4, True] - outside, 1e-9)
    return {
        "kernel_s": kernel,
        "step_s": max(0.0, t_one - kernel),
        "loop_body_factor": max(1.0, factor),
    }


def _shipped_collectives() -> tuple[dict, dict]:
    """Latency and bandwidth per collective kind of the shipped calibration for this device
    (one device moves no bytes between devices, so none are measured)."""
    import jax

    from redist.calibration import Calibration

    kind = jax.devices()[0].device_kind
    shipped = Calibration.for_device_kind(kind) or Calibration.default()
    logging.warning("one device: collectives need two or more devices to measure; their figures "
                    "are those of the shipped %r calibration", shipped.backend)  # fmt: skip
    return dict(shipped.latency_s), dict(shipped.bytes_per_s)


COLLECTIVE_SIZES = (2**12, 2**18, 2**20)  # float32 elements per device tile
"""Tile sizes each collective is timed at (16 KiB to 4 MiB), over groups of every size
:func:`_collectives` tries: a least-squares fit of latency + wire bytes / bandwidth over all, of
relative errors (the largest gathers, whose results leave the caches, would rule otherwise)."""

CHAINED = 8
"""Collectives :func:`_collectives` adds to a program to time one inside a program: a program's
call on every device (a few hundred microseconds on 8 CPU devices) is not a collective's."""


def _collectives(mesh, n: int, seconds) -> tuple[dict, dict]:
    """Latency and bandwidth per collective kind, fitted (least squares) to its times at
    :data:`COLLECTIVE_SIZES` over all ``n`` devices and over groups of half of them (two
    groups at once: the planner's collectives mostly run over one axis of a mesh). A
    collective's time is what one more costs inside a program: programs of 1 and
    ``1 + CHAINED`` of them in a chain (each result scaled, behind an optimization barrier, as
    the next one's input), the difference over ``CHAINED``, less the same chain's without the
    collectives. On a host whose simulated devices share its cores and memory, what costs is
    the traffic of all groups at once; the bandwidth is each device's share of it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from redist.calibration import KINDS, wire_bytes

    meshes = [(mesh, ("d",), n)]
    if n % 2 == 0 and n > 2:
        half = jax.make_mesh((n // 2, 2), ("g", "r"), axis_types=(AxisType.Auto,) * 2)
        meshes.append((half, ("g",), n // 2))

    def chain(one, count: int):
        def body(t):
            for _ in range(count):
                u = one(t)
                t = lax.optimization_barrier(u[: t.shape[0]] * 1.0001)
            return t

        return body

    latency, bandwidth = {}, {}
    for kind in KINDS:
        points = []
        for m, axes, size in meshes:
            perm = [(i, (i + 1) % size) for i in range(size)]
            one = {
                "all-gather": lambda t, a=axes: lax.all_gather(t, a, tiled=True),
                "all-to-all": lambda t, a=axes: lax.all_to_all(t, a, 0, 0, tiled=True),
                "collective-permute": lambda t, a=axes, p=perm: lax.ppermute(t, a, p),
                "all-reduce": lambda t, a=axes: lax.psum(t, a),
                "reduce-scatter": lambda t, a=axes: lax.psum_scatter(t, a, tiled=True),
            }[kind]
            spec = P(tuple(m.axis_names))
            for elems in COLLECTIVE_SIZES:
                x = jax.device_put(np.ones((n * elems,), np.float32), NamedSharding(m, spec))
                same = lambda t: t  # noqa: E731  (the chain without the collective)
                if kind == "reduce-scatter":  # its result tiled back to the input's size
                    x = jax.device_put(np.ones((n * elems * size,), np.float32),
                                       NamedSharding(m, spec))  # fmt: skip
                    one = lambda t, f=one, s=size: jnp.tile(f(t), s)  # noqa: E731
                    same = lambda t, s=size: jnp.tile(t[: t.shape[0] // s], s)  # noqa: E731
                times = {}
                for label, fn in (("with", one), ("without", same)):
                    for count in (1, 1 + CHAINED):
                        f = jax.jit(jax.shard_map(chain(fn, count), mesh=m, in_specs=spec,
                                                  out_specs=spec, check_vma=False))  # fmt: skip
                        times[label, count] = seconds(f, x)
                added = (times["with", 1 + CHAINED] - times["with", 1]) / CHAINED
                base = (times["without", 1 + CHAINED] - times["without", 1]) / CHAINED
                nbytes = elems * 4 * (size if kind in ("all-gather", "reduce-scatter") else 1)
                points.append((wire_bytes(kind, nbytes, size), max(added - base, 1e-7)))
        wire, t = np.array(points).T
        slope, intercept = np.polyfit(wire, t, 1, w=1 / t)  # relative errors: every size counts
        bandwidth[kind] = float(1 / max(slope, 1e-15))
        # a fit through noise can pass below zero: the smallest collectives are latency alone
        smallest = float(t[wire == wire.min()].min())
        latency[kind] = float(intercept if intercept > 0.1 * smallest else smallest)
    return latency, bandwidth


def _with_memory(cal, device_kind: str):
    """``cal`` with the memory per device of the shipped file for ``device_kind`` (the CPU file:
    the host's memory, read again wherever the file is loaded)."""
    import dataclasses

    from redist.calibration import Calibration

    shipped = Calibration.for_device_kind(device_kind)
    if shipped is None:
        return cal
    return dataclasses.replace(cal, memory_bytes=shipped.memory_bytes,
                               memory_source=shipped.memory_source,
                               host_memory=shipped.host_memory)  # fmt: skip


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    from experiments.measure import force_host_devices

    force_host_devices(_DEVICES.value)
    if _UPDATE.value:
        unknown = sorted(set(_UPDATE.value) - set(FIXED) - set(DENSE) - {"collectives"})
        if unknown:
            raise ValueError(
                f"--update takes fields of {FIXED + DENSE + ('collectives',)}, got {unknown}"
            )
        import jax
        from jax.sharding import AxisType

        from experiments.measure import interleaved_times
        from redist.calibration import Calibration

        def seconds(f, *args):
            return interleaved_times([lambda: f(*args)], _REPEATS.value, 2)[0]["median"]

        measured = fixed_costs(seconds)
        mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(AxisType.Auto,))
        if set(DENSE) & set(_UPDATE.value):
            rates, halves = dense_rates(mesh, seconds)
            measured.update(dense_flops_per_s=rates, dense_half_flops=halves)
        fields = [k for k in _UPDATE.value if k != "collectives"]
        if "collectives" in _UPDATE.value:
            latency, bandwidth = _collectives(mesh, jax.device_count(), seconds)
            measured.update(latency_s=latency, bytes_per_s=bandwidth)
            fields += ["latency_s", "bytes_per_s"]
        cal = dataclasses.replace(Calibration.load(_OUT.value),
                                  **{k: measured[k] for k in fields})  # fmt: skip
        cal.save(_OUT.value)
        print(json.dumps(measured, indent=2))
        return
    cal = measure(_REPEATS.value)
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    cal.save(_OUT.value)
    print(cal.to_json())


if __name__ == "__main__":
    app.run(main)
