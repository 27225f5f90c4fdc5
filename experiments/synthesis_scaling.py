"""Synthesis time against device count and array rank (no devices, no JAX).

Usage:
    python -m experiments.synthesis_scaling --workdir=workdir/synthesis_scaling
    python -m experiments.synthesis_scaling --config.meshes="w:8,x:8,y:8,z:8" --config.ranks=8

For every mesh and rank, draws random problems with the paper's recipe (each mesh axis splits a
random dimension or none, in both layouts) and times :func:`redist.plan` on a cold cache: search
and lowering together. Writes ``results.jsonl``, ``report.md`` and ``synthesis_scaling.png``.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time

from absl import app, flags, logging
from ml_collections import config_flags


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(config, workdir: str) -> list[dict]:
    """Time every problem; returns one row per (mesh, rank) with p50 / p90 / max seconds."""
    import redist
    from experiments.measure import parse_mesh
    from redist.problems import random_problem
    from redist.search import weak_paths
    from redist.synthesis import synthesize

    os.makedirs(workdir, exist_ok=True)
    rng = random.Random(config.seed)
    rows = []
    # one plan first, not timed: the first call loads what every later one shares (the
    # calibration file, lazy imports), 0.39 s that the first problem's row otherwise carried
    small = {"a": 2, "b": 2}
    warm = random_problem(random.Random(-1), small, max_elems=config.max_elems)
    redist.plan(warm.shape, warm.src, warm.dst, small, config.dtype, cost_model=config.cost_model)
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        for text in config.meshes.split(";"):
            mesh = parse_mesh(text)
            devices = math.prod(mesh.values())
            for rank in (int(r) for r in config.ranks.split(",")):
                times = []
                for _ in range(config.problems_per_cell):
                    p = random_problem(rng, mesh, min_rank=rank, max_rank=rank,
                                       max_elems=config.max_elems)  # fmt: skip
                    weak_paths.cache_clear()
                    synthesize.cache_clear()
                    start = time.perf_counter()
                    plan = redist.plan(p.shape, p.src, p.dst, mesh, config.dtype,
                                       cost_model=config.cost_model)  # fmt: skip
                    times.append(time.perf_counter() - start)
                    f.write(json.dumps({"mesh": text, "devices": devices, "rank": rank,
                                        "shape": p.shape, "src": p.src, "dst": p.dst,
                                        "seconds": times[-1], "steps": plan.kinds,
                                        "cost_bytes": plan.cost_bytes}) + "\n")  # fmt: skip
                row = {"mesh": text, "devices": devices, "rank": rank,
                       "p50_s": statistics.median(times), "p90_s": _percentile(times, 0.9),
                       "max_s": max(times)}  # fmt: skip
                rows.append(row)
                print(
                    f"{text:28s} {devices:5d} devices  rank {rank}  p50 {row['p50_s'] * 1e3:8.1f} ms"
                    f"  p90 {row['p90_s'] * 1e3:8.1f} ms  max {row['max_s'] * 1e3:8.1f} ms",
                    flush=True,
                )
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(markdown(rows, config))
    if config.figures:
        figure(rows, os.path.join(workdir, "synthesis_scaling.png"))
    return rows


def markdown(rows: list[dict], config) -> str:
    lines = [
        "# Synthesis time against mesh size and rank",
        "",
        f"{config.problems_per_cell} random problems per cell (cold cache, search and lowering), "
        f"cost model `{config.cost_model}`.",
        "",
        "| mesh | devices | rank | p50 ms | p90 ms | max ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['mesh']} | {r['devices']} | {r['rank']} | {r['p50_s']*1e3:.1f} | "
                     f"{r['p90_s']*1e3:.1f} | {r['max_s']*1e3:.1f} |")  # fmt: skip
    worst = max(rows, key=lambda r: r["max_s"])
    lines += [
        "",
        f"Slowest problem: {worst['max_s']:.3f} s ({worst['mesh']}, rank {worst['rank']}).",
    ]
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: str) -> None:
    from experiments.measure import plain_log_ticks, pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for rank in sorted({r["rank"] for r in rows}):
        # Several meshes may have one device count (4096: 8x8x8x8 and 32x16x8): one point per
        # count, the slowest of them, so that a line never runs up and down at one x.
        slowest: dict[int, float] = {}
        for r in rows:
            if r["rank"] == rank:
                slowest[r["devices"]] = max(slowest.get(r["devices"], 0.0), r["max_s"])
        pts = sorted(slowest.items())
        ax.plot([d for d, _ in pts], [s for _, s in pts], marker="o", label=f"rank {rank}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain_log_ticks(ax)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="1 s")
    ax.set_xlabel("devices")
    ax.set_ylabel("slowest synthesis (s)")
    ax.set_title("redist.plan: synthesis time (meshes of one size: the slowest)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    run(flags.FLAGS.config, flags.FLAGS.workdir)
    print(f"outputs in {flags.FLAGS.workdir}")


if __name__ == "__main__":
    config_flags.DEFINE_config_file(
        "config", "configs/synthesis_scaling/default.py", "Config file."
    )
    flags.DEFINE_string("workdir", "workdir/synthesis_scaling", "Where outputs go.")
    app.run(main)
