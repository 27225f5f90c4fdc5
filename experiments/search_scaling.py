"""Search time and plan quality against depth: the DP over layer segments and the greedy passes.

Usage:
    python -m experiments.search_scaling --workdir=workdir/search_scaling

For each workload and depth, plans with ``search`` restricted to each method (``dp``: the
dynamic program of :mod:`planner.chain`; ``greedy``: coordinate descent, run only up to
``--greedy_max_ops`` ops because its cost grows with depth squared) and records search time,
predicted time and the number of ops and anchors. Both methods also simulate the hand-written
strategies as seeds (see ``planner.schedule_search``) and keep the best. Writes ``results.jsonl`` and
``report.md``. Nothing is executed: this measures the planner itself, on the default CPU
calibration.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags, logging

from experiments.workloads import workload


def run(workloads: list[str], depths: list[int], mesh: dict, greedy_max_ops: int, workdir: str):
    import numpy as np

    import planner
    from planner.schedule_search import anchors, search

    rows = []
    for spec in workloads:
        kind, _, sizes = spec.partition(":")
        for depth in depths:
            fn, args = workload(kind, [int(s) for s in sizes.split("x")] + [depth],
                                np.random.default_rng(0))  # fmt: skip
            prog = planner.analyze(fn, *args)
            for method, kw in (
                ("dp", {"greedy_ops": 0}),
                ("greedy", {"dp": False, "greedy_ops": 10**9}),
            ):
                if method == "greedy" and len(prog.ops) > greedy_max_ops:
                    continue
                start = time.perf_counter()
                _, pred = search(prog, mesh, exhaustive_limit=0, **kw)
                row = {"workload": kind, "sizes": sizes, "layers": depth, "method": method,
                       "ops": len(prog.ops), "anchors": len(anchors(prog)),
                       "search_s": time.perf_counter() - start, "predicted_s": pred.time_s}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    lines = ["| workload | layers | ops | anchors | method | search s | predicted ms |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['workload']} {r['sizes']} | {r['layers']} | {r['ops']} | "
                     f"{r['anchors']} | {r['method']} | {r['search_s']:.2f} | "
                     f"{r['predicted_s'] * 1e3:.2f} |")  # fmt: skip
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return rows


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    f = flags.FLAGS
    mesh = {k: int(v) for k, v in (p.split(":") for p in f.mesh.split(","))}
    run(f.workloads, [int(d) for d in f.depths], mesh, f.greedy_max_ops, f.workdir)


if __name__ == "__main__":
    flags.DEFINE_list("workloads", ["transformer:4x64x8x16", "mlp:256x256"],
                      "kind:sizes without the depth (see experiments/workloads.py)")  # fmt: skip
    flags.DEFINE_list("depths", ["1", "2", "4", "8", "24"], "numbers of layers")
    flags.DEFINE_string("mesh", "a:2,b:2,c:2", "mesh axes name:size")
    flags.DEFINE_integer("greedy_max_ops", 1200, "greedy passes only up to this many ops")
    flags.DEFINE_string("workdir", "workdir/search_scaling", "where outputs go")
    app.run(main)
