"""The paper's named problems: our plan and XLA's collectives side by side (compiled, not timed).

Usage:
    python -m experiments.paper_problems --problems=P1,P2,P3,P4,ex3_1
"""

from __future__ import annotations

import math

from absl import app, flags, logging

_PROBLEMS = flags.DEFINE_list("problems", ["P1", "P2", "P3", "P4", "ex3_1"], "Named problems.")


def describe(name: str) -> str:
    """Our plan, and both programs' compiled collectives and temporary memory, as text."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    import redist
    from experiments.measure import compile_stats
    from redist.problems import by_name

    p = by_name(name)
    n = math.prod(p.mesh.values())
    mesh = jax.make_mesh(tuple(p.mesh.values()), tuple(p.mesh), devices=jax.devices()[:n],
                         axis_types=(AxisType.Auto,) * len(p.mesh))  # fmt: skip
    src, dst = PartitionSpec(*p.src), PartitionSpec(*p.dst)
    plan = redist.plan(p.shape, src, dst, mesh)
    x = jax.device_put(np.zeros(p.shape, np.float32), NamedSharding(mesh, src))
    _, ours = compile_stats(jax.jit(lambda v: redist.redistribute(v, src, dst, mesh=mesh)), x)
    _, xla = compile_stats(jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, dst)), x)
    bound = plan.bound_bytes
    return "\n".join([
        f"== {name}: {plan.src} -> {plan.dst} on {plan.mesh} "
        f"({plan.src.global_size * 4 / 2**20:.0f} MB, bound {bound / 2**20:.1f} MB/device)",
        str(plan),
        f"  redist collectives: {ours.sequence() or '(none)'}; temp {ours.temp_bytes / bound:.2f}x bound",
        f"  XLA    collectives: {xla.sequence() or '(none)'}; temp {xla.temp_bytes / bound:.2f}x bound"
        + ("; XLA logged 'Involuntary full rematerialization'" if xla.full_remat else ""),
        "",
    ])  # fmt: skip


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    from experiments.measure import force_host_devices
    from redist.problems import by_name

    need = max(math.prod(by_name(n).mesh.values()) for n in _PROBLEMS.value)
    force_host_devices(need)
    for name in _PROBLEMS.value:
        print(describe(name))


if __name__ == "__main__":
    app.run(main)
