"""When to fold a final permutation into the all-to-all before it: timing both ways.

For problems whose plan is an all-to-all followed by a permutation, compares (a) one all-to-all
plus one ``ppermute`` with (b) the folded form, ``n`` rounds of ``ppermute`` of one chunk each,
over a range of chunk sizes. Prints a table; the default ``fold_min_bytes`` is read from it.

Usage:
    python -m experiments.fold_threshold
"""

from __future__ import annotations

from functools import partial

from absl import app, flags, logging

_REPEATS = flags.DEFINE_integer("repeats", 15, "Interleaved repetitions.")

# (mesh, shape builder for a tile scale s, src, dst): all need an all-to-all then a permutation.
FAMILIES = (
    ({"x": 4, "y": 2}, lambda s: (8 * s, 16, 8), ("x", "y"), ("y", "x")),
    (
        {"a": 2, "b": 2, "c": 2},
        lambda s: (16 * s, 16, 8),
        (("a", "b"), "c"),
        (None, "a", ("c", "b")),
    ),
    ({"a": 2, "b": 2, "c": 2}, lambda s: (16 * s, 192), (("c", "b"),), (None, ("b", "a", "c"))),
)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    from experiments.measure import force_host_devices

    force_host_devices(8)
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    import redist
    from experiments.measure import interleaved_times

    print("| group | chunk KiB | a2a + permute ms | folded ms | folded / unfolded |")
    print("|---|---|---|---|---|")
    for axes, shape_of, src, dst in FAMILIES:
        mesh = jax.make_mesh(
            tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes)
        )
        for scale in (4, 16, 64, 256, 1024, 2048):
            shape = shape_of(scale)
            unfolded = redist.plan(shape, src, dst, mesh, fold_min_bytes=1 << 62)
            folded = redist.plan(shape, src, dst, mesh, fold_min_bytes=0)
            if unfolded.kinds[-2:] != ("alltoall", "allpermute") or folded.kinds[-1] != "alltoall":
                continue
            a2a = folded.steps[-1]
            chunk = a2a.after.local_size * 4 // a2a.group_size
            x = jax.device_put(np.ones(shape, np.float32), NamedSharding(mesh, PartitionSpec(*src)))
            s, d = PartitionSpec(*src), PartitionSpec(*dst)
            f = [
                jax.jit(
                    partial(redist.redistribute, src_or_dst=s, dst=d, mesh=mesh, fold_min_bytes=m)
                )
                for m in (1 << 62, 0)
            ]
            t = interleaved_times([partial(g, x) for g in f], _REPEATS.value, 2)
            a, b = t[0]["median"] * 1e3, t[1]["median"] * 1e3
            print(f"| {a2a.group_size} | {chunk / 1024:.0f} | {a:.3f} | {b:.3f} | {b / a:.2f} |")


if __name__ == "__main__":
    app.run(main)
