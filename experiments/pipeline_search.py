"""DistIR's data x tensor x pipeline grid search, with the planner's simulator: MLP training on
16 simulated H100s (two 8-GPU hosts).

Usage:
    python -m experiments.pipeline_search --config=configs/pipeline_search/default.py \\
        --workdir=workdir/pipeline_search

For each MLP of the family (``config.models``: layers x hidden, 16-bit, ReLU, a squared loss,
SGD) and every power-of-two ``D x T x P = 16`` (data, tensor, pipeline degrees) with
``config.microbatches`` ``K`` for ``P > 1``: one pipeline stage's training work on one
microbatch (its ``L / P`` layers, forward and backward, ``B / (D K)`` rows) is analysed from
shapes and priced by :func:`planner.simulate` with its products split Megatron-style over a
tensor axis of size ``T`` (:func:`planner.solver.strategies.megatron`). The step is then GPipe over
``P`` stages (:func:`planner.cost.pipeline.gpipe_seconds`: ``K + P - 1`` ticks each way, the
activation handed to the next stage each tick at the calibration's price for the link it
crosses), plus the gradients' all-reduce over ``D`` and the SGD update. Memory per device: the
stage's weights, gradients and one microbatch's peak from the simulator, plus the residuals of
the other ``K - 1`` microbatches GPipe keeps (:func:`planner.cost.pipeline.gpipe_activation_bytes`).
Configurations over the calibration's memory do not fit.

The result (``summary.json``, ``report.md``): per model, the best configuration that fits against
the best pure data, tensor and pipeline parallelism (``K = 8 P`` for the latter, DistIR's
expert heuristic, as in its Table 2).

With ``config.planner`` (the default), :func:`planner.plan` also plans the same model written
as people write it for a pipeline (:func:`mlp_step`: the layers stacked under ``lax.scan``) from
shapes on every ``d x p x t`` mesh of the grid, free to pipeline the layers over ``p`` and to
split everything else its own way; the best of those plans is reported beside the grid. The
planner prices the pipeline its lowering runs, whose weight gradients are all-reduced on every
tick (no accumulation across microbatches before one all-reduce, which the grid's formula
assumes), so it pipelines less where the batch is also split over ``d``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from absl import app, flags
from ml_collections import config_flags

MESH_ORDER = ("d", "p", "t")  # the tensor axis innermost: its all-reduces stay inside a host


def _divisors_of_16():
    for d in (1, 2, 4, 8, 16):
        for t in (1, 2, 4, 8, 16):
            p = 16 // (d * t)
            if d * t * p == 16:
                yield d, t, p


@functools.cache
def stage_program(layers: int, rows: int, hidden: int, dtype: str):
    """The planner's program of one stage's forward and backward on one microbatch."""
    import jax
    import jax.numpy as jnp

    import planner

    def loss(ws, x, y):
        for w in ws:
            x = jax.nn.relu(x @ w)
        return jnp.sum((x - y).astype(jnp.float32) ** 2)

    ws = [jax.ShapeDtypeStruct((hidden, hidden), dtype) for _ in range(layers)]
    x = jax.ShapeDtypeStruct((rows, hidden), dtype)
    return planner.analyze(jax.grad(loss), ws, x, x)


def evaluate(cfg: dict, model: dict, cal) -> dict:
    """Step time and memory per device of one ``D x T x P`` configuration with ``K``
    microbatches (see the module docs)."""
    import planner
    from planner.cost.pipeline import gpipe_activation_bytes, gpipe_seconds
    from planner.program.ops import itemsize
    from planner.solver.strategies import megatron
    from redist.types import MeshShape

    d, t, p, k = cfg["D"], cfg["T"], cfg["P"], cfg["K"]
    layers, hidden, batch = model["layers"], model["hidden"], model["batch"]
    rows = batch // (d * k)
    size = itemsize(model["dtype"])
    prog = stage_program(layers // p, rows, hidden, model["dtype"])
    mesh = {"t": t} if t > 1 else {"t": 1}
    sched = prog.schedule(megatron(prog, ("t",)) if t > 1 else {}, mesh, default="propagate")
    pred = planner.simulate(prog, sched, cal)
    full = MeshShape.of(dict(zip(MESH_ORDER, (d, p, t))))
    stage_weights = layers // p * hidden * hidden * size // t
    activation = rows * hidden * size // t  # handed to the next stage, per microbatch
    transfer = cal.collective_time("collective-permute", activation, 2,
                                   cal.crosses(full, full.axis_factors("p")))  # fmt: skip
    step = gpipe_seconds(pred.time_s, p, k, transfer if p > 1 else 0.0)
    step += cal.collective_time("all-reduce", stage_weights, d,
                                cal.crosses(full, full.axis_factors("d")))  # fmt: skip
    step += cal.compute_time(2 * stage_weights / size, 2 * stage_weights, stage_weights)  # SGD
    residuals = max(0, pred.peak_bytes - 2 * stage_weights)  # one microbatch's
    memory = (
        pred.peak_bytes + gpipe_activation_bytes(residuals, k - 1) if k > 1 else pred.peak_bytes
    )
    return {**cfg, "step_s": step, "throughput": batch / step, "memory_bytes": memory,
            "fits": memory <= cal.memory_bytes, "microbatch_s": pred.time_s}  # fmt: skip


def mlp_step(ws, x, y):
    """The family's training step as people write it for a pipeline: the layers stacked and run
    with ``lax.scan``, squared loss, SGD."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def loss(ws):
        h, _ = lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, ws)
        return jnp.sum((h - y).astype(jnp.float32) ** 2)

    return ws - (0.01 * jax.grad(loss)(ws)).astype(ws.dtype)


def planned(model: dict, d: int, t: int, p: int, microbatches, cal) -> dict:
    """``planner.plan`` of :func:`mlp_step` from shapes on the mesh ``d x p x t`` (weights
    donated, the calibration's memory as the limit), free to pipeline the layers over ``p``:
    its predicted step, memory and the microbatches it chose."""
    import time

    import jax
    import jax.numpy as jnp

    import planner

    layers, hidden, batch = model["layers"], model["hidden"], model["batch"]
    dtype = jnp.dtype(model["dtype"])
    f = jax.ShapeDtypeStruct
    args = (
        f((layers, hidden, hidden), dtype),
        f((batch, hidden), dtype),
        f((batch, hidden), dtype),
    )
    sizes = dict(zip(MESH_ORDER, (d, p, t)))
    ks = [k for k in microbatches if batch % (d * k) == 0] if p > 1 else None
    start = time.perf_counter()
    row = {"D": d, "T": t, "P": p}
    try:
        plan = planner.plan(mlp_step, *args, mesh=sizes, calibration=cal, donate_argnums=0,
                            memory_limit_bytes=cal.memory_bytes,
                            pipeline_axis="p" if p > 1 else None, microbatches=ks or None)  # fmt: skip
    except ValueError as e:  # nothing fits
        return {**row, "K": None, "fits": False, "why": str(e).splitlines()[0],
                "search_s": time.perf_counter() - start}  # fmt: skip
    stages = plan.schedule.stages
    return {**row, "K": stages[0].microbatches if stages else 1, "pipelined": bool(stages),
            "step_s": plan.prediction.time_s, "throughput": batch / plan.prediction.time_s,
            "memory_bytes": plan.prediction.peak_bytes, "fits": True,
            "search_s": time.perf_counter() - start}  # fmt: skip


def configurations(model: dict, microbatches) -> list[dict]:
    out = []
    for d, t, p in _divisors_of_16():
        if model["layers"] % p or model["hidden"] % t:
            continue
        for k in microbatches if p > 1 else (1,):
            if model["batch"] % (d * k) == 0:
                out.append({"D": d, "T": t, "P": p, "K": k})
    return out


def pure(rows: list[dict], kind: str) -> dict | None:
    """The best fitting pure strategy: all 16 devices on one of D, T, P (P with K = 8 P)."""
    want = {"data": ("D", 16), "tensor": ("T", 16), "pipeline": ("P", 16)}[kind]
    fit = [r for r in rows if r[want[0]] == want[1] and r["fits"]
           and (kind != "pipeline" or r["K"] == 8 * r["P"])]  # fmt: skip
    return max(fit, key=lambda r: r["throughput"], default=None)


def run(config, workdir: str) -> dict:
    from redist.calibration import Calibration

    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    cal = Calibration.named(config.calibration)
    if config.get("memory_gb"):  # another memory per device than the calibration's
        cal = dataclasses.replace(cal, memory_bytes=config.memory_gb * 1e9)
    if config.get("slice_devices"):  # slices of this many devices, joined by the slower network
        cal = dataclasses.replace(cal, domain_devices=config.slice_devices)
    micro = [int(k) for k in config.microbatches.split(",")]
    where = f"16 simulated {cal.backend} devices ({config.calibration}"
    where += f", slices of {cal.domain_devices})" if cal.domain_devices < 16 else ")"
    summary, lines = {}, [f"# D x T x P on {where}", ""]
    all_rows = []
    for text in config.models.split(";"):
        name, _, sizes = text.partition("=")
        layers, hidden, batch = (int(v) for v in sizes.split("x"))
        model = {"name": name, "layers": layers, "hidden": hidden, "batch": batch,
                 "dtype": config.dtype}  # fmt: skip
        rows = [{"model": name, **evaluate(c, model, cal)} for c in configurations(model, micro)]
        all_rows += rows
        fit = [r for r in rows if r["fits"]]
        best = max(fit, key=lambda r: r["throughput"], default=None)
        entry = {"params": layers * hidden * hidden, "configurations": len(rows),
                 "fitting": len(fit), "best": best}  # fmt: skip
        for kind in ("data", "tensor", "pipeline"):
            b = pure(rows, kind)
            entry[kind] = b
            if b and best:
                entry[f"best_over_{kind}"] = best["throughput"] / b["throughput"]
        if config.get("planner", True):
            grid = {(r["D"], r["T"], r["P"]) for r in rows}
            plans = [{"model": name, "strategy": "planner", **planned(model, *dtp, micro, cal)}
                     for dtp in sorted(grid)]  # fmt: skip
            all_rows += plans
            entry["planner"] = max((r for r in plans if r["fits"]),
                                   key=lambda r: r["throughput"], default=None)  # fmt: skip
            entry["planner_search_s"] = sum(r["search_s"] for r in plans)
            if entry["planner"] and best:
                entry["planner_over_best"] = entry["planner"]["throughput"] / best["throughput"]
        summary[name] = entry
        lines += [f"## {name}: {layers} layers x {hidden}, batch {batch} "
                  f"({entry['params'] / 1e9:.1f} B parameters)", "",
                  "| strategy | D / T / P / K | step ms | GB per device | fits |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for label, r in (("best found", best), ("pure data", entry["data"]),
                         ("pure tensor", entry["tensor"]), ("pure pipeline", entry["pipeline"]),
                         ("planner.plan, best mesh", entry.get("planner"))):  # fmt: skip
            if label.startswith("planner") and "planner" not in entry:
                continue
            if r is None:
                lines.append(f"| {label} | - | - | - | none fits |")
                continue
            lines.append(f"| {label} | {r['D']} / {r['T']} / {r['P']} / {r['K']} | "
                         f"{r['step_s'] * 1e3:.1f} | {r['memory_bytes'] / 1e9:.1f} | yes |")  # fmt: skip
        lines.append("")
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in all_rows)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return summary


def main(argv):
    del argv
    print(json.dumps(run(flags.FLAGS.config, flags.FLAGS.workdir), indent=2))


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", "configs/pipeline_search/default.py", "Config file.")
    flags.DEFINE_string("workdir", "workdir/pipeline_search", "Where outputs go.")
    app.run(main)
