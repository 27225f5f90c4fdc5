"""Regenerate ``results/``: every folder that runs on this host, each folder's ``command.txt``,
and ``results/README.md`` with the headline figures.

Usage:
    python -m experiments.results --list                      # each folder, what it needs, its commands
    python -m experiments.results                             # every folder that runs on 8 CPU devices
    python -m experiments.results --only=weight_sync,lowering  # those folders
    python -m experiments.results --summary_only              # README.md and command.txt files only

What makes each folder, what it needs and how long it takes is :mod:`experiments.catalog`. The
folders that need the TPU compiler for hours, or Python >= 3.12 with MaxText, keras-hub and gemma,
are run on their own with their ``command.txt``; this reads what they left.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from absl import app, flags, logging

from experiments.catalog import FOLDERS, Folder, Needs


def regenerate(folder: Folder, workdir: str) -> None:
    """Run ``folder``'s commands with this Python into ``workdir/<folder>``."""
    for command in folder.commands(workdir):
        argv = shlex.split(command)
        logging.warning("%s", command)
        subprocess.run([sys.executable, *argv[1:]], check=True)


def write_commands(workdir: str) -> list[str]:
    """Write ``command.txt`` into every catalogued folder present under ``workdir``; return the
    folders found there that the catalog does not know."""
    present = sorted(d for d in os.listdir(workdir) if os.path.isdir(os.path.join(workdir, d)))
    for name in present:
        if name in FOLDERS:
            with open(os.path.join(workdir, name, "command.txt"), "w") as f:
                f.write(FOLDERS[name].command_text())
    return [name for name in present if name not in FOLDERS]


def catalog_table() -> list[str]:
    """A markdown table of the catalog: folder, what it needs, minutes, commands."""
    lines = ["| folder | needs | minutes (2 cores) | command |", "|---|---|---|---|"]
    for f in FOLDERS.values():
        commands = "<br>".join(f"`{c}`" for c in f.commands())
        lines.append(f"| `{f.name}/` | {f.needs.value} | {f.minutes:g} | {commands} |")
    return lines


def _read(workdir: str, *path: str) -> dict | list | None:
    """A JSON (``.json``) or JSON-lines (``.jsonl``) file under ``workdir``; None if absent."""
    p = os.path.join(workdir, *path)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return [json.loads(line) for line in f] if p.endswith(".jsonl") else json.load(f)


def summary(workdir: str) -> str:
    """``workdir/README.md``'s text, read from the folders there (sections of absent ones left out)."""
    sections = (redistribution_sections(workdir) + planner_search_section(workdir)
                + lowering_section(workdir) + tpu_sections(workdir) + spatial_section(workdir)
                + uneven_section(workdir) + real_code_section(workdir)
                + ranking_section(workdir))  # fmt: skip
    lines = ["# Results", "",
             "Every folder's `command.txt` names the commands that made it; "
             "`python -m experiments.results` regenerates the ones that run on 8 simulated CPU "
             "devices (times are ratios measured interleaved in one run), "
             "`python -m experiments.results --list` says what the others need.",
             *sections, "", "## What made each folder", "", *catalog_table()]  # fmt: skip
    return "\n".join(lines) + "\n"


def redistribution_sections(workdir: str) -> list[str]:
    """Markdown on ``random_benchmark/``, ``weight_sync/`` and ``synthesis_scaling/``."""
    lines = []
    bench = _read(workdir, "random_benchmark", "summary.json")
    if bench:
        lines += [
            "",
            "## Random redistributions against XLA (`random_benchmark/`)",
            "",
            f"- {bench['problems']} problems of 4-64 MB on mesh a:2,b:2,c:2: speed-up over XLA "
            f"geomean {bench['speedup_geomean']:.2f}x (min {bench['speedup_min']:.2f}x, max "
            f"{bench['speedup_max']:.2f}x).",
            f"- Noise floor: on the {bench['same_collectives_problems']} problems where both compile "
            f"the very same collectives, the ratio is {bench['same_collectives_speedup_geomean']:.2f}x "
            f"geomean, range {bench['same_collectives_speedup_range'][0]:.2f}-"
            f"{bench['same_collectives_speedup_range'][1]:.2f}x. On the other "
            f"{bench['different_collectives_problems']}: "
            f"{bench['different_collectives_speedup_geomean']:.2f}x geomean, "
            f"{bench['below_noise_floor']} below the noise floor.",
            f"- Bytes moved: {bench['bytes_ratio_geomean']:.2f}x XLA's (geomean); more than XLA on "
            f"{bench['ours_more_bytes']} problems.",
            f"- Full rematerializations (XLA's 'replicate, then slice'): XLA "
            f"{bench['xla_full_rematerializations']}, ours {bench['ours_full_rematerializations']}.",
            f"- Compiled temporary memory over max(src tile, dst tile): median "
            f"{bench['ours_temp_over_bound_median']:.2f} (max {bench['ours_temp_over_bound_max']:.2f}) "
            f"against XLA's {bench['xla_temp_over_bound_median']:.2f} (max "
            f"{bench['xla_temp_over_bound_max']:.2f}).",
            f"- Synthesis p50 {bench['synthesis_ms_p50']:.1f} ms, p99 {bench['synthesis_ms_p99']:.1f} ms.",
        ]
    ws = _read(workdir, "weight_sync", "results.json")
    if ws:
        m = ws["methods"]
        lines += [
            "",
            "## Weight sync (`weight_sync/`)",
            "",
            f"FSDP training mesh to tensor-parallel serving mesh, {ws['param_bytes'] / 2**20:.0f} MiB "
            f"of parameters: redist {m['redist']['time_s'] * 1e3:.1f} ms "
            f"({m['redist']['speedup_vs_xla']:.2f}x XLA), XLA {m['xla']['time_s'] * 1e3:.1f} ms, "
            f"device_put {m['device_put']['time_s'] * 1e3:.1f} ms; compiled temporary memory "
            f"{m['redist']['temp_bytes'] / 2**20:.2f} MiB against XLA's "
            f"{m['xla']['temp_bytes'] / 2**20:.2f} MiB per device.",
        ]
    table = os.path.join(workdir, "frontier_sync", "report.md")
    frontier = open(table).read() if os.path.exists(table) else ""
    if frontier:
        lines += ["", "## Weight sync at frontier size (`frontier_sync/`)", "",
                  "Training layout (fsdp x expert) to serving layout (tensor, experts over ep x tp) "
                  "on the same v5p chips, compiled by the TPU compiler on this host; temporaries "
                  "are what a chip holds beyond the two trees:", "", *frontier.splitlines()]  # fmt: skip
    problems = _read(workdir, "synthesis_scaling", "results.jsonl")
    if problems:
        worst = max(problems, key=lambda r: r["seconds"])
        lines += [
            "",
            "## Synthesis time (`synthesis_scaling/`)",
            "",
            f"Meshes of 8 to 4096 devices, ranks 1-8: slowest problem {worst['seconds']:.2f} s "
            f"({worst['mesh']}, rank {worst['rank']}).",
        ]
    return lines


def planner_search_section(workdir: str) -> list[str]:
    """Markdown on ``planner_search_scaling/`` (its three runs' rows, in the catalog's order)."""
    runs = FOLDERS["planner_search_scaling"].runs
    rows = [r for run in runs
            for r in _read(workdir, "planner_search_scaling", run.sub, "results.jsonl") or []]  # fmt: skip
    if not rows:
        return []
    return [
        "",
        "## Planner search time (`planner_search_scaling/`)",
        "",
        "`planner.search`; programs analysed from shapes, meshes abstract; the transformer priced "
        "on the CPU calibration, the flax language model (`lm_scan`) on TPU v5p's.",
        "",
        "| program | layers | ops | mesh | devices | search s | predicted ms (replicated) |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['workload']} {r['sizes']} | {r['layers']} | {r['ops']} | {r['mesh']} | "
            f"{r['devices']} | {r['search_s']:.1f} | {r['predicted_s'] * 1e3:.1f} "
            f"({r['replicated_s'] * 1e3:.1f}) |"
            for r in rows
        ),
    ]


def lowering_section(workdir: str) -> list[str]:
    """Markdown on ``lowering/``."""
    lowered = _read(workdir, "lowering", "summary.json")
    if not lowered:
        return []
    return [
        "",
        "## One plan, four lowerings (`lowering/`)",
        "",
        "The planner-benchmark workloads' searched plans (and data parallelism), time over XLA's "
        "SPMD partitioning of the same plan (`xla again`: the same program timed twice, the "
        "noise floor of the run):",
        "",
        "| lowering | geomean | min | max |",
        "|---|---|---|---|",
        *(
            f"| {name} | {r['geomean_over_xla']:.2f} | {r['min_over_xla']:.2f} | "
            f"{r['max_over_xla']:.2f} |"
            for name, r in lowered.items()
        ),
    ]


def real_code_section(workdir: str) -> list[str]:
    """Markdown on ``real_code/`` (MaxText's, keras-hub's and gemma's own steps against their
    authors' layouts): it needs Python >= 3.12 with those libraries, so it is run on its own
    (``python -m experiments.real_code --config=configs/real_code/default.py --workdir=results/real_code``)
    and read here."""
    path = os.path.join(workdir, "real_code", "report.md")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        table = f.read().strip()
    return ["", "## The code people run (`real_code/`)", "",
            "Each library's own training step, tiny, on 8 CPU devices: the plan against the "
            "authors' layout, searched handed that layout (`authors`) and on its own (`none`: "
            "`constraints=\"drop\"`, `compare=None`).", "", table]  # fmt: skip


def ranking_section(workdir: str) -> list[str]:
    """Markdown on ``ranking/`` (the cost model's order of many plans of MaxText's tiny step
    against the measured order), run on its own as ``real_code/`` is, and read here."""
    s = _read(workdir, "ranking", "summary.json")
    config = _read(workdir, "ranking", "config.json") or {}
    if not s:
        return []
    return ["", "## Predicted against measured order (`ranking/`)", "",
            f"{s['plans']} plans of `{config.get('case', 'one step')}` (the search's, the experts', the authors' layout, "
            f"random ones), predicted and measured on 8 CPU devices: Spearman "
            f"{s['spearman']:.3f}; {s['pairs_within_25pct']:.0%} of {s['pairs']} pairs have a "
            f"predicted ratio within 25 % of the measured one (worst {s['worst_pair_ratio']:.2f}x "
            f"off).{_compiled_agreement(s)} Every plan: [ranking/report.md](ranking/report.md)."]  # fmt: skip


def _compiled_agreement(s: dict) -> str:
    """The sentence on the compiled programs' prices of a ranking summary, where it has them."""
    if "compiled_spearman" not in s:
        return ""
    return (f" Their compiled programs priced by the same calibration (`planner.plan(..., "
            f"rank_by=\"compiled\")`'s ranking): Spearman {s['compiled_spearman']:.3f}, "
            f"{s['compiled_pairs_within_25pct']:.0%} of pairs within 25 % (worst "
            f"{s['compiled_worst_pair_ratio']:.2f}x off).")  # fmt: skip


def tpu_sections(workdir: str) -> list[str]:
    """Markdown on the TPU-compiler runs found under ``workdir`` (``pod_plans/``,
    ``time_check/``): they take hours on 2 cores and are run on their own (their modules say
    how), so this reads their summaries rather than running them."""
    lines = []
    summary = _read(workdir, "pod_plans", "summary.json")
    if summary:
        lines += ["", "## Planning TPU pods (`pod_plans/`)", "",
                  "Searched plan against the best expert strategy that fits, both compiled by the "
                  "TPU compiler for the pod (`python -m experiments.pod_plans`); estimate: "
                  "compiled kernels + the HLO's collectives priced by the calibration. Compiled "
                  "memory here is arguments + outputs + temporaries - aliased, measured before "
                  "`compiled_report` read the TPU compiler's own peak (12-32 % lower on "
                  "MaxText's steps).", "",
                  "| model @ topology | searched fits | search s | searched / best expert | "
                  "best expert | predicted / compiled memory |", "|---|---|---|---|---|---|"]  # fmt: skip
        for case, c in summary.items():
            if c.get("search_s") is None:  # the searched plan not measured (yet)
                continue
            ratio = c.get("searched_over_best_expert")
            mem = c.get("searched_memory_ratio")
            search = c.get("search_s")
            lines.append(
                f"| {case} | {'yes' if c['searched_fits'] else 'no'} | "
                f"{'-' if search is None else f'{search:.0f}'} | "
                f"{'-' if ratio is None else f'{ratio:.3f}'} | {c.get('best_expert') or 'none fits'}"
                f" | {'-' if mem is None else f'{mem:.2f}'} |"
            )
    s = _read(workdir, "time_check", "summary.json")
    if s:
        lines += ["", "## Time against the TPU compiler (`time_check/`)", "",
                  f"{s['plans']} plans of the flax LM on 256 v5p chips "
                  "(`python -m experiments.time_check`): Spearman of predicted and compiled step "
                  f"time {s['spearman_time']:.3f} ({s['spearman_time_random']:.3f} over the "
                  f"{s['random_plans']} random plans); predicted / compiled time geomean "
                  f"{s['time_ratio']['geomean']:.2f} (range {s['time_ratio']['min']:.2f}-"
                  f"{s['time_ratio']['max']:.2f}); flops within 10% on {s['flops_within_10pct']} "
                  f"of {s['plans']}, bytes accessed on {s['bytes_within_10pct']}."]  # fmt: skip
    path = os.path.join(workdir, "recipes", "report.md")
    if os.path.exists(path):
        lines += ["", "## Against MaxText's recipes (`recipes/`)", "",
                  "MaxText's steps and recipes (v5p-128, v5p-512, v6e-256), its own layout "
                  "(logical axis rules and activation constraints, GSPMD) and the planner's "
                  "plans, compiled by the TPU compiler (`python -m experiments.recipes`); "
                  "compiled memory is the compiler's peak per chip:", "",
                  open(path).read().rstrip()]  # fmt: skip
    path = os.path.join(workdir, "recipes", "depths.md")
    if os.path.exists(path):
        lines += ["", "The searched plan with its layers cut (`--config.depths`): predicted and "
                  "compiled peak per chip by depth:", "", open(path).read().rstrip()]  # fmt: skip
    path = os.path.join(workdir, "recipes", "code_report.md")
    if os.path.exists(path):
        lines += ["", "MaxText's own training step (`maxtext` 0.2.5) at its recipes' size, built "
                  "from shapes as its `train_compile` builds it: MaxText's own compile of its "
                  "layout (`recipe`) against the planner's plan of the same step (`searched`); "
                  "the estimate is each layout's kernels at 1 and 2 layers, unrolled, extended, "
                  "plus the step's collectives; MFU by MaxText's own count of a step's flops "
                  "(`configs/recipes/maxtext_code.py`):", "",
                  open(path).read().rstrip()]  # fmt: skip
    return lines


def spatial_section(workdir: str) -> list[str]:
    """Markdown on the spatial-partitioning run (``planner_spatial/``, ``python -m
    experiments.planner_benchmark --config=configs/planner_benchmark/spatial.py``), read from its rows."""
    return _benchmark_section(
        workdir, "planner_spatial", "Spatial partitioning",
        "Training steps on two 256x256 images over 8 simulated CPU devices (the batch splits 2 "
        "ways) of a 3x3 convolutional network (`convnet`) and of one with a depthwise "
        "convolution, a 3x3 max pool and a 2x2 average pool per layer (`convpool`): the searched "
        "plan against batch x channels (groups), batch x rows (every convolution and pool, and "
        "their gradients, split by rows with halos) and replication, timed interleaved.",
        digits=1, error=False,
    )  # fmt: skip


def uneven_section(workdir: str) -> list[str]:
    """Markdown on the GPT-2-sized run (``planner_uneven/``, ``python -m
    experiments.planner_benchmark --config=configs/planner_benchmark/uneven.py``), read from its rows."""
    return _benchmark_section(
        workdir, "planner_uneven", "A vocabulary the mesh does not divide",
        "A GPT-2-sized training step (flax, adamw; 2 scanned layers, d 768, 12 heads, vocabulary "
        "50,257, batch 8 x 256) on 8 simulated CPU devices: the search with the splits only "
        "XLA's partitioner runs (`auto`: the vocabulary in padded tiles, the cross-entropy's "
        "lookup masked) and without them (`auto_even`), against data parallelism and FSDP, timed "
        "interleaved; max error: the largest difference from the unsharded step over its largest "
        "output.",
        digits=0, error=True,
    )  # fmt: skip


def _benchmark_section(workdir: str, name: str, title: str, intro: str, digits: int,
                       error: bool) -> list[str]:  # fmt: skip
    """A planner-benchmark run's rows under ``workdir/name`` as a markdown table (none if the run
    is absent): measured and predicted ms and compiled MiB with ``digits`` decimals, and with
    ``error`` each plan's largest difference from the unsharded program."""
    rows = _read(workdir, name, "results.jsonl")
    if not rows:
        return []
    head = "| workload | strategy | measured ms | predicted ms | device MiB |"
    lines = ["", f"## {title} (`{name}/`)", "", intro, "",
             head + (" max error |" if error else ""),
             "|---|---|---|---|---|" + ("---|" if error else "")]  # fmt: skip
    for r in rows:
        if r.get("measured_s") is None:
            continue
        line = (f"| {r['workload']} | {r['strategy']} | {r['measured_s'] * 1e3:.{digits}f} | "
                f"{r['predicted_s'] * 1e3:.{digits}f} | {r['device_bytes'] / 2**20:.{digits}f} |")  # fmt: skip
        lines.append(line + (f" {r.get('max_error', float('nan')):.1e} |" if error else ""))
    return lines


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    f = flags.FLAGS
    if f.list:
        print("\n".join(catalog_table()))
        return
    names = f.only or [n for n, folder in FOLDERS.items() if folder.needs == Needs.HOST]
    unknown = sorted(set(names) - set(FOLDERS))
    if unknown:
        raise ValueError(f"--only names folders the catalog does not have: {unknown}; "
                         f"known: {sorted(FOLDERS)}")  # fmt: skip
    if not f.summary_only:
        for name in names:
            regenerate(FOLDERS[name], f.workdir)
    strays = write_commands(f.workdir)
    if strays:
        logging.warning("folders under %s that experiments.catalog does not list: %s",
                        f.workdir, strays)  # fmt: skip
    text = summary(f.workdir)
    with open(os.path.join(f.workdir, "README.md"), "w") as out:
        out.write(text)
    print(text)
    print(f"outputs in {f.workdir}")


if __name__ == "__main__":
    flags.DEFINE_string("workdir", "results", "Where outputs go.")
    flags.DEFINE_bool(
        "list", False, "Print each folder, what it needs and its commands; run nothing."
    )
    flags.DEFINE_list("only", [], "Regenerate these folders (default: all that run on this host).")
    flags.DEFINE_bool("summary_only", False, "Write README.md and command.txt files only.")
    app.run(main)
