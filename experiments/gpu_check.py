"""The simulator against one accelerator: whole training steps on one device, predicted and
measured (time, and memory as the compiler counts it).

Usage:
    python -m experiments.gpu_check --config=configs/gpu_check/default.py --workdir=results/gpu_check

On a machine with a GPU (or any one device) it measures each workload (median of ``repeats``
runs after ``warmup``, inputs on the device) and compiles it (arguments + outputs + temporaries -
aliased). Where the device is not the calibration's (this project's CI and laptops have no GPU),
``config.recorded`` compares the predictions with the figures recorded on a real H100 80GB HBM3
(JAX 0.11.2, CUDA 13), and says so in every row (``source``).

Writes ``results.jsonl``, ``summary.json`` (Spearman rank correlation and geomean of predicted /
measured time and memory; the share of workloads within 0.6-1.6) and ``report.md``.
"""

from __future__ import annotations

import json
import math
import os

from absl import app, flags, logging
from ml_collections import config_flags

# Measured on one H100 80GB HBM3 (JAX 0.11.2, CUDA 13): median ms of 15 runs after 3 warm-ups,
# and the compiled program's arguments + outputs + temporaries - aliased in MiB (None: not kept).
H100_RECORDED = {
    "matmul": (3.20, 800), "mlp": (5.72, 800), "attention": (3.87, 4240),
    "transformer": (21.17, 6784), "lm": (52.99, 14713), "lm_scan": (130.57, 33954),
    "lm_unrolled": (81.1, None), "llama_bf16": (3.66, 941), "llama_scan": (120.51, 33183),
    "llama_unrolled": (78.9, 19801),
}  # fmt: skip


def build(kind: str, sizes: list[int], rng, shapes_only: bool = False):
    """``(fn, args)`` of a workload: the planner benchmark's kinds (:mod:`experiments.workloads`),
    ``lm`` / ``lm_scan`` / ``lm_unrolled`` (the scanned LM with its loop unrolled) and ``llama`` /
    ``llama_unrolled`` (:func:`experiments.language_model.llama_step`: batch x seq x d x heads x
    layers x vocab x ffn, bfloat16 parameters); ``shapes_only``: the arguments as
    ``jax.ShapeDtypeStruct``s (nothing drawn: compared with recorded figures, nothing runs)."""
    from experiments.language_model import llama_step, lm_step
    from experiments.workloads import workload

    if kind in ("lm", "lm_scan", "lm_unrolled"):
        return lm_step(*sizes, scan=kind != "lm", unroll=kind == "lm_unrolled", rng=rng,
                       shapes_only=shapes_only)  # fmt: skip
    if kind in ("llama", "llama_unrolled"):
        return llama_step(*sizes, rng=rng, unroll=kind == "llama_unrolled",
                          shapes_only=shapes_only)  # fmt: skip
    return workload(kind, sizes, rng, shapes_only)


def run(config, workdir: str) -> dict:
    import jax
    import numpy as np

    import planner
    from experiments.measure import interleaved_times
    from redist.calibration import Calibration

    cal = Calibration.named(config.calibration)
    on_device = jax.default_backend() == cal.backend
    if config.recorded and on_device:
        raise ValueError("recorded=True compares with recorded figures; on a "
                         f"{cal.backend} device, set recorded=False to measure")  # fmt: skip
    os.makedirs(workdir, exist_ok=True)
    rng = np.random.default_rng(config.seed)
    here = compile_only_device(config) if config.recorded else None
    rows = []
    for entry in config.workloads.split(";"):
        name, _, spec = entry.strip().partition("=")
        kind, _, sizes = spec.partition(":")
        fn, args = build(kind, [int(s) for s in sizes.split("x")], rng, config.recorded)
        prog = planner.analyze(fn, *args)
        sched = planner.make_schedule(prog, {}, {"d": 1}, default="replicate")
        pred = planner.simulate(prog, sched, cal)
        row = {"workload": name, "kind": kind, "predicted_ms": pred.time_s * 1e3,
               "predicted_mib": pred.peak_bytes / 2**20}  # fmt: skip
        if config.recorded:
            ms, mib = H100_RECORDED[name]
            row.update(
                measured_ms=ms, compiled_mib=mib, source="recorded on an H100 80GB HBM3, JAX 0.11.2"
            )
            if here is not None and _compiled_here(config, name):
                row["compiled_here_mib"] = compiled_here_mib(fn, args, here)
                row["memory_ratio_here"] = row["predicted_mib"] / row["compiled_here_mib"]
        else:
            jitted = jax.jit(fn)
            compiled = jitted.lower(*args).compile()
            m = compiled.memory_analysis()
            placed = jax.device_put(args)
            t = interleaved_times([lambda f=jitted, a=placed: f(*a)], config.repeats,
                                  config.warmup)[0]  # fmt: skip
            row.update(measured_ms=t["median"] * 1e3, source=f"measured on {jax.devices()[0]}",
                       compiled_mib=(m.argument_size_in_bytes + m.output_size_in_bytes
                                     + m.temp_size_in_bytes - m.alias_size_in_bytes) / 2**20)  # fmt: skip
        row["time_ratio"] = row["predicted_ms"] / row["measured_ms"]
        row["memory_ratio"] = (row["predicted_mib"] / row["compiled_mib"]
                               if row["compiled_mib"] else None)  # fmt: skip
        rows.append(row)
        print(f"{name}: predicted {row['predicted_ms']:.2f} ms, measured {row['measured_ms']:.2f} "
              f"ms ({row['time_ratio']:.2f})", flush=True)  # fmt: skip
    summary = summarize(rows, cal.backend if not config.recorded else "h100 (recorded)")
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report(rows, summary, config.calibration))
    return summary


def _compiled_here(config, name: str) -> bool:
    """Whether workload ``name`` is compiled by XLA:GPU here (``config.compile_here``: names,
    comma-separated; empty: all)."""
    chosen = config.get("compile_here", "")
    return not chosen or name in chosen.split(",")


def compile_only_device(config):
    """A compile-only GPU of the calibration's chip (:func:`planner.gpu_mesh`), where XLA:GPU is
    installed and ships a description of it; else None."""
    import planner

    try:
        return planner.gpu_mesh({"gpu": 1}, gpu=config.calibration).devices.flat[0]
    except ValueError:  # XLA:GPU missing, or no description of the chip shipped
        return None


def compiled_here_mib(fn, args, device) -> float:
    """MiB the program needs compiled by XLA:GPU for ``device`` (arguments + outputs +
    temporaries - aliased), nothing run."""
    import jax

    import planner

    placed = jax.sharding.SingleDeviceSharding(device)
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), args)
    return planner.compiled_report(jax.jit(fn), *structs).total_bytes / 2**20


def geomean(xs) -> float:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summarize(rows: list[dict], against: str) -> dict:
    from experiments.planner_benchmark import spearman

    times = [r["time_ratio"] for r in rows]
    mem = [r for r in rows if r["memory_ratio"] is not None]
    return {
        "against": against,
        "workloads": len(rows),
        "time_ratio_geomean": geomean(times),
        "time_ratio_range": [min(times), max(times)],
        "time_within_0.6_1.6": sum(0.6 <= t <= 1.6 for t in times),
        "spearman_time": spearman(
            [r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows]
        ),  # fmt: skip
        "memory_ratio_geomean": geomean(r["memory_ratio"] for r in mem),
        "memory_within_25pct": sum(0.75 <= r["memory_ratio"] <= 1.25 for r in mem),
        "memory_workloads": len(mem),
        **_here(rows),
    }


def _here(rows: list[dict]) -> dict:
    """The memory figures against XLA:GPU compiling here for a compile-only GPU, if it did."""
    here = [r["memory_ratio_here"] for r in rows if r.get("memory_ratio_here")]
    if not here:
        return {}
    return {"memory_ratio_geomean_compiled_here": geomean(here),
            "memory_within_25pct_compiled_here": sum(0.75 <= x <= 1.25 for x in here),
            "memory_workloads_compiled_here": len(here)}  # fmt: skip


def report(rows: list[dict], summary: dict, calibration: str) -> str:
    lines = [f"# `{calibration}` against {summary['against']}", "", "```",
             json.dumps(summary, indent=2), "```", "",
             "| workload | predicted ms | measured ms | ratio | predicted MiB | compiled MiB | ratio "
             "| compiled here MiB | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        mem = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}"
        compiled = "-" if r["compiled_mib"] is None else f"{r['compiled_mib']:.0f}"
        here = r.get("compiled_here_mib")
        here = "- | -" if here is None else f"{here:.0f} | {r['memory_ratio_here']:.2f}"
        lines.append(f"| {r['workload']} | {r['predicted_ms']:.2f} | {r['measured_ms']:.2f} | "
                     f"{r['time_ratio']:.2f} | {r['predicted_mib']:.0f} | {compiled} | {mem} | "
                     f"{here} |")  # fmt: skip
    lines += ["", f"Measurements: {rows[0]['source'] if rows else '-'}. Compiled here: by "
              "XLA:GPU on this host for a compile-only GPU of the calibration's chip "
              "(`planner.gpu_mesh`), nothing run."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    print(json.dumps(run(flags.FLAGS.config, flags.FLAGS.workdir), indent=2))


if __name__ == "__main__":
    # Flags are defined here, not at import, so that several runners can be imported together.
    config_flags.DEFINE_config_file("config", "configs/gpu_check/default.py", "Config file.")
    flags.DEFINE_string("workdir", "results/gpu_check", "Where to write the results.")
    app.run(main)
