"""Weight sync at frontier size: Qwen3-235B-A22B's and DeepSeek-V3's parameters moved from a
MaxText-style training layout to a vLLM-style serving layout on the same TPU v5p chips (or the
8 H100s of one host), within a memory budget, compiled ahead of time by the TPU compiler (or
XLA:GPU) on this host (nothing runs).

Usage:
    python -m experiments.frontier_sync --workdir=workdir/frontier_sync
    python -m experiments.frontier_sync --config.cases=qwen3_235b@v5p-128
    python -m experiments.frontier_sync --config.cases=qwen3_235b@h100x8,deepseek_v3@h100x8

On a pod slice the whole sync is one program per method. On 8 H100s the trees alone outgrow a
GPU (Qwen3-235B: 59 GB per GPU each in bfloat16, DeepSeek-V3: 168 GB), so the sync is compiled
as the eager budgeted path runs it: one program per bucket (:func:`bucketed`), each holding its
pieces' source and destination tiles plus at most the budget; the rows give the largest.

The trees and layouts are :mod:`experiments.frontier_weights`'s (bfloat16). The serving mesh is
the training mesh's devices in the same order with its axes renamed (``ep`` is ``fsdp``, ``tp``
is ``expert``), so both layouts are written on one mesh. Per case and method:

- ``redist``: ``redist.redistribute(params, src, dst, memory_budget=...)`` in one ``jax.jit``;
- ``xla``: ``jax.jit(lambda p: p, out_shardings=dst)``.

Each row gives the compiled arguments, outputs and temporaries per chip (the budget bounds the
temporaries: what is alive beyond the two trees), whether the program fits the chip's HBM, the
bytes each chip sends under redist's plans against the lower bound (a chip must receive its
destination tiles less what it already holds), and redist's predicted time on the v5p
calibration (the buckets in series: each bucket's moves summed). Writes ``results.jsonl`` and
``report.md`` under ``--workdir``.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.frontier_weights import parameter_count, parameters

RENAME = {"ep": "fsdp", "tp": "expert"}
"""The serving axes on the training mesh (the same devices in the same order)."""

TOPOLOGIES = {
    "v5p-128": ("tpu", "v5p:4x4x4", 64),
    "v5p-512": ("tpu", "v5p:8x8x4", 256),
    "v5p-1024": ("tpu", "v5p:8x8x8", 512),
    "h100x8": ("gpu", "h100_sxm", 8),
}
"""Per topology name: the compiler, its topology (TPU, as MaxText's ``compile_topology``) or
GPU calibration, and the chips (a v5p-N slice has N TensorCores, N / 2 chips)."""

CHIPS = {name: chips for name, (_, _, chips) in TOPOLOGIES.items()}
"""Chips per topology name."""


def mesh_axes(chips: int, expert: int = 8) -> dict[str, int]:
    """The training mesh: ``fsdp`` x ``expert`` (MaxText's expert parallelism 8)."""
    if chips % expert:
        raise ValueError(f"{chips} chips do not divide into expert parallelism {expert}")
    return {"fsdp": chips // expert, "expert": expert}


def specs(model: str) -> tuple[dict, dict, dict]:
    """``(shapes, train specs, serve specs)`` by path, the serving specs on the training axes."""
    from jax.sharding import PartitionSpec as P

    def spec(axes):
        return P(*[RENAME.get(a, a) if isinstance(a, str) else
                   (tuple(RENAME.get(b, b) for b in a) if a else None) for a in axes])  # fmt: skip

    tree = parameters(model)
    return ({k: leaf.shape for k, leaf in tree.items()},
            {k: spec(leaf.train) for k, leaf in tree.items()},
            {k: spec(leaf.serve) for k, leaf in tree.items()})  # fmt: skip


def received_lower_bound(shape, itemsize: int, src, dst) -> int:
    """The most bytes any device must receive to move an array of ``shape`` from sharding
    ``src`` to ``dst``: its destination tile less what its source tile already holds of it."""
    have, want = src.devices_indices_map(tuple(shape)), dst.devices_indices_map(tuple(shape))
    most = 0
    for device, region in want.items():
        size = overlap = 1
        for d, (w, h) in enumerate(zip(region, have[device])):
            w0, w1, _ = w.indices(shape[d])
            h0, h1, _ = h.indices(shape[d])
            size *= w1 - w0
            overlap *= max(0, min(w1, h1) - max(w0, h0))
        most = max(most, size - overlap)
    return most * itemsize


def measure(model: str, topology: str, budget_gib: float) -> list[dict]:
    """The rows of one case (see the module)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    import planner
    import redist
    from redist.calibration import Calibration
    from redist.cost import plan_cost

    compiler, target, chips = TOPOLOGIES[topology]
    axes = mesh_axes(chips, expert=min(8, chips))
    if compiler == "gpu":
        mesh, calibration = planner.gpu_mesh(axes, gpu=target), target
    else:
        mesh, calibration = planner.topology_mesh(target, axes), "tpu_v5p"
    shapes, train, serve = specs(model)
    src = {k: NamedSharding(mesh, s) for k, s in train.items()}
    dst = {k: NamedSharding(mesh, s) for k, s in serve.items()}
    dtype = jnp.bfloat16
    structs = {
        k: jax.ShapeDtypeStruct(shape, dtype, sharding=src[k]) for k, shape in shapes.items()
    }
    budget = int(budget_gib * 2**30)
    cal = Calibration.named(calibration)
    sizes = dict(mesh.shape)
    sent = bound = seconds = 0.0
    for k, shape in shapes.items():
        p = redist.plan(shape, train[k], serve[k], sizes, "bfloat16",
                        cost_model=f"calibrated:{calibration}")  # fmt: skip
        t, wire = plan_cost(p, cal)
        seconds, sent = seconds + t, sent + wire
        bound += received_lower_bound(shape, 2, src[k], dst[k])
    base = {"model": model, "parameters": parameter_count(model), "topology": topology,
            "chips": mesh.size, "budget_bytes": budget, "leaves": len(shapes),
            "train_bytes_per_chip": _per_chip(structs, src),
            "serve_bytes_per_chip": _per_chip(structs, dst)}  # fmt: skip
    rows = []
    # On a few chips the trees alone outgrow one (Qwen3-235B: 59 GB per H100 each): one program
    # per bucket, as the eager budgeted sync runs them; on a pod slice one program in all.
    groups = (bucketed(shapes, train, serve, src, dst, mesh, budget, calibration)
              if compiler == "gpu" else [[(k, shape) for k, shape in shapes.items()]])  # fmt: skip
    for name in ("redist", "xla"):
        start = time.perf_counter()
        reports = [_compiled(name, group, src, dst, budget, dtype) for group in groups]
        report = max(reports, key=lambda r: r.total_bytes)
        row = {**base, "method": name, "compile_s": time.perf_counter() - start,
               "programs": len(groups),
               "argument_bytes": report.argument_bytes, "output_bytes": report.output_bytes,
               "temp_bytes": max(r.temp_bytes for r in reports),
               "total_bytes": report.total_bytes, "fits": all(r.fits for r in reports)}  # fmt: skip
        if name == "redist":
            row |= {"sent_bytes_per_chip": sent, "lower_bound_bytes_per_chip": bound,
                    "predicted_s": seconds}  # fmt: skip
            if len(groups) > 1:
                row["held_over_sync"] = held_over_sync(reports, base["train_bytes_per_chip"])
        logging.warning("%s", row)
        rows.append(row)
    if len(groups) > 1:  # what a JAX user writes today: the whole tree in one jit
        start = time.perf_counter()
        whole = _compiled("xla", [(k, shape) for k, shape in shapes.items()], src, dst, budget,
                          dtype)  # fmt: skip
        row = {**base, "method": "xla_whole_tree", "compile_s": time.perf_counter() - start,
               "programs": 1, "argument_bytes": whole.argument_bytes,
               "output_bytes": whole.output_bytes, "temp_bytes": whole.temp_bytes,
               "total_bytes": whole.total_bytes, "fits": whole.fits}  # fmt: skip
        logging.warning("%s", row)
        rows.append(row)
    return rows


def held_over_sync(reports: list, train_bytes: int) -> list[int]:
    """Bytes per device held while each bucket runs, the sources donated bucket by bucket (the
    eager ``redistribute(..., memory_budget=..., donate=True)``): the source tiles not yet moved,
    the destination tiles already made, and the running program's outputs and temporaries."""
    held, moved_in, made = [], 0, 0
    for r in reports:
        held.append(train_bytes - moved_in + made + r.output_bytes + r.temp_bytes)
        moved_in, made = moved_in + r.argument_bytes, made + r.output_bytes
    return held


def bucketed(shapes, train, serve, src, dst, mesh, budget: int, calibration: str) -> list:
    """The sync's programs within ``budget`` as the eager budgeted path runs them: buckets
    (:func:`redist.buckets.buckets`) of ``(leaf, shape)`` pieces, a leaf whose move alone holds
    more cut along a dimension neither layout splits (:func:`redist.buckets.cut`)."""
    import math

    import redist
    from redist.buckets import buckets, cut, in_flight_bytes, index_bytes

    pieces, sizes = [], []
    for k, shape in shapes.items():
        p = redist.plan(shape, train[k], serve[k], dict(mesh.shape), "bfloat16",
                        cost_model=f"calibrated:{calibration}")  # fmt: skip
        size = in_flight_bytes(p, math.prod(dst[k].shard_shape(shape)) * 2)
        dim, ranges = (cut(tuple(train[k]), tuple(serve[k]), shape, size, budget)
                       if size > budget else None) or (None, None)  # fmt: skip
        for a, b in ranges or [(0, shape[0])]:
            piece = shape if ranges is None else (*shape[:dim], b - a, *shape[dim + 1 :])
            pieces.append((k, tuple(piece)))
            sizes.append(size if ranges is None else (b - a) * index_bytes(size, shape[dim]))
    return [[pieces[i] for i in g] for g in buckets(sizes, budget, [k for k, _ in pieces])]


_REPORTS: dict = {}


def _compiled(method: str, group: list, src: dict, dst: dict, budget: int, dtype):
    """The compiled report of one bucket's program (``group``: ``(leaf, shape)`` pieces), cached
    by its pieces (a stacked weight's equal slices compile once)."""
    import jax

    import redist
    from planner.target.compiled import compiled_report

    key = (method, tuple(group), tuple(src[k] for k, _ in group), tuple(dst[k] for k, _ in group))
    if key not in _REPORTS:
        names = [f"{k}#{i}" for i, (k, _) in enumerate(group)]
        s = {n: src[k] for n, (k, _) in zip(names, group)}
        d = {n: dst[k] for n, (k, _) in zip(names, group)}
        structs = {n: jax.ShapeDtypeStruct(shape, dtype, sharding=s[n])
                   for n, (_, shape) in zip(names, group)}  # fmt: skip
        fn = (jax.jit(lambda p: redist.redistribute(p, s, d, memory_budget=budget))
              if method == "redist" else jax.jit(lambda p: p, out_shardings=d))  # fmt: skip
        _REPORTS[key] = compiled_report(fn, structs)
    return _REPORTS[key]


def _per_chip(structs: dict, shardings: dict) -> int:
    import math

    return sum(math.prod(shardings[k].shard_shape(s.shape)) * s.dtype.itemsize
               for k, s in structs.items())  # fmt: skip


def report(rows: list[dict]) -> str:
    gb = 1e9
    lines = [
        "| model | topology | method | programs | budget GB | temporaries GB / chip "
        "| in + out GB / chip (largest program) | fits | sent GB / chip (lower bound) "
        "| predicted s | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        trees = (r["argument_bytes"] + r["output_bytes"]) / gb
        sent = (f"{r['sent_bytes_per_chip'] / gb:.2f} ({r['lower_bound_bytes_per_chip'] / gb:.2f})"
                if "sent_bytes_per_chip" in r else "-")  # fmt: skip
        pred = f"{r['predicted_s']:.2f}" if "predicted_s" in r else "-"
        lines.append(f"| {r['model']} | {r['topology']} | {r['method']} | {r.get('programs', 1)} | "
                     f"{r['budget_bytes'] / gb:.1f} | {r['temp_bytes'] / gb:.2f} | {trees:.2f} | "
                     f"{r['fits']} | {sent} | {pred} | {r['compile_s']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def run(config, workdir: str) -> list[dict]:
    os.makedirs(workdir, exist_ok=True)
    rows = []
    for case in config.cases.split(","):
        model, _, topology = case.strip().partition("@")
        rows += measure(model, topology, config.budget_gib)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report(rows))
    if any("held_over_sync" in r for r in rows):
        figure(rows, os.path.join(workdir, "memory_over_sync.png"))
    return rows


def figure(rows: list[dict], path: str) -> None:
    """Per-device memory over the sync: the budgeted, donating redist bucket by bucket against
    XLA's whole-tree program, with the chip's memory."""
    from experiments.measure import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    cases = [r for r in rows if "held_over_sync" in r]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.2), squeeze=False)
    gb = 1e9
    for ax, r in zip(axes[0], cases):
        held = r["held_over_sync"]
        xs = [i / len(held) for i in range(len(held) + 1)]
        ax.step(xs, [h / gb for h in held] + [held[-1] / gb], where="post", color="#4477aa",
                label=f"redist, {r['budget_bytes'] / 2**30:.0f} GiB budget, donating")  # fmt: skip
        whole = [w for w in rows if w["model"] == r["model"] and w["topology"] == r["topology"]
                 and w["method"] == "xla_whole_tree"]  # fmt: skip
        if whole:
            ax.axhline(whole[0]["total_bytes"] / gb, color="#cc6677",
                       label="XLA, the whole tree in one jit")  # fmt: skip
        ax.axhline(80, color="gray", linestyle="--", linewidth=1, label="H100 memory (80 GB)")
        ax.set_title(f"{r['model']} on {r['topology']}", fontsize=9)
        ax.set_xlabel("fraction of the buckets run")
        ax.set_ylabel("GB per device")
        ax.legend(fontsize=6)
    save_figure(fig, path)


def main(argv):
    del argv
    run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", "configs/weight_sync/frontier.py", "Config file.")
    flags.DEFINE_string("workdir", "workdir/frontier_sync", "Where outputs go.")
    app.run(main)
