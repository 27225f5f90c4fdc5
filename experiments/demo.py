"""Demo: redistribute the paper's problems on 8 simulated CPU devices, print plans, check values.

Usage:
    python -m experiments.demo [--devices=8] [--scale=0.25]

Problems that need more devices than available are planned (pure) but not run.
"""

from __future__ import annotations

import math

from absl import app, flags, logging

_DEVICES = flags.DEFINE_integer("devices", 8, "Number of simulated host CPU devices.")
_SCALE = flags.DEFINE_float("scale", 0.25, "Shrink every dimension of the paper's shapes by this.")


def _shrink(shape, src_axes_sizes, scale):
    """Scale a shape down, keeping every dimension divisible by the axes that split it."""
    return tuple(max(s, (int(n * scale) // s) * s) for n, s in zip(shape, src_axes_sizes))


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    from experiments.measure import force_host_devices

    force_host_devices(_DEVICES.value)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import redist
    from redist.problems import PAPER_PROBLEMS
    from redist.types import DistType, MeshShape

    devices = jax.devices()
    print(f"{len(devices)} devices ({devices[0].platform})\n")
    ok = 0
    for p in PAPER_PROBLEMS:
        ms = MeshShape.of(p.mesh)
        parts = [
            math.lcm(*(
                math.prod(ms.sizes[a] for a in ((e,) if isinstance(e, str) else e or ()))
                for e in (spec[i] if i < len(spec) else None for spec in (p.src, p.dst))
            ))
            for i in range(len(p.shape))
        ]  # fmt: skip
        shape = _shrink(p.shape, parts, _SCALE.value)
        plan = redist.plan(shape, p.src, p.dst, p.mesh)
        print(f"== {p.name}: {DistType.from_spec(p.src, shape, ms)} -> "
              f"{DistType.from_spec(p.dst, shape, ms)}")  # fmt: skip
        print(plan)
        if ms.num_devices > len(devices):
            print(f"(planned only: needs {ms.num_devices} devices)\n")
            continue
        mesh = jax.make_mesh(
            tuple(p.mesh.values()), tuple(p.mesh), devices=devices[: ms.num_devices]
        )
        arr = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        x = jax.device_put(arr, NamedSharding(mesh, PartitionSpec(*p.src)))
        y = redist.redistribute(x, PartitionSpec(*p.dst))
        exact = np.array_equal(np.asarray(y), arr) and y.sharding.is_equivalent_to(
            NamedSharding(mesh, PartitionSpec(*p.dst)), len(shape)
        )
        ok += exact
        print(f"ran on {ms.num_devices} devices: {'exact' if exact else 'WRONG'}\n")
        if not exact:
            raise SystemExit(f"{p.name}: redistribution was not exact")
    print(f"{ok} problems redistributed exactly")


if __name__ == "__main__":
    app.run(main)
