"""Summaries, a markdown report and figures for the random benchmark's results."""

from __future__ import annotations

import math
import os
import statistics

import numpy as np


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


SLACK_BYTES = 4096  # constants (offset tables, scalars) that any compiled program may hold


def _over(r: dict, side: str, factor: float) -> bool:
    return r[side]["temp_bytes"] > factor * r["bound_bytes"] + SLACK_BYTES


def summarize(results: list[dict], wall_s: float) -> dict:
    """Aggregate figures over all problems (ratios measured in one run).

    Memory counts compare compiled temporary bytes with ``factor * bound + 4 KiB``.
    """
    sp = [r["speedup"] for r in results]
    syn = [r["synthesis_s"] * 1e3 for r in results]
    ours_mem = [r["ours"]["temp_over_bound"] for r in results]
    xla_mem = [r["xla"]["temp_over_bound"] for r in results]
    byte_ratio = [
        r["ours"]["collective_bytes"] / r["xla"]["collective_bytes"]
        for r in results
        if r["xla"]["collective_bytes"] > 0 and r["ours"]["collective_bytes"] > 0
    ]
    more_bytes = [
        r["name"] for r in results if r["ours"]["collective_bytes"] > r["xla"]["collective_bytes"]
    ]
    more_bytes_bounded = [
        r["name"]
        for r in results
        if r["ours"]["collective_bytes"] > r["xla"]["collective_bytes"] and not _over(r, "xla", 1.0)
    ]
    same = [r["speedup"] for r in results if r.get("same_collectives")]
    differ = [r["speedup"] for r in results if not r.get("same_collectives")]
    floor = min(same) if same else 0.0
    return {
        "problems": len(results),
        "same_collectives_problems": len(same),
        "same_collectives_speedup_geomean": _geomean(same),
        "same_collectives_speedup_range": [min(same), max(same)] if same else None,
        "different_collectives_problems": len(differ),
        "different_collectives_speedup_geomean": _geomean(differ),
        "below_noise_floor": sum(s < floor for s in differ),
        "wall_s": wall_s,
        "speedup_geomean": _geomean(sp),
        "speedup_min": min(sp),
        "speedup_max": max(sp),
        "speedup_min_based_geomean": _geomean(r["speedup_min"] for r in results),
        "slower_than_0.8x": sum(s < 0.8 for s in sp),
        "slower_than_1x": sum(s < 1.0 for s in sp),
        "bytes_ratio_geomean": _geomean(byte_ratio),
        "ours_more_bytes": len(more_bytes),
        "ours_more_bytes_where_xla_memory_bounded": len(more_bytes_bounded),
        "ours_temp_over_bound_max": max(ours_mem),
        "ours_temp_over_bound_median": statistics.median(ours_mem),
        "ours_over_1.5x_bound": sum(_over(r, "ours", 1.5) for r in results),
        "xla_temp_over_bound_max": max(xla_mem),
        "xla_temp_over_bound_median": statistics.median(xla_mem),
        "ours_over_bound": sum(_over(r, "ours", 1.0) for r in results),
        "xla_over_bound": sum(_over(r, "xla", 1.0) for r in results),
        "xla_over_1.5x_bound": sum(_over(r, "xla", 1.5) for r in results),
        "xla_full_rematerializations": sum(r["xla"]["full_remat"] for r in results),
        "ours_full_rematerializations": sum(r["ours"]["full_remat"] for r in results),
        "synthesis_ms_p50": float(np.percentile(syn, 50)),
        "synthesis_ms_p99": float(np.percentile(syn, 99)),
        "synthesis_ms_max": max(syn),
        "ours_exact": sum(bool(r["ours"]["exact"]) for r in results),
        "xla_exact": sum(bool(r["xla"]["exact"]) for r in results),
    }


def _seq(side: dict) -> str:
    return " ".join(f"{k}({b / 2**20:.1f}M)" for k, b in side["collectives"]) or "(none)"


def _row(r: dict) -> str:
    return (
        f"| {r['name']} | `{r['src_type']}` | `{r['dst_type']}` | {r['global_bytes'] / 2**20:.1f} "
        f"| {r['speedup']:.2f}x | {r['ours']['temp_over_bound']:.2f} | "
        f"{r['xla']['temp_over_bound']:.2f}{' (remat)' if r['xla']['full_remat'] else ''} "
        f"| {_seq(r['ours'])} | {_seq(r['xla'])} |"
    )


def markdown(results: list[dict], summary: dict, config) -> str:
    head = (
        "| problem | source | target | MB | speed-up | ours temp/bound | XLA temp/bound "
        "| our collectives | XLA collectives |\n|---|---|---|---|---|---|---|---|---|"
    )
    by_speed = sorted(results, key=lambda r: r["speedup"])
    n = config.report_rows
    lines = [
        "# Random redistribution benchmark: redist vs XLA resharding",
        "",
        f"{summary['problems']} problems, mesh `{config.mesh}`, {config.min_mb}-{config.max_mb} MB, "
        f"dtype {config.dtype}, seed {config.seed}, {config.repeats} interleaved repetitions "
        f"(median) after {config.warmup} warm-up. Speed-up = XLA time / our time. "
        "Bound = max(source tile, destination tile) per device; temp = compiled temporary memory.",
        "",
        "## Summary",
        "",
        "| figure | value |",
        "|---|---|",
        *(
            f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
            for k, v in summary.items()
        ),  # fmt: skip
        "",
        f"## Where we lose most ({min(n, len(results))} slowest ratios)",
        "",
        head,
        *(_row(r) for r in by_speed[:n]),
        "",
        f"## Where we win most ({min(n, len(results))} fastest ratios)",
        "",
        head,
        *(_row(r) for r in reversed(by_speed[-n:])),
        "",
    ]
    return "\n".join(lines)


def figures(results: list[dict], workdir: str) -> list[str]:
    """Fig. 14a-like scatter, Fig. 14b-like histogram, and a memory-ratio histogram (PNG). Where
    both sides compile the very same collectives the ratio is the host's noise, not a win: those
    problems are drawn apart ("same collectives") from the ones where the programs differ."""
    from experiments.measure import plain_log_ticks, pyplot, ratio_axis

    plt = pyplot()
    if plt is None:
        return []
    from matplotlib.ticker import MaxNLocator

    paths = []
    same = np.array([bool(r.get("same_collectives")) for r in results])
    groups = [(~same, "different collectives", "C0"), (same, "same collectives (noise)", "C7")]
    ours = np.array([r["ours"]["median_s"] for r in results]) * 1e3
    xla = np.array([r["xla"]["median_s"] for r in results]) * 1e3
    fig, ax = plt.subplots(figsize=(5, 5))
    for mask, label, color in groups:
        if mask.any():
            ax.loglog(xla[mask], ours[mask], "o", alpha=0.6, ms=4, color=color, label=label)
    lo, hi = min(ours.min(), xla.min()) * 0.8, max(ours.max(), xla.max()) * 1.25
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="equal time")
    ax.set(xlabel="XLA resharding time (ms)", ylabel="redist time (ms)", xlim=(lo, hi), ylim=(lo, hi),
           title="Run times (below the diagonal: redist faster)")  # fmt: skip
    plain_log_ticks(ax)
    ax.legend()
    paths.append(_save(fig, workdir, "runtimes.png"))
    sp = np.array([r["speedup"] for r in results])
    fig, ax = plt.subplots(figsize=(6, 4))
    lo, hi = min(sp.min(), 0.5), max(sp.max(), 2.0)
    bins = np.geomspace(lo, hi, 30)
    shown = [(sp[mask], label, color) for mask, label, color in groups if mask.any()]
    ax.hist([s for s, _, _ in shown], bins=bins, stacked=True,
            label=[f"{label}: {len(s)}" for s, label, _ in shown],
            color=[color for _, _, color in shown])  # fmt: skip
    ax.set_xscale("log")
    ratio_axis(ax, "x", lo, hi)
    ax.axvline(1.0, color="k", ls="--", lw=1, label="equal time (1×)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="speed-up (XLA time / redist time)", ylabel="problems",
           title=f"Speed-ups, geometric mean {math.exp(np.log(sp).mean()):.2f}×")  # fmt: skip
    ax.legend()
    paths.append(_save(fig, workdir, "speedups.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    om = [r["ours"]["temp_over_bound"] for r in results]
    xm = [r["xla"]["temp_over_bound"] for r in results]
    bins = np.linspace(0, max(max(om), max(xm)) * 1.05 + 1e-9, 30)
    ax.hist([om, xm], bins=bins, label=["redist", "XLA"])
    ax.axvline(1.0, color="k", ls="--", lw=1, label="the bound: max(src tile, dst tile)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="compiled temporary memory / max(src tile, dst tile)", ylabel="problems",
           title="Temporary memory per device")  # fmt: skip
    ax.legend()
    paths.append(_save(fig, workdir, "memory.png"))
    return paths


def _save(fig, workdir: str, name: str) -> str:
    from experiments.measure import save_figure

    path = os.path.join(workdir, name)
    save_figure(fig, path)
    return path
