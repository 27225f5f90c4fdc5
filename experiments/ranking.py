"""Does the cost model rank plans as they run? Many valid plans of one training step, predicted
by the planner and measured on this host's devices, in the same order.

Usage:
    python -m experiments.ranking --config=configs/ranking/default.py --workdir=workdir/ranking

The plans of ``config.case``: the search's choice on its own (``constraints="drop",
compare=None``), the expert strategies (:func:`planner.expert_plans`), the authors' layout where
the case has one (:func:`planner.price`), and ``config.random_plans`` random points of the
search's own space (each product group's whole mesh axes on random loops, the rest propagated:
:func:`experiments.time_check.random_anchor_plan`). Each is compiled (``plan.jit()``, XLA's
partitioner), checked against the searched plan (the metrics of the second of two steps from
the same state within ``config.tolerance``, relative: a state leaf whose gradient is at rounding
level, a key's bias, moves either way under AdamW), and timed: one step of every plan in turn,
``config.repeats`` rounds, medians (not donated: each round steps from the same state).

Writes ``results.jsonl`` (a line per plan: predicted and measured seconds, predicted and
compiled memory), ``config.json``, ``summary.json`` (Spearman rank correlation of predicted and
measured time; over every pair of plans, how far the predicted ratio is from the measured one)
and ``report.md``.

Cases: ``lm`` (the flax language model of :mod:`experiments.language_model`, on a
``(fsdp 4, tensor 2)`` mesh) or a case of :mod:`experiments.real_code`
(``library:dtype:mesh``, e.g. ``maxtext:float32:maxtext``; Python >= 3.12 with the libraries).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import random
import time

from absl import app, flags, logging
from ml_collections import config_flags

MIB = 2**20


def _case(spec: str, lm: str = "8x32x64x4x2x256"):
    """The :class:`experiments.real_code.Case` of ``spec`` (``lm``: the flax language model of
    ``lm``'s sizes, batch x sequence x width x heads x layers x vocabulary, with no authors'
    layout)."""
    from experiments import real_code

    if spec != "lm":
        return real_code.build_case(*spec.split(":"))
    import jax
    import numpy as np
    from jax.sharding import AxisType

    from experiments.language_model import lm_step

    b, s, d, h, layers, vocab = (int(n) for n in lm.split("x"))
    step, (params, opt, tokens, labels) = lm_step(b, s, d, h, layers, vocab, True,
                                                  np.random.default_rng(0))  # fmt: skip

    def split_step(state, batch):  # (state, metrics), as the libraries' steps return
        params, opt_state, loss = step(*state, *batch)
        return (params, opt_state), loss

    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    return real_code.Case(split_step, (params, opt), (tokens, labels), mesh, None, None)


def plans(case, config) -> list[tuple[str, object]]:
    """``(name, AutoPlan)`` of every plan to rank (see the module)."""
    import planner
    from experiments.time_check import random_anchor_plan
    from planner.cost.simulator import simulate
    from planner.program.schedule import make_schedule

    with case.context():
        searched = planner.plan(case.step, case.state, case.batch, mesh=case.mesh,
                                donate_argnums=case.donate_argnums, constraints="drop",
                                compare=None)  # fmt: skip
        out = [("searched", searched)]
        if case.in_shardings is not None:
            out.append(("authors", planner.price(case.step, case.state, case.batch,
                                                 mesh=case.mesh, in_shardings=case.in_shardings,
                                                 donate_argnums=case.donate_argnums)))  # fmt: skip
        names = case.mesh.axis_names
        sized = [a for a in names if case.mesh.shape[a] > 1]
        experts = planner.expert_plans(case.step, case.state, case.batch, mesh=case.mesh,
                                       data_axes=tuple(sized[:-1]), tensor_axis=sized[-1],
                                       donate_argnums=case.donate_argnums)  # fmt: skip
        out += sorted(experts.items())
    prog, cal = searched.program, searched.calibration
    sizes = {a: n for a, n in case.mesh.shape.items() if n > 1}
    rng, seen = random.Random(f"{config.seed}"), {json.dumps(_key(p.schedule)) for _, p in out}
    made = tries = 0
    while made < config.random_plans and tries < 20 * config.random_plans:
        tries += 1
        try:
            sched = make_schedule(prog, random_anchor_plan(prog, sizes, rng), sizes)
        except ValueError:
            continue
        key = json.dumps(_key(sched))
        if key in seen:  # a plan already ranked
            continue
        seen.add(key)
        plan = dataclasses.replace(searched, schedule=sched, prediction=simulate(prog, sched, cal),
                                   memory_checks=(), asked=None, on_its_own=None)  # fmt: skip
        out.append((f"random_{made}", plan))
        made += 1
    return out


def _key(sched) -> list:
    return [sorted((op, sorted(loops.items())) for op, loops in sched.assign.items() if loops),
            sorted(sched.stored.items())]  # fmt: skip


def measure(case, named: list[tuple[str, object]], config) -> list[dict]:
    """Compile, check and time every plan of ``named`` (see the module)."""
    import jax

    from experiments.measure import interleaved_times
    from experiments.real_code import compiled_mib, worst_difference
    from planner.target.compiled_time import compiled_time

    def fresh():
        return jax.tree.map(lambda x: x.copy(), case.state)

    rows, runs = [], []
    with case.context():
        want = None
        for name, p in named:
            start = time.perf_counter()
            state, batch = jax.device_put((case.state, case.batch), tuple(p.in_shardings))
            # not donated: every round steps from the same state (a random plan may return the
            # state in other layouts than it takes)
            compiled = p.jit(donate_argnums=()).lower(state, batch).compile()
            row = {"plan": name, "predicted_s": p.prediction.time_s,
                   "predicted_mib": p.prediction.peak_bytes / MIB,
                   "compiled_mib": compiled_mib(compiled),
                   "compiled_priced_s": compiled_time(compiled, p.calibration).seconds,
                   "compile_s": time.perf_counter() - start}  # fmt: skip
            # two steps, the first's state placed back as the plan takes it: the second's metrics
            moved, _ = compiled(state, batch)
            metrics = compiled(jax.device_put(moved, p.in_shardings[0]), batch)[1]
            want = metrics if want is None else want
            row["difference"] = worst_difference(metrics, want)
            if row["difference"] > config.tolerance:
                raise RuntimeError(f"plan {name} computes another step than the searched: {row}")
            rows.append(row)
            runs.append(functools.partial(compiled, state, batch))
            logging.warning("%s", row)

    times = interleaved_times(runs, config.repeats, 1)
    for row, t in zip(rows, times, strict=True):
        row["measured_s"], row["measured_min_s"] = t["median"], t["min"]
    return rows


def summarize(rows: list[dict]) -> dict:
    """Spearman of predicted and measured time; the predicted ratio of every pair of plans over
    the measured one (``1`` where the model is right), its worst and the share within 25 %. The
    same, prefixed ``compiled_``, of each compiled program priced by the calibration
    (``compiled_priced_s``, :func:`planner.target.compiled_time.compiled_time`) where the rows
    have it.

    Example:
        >>> summarize([{"predicted_s": 1, "measured_s": 2}, {"predicted_s": 2, "measured_s": 4}])
        {'plans': 2, 'spearman': nan, 'pairs': 1, 'pairs_within_25pct': 1.0, 'worst_pair_ratio': 1.0}
    """
    out = {"plans": len(rows), **agreement(rows, "predicted_s")}
    if rows and all("compiled_priced_s" in r for r in rows):
        out.update({f"compiled_{k}": v for k, v in agreement(rows, "compiled_priced_s").items()})
    return out


def agreement(rows: list[dict], key: str) -> dict:
    """How ``row[key]`` ranks the rows against ``row["measured_s"]`` (see :func:`summarize`)."""
    from experiments.planner_benchmark import spearman

    errors = [(a[key] / b[key]) / (a["measured_s"] / b["measured_s"])
              for a, b in itertools.combinations(rows, 2)]  # fmt: skip
    off = [max(e, 1 / e) for e in errors]
    return {
        "spearman": spearman([r[key] for r in rows], [r["measured_s"] for r in rows]),
        "pairs": len(off),
        "pairs_within_25pct": sum(e <= 1.25 for e in off) / len(off) if off else math.nan,
        "worst_pair_ratio": max(off, default=math.nan),
    }


def report(rows: list[dict], summary: dict, config) -> str:
    """The table, fastest measured first, under the summary."""
    lines = [
        f"# Predicted against measured: {config.case}, {summary['plans']} plans",
        "",
        f"Spearman {summary['spearman']:.3f}; of {summary['pairs']} pairs, "
        f"{summary['pairs_within_25pct']:.0%} have a predicted ratio within 25 % of the measured "
        f"one (worst {summary['worst_pair_ratio']:.2f}x off). Medians of {config.repeats} "
        "interleaved rounds.",
    ]
    if "compiled_spearman" in summary:
        lines += [
            "",
            f"Each compiled program priced by the calibration (its optimized HLO's kernels and "
            f"collectives, loops by their trips: `planner.target.compiled_time`): Spearman "
            f"{summary['compiled_spearman']:.3f}; {summary['compiled_pairs_within_25pct']:.0%} "
            f"of pairs within 25 % (worst {summary['compiled_worst_pair_ratio']:.2f}x off).",
        ]
    lines += [
        "",
        "| plan | predicted ms | compiled, priced ms | measured ms | predicted MiB | compiled MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        priced = f"{r['compiled_priced_s'] * 1e3:.1f}" if "compiled_priced_s" in r else ""
        lines.append(f"| {r['plan']} | {r['predicted_s'] * 1e3:.1f} | {priced} "
                     f"| {r['measured_s'] * 1e3:.1f} | {r['predicted_mib']:.2f} "
                     f"| {r['compiled_mib']:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def run(config, workdir: str) -> dict:
    """Rank the plans of ``config.case``; write the outputs under ``workdir``."""
    os.makedirs(workdir, exist_ok=True)
    case = _case(config.case, config.get("lm", "8x32x64x4x2x256"))
    rows = measure(case, plans(case, config), config)
    summary = summarize(rows)
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report(rows, summary, config))
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json())
    return summary


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from experiments.measure import force_host_devices

    force_host_devices(8)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("KERAS_BACKEND", "jax")
    print(json.dumps(run(flags.FLAGS.config, flags.FLAGS.workdir), indent=1))


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", "configs/ranking/default.py", "Config file.")
    flags.DEFINE_string("workdir", "workdir/ranking", "Where outputs go.")
    app.run(main)
