"""One plan, four ways to run it: the lowerings against XLA's SPMD partitioning of the same plan.

Usage:
    python -m experiments.lowering_benchmark --config=configs/lowering_benchmark/default.py --workdir=workdir/lowering

For every workload the planner's searched schedule (and, for reference, plain data parallelism) is
run as

- ``xla``: the user's ops under ``jax.jit`` with a sharding constraint on every value the plan
  lays out, all layout changes left to XLA's SPMD partitioner (the reference);
- ``plan.jit``: the same, with ``redist`` making the changes XLA would rematerialise or that
  ``redist`` is predicted to make faster (what ``AutoPlan.jit`` runs);
- ``explicit``: the whole program as one ``shard_map`` (ops on tiles, ``redist`` between them);
- ``per-op``: one ``shard_map`` per op (the reference lowering the explicit one grew from);
- ``xla again``: the reference once more, so the run measures its own noise floor.

Times are medians of interleaved repetitions, inputs placed once as the program wants them.
Writes ``results.jsonl``, ``summary.json`` (per lowering, the geometric mean and range of its
time over ``xla``'s) and ``report.md``.
"""

from __future__ import annotations

import json
import math
import os

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.workloads import parse_workload, workload

LOWERINGS = {  # name -> (backend, moves)
    "xla": ("xla", "xla"),
    "xla again": ("xla", "xla"),  # the same program timed twice: the noise floor of this run
    "plan.jit": ("xla", "auto"),
    "explicit": ("explicit", "auto"),
    "per-op": ("per-op", "auto"),
}


def run(config, workdir: str) -> dict:
    """Run every workload x schedule x lowering; write outputs under ``workdir``."""
    from experiments.measure import force_host_devices

    force_host_devices(8)
    import jax
    import numpy as np

    import planner
    from experiments.measure import auto_mesh, hlo_collectives, interleaved_times
    from planner import baselines
    from planner.solver.schedule_search import search

    mesh = auto_mesh(config.mesh)
    sizes, axes = dict(mesh.shape), tuple(mesh.axis_names)
    os.makedirs(workdir, exist_ok=True)
    rng = np.random.default_rng(config.seed)
    rows = []
    for entry in config.workloads.split(";"):
        name, kind, dims = parse_workload(entry)
        fn, args = workload(kind, dims, rng)
        prog = planner.analyze(fn, *args)
        schedules = {"auto": search(prog, sizes)[0]}
        if "data" in config.schedules:
            try:
                schedules["data"] = prog.schedule(baselines.data_parallel(prog, axes), mesh)
            except ValueError as e:  # the batch does not divide over the mesh
                print(f"{name}/data: not applicable ({e})")
        for label, sched in schedules.items():
            runs, found = [], []
            for lowering, (backend, moves) in LOWERINGS.items():
                lowered = planner.lower(prog, sched, mesh, backend=backend, moves=moves)
                compiled = lowered.lower(*args).compile()
                flat = jax.tree.leaves(args)
                placed = jax.device_put(flat, list(compiled.input_shardings[0]))
                colls = hlo_collectives(compiled.as_text())
                found.append({
                    "workload": name, "schedule": label, "lowering": lowering,
                    "collectives": len(colls), "collective_bytes": sum(c.bytes for c in colls),
                    "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                    "redist_moves": sum(c.use_redist for c in lowered.choices.values()),
                })  # fmt: skip
                runs.append(lambda c=compiled, a=placed: c(*a))
            times = interleaved_times(runs, config.repeats, config.warmup, config.min_time_s)
            base = times[0]["median"]
            for row, t in zip(found, times):
                row["measured_s"] = t["median"]
                row["over_xla"] = t["median"] / base
                print(json.dumps(row), flush=True)
            rows += found
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    summary = summarize(rows)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report(rows, summary))
    return summary


def summarize(rows: list[dict]) -> dict:
    """Per lowering: geometric mean, min and max of its time over ``xla``'s, over all runs."""
    out = {}
    for lowering in LOWERINGS:
        ratios = [r["over_xla"] for r in rows if r["lowering"] == lowering]
        if ratios:
            out[lowering] = {
                "geomean_over_xla": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                "min_over_xla": min(ratios),
                "max_over_xla": max(ratios),
            }
    return out


def report(rows: list[dict], summary: dict) -> str:
    lines = ["# One plan, four lowerings", "", "Time over XLA's SPMD partitioning of the same plan "
             "(`xla`); below 1 is faster.", "", "| lowering | geomean | min | max |",
             "|---|---|---|---|"]  # fmt: skip
    for name, s in summary.items():
        lines.append(f"| {name} | {s['geomean_over_xla']:.2f} | {s['min_over_xla']:.2f} | "
                     f"{s['max_over_xla']:.2f} |")  # fmt: skip
    lines += ["", "| workload | schedule | lowering | ms | over xla | collectives | collective "
              "MiB | temp MiB | moves by redist |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['schedule']} | {r['lowering']} | {r['measured_s'] * 1e3:.3f} "
            f"| {r['over_xla']:.2f} | {r['collectives']} | {r['collective_bytes'] / 2**20:.2f} | "
            f"{r['temp_bytes'] / 2**20:.2f} | {r['redist_moves']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    print(json.dumps(run(flags.FLAGS.config, flags.FLAGS.workdir), indent=2))
    print(f"outputs in {flags.FLAGS.workdir}")


if __name__ == "__main__":
    config_flags.DEFINE_config_file(
        "config", "configs/lowering_benchmark/default.py", "Config file."
    )
    flags.DEFINE_string("workdir", "workdir/lowering", "Where outputs go.")
    app.run(main)
