"""Time checked against the compiler: the simulator's per-device flops, bytes and step time of many
plans of the flax language model against the TPU compiler's verdict on the same plans.

Usage:
    python -m experiments.time_check --config=configs/time_check/default.py --workdir=workdir/time_check

Plans (all on one mesh over a TPU topology's devices, e.g. v5p:8x8x4 as data:16,fsdp:4,tensor:4):
the searched plan, hand baselines (replication; data parallelism over all axes, all but the last,
the first; Megatron and data x model where the program has weights as direct inputs), random plans
over the search's own space (each anchor product group's whole mesh axes on random loops, the rest
propagated), and random plans of every op (as tests/planner/lowering/test_random_schedules.py makes
them, whole axes). Each plan is simulated on the planned (scanned) program, then bound to the
topology mesh, and ``plan.jit()`` is compiled by the TPU compiler on the argument shapes. The TPU
compiler's ``cost_analysis()`` counts a loop's body once, so the program compiled is the same one
with its layer scan unrolled (``unroll=True``: the same ops and names, no loop; ``config.unroll``).

Per plan: predicted flops, bytes accessed and transcendentals per device against the compiler's;
predicted step time against the compiled estimate (the compiler's ``optimal_seconds`` for the
kernels plus the HLO's collectives priced by the calibration, :mod:`planner.target.compiled_time`).
Writes ``results.jsonl`` (one line per plan), ``compiled.jsonl`` (the compiler's results by
schedule: a rerun compiles only new schedules), ``summary.json`` (Spearman rank correlation of
predicted and compiled time; ratios) and ``report.md``.
"""

from __future__ import annotations

import json
import math
import os
import random
import time

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.planner_benchmark import spearman


def _lm(config, unroll):
    """``(program, signature, out_tree)`` of the language model's training step."""
    import jax
    import numpy as np

    from experiments.language_model import lm_step
    from planner.calls import Signature
    from planner.program.analysis import analyze

    b, s, d, h, layers, vocab = (int(n) for n in config.lm.split("x"))
    step, args = lm_step(b, s, d, h, layers, vocab, True, np.random.default_rng(0), unroll=unroll)
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    sig = Signature.of(structs, {})
    flat, arrays = sig.traced(step, structs, {})
    prog = analyze(flat, *arrays)
    return prog, sig, jax.tree.structure(jax.eval_shape(flat, *arrays))


def random_anchor_plan(prog, sizes: dict[str, int], rng: random.Random) -> dict:
    """A random point of the search's space: each anchor group's product (with its siblings)
    gets each whole mesh axis on a random partitionable loop, or none; the rest propagates."""
    from planner.solver.chain import with_siblings
    from planner.solver.schedule_search import groups

    gs = groups(prog)
    assign = {}
    for g in gs:
        op, loops = g[0], {}
        for axis in rng.sample(list(sizes), len(sizes)):
            parts = {lp: math.prod(sizes[a] for a in ax) for lp, ax in loops.items()}
            options = [lp.name for lp in op.loops
                       if lp.partitionable and lp.extent % (parts.get(lp.name, 1) * sizes[axis]) == 0]  # fmt: skip
            choice = rng.choice([None, *options])
            if choice is not None:
                loops[choice] = loops.get(choice, ()) + (axis,)
        assign[op.name] = loops
    return {k: v for k, v in with_siblings(assign, gs).items() if v}


def random_op_plan(prog, sizes: dict[str, int], rng: random.Random) -> dict:
    """Every op split at random, whole mesh axes on random loops (as the random-schedule tests
    do with prime factors); ops left unsplit run replicated."""
    from planner.program.schedule import check_assignment
    from redist.types import MeshShape

    shape = MeshShape.of(sizes)
    out = {}
    for op in prog.ops:
        loops: dict[str, tuple[str, ...]] = {}
        for axis in rng.sample(list(sizes), len(sizes)):
            options = [None, *(lp.name for lp in op.loops if lp.partitionable)]
            rng.shuffle(options)
            for loop in options:
                if loop is None:
                    break
                trial = {**loops, loop: loops.get(loop, ()) + (axis,)}
                try:
                    check_assignment(shape, op, trial)
                except ValueError:
                    continue
                loops = trial
                break
        if loops:
            out[op.name] = loops
    return out


def plans(prog, sizes: dict[str, int], config, cal) -> list[tuple[str, str, object]]:
    """``(name, kind, schedule)`` of every plan to check: searched, baselines, random."""
    from planner import baselines
    from planner.program.schedule import make_schedule
    from planner.solver.schedule_search import search_within

    axes = tuple(sizes)
    out = []
    if config.searched:
        sched, _ = search_within(prog, sizes, cal, None)
        out.append(("searched", "searched", sched))
    hand = {
        "replicated": lambda: make_schedule(prog, {}, sizes, default="replicate"),
        "data": lambda: make_schedule(prog, baselines.data_parallel(prog, axes), sizes),
        "data_major": lambda: make_schedule(prog, baselines.data_parallel(prog, axes[:-1]), sizes),
        "data_first": lambda: make_schedule(prog, baselines.data_parallel(prog, axes[:1]), sizes),
        "megatron": lambda: make_schedule(prog, baselines.megatron(prog, axes[-1:]), sizes),
        "data_and_model": lambda: make_schedule(
            prog, baselines.data_and_model(prog, axes[:-1], axes[-1:]), sizes),
    }  # fmt: skip
    for name in baselines.STRATEGIES:  # the expert strategies, on (data-like..., tensor) axes
        hand[name] = lambda name=name: baselines.expert_schedules(
            prog, sizes, axes[:-1], axes[-1])[name]  # fmt: skip
    for name in [n for n in config.baselines.split(",") if n]:
        try:
            out.append((name, "baseline", hand[name]()))
        except (ValueError, KeyError) as e:
            print(f"baseline {name}: not applicable ({e})", flush=True)
    for kind, count, make, default in (
        ("random_anchors", config.random_anchors, random_anchor_plan, "propagate"),
        ("random_ops", config.random_ops, random_op_plan, "replicate"),
    ):
        rng = random.Random(f"{config.seed}/{kind}")
        made = 0
        while made < count:
            try:
                sched = make_schedule(prog, make(prog, sizes, rng), sizes, default=default)
            except ValueError:
                continue
            out.append((f"{kind}_{made}", kind, sched))
            made += 1
    return out


def _key(sched) -> str:
    """A schedule as text: what a compiled result in the cache was compiled for."""
    assign = {op: {lp: list(ax) for lp, ax in sorted(loops.items())}
              for op, loops in sorted(sched.assign.items()) if loops}  # fmt: skip
    stored = {k: [list(a) for a in v] for k, v in sorted(sched.stored.items())}
    return json.dumps([assign, stored], sort_keys=True)


def compile_plan(sched, compiled_prog, sig, out_tree, mesh, cal) -> dict:
    """The compiler's verdict on one schedule: ``plan.jit()`` bound to ``mesh`` and compiled on
    the argument shapes (of ``compiled_prog``, the planned program or its unrolled twin)."""
    from planner.autoplan import AutoPlan
    from planner.program.schedule import Schedule
    from planner.target.compiled import compiled_report, input_structs
    from planner.target.compiled_time import compiled_time

    target = Schedule(compiled_prog, sched.mesh, sched.assign, sched.stored)
    plan = AutoPlan.of(compiled_prog, target, mesh, calibration=cal, signature=sig,
                       out_tree=out_tree)  # fmt: skip
    start = time.perf_counter()
    compiled = plan.jit().lower(*input_structs(plan)).compile()
    compile_s = time.perf_counter() - start
    ct = compiled_time(compiled, cal, mesh.devices.size)
    report = compiled_report(compiled)
    return {
        "compile_s": compile_s, "compiled_s": ct.seconds,
        "compiled_optimal_s": ct.optimal_seconds, "compiled_collective_s": ct.collective_s,
        "compiled_collectives": ct.collectives, "compiled_flops": ct.flops,
        "compiled_bytes": ct.bytes_accessed, "compiled_transcendentals": ct.transcendentals,
        "compiled_total_bytes": report.total_bytes, "fits": report.fits,
    }  # fmt: skip


def predict_plan(sched, prog, cal) -> dict:
    """The simulator's prediction of one schedule, per device."""
    from planner.cost.simulator import simulate

    pred = simulate(prog, sched, cal)
    compute_s = sum(c.compute_s for c in pred.ops)
    return {
        "predicted_s": pred.time_s, "predicted_compute_s": compute_s,
        "predicted_comm_s": pred.time_s - compute_s, "predicted_comm_bytes": pred.comm_bytes,
        "predicted_flops": pred.flops, "predicted_bytes": pred.bytes_accessed,
        "predicted_transcendentals": pred.transcendentals,
        "predicted_peak_bytes": pred.peak_bytes,
    }  # fmt: skip


def run(config, workdir: str) -> dict:
    """Plan, simulate and compile every plan; write outputs under ``workdir``; return the summary.

    Compiled results are kept in ``workdir/compiled.jsonl`` by plan and schedule: a rerun (after
    a change to the simulator, say) compiles only schedules it has not compiled before."""
    from experiments.measure import force_host_devices

    force_host_devices(8)
    import planner
    from experiments.measure import parse_mesh
    from redist.calibration import Calibration

    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    sizes = parse_mesh(config.mesh)
    cal = Calibration.named(config.calibration)
    prog, sig, out_tree = _lm(config, 1)
    if config.unroll:
        compiled_prog, _, _ = _lm(config, True)
        same = [(o.name, o.signature, o.trips) for o in prog.ops]
        if same != [(o.name, o.signature, o.trips) for o in compiled_prog.ops]:
            raise RuntimeError("the unrolled program's ops differ from the scanned program's")
    else:
        compiled_prog = prog
    mesh = planner.topology_mesh(config.topology, sizes)
    cache_path = os.path.join(workdir, "compiled.jsonl")
    cache = {}
    if os.path.exists(cache_path):
        for line in open(cache_path):
            row = json.loads(line)
            cache[(row["plan"], row["schedule"])] = row
    todo = plans(prog, sizes, config, cal)
    results = []
    for k, (name, kind, sched) in enumerate(todo):
        key = _key(sched)
        compiled = cache.get((name, key))
        if compiled is None:
            try:
                compiled = compile_plan(sched, compiled_prog, sig, out_tree, mesh, cal)
            except Exception as e:  # noqa: BLE001  (a plan the compiler refuses is reported)
                print(f"[{k + 1}/{len(todo)}] {name}: not compiled ({str(e)[:300]})", flush=True)
                continue
            compiled = {"plan": name, "schedule": key, **compiled}
            with open(cache_path, "a") as f:
                f.write(json.dumps(compiled) + "\n")
        row = {"plan": name, "kind": kind, "topology": config.topology,
               **predict_plan(sched, prog, cal),
               **{k: v for k, v in compiled.items() if k not in ("plan", "schedule")},
               "schedule": key}  # fmt: skip
        results.append(row)
        print(f"[{k + 1}/{len(todo)}] {name}: predicted {row['predicted_s'] * 1e3:.3f} ms, "
              f"compiled {row['compiled_s'] * 1e3:.3f} ms; flops {_ratio(row, 'flops'):.3f}, "
              f"bytes {_ratio(row, 'bytes'):.3f} of the compiler's; compiled in "
              f"{row['compile_s']:.0f} s", flush=True)  # fmt: skip
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        for row in results:
            f.write(json.dumps(row) + "\n")
    summary = summarize(results)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report(results, summary, config))
    return summary


def _ratio(row: dict, what: str) -> float:
    return row[f"predicted_{what}"] / max(row[f"compiled_{what}"], 1e-30)


def _stats(values: list[float]) -> dict:
    import numpy as np

    if not values:
        return {}
    v = np.asarray(values, float)
    return {"geomean": float(np.exp(np.log(v).mean())), "min": float(v.min()),
            "max": float(v.max()), "median": float(np.median(v))}  # fmt: skip


def summarize(results: list[dict]) -> dict:
    flops = [_ratio(r, "flops") for r in results]
    nbytes = [_ratio(r, "bytes") for r in results]
    times = [_ratio(r, "s") for r in results]
    random_plans = [r for r in results if r["kind"].startswith("random")]
    return {
        "plans": len(results),
        "random_plans": len(random_plans),
        "spearman_time_random": spearman([r["predicted_s"] for r in random_plans],
                                         [r["compiled_s"] for r in random_plans]),
        "spearman_time": spearman([r["predicted_s"] for r in results],
                                  [r["compiled_s"] for r in results]),
        "spearman_flops": spearman([r["predicted_flops"] for r in results],
                                   [r["compiled_flops"] for r in results]),
        "spearman_bytes": spearman([r["predicted_bytes"] for r in results],
                                   [r["compiled_bytes"] for r in results]),
        "flops_ratio": _stats(flops),
        "flops_within_10pct": sum(abs(x - 1) <= 0.1 for x in flops),
        "bytes_ratio": _stats(nbytes),
        "bytes_within_10pct": sum(abs(x - 1) <= 0.1 for x in nbytes),
        "time_ratio": _stats(times),
        "compute_ratio": _stats([r["predicted_compute_s"] / r["compiled_optimal_s"]
                                 for r in results]),
        "comm_ratio": _stats([r["predicted_comm_s"] / r["compiled_collective_s"]
                              for r in results if r["compiled_collective_s"] > 0
                              and r["predicted_comm_s"] > 0]),
    }  # fmt: skip


def report(results: list[dict], summary: dict, config) -> str:
    lines = [
        "# Time checked against the compiler",
        "",
        f"Language model {config.lm} (batch x seq x d x heads x layers x vocab, flax nnx + adamw, "
        f"scanned layers), {config.topology} as {config.mesh}, calibration {config.calibration}. "
        "Predicted: the simulator on the planned program. Compiled: the TPU compiler's "
        "cost_analysis() of plan.jit() "
        + ("with the layer scan unrolled (the compiler counts a loop body once)" if config.unroll
           else "as planned")
        + "; compiled time = optimal_seconds + the HLO's collectives priced by the calibration.",
        "",
        f"- plans: {summary['plans']}",
        f"- Spearman (predicted vs compiled time): {summary['spearman_time']:.3f}; over the "
        f"{summary['random_plans']} random plans alone: {summary['spearman_time_random']:.3f}",
        f"- predicted / compiled flops: {_fmt(summary['flops_ratio'])} "
        f"({summary['flops_within_10pct']} of {summary['plans']} within 10%)",
        f"- predicted / compiled bytes accessed: {_fmt(summary['bytes_ratio'])} "
        f"({summary['bytes_within_10pct']} of {summary['plans']} within 10%)",
        f"- predicted / compiled time: {_fmt(summary['time_ratio'])}",
        f"- kernels (predicted compute / optimal_seconds): {_fmt(summary['compute_ratio'])}",
        f"- collectives (predicted / priced from the HLO): {_fmt(summary['comm_ratio'])}",
        "",
        "| plan | kind | predicted ms | compiled ms | ratio | pred. compute ms | optimal ms | "
        "pred. comm ms | HLO comm ms | pred. GFLOP | compiled GFLOP | flops ratio | pred. GB | "
        "compiled GB | bytes ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in sorted(results, key=lambda r: r["compiled_s"]):
        lines.append(
            f"| {r['plan']} | {r['kind']} | {r['predicted_s'] * 1e3:.3f} | "
            f"{r['compiled_s'] * 1e3:.3f} | {_ratio(r, 's'):.2f} | "
            f"{r['predicted_compute_s'] * 1e3:.3f} | {r['compiled_optimal_s'] * 1e3:.3f} | "
            f"{r['predicted_comm_s'] * 1e3:.3f} | {r['compiled_collective_s'] * 1e3:.3f} | "
            f"{r['predicted_flops'] / 1e9:.2f} | {r['compiled_flops'] / 1e9:.2f} | "
            f"{_ratio(r, 'flops'):.3f} | {r['predicted_bytes'] / 1e9:.3f} | "
            f"{r['compiled_bytes'] / 1e9:.3f} | {_ratio(r, 'bytes'):.3f} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(stats: dict) -> str:
    if not stats:
        return "n/a"
    return (f"geomean {stats['geomean']:.3f}, median {stats['median']:.3f}, "
            f"range {stats['min']:.3f}-{stats['max']:.3f}")  # fmt: skip


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    print(json.dumps(run(flags.FLAGS.config, flags.FLAGS.workdir), indent=2))


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", "configs/time_check/default.py", "Config file.")
    flags.DEFINE_string("workdir", "workdir/time_check", "Where outputs go.")
    app.run(main)
