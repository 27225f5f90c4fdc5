"""Random-problem benchmark against XLA's own resharding (the paper's §8, Fig. 13-14).

Usage:
    python -m experiments.random_benchmark --workdir=workdir/bench --config=configs/random_benchmark/default.py
    python -m experiments.random_benchmark --config=configs/random_benchmark/default.py --config.num_problems=10

For every problem, on the same input array and in the same process: our plan (synthesis time), our
compiled program, and XLA's resharding (``jax.jit(lambda v: v, out_shardings=dst)``, what
``jax.device_put`` and ``jax.reshard`` run). Writes under ``--workdir``: ``config.json``,
``results.jsonl``, ``summary.json``, ``report.md`` and PNG figures.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
import zlib

from absl import app, flags, logging
from ml_collections import config_flags


def problems_of(config):
    """The problems a config asks for: named ones (scaled), or random ones of the paper's recipe."""
    from redist import problems

    if config.problems:
        out = []
        for name in config.problems.split(","):
            p = problems.by_name(name.strip())
            out.append(p._replace(shape=_scaled(p, config.scale)))
        return out
    from experiments.measure import parse_mesh

    mesh = parse_mesh(config.mesh)
    rng = random.Random(config.seed)
    itemsize = _itemsize(config.dtype)
    lo, hi = (int(mb * 2**20 / itemsize) for mb in (config.min_mb, config.max_mb))
    out = [
        problems.random_problem(
            rng, mesh, max_rank=config.max_rank, min_elems=lo, max_elems=hi, name=f"r{k:04d}"
        )  # fmt: skip
        for k in range(config.num_problems)
    ]
    if config.get("uneven"):
        out = [problems.cut_uneven(p, rng)._replace(name=f"u{p.name[1:]}") for p in out]
    return out


def _itemsize(dtype: str) -> int:
    from redist.specs import dtype_info

    return dtype_info(dtype)[1]


def _scaled(p, scale: float) -> tuple[int, ...]:
    if scale == 1.0:
        return p.shape
    from redist.problems import _names

    out = []
    for i, n in enumerate(p.shape):
        parts = math.lcm(*(math.prod(p.mesh[a] for a in _names(s[i] if i < len(s) else None))
                           for s in (p.src, p.dst)))  # fmt: skip
        out.append(max(parts, int(n * scale) // parts * parts))
    return tuple(out)


def measure_problem(p, config) -> dict:
    """Plan, compile, time and check ours and XLA's program for one problem."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    import redist
    from experiments.measure import compile_stats, interleaved_times
    from redist.api import resolved_cost_model
    from redist.search import weak_paths
    from redist.synthesis import synthesize

    ndev = math.prod(p.mesh.values())
    mesh = jax.make_mesh(tuple(p.mesh.values()), tuple(p.mesh), devices=jax.devices()[:ndev],
                         axis_types=(AxisType.Auto,) * len(p.mesh))  # fmt: skip
    src, dst = PartitionSpec(*p.src), PartitionSpec(*p.dst)
    synthesize.cache_clear()
    weak_paths.cache_clear()
    t0 = time.perf_counter()
    model = resolved_cost_model(config.cost_model, mesh)  # "auto": redistribute's default
    plan = redist.plan(p.shape, src, dst, mesh, dtype=config.dtype, cost_model=model)
    synthesis_s = time.perf_counter() - t0

    rng = np.random.default_rng(zlib.crc32(p.name.encode()))
    arr = rng.standard_normal(p.shape, dtype=np.float32).astype(config.dtype)
    ours, xla, padded = _programs(plan, mesh, src, dst, model)
    x = jax.device_put(padded(arr), NamedSharding(mesh, src))
    ours_c, ours_s = compile_stats(ours, x)
    xla_c, xla_s = compile_stats(xla, x)
    timing = interleaved_times(
        [lambda: ours_c(x), lambda: xla_c(x)], config.repeats, config.warmup, config.min_time_s
    )
    exact = {}
    if config.check:
        for name, f in (("ours", ours_c), ("xla", xla_c)):
            y = f(x)
            exact[name] = bool(
                y.sharding.is_equivalent_to(NamedSharding(mesh, dst), len(p.shape))
                and np.array_equal(np.asarray(y)[tuple(map(slice, p.shape))], arr)
            )
            del y
    bound = plan.bound_bytes

    def side(stats, t, extra):
        return {
            "median_s": t["median"],
            "min_s": t["min"],
            "collectives": [[c.kind, c.bytes] for c in stats.collectives],
            "collective_bytes": stats.collective_bytes,
            "temp_bytes": stats.temp_bytes,
            "temp_over_bound": stats.temp_bytes / bound,
            "full_remat": stats.full_remat,
            **extra,
        }

    return {
        "name": p.name,
        "mesh": p.mesh,
        "shape": list(p.shape),
        "dtype": config.dtype,
        "src": str(src),
        "dst": str(dst),
        "src_type": str(plan.src),
        "dst_type": str(plan.dst),
        "global_bytes": math.prod(plan.global_shape) * plan.itemsize,
        "uneven": plan.uneven,
        "bound_bytes": bound,
        "synthesis_s": synthesis_s,
        "plan": str(plan),
        "plan_kinds": list(plan.kinds),
        "plan_cost_bytes": plan.cost_bytes,
        "plan_peak_bytes": plan.peak_bytes,
        "ours": side(ours_s, timing[0], {"exact": exact.get("ours")}),
        "xla": side(xla_s, timing[1], {"exact": exact.get("xla")}),
        "same_collectives": [c.kind for c in ours_s.collectives]
        == [c.kind for c in xla_s.collectives]
        and ours_s.collective_bytes == xla_s.collective_bytes,
        "speedup": timing[1]["median"] / timing[0]["median"],
        "speedup_min": timing[1]["min"] / timing[0]["min"],
    }


def _programs(plan, mesh, src, dst, model):
    """Ours and XLA's jitted move, and how an input is padded for them. An uneven layout exists
    only inside ``jit``: both programs then take the source's padded array (an even layout),
    cut it to the true extent, move it, and pad the result to the destination's padded extent;
    XLA lays an uneven dimension out as the padded one, so the cut and the pad move nothing."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    import redist

    def ours_move(v):
        return redist.redistribute(v, src, dst, mesh=mesh, cost_model=model)

    def xla_move(v):
        return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, dst))

    if not plan.uneven:
        ours = jax.jit(ours_move)
        return ours, jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, dst)), lambda a: a
    shape, src_shape, dst_shape = plan.global_shape, plan.src.global_shape, plan.dst.global_shape

    def wrapped(move):
        def f(v):
            v = jax.lax.with_sharding_constraint(v[tuple(map(slice, shape))],
                                                 NamedSharding(mesh, src))  # fmt: skip
            v = jax.numpy.pad(move(v), [(0, m - n) for n, m in zip(shape, dst_shape)])
            return v

        return jax.jit(f, out_shardings=NamedSharding(mesh, dst))

    def padded(a):
        return np.pad(a, [(0, m - n) for n, m in zip(shape, src_shape)])

    return wrapped(ours_move), wrapped(xla_move), padded


def topology_mesh(topology: str, axes: dict[str, int]):
    """A compile-only mesh of ``axes``: over the TPU ``topology`` (``"v5p:2x2x2"``), or over the
    GPUs of one host for ``"gpu:<calibration>"`` (``"gpu:h100_sxm"``, :func:`planner.gpu_mesh`)."""
    import planner

    kind, _, gpu = topology.partition(":")
    if kind == "gpu":
        return planner.gpu_mesh(axes, gpu=gpu or "h100_sxm")
    return planner.topology_mesh(topology, axes)


def compile_problem(p, config) -> dict:
    """Compile ours and XLA's program for ``config.topology`` (:func:`topology_mesh`: the TPU
    and GPU compilers run on any host; nothing runs): compiled temporary memory and collectives
    of both."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import redist
    from experiments.measure import compile_stats
    from redist.api import resolved_cost_model

    mesh = topology_mesh(config.topology, p.mesh)
    src, dst = PartitionSpec(*p.src), PartitionSpec(*p.dst)
    model = resolved_cost_model(config.cost_model, mesh)
    plan = redist.plan(p.shape, src, dst, mesh, dtype=config.dtype, cost_model=model)
    ours, xla, _ = _programs(plan, mesh, src, dst, model)
    x = jax.ShapeDtypeStruct(plan.src.global_shape, config.dtype, sharding=NamedSharding(mesh, src))
    sides = {}
    for name, f in (("ours", ours), ("xla", xla)):
        _, stats = compile_stats(f, x)
        sides[name] = {
            "collectives": [[c.kind, c.bytes] for c in stats.collectives],
            "collective_bytes": stats.collective_bytes,
            "temp_bytes": stats.temp_bytes,
            "temp_over_bound": stats.temp_bytes / plan.bound_bytes,
            "full_remat": stats.full_remat,
        }
    return {
        "name": p.name, "topology": config.topology, "mesh": p.mesh, "shape": list(p.shape),
        "src": str(src), "dst": str(dst), "bound_bytes": plan.bound_bytes,
        "plan_kinds": list(plan.kinds), **sides,
    }  # fmt: skip


def _topology_summary(results: list[dict]) -> dict:
    import statistics

    out = {"topology": results[0]["topology"], "problems": len(results)}
    for side in ("ours", "xla"):
        over = [r[side]["temp_over_bound"] for r in results]
        out[f"{side}_temp_over_bound_median"] = statistics.median(over)
        out[f"{side}_temp_over_bound_max"] = max(over)
        out[f"{side}_full_remats"] = sum(r[side]["full_remat"] for r in results)
        out[f"{side}_collective_bytes"] = sum(r[side]["collective_bytes"] for r in results)
    out["ours_less_temp"] = sum(r["ours"]["temp_bytes"] < r["xla"]["temp_bytes"] for r in results)
    out["xla_less_temp"] = sum(r["xla"]["temp_bytes"] < r["ours"]["temp_bytes"] for r in results)
    return out


def _topology_markdown(results: list[dict], summary: dict) -> str:
    mb = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    seq = lambda cs: " ".join(f"{k}({mb(b)})" for k, b in cs) or "-"  # noqa: E731
    lines = [
        f"# Compiled for {summary['topology']} by the "
        f"{'GPU' if summary['topology'].startswith('gpu') else 'TPU'} compiler (nothing runs)",
        "",
        f"{summary['problems']} problems. Temporary memory over max(src tile, dst tile): median "
        f"{summary['ours_temp_over_bound_median']:.2f} (max {summary['ours_temp_over_bound_max']:.2f})"
        f" for redist, {summary['xla_temp_over_bound_median']:.2f} "
        f"(max {summary['xla_temp_over_bound_max']:.2f}) for XLA; less temporary memory: redist on "
        f"{summary['ours_less_temp']}, XLA on {summary['xla_less_temp']}.",
        "",
        "| problem | shape | src -> dst | redist temp MB | XLA temp MB | redist collectives (MB)"
        " | XLA collectives (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {tuple(r['shape'])} | {r['src']} -> {r['dst']} | "
            f"{mb(r['ours']['temp_bytes'])} | {mb(r['xla']['temp_bytes'])}"
            f"{' (remat)' if r['xla']['full_remat'] else ''} | {seq(r['ours']['collectives'])} | "
            f"{seq(r['xla']['collectives'])} |"
        )
    return "\n".join(lines) + "\n"


def _progress(k: int, n: int, text: str, finished: bool = False) -> None:
    """A bar redrawn in place on a terminal; elsewhere (a log file) a plain line after about
    every tenth of the problems, no carriage returns."""
    if sys.stderr.isatty():
        width = 30
        done = int(width * k / max(n, 1))
        sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {k}/{n} {text:<40}")
    elif finished and (k == n or k % max(1, n // 10) == 0):
        sys.stderr.write(f"{k}/{n} problems done, last {text}\n")
    sys.stderr.flush()


def run(config, workdir: str) -> dict:
    """Run the benchmark of ``config``; write outputs under ``workdir``; return the summary."""
    from experiments import report
    from experiments.measure import force_host_devices

    problems = problems_of(config)
    if config.get("topology"):
        return _run_on_topology(problems, config, workdir)
    force_host_devices(max(math.prod(p.mesh.values()) for p in problems))
    import jax

    need = max(math.prod(p.mesh.values()) for p in problems)
    if jax.device_count() < need:
        raise ValueError(f"the problems need {need} devices, but JAX has {jax.device_count()}")
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    results = []
    start = time.perf_counter()
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        for k, p in enumerate(problems):
            _progress(k, len(problems), p.name)
            r = measure_problem(p, config)
            results.append(r)
            f.write(json.dumps(r) + "\n")
            f.flush()
            _progress(k + 1, len(problems), f"{p.name} speed-up {r['speedup']:.2f}x", True)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    summary = report.summarize(results, time.perf_counter() - start)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report.markdown(results, summary, config))
    if config.figures:
        report.figures(results, workdir)
    return summary


def _run_on_topology(problems, config, workdir: str) -> dict:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    results = []
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        for k, p in enumerate(problems):
            _progress(k, len(problems), p.name)
            results.append(compile_problem(p, config))
            f.write(json.dumps(results[-1]) + "\n")
            _progress(k + 1, len(problems), p.name, True)
    summary = _topology_summary(results)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(_topology_markdown(results, summary))
    return summary


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    summary = run(flags.FLAGS.config, flags.FLAGS.workdir)
    print(json.dumps(summary, indent=2))
    workdir = flags.FLAGS.workdir
    print(f"outputs in {workdir}: summary.json, results.jsonl, report.md and figures (*.png)")


if __name__ == "__main__":
    # Flags are defined here, not at import, so that several runners can be imported together.
    config_flags.DEFINE_config_file(
        "config", "configs/random_benchmark/default.py", "Benchmark config file."
    )
    flags.DEFINE_string("workdir", "workdir/random_benchmark", "Where outputs go.")
    app.run(main)
