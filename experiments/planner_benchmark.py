"""Planner benchmark: the automatic plan against hand-written strategies, measured and predicted.

Usage:
    python -m experiments.planner_benchmark --config=configs/planner_benchmark/default.py --workdir=workdir/planner

For every workload x strategy (all lowered the same way): measured time (interleaved repetitions,
inputs placed on the devices once as the program wants them),
per-device memory of the compiled program (arguments + outputs + temporaries), collective bytes from
the HLO, the simulator's predicted time / bytes / peak memory, the search time for ``auto``, and
the largest difference of its outputs from the unsharded program's (``max_error``, relative).
Writes ``results.jsonl``, ``summary.json`` (Spearman rank correlation of predicted and measured
times; per workload the auto plan's time over the best baseline's), ``report.md`` and figures.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.workloads import parse_workload, workload


def memory_limit(prog, mesh, fraction: float) -> int:
    """``fraction`` of the replicated program's predicted peak per device, in bytes."""
    import planner

    replicated = prog.schedule({}, mesh, default="replicate")
    return int(fraction * planner.simulate(prog, replicated).peak_bytes)


def schedule_for(strategy: str, prog, mesh, axes, limit: int | None = None):
    """``(schedule, search seconds, backend)``; ``auto_memory`` searches under ``limit`` bytes,
    ``auto_even`` without the splits only XLA's partitioner runs (uneven loops, masked lookups)."""
    from planner import baselines
    from planner.program.schedule import xla_splits
    from planner.solver.schedule_search import search

    if strategy in ("auto", "auto_memory", "auto_even"):
        limit = limit if strategy == "auto_memory" else None
        start = time.perf_counter()
        sched, _ = search(prog, mesh, memory_limit_bytes=limit, xla=strategy != "auto_even")
        # splits of padded tiles or masked lookups run under XLA's partitioner only (plan.jit)
        return sched, time.perf_counter() - start, "xla" if xla_splits(sched) else "explicit"
    if strategy == "fsdp":
        stored = baselines.fsdp_stored(prog, axes, dict(mesh.shape))
        return (
            prog.schedule(baselines.data_parallel(prog, axes), mesh, stored=stored),
            0.0,
            "explicit",
        )
    if strategy == "xla_propagation":  # batch-split inputs only; XLA propagates the rest
        return prog.schedule(baselines.data_parallel(prog, axes), mesh), 0.0, "xla-inputs"
    assign = {
        "replicated": lambda: {},
        "data": lambda: baselines.data_parallel(prog, axes),
        "megatron": lambda: baselines.megatron(prog, axes),
        "data_x_model": lambda: baselines.data_and_model(prog, axes[:1], axes[1:]),
        "batch_x_channels": lambda: baselines.batch_and_channels(
            prog, axes[:1], axes[1:], dict(mesh.shape)
        ),
        "batch_x_rows": lambda: baselines.batch_and_rows(
            prog, axes[:1], axes[1:], dict(mesh.shape)
        ),
    }[strategy]()
    default = "replicate" if strategy == "replicated" else "propagate"
    return prog.schedule(assign, mesh, default=default), 0.0, "explicit"


def max_error(got, want) -> float:
    """The largest difference between matching outputs, relative to the largest magnitude of any
    output (per output it would read noise as error: an attention key's bias has no gradient in
    exact arithmetic, and Adam turns rounding noise there into updates of the learning rate's
    size, whatever the layout). Infinite where shapes differ.

    Example:
        >>> max_error([np.array([1.0, 2.0])], [np.array([1.0, 4.0])])   # doctest: +SKIP
        0.5
    """
    import numpy as np

    got = [np.asarray(g, np.float64) for g in got]
    want = [np.asarray(w, np.float64) for w in want]
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return float("inf")
    scale = max((float(np.max(np.abs(w), initial=0.0)) for w in want), default=0.0) or 1.0
    return max((float(np.max(np.abs(g - w), initial=0.0)) for g, w in zip(got, want)),
               default=0.0) / scale  # fmt: skip


def spearman(a, b) -> float:
    import numpy as np

    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def run(config, workdir: str) -> dict:
    """Run every workload x strategy; write outputs under ``workdir``; return the summary."""
    from experiments.measure import force_host_devices

    force_host_devices(8)
    import jax
    import numpy as np

    import planner
    from experiments.measure import auto_mesh, hlo_collectives, interleaved_times

    mesh = auto_mesh(config.mesh)
    axes = tuple(mesh.axis_names)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    rng = np.random.default_rng(config.seed)
    results = []
    entries = [parse_workload(w) for w in config.workloads.split(";") if w.strip()]
    strategies = config.strategies.split(",")
    for name, kind, sizes in entries:
        fn, args = workload(kind, sizes, rng)
        prog = planner.analyze(fn, *args)
        limit = memory_limit(prog, mesh, config.memory_limit_fraction)
        rows, runs = [], []
        for strategy in strategies:
            try:
                sched, search_s, backend = schedule_for(strategy, prog, mesh, axes, limit)
            except ValueError as e:
                print(f"{name}/{strategy}: not applicable ({e})")
                continue
            pred = planner.simulate(prog, sched)
            lowered = planner.lower(prog, sched, mesh, backend=backend)
            compiled = lowered.lower(*args).compile()
            mem = compiled.memory_analysis()
            colls = hlo_collectives(compiled.as_text())
            # Inputs are placed once, as the program wants them (parameters stay on the devices
            # between steps): the timing is the program's, not a host-to-device copy per call.
            flat = jax.tree.leaves(args)  # the lowered programs take the leaves
            placed = jax.device_put(flat, list(compiled.input_shardings[0]))
            rows.append({
                "workload": name, "strategy": strategy, "search_s": search_s,
                "memory_limit_bytes": limit if strategy == "auto_memory" else None,
                "predicted_s": pred.time_s, "predicted_comm_bytes": pred.comm_bytes,
                "predicted_peak_bytes": pred.peak_bytes,
                "device_bytes": mem.argument_size_in_bytes + mem.output_size_in_bytes
                + mem.temp_size_in_bytes - mem.alias_size_in_bytes,
                "temp_bytes": mem.temp_size_in_bytes,
                "collectives": [[c.kind, c.bytes] for c in colls],
                "collective_bytes": sum(c.bytes for c in colls),
            })  # fmt: skip
            runs.append(lambda c=compiled, a=placed: c(*a))
            print(f"{name}/{strategy}: {pred}", flush=True)
        times = interleaved_times(runs, config.repeats, config.warmup, config.min_time_s)
        want = jax.tree.leaves(jax.jit(fn)(*args))  # the unsharded program
        for row, t, once in zip(rows, times, runs):
            row["measured_s"] = t["median"]
            row["measured_min_s"] = t["min"]
            row["max_error"] = max_error(jax.tree.leaves(once()), want)
        results += rows
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    summary = summarize(results)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report(results, summary))
    if config.figures:
        figures(results, workdir)
    return summary


def summarize(results: list[dict]) -> dict:
    per = {}
    for w in dict.fromkeys(r["workload"] for r in results):
        rows = [r for r in results if r["workload"] == w]
        auto = [r for r in rows if r["strategy"] == "auto"]
        base = [r for r in rows if not r["strategy"].startswith("auto")]
        limited = [r for r in rows if r["strategy"] == "auto_memory"]
        best = min(base, key=lambda r: r["measured_s"]) if base else None
        per[w] = {
            "best_baseline": best["strategy"] if best else None,
            "auto_over_best_baseline": auto[0]["measured_s"] / best["measured_s"] if auto and best else None,
            "predicted_best": min(rows, key=lambda r: r["predicted_s"])["strategy"],
            "measured_best": min(rows, key=lambda r: r["measured_s"])["strategy"],
        }  # fmt: skip
        if limited:
            r = limited[0]
            per[w]["auto_memory"] = {
                "limit_bytes": r["memory_limit_bytes"],
                "predicted_peak_bytes": r["predicted_peak_bytes"],
                "compiled_device_bytes": r["device_bytes"],
                "over_auto_time": r["measured_s"] / auto[0]["measured_s"] if auto else None,
            }
    return {
        "pairs": len(results),
        "spearman_predicted_vs_measured": spearman(
            [r["predicted_s"] for r in results], [r["measured_s"] for r in results]
        ),
        "workloads": per,
        "search_s_max": max((r["search_s"] for r in results), default=0.0),
    }


def report(results: list[dict], summary: dict) -> str:
    lines = ["# Planner benchmark", "", "```", json.dumps(summary, indent=2), "```", "",
             "| workload | strategy | measured ms | predicted ms | device MiB | predicted peak MiB "
             "| collective MiB | search s | max error |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        lines.append(
            f"| {r['workload']} | {r['strategy']} | {r['measured_s'] * 1e3:.3f} | "
            f"{r['predicted_s'] * 1e3:.3f} | {r['device_bytes'] / 2**20:.2f} | "
            f"{r['predicted_peak_bytes'] / 2**20:.2f} | {r['collective_bytes'] / 2**20:.2f} | "
            f"{r['search_s']:.2f} | {r.get('max_error', float('nan')):.1e} |"
        )
    return "\n".join(lines) + "\n"


def figures(results: list[dict], workdir: str) -> None:
    from experiments.measure import plain_log_ticks, pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.loglog(
        [r["predicted_s"] * 1e3 for r in results], [r["measured_s"] * 1e3 for r in results], "o"
    )
    ax.set(xlabel="predicted ms", ylabel="measured ms", title="Simulator vs measurement")
    plain_log_ticks(ax)
    save_figure(fig, os.path.join(workdir, "predicted_vs_measured.png"))
    work = list(dict.fromkeys(r["workload"] for r in results))
    strat = list(dict.fromkeys(r["strategy"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(strat)
    for k, s in enumerate(strat):
        vals = [next((r["measured_s"] * 1e3 for r in results
                      if r["workload"] == w and r["strategy"] == s), 0) for w in work]  # fmt: skip
        ax.bar([i + k * width for i in range(len(work))], vals, width, label=s)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(work))], work, rotation=20)
    ax.set(ylabel="measured ms", yscale="log")
    plain_log_ticks(ax)
    ax.legend(fontsize=7)
    save_figure(fig, os.path.join(workdir, "workloads.png"))


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    print(json.dumps(run(flags.FLAGS.config, flags.FLAGS.workdir), indent=2))


if __name__ == "__main__":
    # Flags are defined here, not at import, so that several runners can be imported together.
    config_flags.DEFINE_config_file(
        "config", "configs/planner_benchmark/default.py", "Config file."
    )
    flags.DEFINE_string("workdir", "workdir/planner_benchmark", "Where outputs go.")
    app.run(main)
