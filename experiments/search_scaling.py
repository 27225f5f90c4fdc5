"""Search time and plan quality against depth and mesh size: the DP over layer segments and the
greedy passes.

Usage:
    python -m experiments.search_scaling --workdir=workdir/search_scaling
    python -m experiments.search_scaling --workloads=transformer:64x128x16x64 --depths=2 \\
        --meshes="a:2,b:2,c:2;a:4,b:4,c:4;a:8,b:8,c:4" --methods=dp
    python -m experiments.search_scaling --workloads=lm_scan:256x512x1024x16x32768 --depths=2 \
        --meshes="data:16,fsdp:4,tensor:4;data:32,fsdp:16,tensor:8" --methods=dp \
        --calibration=tpu_v5p

For each workload, depth and mesh (``;``-separated; meshes are abstract: nothing is allocated
or executed, the programs are analysed from shapes), plans with ``search`` restricted to each
method (``dp``: the dynamic program of :mod:`planner.solver.chain`; ``greedy``: coordinate descent,
run only up to ``--greedy_max_ops`` ops because its cost grows with depth squared) and records
search time, predicted time and peak memory per device (and those of full replication), and the
number of ops and anchors; ``--calibration`` names the machine priced (a shipped calibration file).
Both methods also simulate the hand-written strategies as seeds (see
``planner.solver.schedule_search``) and keep the best. Writes ``results.jsonl``, ``report.md`` and
``search_scaling.png`` (search time against devices).
"""

from __future__ import annotations

import json
import math
import os
import time

from absl import app, flags, logging

from experiments.measure import parse_mesh
from experiments.workloads import with_depth, workload


def run(workloads: list[str], depths: list[int], meshes: list[dict], greedy_max_ops: int,
        workdir: str, methods: tuple[str, ...] = ("dp", "greedy"),
        calibration: str = "cpu") -> list[dict]:  # fmt: skip
    import jax
    import numpy as np

    import planner
    from planner.solver.schedule_search import anchors, search
    from redist.calibration import Calibration

    cal = Calibration.named(calibration)

    kwargs = {"dp": {"greedy_ops": 0}, "greedy": {"dp": False, "greedy_ops": 10**9}}
    rows = []
    for spec in workloads:
        kind, _, sizes = spec.partition(":")
        for depth in depths:
            dims = with_depth(kind, [int(s) for s in sizes.split("x")], depth)
            fn, args = workload(kind, dims, np.random.default_rng(0))
            shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
            del args  # planned from shapes alone
            prog = planner.analyze(fn, *shapes)
            for mesh in meshes:
                replicated = planner.simulate(prog, prog.schedule({}, mesh), cal)
                for method in methods:
                    if method == "greedy" and len(prog.ops) > greedy_max_ops:
                        continue
                    start = time.perf_counter()
                    _, pred = search(prog, mesh, cal, exhaustive_limit=0, **kwargs[method])
                    row = {"workload": kind, "sizes": sizes, "layers": depth, "method": method,
                           "mesh": ",".join(f"{k}:{v}" for k, v in mesh.items()),
                           "devices": math.prod(mesh.values()), "ops": len(prog.ops),
                           "anchors": len(anchors(prog)), "search_s": time.perf_counter() - start,
                           "predicted_s": pred.time_s, "replicated_s": replicated.time_s,
                           "peak_bytes": pred.peak_bytes,
                           "replicated_peak_bytes": replicated.peak_bytes}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    lines = [f"Calibration: {calibration}.", "",
             "| workload | layers | ops | anchors | mesh | devices | method | search s | predicted "
             "ms | replicated ms | peak GB | replicated peak GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['workload']} {r['sizes']} | {r['layers']} | {r['ops']} | "
                     f"{r['anchors']} | {r['mesh']} | {r['devices']} | {r['method']} | "
                     f"{r['search_s']:.2f} | {r['predicted_s'] * 1e3:.2f} | "
                     f"{r['replicated_s'] * 1e3:.2f} | {r['peak_bytes'] / 1e9:.3f} | "
                     f"{r['replicated_peak_bytes'] / 1e9:.3f} |")  # fmt: skip
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    figure(rows, os.path.join(workdir, "search_scaling.png"))
    return rows


def figure(rows: list[dict], path: str) -> None:
    from experiments.measure import plain_log_ticks, pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    words = {"dp": "dynamic-programming search", "greedy": "greedy search"}
    for key in dict.fromkeys((r["workload"], r["sizes"], r["layers"], r["method"]) for r in rows):
        pts = sorted((r["devices"], r["search_s"]) for r in rows
                     if (r["workload"], r["sizes"], r["layers"], r["method"]) == key)  # fmt: skip
        ax.plot([d for d, _ in pts], [s for _, s in pts], marker="o",
                label=f"{key[0]} {key[1]}, {key[2]} layer{'s' * (key[2] != 1)} "
                      f"({words.get(key[3], key[3])})")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain_log_ticks(ax)
    ax.set(xlabel="devices", ylabel="search time (s)", title="planner search time")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    f = flags.FLAGS
    meshes = [parse_mesh(m) for m in f.meshes.split(";")]
    run(f.workloads, [int(d) for d in f.depths], meshes, f.greedy_max_ops, f.workdir,
        tuple(f.methods), f.calibration)  # fmt: skip
    print(f"outputs in {f.workdir}")


if __name__ == "__main__":
    flags.DEFINE_list("workloads", ["transformer:4x64x8x16", "mlp:256x256"],
                      "kind:sizes without the depth (see experiments/workloads.py)")  # fmt: skip
    flags.DEFINE_list("depths", ["1", "2", "4", "8", "24"], "numbers of layers")
    flags.DEFINE_string("meshes", "a:2,b:2,c:2", "meshes, ';'-separated, each axis:size,...")
    flags.DEFINE_list("methods", ["dp", "greedy"], "search methods: dp, greedy")
    flags.DEFINE_string("calibration", "cpu", "calibration file the search prices with: cpu, "
                        "h100_sxm, tpu_v5p, tpu_v5e, tpu_v6e, tpu_v7x, tpu_v4 "
                        "(redist/calibrations)")  # fmt: skip
    flags.DEFINE_integer("greedy_max_ops", 1200, "greedy passes only up to this many ops")
    flags.DEFINE_string("workdir", "workdir/search_scaling", "where outputs go")
    app.run(main)
