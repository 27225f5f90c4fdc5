"""Memory check: the simulator's predicted peak per device against what the compiler allocates.

Usage:
    python -m experiments.memory_check --config=configs/memory_check/default.py --workdir=workdir/memory_check
    python -m experiments.memory_check --config=configs/memory_check/default.py --config.tpu=True \\
        --config.strategies=auto --workdir=workdir/memory_check

XLA:CPU (8 forced host devices): for every workload x strategy on ``config.mesh``, the schedule
(``auto``: the planner's search; ``auto_donated``: the same with the state the step returns
donated, ``plan(..., donate_argnums=...)``; hand-written strategies as in the planner benchmark),
its predicted peak per device (``planner.simulate``, the CPU calibration) and the compiled total
of that schedule run as ``plan.jit`` runs it (arguments + outputs + temporaries - aliased, from
``compiled.memory_analysis()``; on TPU the compiler's own peak, ``CompiledReport.total_bytes``). With ``config.tpu``: for every TPU case (a workload, a TPU
topology, mesh axes), the plan searched for those axes and priced for TPU v5p, compiled for the
topology by the TPU compiler on this host (``planner.topology_mesh``). With ``config.gpu``: for
every GPU case, the searched plan and the expert plans on compile-only GPUs of one host
(``planner.gpu_mesh``, ``pip install "redist[gpu]"``), compiled by XLA:GPU. Writes ``config.json``,
``results.jsonl`` (one row per case, as soon as it is measured), ``summary.json`` (per backend:
how many cases fall within ``config.tolerance`` of the compiled total, the worst ratios) and
``report.md``.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import NamedTuple

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.workloads import parse_workload, workload

STATE_ARGNUMS = {"mlp": (0,), "transformer": (0,), "moe": (0,), "lm": (0, 1), "lm_scan": (0, 1)}
"""The arguments a workload's step returns updated (parameters, optimizer state): what
``auto_donated`` donates."""


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    row = {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
           "temp_bytes": m.temp_size_in_bytes, "alias_bytes": m.alias_size_in_bytes}  # fmt: skip
    row["compiled_bytes"] = (row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"]
                             - row["alias_bytes"])  # fmt: skip
    return row


def cpu_case(name: str, kind: str, sizes: list[int], strategy: str, mesh, rng) -> dict | None:
    """One workload x strategy on the CPU mesh: predicted and compiled bytes per device; None
    when the strategy does not apply."""
    import jax

    import planner
    from experiments.planner_benchmark import schedule_for

    fn, args = workload(kind, sizes, rng)
    start = time.perf_counter()
    if strategy in ("auto", "auto_donated"):
        donate = STATE_ARGNUMS.get(kind, ()) if strategy == "auto_donated" else ()
        if strategy == "auto_donated" and not donate:
            return None
        p = planner.plan(fn, *args, mesh=mesh, memory_limit_bytes=None, donate_argnums=donate)
        predicted, jitted = p.prediction, p.jit()
    else:
        prog = planner.analyze(fn, *args)
        try:
            sched, _, _ = schedule_for(strategy, prog, mesh, tuple(mesh.axis_names))
        except ValueError:
            return None
        predicted = planner.simulate(prog, sched)
        out_tree = jax.tree.structure(jax.eval_shape(fn, *args))
        jitted = planner.AutoPlan.of(
            prog,
            sched,
            mesh,
            prediction=predicted,
            in_tree=jax.tree.structure(args),
            out_tree=out_tree,
        ).jit()  # run as plan.jit runs a searched plan
    search_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    row = {"backend": "cpu", "workload": name, "sizes": "x".join(map(str, sizes)),
           "mesh": ",".join(f"{k}:{v}" for k, v in mesh.shape.items()), "devices": mesh.size,
           "strategy": strategy, "predicted_bytes": predicted.peak_bytes,
           "plan_s": search_s, "compile_s": time.perf_counter() - start, **_memory(compiled)}  # fmt: skip
    row["ratio"] = row["predicted_bytes"] / row["compiled_bytes"]
    return row


class Case(NamedTuple):
    """A compiled case, ``"name=kind:sizes@target=axis:n,..."``, its workload built from shapes."""

    name: str
    kind: str
    sizes: list[int]
    target: str  # a TPU topology, or a GPU calibration
    axes: dict[str, int]
    axes_text: str
    fn: object
    shapes: tuple


def _parse_case(spec: str) -> Case:
    import jax
    import numpy as np

    from experiments.measure import parse_mesh

    work, _, where = spec.partition("@")
    target, _, axes_text = where.partition("=")
    name, kind, sizes = parse_workload(work)
    fn, args = workload(kind, sizes, np.random.default_rng(0))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    return Case(name, kind, sizes, target, parse_mesh(axes_text), axes_text, fn, shapes)


def _compiled_row(backend: str, case: Case, strategy: str, calibration: str, p, search_s: float,
                  mesh) -> dict:  # fmt: skip
    """The row of plan ``p`` of a parsed ``case``, compiled for ``mesh``."""
    start = time.perf_counter()
    report = p.compiled_report(mesh)
    row = {"backend": backend, "workload": case.name, "sizes": "x".join(map(str, case.sizes)),
           "topology": case.target, "mesh": case.axes_text,
           "devices": math.prod(case.axes.values()),
           "strategy": strategy, "calibration": calibration,
           "predicted_bytes": p.prediction.peak_bytes, "plan_s": search_s,
           "compile_s": time.perf_counter() - start, "compiled_bytes": report.total_bytes,
           "argument_bytes": report.argument_bytes, "output_bytes": report.output_bytes,
           "temp_bytes": report.temp_bytes, "alias_bytes": report.alias_bytes,
           "fits": report.fits}  # fmt: skip
    row["ratio"] = row["predicted_bytes"] / row["compiled_bytes"]
    return row


def tpu_case(spec: str, calibration: str) -> dict:
    """``"name=kind:sizes@topology=axis:n,..."``: the plan for those axes, priced on
    ``calibration``, compiled for the topology."""
    import planner
    from redist.calibration import Calibration

    case = _parse_case(spec)
    start = time.perf_counter()
    p = planner.plan(case.fn, *case.shapes, mesh=case.axes, calibration=Calibration.named(calibration),
                     memory_limit_bytes=None)  # fmt: skip
    search_s = time.perf_counter() - start
    return _compiled_row("tpu", case, "auto", calibration, p, search_s,
                         planner.topology_mesh(case.target, case.axes))  # fmt: skip


def gpu_cases(spec: str) -> list[dict]:
    """``"name=kind:sizes@gpu=axis:n,..."`` (``gpu`` a calibration with a compile-only
    description, e.g. ``h100_sxm``; one host): the searched plan, its state donated, and the
    expert plans on a mesh of those axes over compile-only GPUs (:func:`planner.gpu_mesh`),
    priced on that calibration, compiled by XLA:GPU."""
    import planner

    case = _parse_case(spec)
    fn, shapes, axes = case.fn, case.shapes, case.axes
    mesh = planner.gpu_mesh(axes, gpu=case.target)
    donated = STATE_ARGNUMS.get(case.kind, ())
    start = time.perf_counter()
    plans = {"auto": planner.plan(fn, *shapes, mesh=mesh, donate_argnums=donated,
                                  memory_limit_bytes=None)}  # fmt: skip
    search_s = time.perf_counter() - start
    data = tuple(a for a in ("data", "fsdp") if a in axes)
    plans.update(planner.expert_plans(fn, *shapes, mesh=mesh, data_axes=data or tuple(axes)[:1],
                                      donate_argnums=donated))  # fmt: skip
    return [_compiled_row("gpu", case, name, case.target, p, search_s if name == "auto" else 0.0, mesh)
            for name, p in plans.items()]  # fmt: skip


def run(config, workdir: str) -> dict:
    """Measure every case of ``config``; write outputs under ``workdir``; return the summary."""
    from experiments.measure import force_host_devices

    force_host_devices(8)
    import numpy as np

    import planner  # noqa: F401  before JAX starts its backends, for the GPU cases (planner.target.gpus)
    from experiments.measure import auto_mesh

    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    rows: list[dict] = []
    out = open(os.path.join(workdir, "results.jsonl"), "w")

    def keep(row: dict | None) -> None:
        if row is None:
            return
        rows.append(row)
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(f"{row['backend']} {row['workload']} {row['mesh']} {row['strategy']}: predicted "
              f"{_size(row['predicted_bytes'])}, compiled {_size(row['compiled_bytes'])}, "
              f"ratio {row['ratio']:.2f}", flush=True)  # fmt: skip

    if config.cpu:
        mesh = auto_mesh(config.mesh)
        for entry in (w for w in config.workloads.split(";") if w.strip()):
            name, kind, sizes = parse_workload(entry)
            for strategy in config.strategies.split(","):
                keep(cpu_case(name, kind, sizes, strategy, mesh, np.random.default_rng(0)))
    if config.tpu:
        for spec in (s for s in config.tpu_cases.split(";") if s.strip()):
            keep(tpu_case(spec, config.tpu_calibration))
    if config.get("gpu"):
        for spec in (s for s in config.gpu_cases.split(";") if s.strip()):
            for row in gpu_cases(spec):
                keep(row)
    out.close()
    summary = summarize(rows, config.tolerance)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report(rows, summary))
    return summary


def summarize(rows: list[dict], tolerance: float) -> dict:
    """Per backend (and for the planner's own plans): cases, how many predict the compiled total
    within ``tolerance``, the geometric mean of the ratio's spread and the extremes."""

    def stats(rs: list[dict]) -> dict:
        if not rs:
            return {"cases": 0}
        ratios = [r["ratio"] for r in rs]
        worst = max(rs, key=lambda r: abs(math.log(r["ratio"])))
        return {
            "cases": len(rs),
            "within_tolerance": sum(abs(x - 1) <= tolerance for x in ratios),
            "geomean_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)),
            "geomean_spread": math.exp(sum(abs(math.log(x)) for x in ratios) / len(ratios)),
            "min_ratio": min(ratios),
            "max_ratio": max(ratios),
            "worst": f"{worst['workload']} {worst['mesh']} {worst['strategy']}",
        }

    out: dict = {"tolerance": tolerance}
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        out[backend] = {"all": stats(mine),
                        "planned": stats([r for r in mine if r["strategy"].startswith("auto")])}  # fmt: skip
    return out


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def report(rows: list[dict], summary: dict) -> str:
    lines = ["# Predicted peak memory per device against the compiled program", "",
             "Compiled: arguments + outputs + temporaries - aliased (`memory_analysis()`; on TPU "
             "the compiler's peak, `peak_memory_in_bytes`); "
             "ratio: predicted / compiled.", "", "```", json.dumps(summary, indent=2), "```", "",
             "| backend | workload | sizes | mesh | strategy | predicted | compiled | ratio | "
             "arguments | outputs | temporaries | aliased |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        where = r["mesh"] if r["backend"] == "cpu" else f"{r['topology']} ({r['mesh']})"
        lines.append(
            f"| {r['backend']} | {r['workload']} | {r['sizes']} | {where} | {r['strategy']} | "
            f"{_size(r['predicted_bytes'])} | {_size(r['compiled_bytes'])} | {r['ratio']:.2f} | "
            f"{_size(r['argument_bytes'])} | {_size(r['output_bytes'])} | "
            f"{_size(r['temp_bytes'])} | {_size(r['alias_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    print(json.dumps(run(flags.FLAGS.config, flags.FLAGS.workdir), indent=2))


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", "configs/memory_check/default.py", "Config file.")
    flags.DEFINE_string("workdir", "workdir/memory_check", "Where outputs go.")
    app.run(main)
