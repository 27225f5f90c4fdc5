"""Planning a pod from a laptop: the planner's plans of language-model training steps against the
strategies experts write, each compiled by the TPU compiler for the pod it is meant for.

Usage:
    python -m experiments.pod_plans --config=configs/pod_plans/default.py --workdir=workdir/pod_plans

For every model x topology (``config.models``, ``config.topologies``): the step is built from
shapes only (nothing allocated), planned by ``planner.plan`` (``searched``; parameters and
optimizer state donated, memory bounded by the chip's HBM as by default) and laid out by the
expert strategies of ``planner.expert_plans`` (``data_parallel``, ``fsdp``, ``fsdp_tensor``:
data-like axes ``data`` and ``fsdp``, tensor axis ``tensor``). Each plan is compiled for the
topology (``planner.topology_mesh``) and read:

- memory: the compiled total per device (``CompiledReport.total_bytes``: the TPU compiler's peak), whether it
  fits HBM (the compiler refuses a program that does not), against the planner's prediction;
- time: the compiled-program estimate, the compiler's ``optimal_seconds`` for the kernels plus
  the HLO's collectives priced by the calibration, each as often as it runs
  (:mod:`planner.target.compiled_time`; where libtpu's ``optimal_seconds`` is not positive, as it is
  on v6e, the calibration's roofline of the compiler's flops and bytes). The compiler counts a loop's body once in ``optimal_seconds``,
  so the kernels' time of an ``L``-layer scanned model is taken from the same plan compiled with
  1 and 2 layers, unrolled: ``t1 + (L - 1) (t2 - t1)`` (every layer costs the same; parameters,
  gradients and optimizer updates of stacked layers grow linearly with ``L``). A plan whose
  layouts split the layer dimension cannot be carried to 1 and 2 layers: its estimate is n/a.

Where no plan of a model fits a topology and ``config.remat_fallback``, the same model with
every layer under ``jax.checkpoint`` (``<model>+remat``, as MaxText's ``remat_policy="full"``) is
measured there too, with every strategy.

Rows are appended to ``results.jsonl`` as they are measured, and a rerun measures only the
missing (model, topology, strategy) rows. Each searched plan is kept in ``plans/`` (``plan.save``
JSON, to load onto the pod with ``planner.load``, and its ``explain()``). ``summary.json`` states per model x topology whether
the searched plan fits and its estimate against the best expert strategy's; ``report.md`` has
the table, ``pod_plans.png`` the figure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Iterator

from absl import app, flags, logging
from ml_collections import config_flags

STRATEGIES = ("searched", "data_parallel", "fsdp", "fsdp_tensor")

MODELS = {
    # name: (builder, keyword arguments; ``layers`` is the scanned depth)
    "lm_134m": ("lm", dict(batch=256, seq=1024, d=1024, heads=16, layers=8, vocab=32768)),
    "lm_6.6b": ("lm", dict(batch=256, seq=2048, d=4096, heads=32, layers=32, vocab=32768)),
    "llama_1b": (
        "llama",
        dict(batch=256, seq=2048, d=2048, heads=32, layers=22, vocab=32000, ffn=5632),
    ),  # fmt: skip
    "llama_8b": (
        "llama",
        dict(batch=256, seq=2048, d=4096, heads=32, layers=32, vocab=32000, ffn=14336),
    ),  # fmt: skip
    "lm_tiny": ("lm", dict(batch=8, seq=32, d=64, heads=4, layers=2, vocab=128)),
}
"""The language-model family: flax nnx + optax adamw, fp32 (``lm``, experiments.language_model
``lm_step``), and Llama-like (``llama``: RMSNorm, rotary, SwiGLU, bf16 parameters with fp32
AdamW; ``llama_step``); layers scanned."""


REMAT = "+remat"
"""A model name ending so (``llama_1b+remat``): its layers under ``jax.checkpoint``. Measured
when ``config.remat_fallback`` and no plan of the model itself fits."""


def model_config(model: str) -> tuple[str, dict, bool]:
    """``(builder, keyword arguments, remat)`` of ``model`` (a name of ``MODELS``, with
    ``REMAT`` or not)."""
    name = model.removesuffix(REMAT)
    if name not in MODELS:
        raise ValueError(f"model {model!r} is not one of {sorted(MODELS)} (optionally +remat)")
    kind, kw = MODELS[name]
    return kind, kw, model.endswith(REMAT)


def build(model: str, layers: int | None = None, unroll: int | bool = 1):
    """``(step, args)`` of ``model`` from shapes only, optionally with another depth."""
    from experiments.language_model import llama_step, lm_step

    kind, kw, remat = model_config(model)
    kw = {**kw, **({"layers": layers} if layers is not None else {})}
    if kind == "lm":
        b, s, d, h, n, v = (kw[k] for k in ("batch", "seq", "d", "heads", "layers", "vocab"))
        return lm_step(b, s, d, h, n, v, True, shapes_only=True, unroll=unroll, remat=remat)
    b, s, d, h, n, v, f = (kw[k] for k in ("batch", "seq", "d", "heads", "layers", "vocab", "ffn"))
    return llama_step(b, s, d, h, n, v, f, shapes_only=True, unroll=unroll, remat=remat)


def parameters(args) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(a.shape) for a in jax.tree.leaves(args[0])))


def parse_topology(text: str) -> tuple[str, dict[str, int]]:
    """``"v5p:4x4x4@data:4,fsdp:4,tensor:4"`` -> ``("v5p:4x4x4", {"data": 4, ...})``."""
    from experiments.measure import parse_mesh

    topology, _, axes = text.partition("@")
    if not axes:
        raise ValueError(f"topology {text!r}: write it as topology@axis:size,... ")
    return topology, parse_mesh(axes)


def _compiled(plan, cal, n: int) -> dict:
    """The compiler's verdict on ``plan`` (bound to its topology mesh)."""
    from planner.target.compiled import plan_compile_and_report
    from planner.target.compiled_time import compiled_time

    start = time.perf_counter()
    compiled, report = plan_compile_and_report(plan)
    row = {"compile_s": time.perf_counter() - start, "fits": report.fits,
           "compiled_bytes": report.total_bytes, "hbm_bytes": report.hbm_bytes,
           "temp_bytes": report.temp_bytes}  # fmt: skip
    if compiled is not None:
        ct = compiled_time(compiled, cal, n)
        row.update(compiled_optimal_s=ct.optimal_seconds, compiled_collective_s=ct.collective_s,
                   compiled_flops=ct.flops, collectives=ct.collectives,
                   kernel_source=ct.kernel_source)  # fmt: skip
    return row


def _layer_optimal(plan, model: str, layers: int, mesh, cal) -> float | None:
    """:func:`layer_optimal` of ``plan`` of ``model``."""
    return layer_optimal(plan, lambda depth: build(model, depth, unroll=True), layers, mesh, cal,
                         model)  # fmt: skip


def extrapolated(times: list[float], layers: int) -> float:
    """A step's kernel seconds at depth ``layers`` from its seconds at 1 and 2 layers: every
    layer costs the same, ``t1 + (layers - 1) (t2 - t1)``."""
    return times[0] + (layers - 1) * (times[1] - times[0])


def layer_optimal(plan, build_at, layers: int, mesh, cal, name: str = "") -> float | None:
    """The kernels' seconds of ``plan`` at depth ``layers``, from its schedule carried onto the
    same model at 1 and 2 layers (``build_at(depth)``: ``(step, args)``, unrolled) and compiled:
    ``t1 + (layers - 1) (t2 - t1)``; None when its layouts do not carry (a split layer
    dimension)."""
    import jax

    from planner.autoplan import AutoPlan
    from planner.calls import Signature
    from planner.program.analysis import analyze
    from planner.program.schedule import Schedule
    from planner.target.compiled import input_structs
    from planner.target.compiled_time import compiled_time

    times = []
    for depth in (1, 2):
        step, args = build_at(depth)
        sig = Signature.of(args, {})
        traced, values = sig.traced(step, args, {})
        prog = analyze(traced, *values)
        if [o.name for o in prog.ops] != [o.name for o in plan.program.ops]:
            return None
        out_tree = jax.tree.structure(jax.eval_shape(traced, *values))
        sched = plan.schedule
        try:
            target = Schedule(prog, sched.mesh, sched.assign, sched.stored)
            small = AutoPlan.of(prog, target, mesh, calibration=cal, signature=sig,
                                out_tree=out_tree)  # fmt: skip
            compiled = small.jit().lower(*input_structs(small)).compile()
        except Exception as e:  # noqa: BLE001  (layouts that do not carry: reported as n/a)
            logging.warning("%s at %d layers: %s", name, depth, str(e)[:200])
            return None
        times.append(compiled_time(compiled, cal).optimal_seconds)
    return extrapolated(times, layers)


def measure(
    model: str, topology: str, axes: dict, strategies, done: set, config, workdir: str
) -> Iterator[dict]:
    """Rows of the strategies of ``model`` on ``topology`` not yet in ``done``, each as soon as
    it is measured; the searched plan is saved under ``workdir/plans`` (``plan.save``) with its
    ``explain()``."""
    import planner
    from planner.baselines import expert_plans
    from planner.cost.memory import MemoryLimitError, default_calibration

    todo = [s for s in strategies if (model, topology, s) not in done]
    if not todo:
        return
    step, args = build(model)
    layers = model_config(model)[1]["layers"]
    mesh = planner.topology_mesh(topology, axes)
    cal = default_calibration(mesh)
    base = {"model": model, "parameters": parameters(args), "topology": topology,
            "mesh": ",".join(f"{k}:{v}" for k, v in axes.items()), "devices": mesh.size,
            "device_kind": mesh.devices.flat[0].device_kind}  # fmt: skip
    plans = {}
    if "searched" in todo:
        start = time.perf_counter()
        try:
            plans["searched"] = planner.plan(step, *args, mesh=mesh, donate_argnums=(0, 1))
        except MemoryLimitError as e:
            yield {**base, "strategy": "searched", "search_s": time.perf_counter() - start,
                   "fits": False, "error": str(e)[:500]}  # fmt: skip
    experts = [s for s in todo if s != "searched"]
    if experts:
        made = expert_plans(step, *args, mesh=mesh, calibration=cal, donate_argnums=(0, 1))
        plans.update({s: made[s] for s in experts if s in made})
    if "searched" in plans and config.get("save_plans", True):
        stem = os.path.join(workdir, "plans", f"{model}@{topology.replace(':', '_')}")
        os.makedirs(os.path.dirname(stem), exist_ok=True)
        plans["searched"].save(stem + ".plan.json")
        with open(stem + ".txt", "w") as f:
            f.write(plans["searched"].explain() + "\n")
    for strategy, p in plans.items():
        row = {**base, "strategy": strategy, "search_s": p.search_s,
               "predicted_s": p.prediction.time_s,
               "predicted_peak_bytes": p.prediction.peak_bytes}  # fmt: skip
        row.update(_compiled(p, cal, mesh.size))
        if config.layer_estimate and "compiled_optimal_s" in row:
            optimal = _layer_optimal(p, model, layers, mesh, cal)
            if optimal is not None:
                row["layer_optimal_s"] = optimal
                row["estimate_s"] = optimal + row["compiled_collective_s"]
        elif "compiled_optimal_s" in row:
            row["estimate_s"] = row["compiled_optimal_s"] + row["compiled_collective_s"]
        _say(row)
        yield row


def _say(row: dict) -> None:
    gb = lambda b: "?" if b is None else f"{b / 1e9:.2f} GB"  # noqa: E731
    est = row.get("estimate_s")
    print(f"{row['model']} on {row['topology']} ({row['mesh']}) {row['strategy']}: "
          f"{'fits' if row.get('fits') else 'does NOT fit'}, compiled {gb(row.get('compiled_bytes'))}"
          f" vs predicted {gb(row.get('predicted_peak_bytes'))}; estimate "
          f"{'n/a' if est is None else f'{est * 1e3:.1f} ms'} vs predicted "
          f"{row.get('predicted_s', float('nan')) * 1e3:.1f} ms; search {row['search_s']:.0f} s, "
          f"compile {row.get('compile_s', 0):.0f} s", flush=True)  # fmt: skip


def summarize(rows: list[dict]) -> dict:
    """Per model x topology: the searched plan against the best expert strategy."""
    cases: dict = {}
    for r in rows:
        cases.setdefault(f"{r['model']} @ {r['topology']}", {})[r["strategy"]] = r
    out = {}
    for case, by in cases.items():
        s = by.get("searched", {})
        experts = {k: v for k, v in by.items() if k != "searched"}
        fitting = {k: v["estimate_s"] for k, v in experts.items()
                   if v.get("fits") and v.get("estimate_s") is not None}  # fmt: skip
        best = min(fitting, key=fitting.get) if fitting else None
        entry = {"searched_fits": bool(s.get("fits")), "search_s": s.get("search_s"),
                 "searched_estimate_s": s.get("estimate_s"), "best_expert": best,
                 "best_expert_estimate_s": fitting.get(best)}  # fmt: skip
        if s.get("estimate_s") and best:
            entry["searched_over_best_expert"] = s["estimate_s"] / fitting[best]
        if s.get("compiled_bytes") and s.get("predicted_peak_bytes"):
            entry["searched_memory_ratio"] = s["predicted_peak_bytes"] / s["compiled_bytes"]
        out[case] = entry
    return out


def compact_table(rows: list[dict], summary: dict) -> list[str]:
    """One line per model x topology: the searched plan and the best expert strategy."""
    lines = [
        "| model | pod (mesh) | plan: fits, GB/device compiled (predicted) | plan: estimate ms "
        "(predicted) | best expert: estimate ms | plan / best expert | search s |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, c in summary.items():
        by = {r["strategy"]: r for r in rows if f"{r['model']} @ {r['topology']}" == case}
        s = by.get("searched")
        if s is None:
            continue
        first = next(iter(by.values()))
        fits = "yes" if s.get("fits") else "**no**"
        gb = (f"{s['compiled_bytes'] / 1e9:.1f} ({s['predicted_peak_bytes'] / 1e9:.1f})"
              if s.get("compiled_bytes") and s.get("predicted_peak_bytes") else "-")  # fmt: skip
        smallest = re.search(r"smallest predicted peak seen is (\d+) bytes", s.get("error", ""))
        if smallest:
            gb = f"none under the HBM limit (smallest predicted {int(smallest[1]) / 1e9:.1f})"
        est = (f"{s['estimate_s'] * 1e3:.1f} ({s['predicted_s'] * 1e3:.1f})"
               if s.get("estimate_s") else "-")  # fmt: skip
        best = c.get("best_expert")
        least = min((r for k, r in by.items() if k != "searched" and r.get("compiled_bytes")),
                    key=lambda r: r["compiled_bytes"], default=None)  # fmt: skip
        best_text = (f"{best} {c['best_expert_estimate_s'] * 1e3:.1f}" if best
                     else "none fits" + (f" ({least['strategy']}: {least['compiled_bytes'] / 1e9:.1f}"
                                         " GB compiled)" if least else ""))  # fmt: skip
        ratio = c.get("searched_over_best_expert")
        lines.append(
            f"| {first['model']} ({first['parameters'] / 1e9:.2f} B) | {first['topology']} "
            f"({first['mesh']}) | {fits}, {gb} | {est} | {best_text} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} | {s['search_s']:.0f} |"
        )
    return lines


def report(rows: list[dict], summary: dict) -> str:
    lines = [
        "# Planning a pod from a laptop",
        "",
        *compact_table(rows, summary),
        "",
        "Every plan:",
        "",
        "Each plan compiled by the TPU compiler for its topology on a 2-core CPU host. Memory: "
        "the compiled total per device (the TPU compiler's peak: live arguments, outputs and "
        "temporaries at its worst point, the figure it refuses a program on) and the "
        "planner's prediction. Estimate: the compiled program's kernels (optimal_seconds, per "
        "layer from 1- and 2-layer compiles; where libtpu's optimal_seconds is not positive, as "
        "on v6e, the calibration's roofline of the compiler's flops and bytes) plus its "
        "collectives priced by the calibration.",
        "",
        "| model | params | topology | mesh | strategy | fits | compiled GB/dev | predicted GB/dev "
        "| mem ratio | estimate ms | predicted ms | time ratio | vs best expert | search s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        case = summary.get(f"{r['model']} @ {r['topology']}", {})
        best = case.get("best_expert_estimate_s")
        est, pred = r.get("estimate_s"), r.get("predicted_s")
        cb, pb = r.get("compiled_bytes"), r.get("predicted_peak_bytes")
        cells = [
            r["model"], f"{r['parameters'] / 1e9:.2f} B", r["topology"], r["mesh"], r["strategy"],
            "yes" if r.get("fits") else "**no**",
            "?" if cb is None else f"{cb / 1e9:.1f}", "-" if pb is None else f"{pb / 1e9:.1f}",
            f"{pb / cb:.2f}" if cb and pb else "-",
            "n/a" if est is None else f"{est * 1e3:.1f}",
            "-" if pred is None else f"{pred * 1e3:.1f}",
            f"{pred / est:.2f}" if est and pred else "-",
            f"{est / best:.2f}" if est and best else "-",
            f"{r['search_s']:.0f}" if r["strategy"] == "searched" else "",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: str) -> None:
    """Bars: each strategy's estimate over the best expert's, one row per model x topology (log
    axis, 1x: the best expert); "does not fit" where a strategy's program is over HBM."""
    from experiments.measure import pyplot, ratio_axis, save_figure

    plt = pyplot()
    if plt is None:
        return
    cases = list(dict.fromkeys(f"{r['model']} @ {r['topology']}" for r in rows))
    fig, ax = plt.subplots(figsize=(7, 1.0 + 0.5 * len(cases)))
    height = 0.8 / len(STRATEGIES)
    ratios = []
    for k, strategy in enumerate(STRATEGIES):
        ys, widths, missing = [], [], []
        for i, case in enumerate(cases):
            by = {r["strategy"]: r for r in rows if f"{r['model']} @ {r['topology']}" == case}
            fitting = [v["estimate_s"] for s, v in by.items()
                       if s != "searched" and v.get("fits") and v.get("estimate_s")]  # fmt: skip
            r = by.get(strategy)
            if r is None or not fitting:
                continue
            y = i + (k - (len(STRATEGIES) - 1) / 2) * height
            if r.get("fits") and r.get("estimate_s"):
                ys.append(y)
                widths.append(r["estimate_s"] / min(fitting))
            else:
                missing.append(y)
        ax.barh(ys, widths, height, label=strategy, color=f"C{k}")
        ratios += widths
        for y in missing:
            ax.annotate("does not fit", (1.0, y), fontsize=6, va="center", color=f"C{k}")
    for i, case in enumerate(cases):
        if not any(r.get("fits") and r.get("estimate_s") for r in rows
                   if f"{r['model']} @ {r['topology']}" == case and r["strategy"] != "searched"):  # fmt: skip
            ax.annotate("no expert strategy fits (or none compiled)", (1.0, i), fontsize=6,
                        va="center", color="gray")  # fmt: skip
    ax.set_xscale("log")
    if ratios:
        lo, hi = min(min(ratios), 0.5), max(max(ratios), 2.0)
        ax.set_xlim(lo / 1.2, hi * 1.2)
        ratio_axis(ax, "x", lo, hi)
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_yticks(range(len(cases)), cases, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("compiled step-time estimate / best expert's (shorter: faster)")
    ax.set_title("Step time on TPU pods, compiled by the TPU compiler")
    ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path)


def run(config, workdir: str) -> dict:
    """Measure the missing rows, then write the summary, report and figure; return the summary."""
    from experiments.measure import force_host_devices

    force_host_devices(8)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    path = os.path.join(workdir, "results.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    done = {(r["model"], r["topology"], r["strategy"]) for r in rows}
    strategies = [s for s in config.strategies.split(",") if s]

    def measure_and_keep(model: str, topology: str, axes: dict) -> None:
        for row in measure(model, topology, axes, strategies, done, config, workdir):
            rows.append(row)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    for model in [m for m in config.models.split(",") if m]:
        for text in [t for t in config.topologies.split(";") if t]:
            topology, axes = parse_topology(text)
            measure_and_keep(model, topology, axes)
            searched = [r for r in rows if (r["model"], r["topology"], r["strategy"])
                        == (model, topology, "searched")]  # fmt: skip
            if config.get("remat_fallback") and searched and not searched[0].get("fits"):
                measure_and_keep(model + REMAT, topology, axes)  # the layers recomputed
    summary = summarize(rows)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report(rows, summary))
    if rows and importlib.util.find_spec("matplotlib") is not None:  # the figures extra
        figure(rows, os.path.join(workdir, "pod_plans.png"))
    return summary


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    print(json.dumps(run(flags.FLAGS.config, flags.FLAGS.workdir), indent=2))


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", "configs/pod_plans/default.py", "Config file.")
    flags.DEFINE_string("workdir", "workdir/pod_plans", "Where outputs go.")
    app.run(main)
