"""The planner on the code people run: MaxText's own training step, keras-hub's Llama and Google's
gemma, planned and measured against the layouts their authors wrote.

Usage:
    python -m experiments.real_code --config=configs/real_code/default.py --workdir=workdir/real_code

Each case (library, dtype, mesh) builds the library's own step tiny on 8 CPU devices
(:mod:`experiments.libraries`), plans it with :func:`planner.plan` in each mode of
``config.given_layout`` (comma-separated: ``authors``, its sharding constraints as hints and the
authors' ``in_shardings`` to compare with; ``hints``, the constraints as hints and no input
layouts; ``none``, on its own: ``constraints="drop", compare=None``), prices the authors' layout with
:func:`planner.price` on the same model, then compiles both (``plan.jit()`` and the library's own
jitted step) and runs two steps of each from the same state: the largest difference of any
state leaf (relative to its largest value), compiled memory per device (arguments + outputs +
temporaries - aliased, ``memory_analysis()``), and the time of one step, both programs run in
turn (medians of ``config.repeats``). Writes ``results.json`` and ``report.md``.

Two steps of AdamW from a fresh state amplify float noise: an update is about the learning rate
times the sign of the gradient, so where a gradient is at the level of rounding (a norm's scale
initialized at zero, a bfloat16 product) the two programs may move a weight in opposite
directions. ``difference`` (every state leaf, relative to its largest value) shows that;
``metrics_difference`` compares the step's loss and metrics after the second step.
``state_moved`` counts the state leaves the plan returns in another layout than it takes them
(0: a training loop feeds its outputs back to the compiled plan as they are).

Needs Python >= 3.12 with the libraries (the ``test`` extra installs them there); a library
that is not installed is reported as skipped.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Case:
    """A library's step ready to plan: the step, its state and batch, the mesh, the authors'
    ``in_shardings`` and their jitted step, the context to trace it in, the state arguments the
    authors donate."""

    step: Callable
    state: Any
    batch: Any
    mesh: Any
    in_shardings: tuple
    authors_jit: Callable[[], Callable]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    donate_argnums: tuple[int, ...] = ()


#: MaxText's tiny models (:data:`experiments.libraries.maxtext_step.TINY`) by case name: llama2,
#: DeepSeek-V3, Qwen3 (experts as dense matmuls), Qwen3 with MaxText's sparse MoE ``shard_map``
#: and Qwen3 with its ring of experts
MAXTEXT = (
    "maxtext",
    "maxtext_deepseek3",
    "maxtext_qwen3",
    "maxtext_qwen3sparse",
    "maxtext_qwen3ring",
)


def build_case(library: str, dtype: str, mesh: str) -> Case:
    """The case of ``library`` (one of :data:`MAXTEXT`, ``keras`` or ``gemma``) in
    ``dtype`` on ``mesh`` (``maxtext``: MaxText's own 12-axis mesh; ``2axis``: a plain fsdp 4 x
    tensor 2 one)."""
    if library in MAXTEXT:
        from experiments.libraries import maxtext_step

        b = maxtext_step.build(dtype, mesh, library.partition("_")[2] or "llama2")
        return Case(b.step, b.state, b.batch, b.mesh, (b.state_shardings, b.batch_shardings),
                    b.authors_jit, b.context, (0,))  # fmt: skip
    if mesh != "2axis":
        raise ValueError(f"{library} runs on the 2axis mesh only, not {mesh!r}")
    if library == "keras":
        from experiments.libraries import keras_step

        b = keras_step.build("mixed_bfloat16" if dtype == "bfloat16" else dtype)
    elif library == "gemma":
        from experiments.libraries import gemma_step

        b = gemma_step.build(dtype)
    else:
        raise ValueError(f"library must be one of {MAXTEXT}, keras or gemma, got {library!r}")
    return Case(b.step, b.state, b.batch, b.mesh, b.authors_shardings, b.authors_jit)


def compiled_mib(compiled) -> float:
    """Arguments + outputs + temporaries - aliased bytes per device, in MiB."""
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)  # fmt: skip
    return total / MIB


def worst_difference(a, b) -> float:
    """The largest difference of two pytrees' float leaves, each relative to its largest value."""
    import jax
    import numpy as np

    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            continue
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
    return worst


GIVEN_LAYOUTS = {  # config.given_layout -> plan()'s arguments (compare: the authors' or None)
    "authors": {"constraints": "hint", "compare": True},
    "hints": {"constraints": "hint", "compare": None},
    "none": {"constraints": "drop", "compare": None},
}


def authors_side(case: Case) -> dict:
    """What :func:`measure` needs of the authors' layout, the same in every mode, so made once
    a case: its price (``planner.price``), its compiled step and memory, its two steps' state
    and metrics (as NumPy arrays: a timed run may donate the arrays) and a state to time from.
    Call it in ``case.context()``."""
    import jax

    import planner

    mine = planner.price(case.step, case.state, case.batch, mesh=case.mesh,
                         in_shardings=case.in_shardings,
                         donate_argnums=case.donate_argnums)  # fmt: skip
    theirs = case.authors_jit()
    state, batch = jax.device_put((_fresh(case), case.batch), case.in_shardings)
    compiled = theirs.lower(state, batch).compile()
    for _ in range(2):
        state, metrics = theirs(state, batch)
    return {
        "prediction": mine.prediction,
        "mib": compiled_mib(compiled),
        "two": jax.device_get((state, metrics)),
        "timed": [state, batch, compiled],
    }


def _fresh(case: Case):
    """A copy of the case's state (a donating step deletes what it is given)."""
    import jax

    return jax.tree.map(lambda x: x.copy(), case.state)


def measure(case: Case, repeats: int, given_layout: str = "authors",
            authors: dict | None = None, rank_by: str = "model") -> dict:  # fmt: skip
    """Plan ``case`` with ``given_layout`` (:data:`GIVEN_LAYOUTS`; ``rank_by`` as
    :func:`planner.plan`'s), price the authors' layout, compile, run and time both (see the
    module); ``authors``: the case's :func:`authors_side`, where another mode made it already."""
    import jax

    import planner
    from experiments.measure import interleaved_times
    from planner.cost.simulator import BODY_COLLECTIVES

    out: dict = {}
    with case.context():
        start = time.perf_counter()
        given = GIVEN_LAYOUTS[given_layout]
        p = planner.plan(case.step, case.state, case.batch, mesh=case.mesh,
                         donate_argnums=case.donate_argnums, constraints=given["constraints"],
                         compare=case.in_shardings if given["compare"] else None,
                         rank_by=rank_by)  # fmt: skip
        out["plan_s"] = time.perf_counter() - start
        out["search_s"] = p.search_s
        if p.compiled_ranking:  # rank_by="compiled": each candidate's compiled price
            out["compiled_ranking"] = [dataclasses.asdict(c) for c in p.compiled_ranking]
        authors = {} if authors is None else authors
        if not authors:
            authors.update(authors_side(case))
        out["predicted_plan_ms"] = p.prediction.time_s * 1e3
        out["predicted_authors_ms"] = authors["prediction"].time_s * 1e3
        out["predicted_plan_mib"] = p.prediction.peak_bytes / MIB
        out["predicted_authors_mib"] = authors["prediction"].peak_bytes / MIB
        ours = p.jit()
        state_p, batch_p = jax.device_put((_fresh(case), case.batch), tuple(p.in_shardings))
        compiled_p = ours.lower(state_p, batch_p).compile()
        out["authors_mib"], out["plan_mib"] = authors["mib"], compiled_mib(compiled_p)
        taken, made = (jax.tree.leaves(s[0]) for s in (p.in_shardings, p.out_shardings))
        out["state_moved"] = sum(not a.is_equivalent_to(b, x.ndim) for a, b, x in
                                 zip(taken, made, jax.tree.leaves(case.state)))  # fmt: skip
        for _ in range(2):
            state_p, metrics = ours(state_p, batch_p)
        their_state, their_metrics = authors["two"]
        out["difference"] = worst_difference(state_p, their_state)
        out["metrics_difference"] = worst_difference(metrics, their_metrics)
        # how far the plan's two steps moved the state (0 if they changed nothing, as a step
        # of MaxText's dropless fallback that overflowed its experts' buffer), and that flag
        out["moved"] = worst_difference(_fresh(case), state_p)
        if isinstance(metrics, dict) and "has_moe_overflow" in metrics:
            out["overflowed"] = bool(metrics["has_moe_overflow"])
        runs = {"authors": authors["timed"], "plan": [state_p, batch_p, compiled_p]}

        def stepper(name):
            def run():
                held = runs[name]
                held[0] = held[2](held[0], held[1])[0]
                return held[0]

            return run

        if repeats:
            times = interleaved_times([stepper("authors"), stepper("plan")], repeats, 1)
            out["authors_ms"] = times[0]["median"] * 1e3
            out["plan_ms"] = times[1]["median"] * 1e3
        out["departures"] = [line for line in p.explain().splitlines()
                             if line.startswith("Sharding constraints")]  # fmt: skip
        out["sources"] = sorted({os.path.basename(o.source[0]) for o in p.program.ops
                                 if o.source})[:12]  # fmt: skip
        out["not_understood"] = sorted({o.primitive for o in p.program.ops
                                        if o.how == "replicated"})  # fmt: skip
        out["shard_map_collectives"] = dict(collections.Counter(
            b.primitive for o in p.program.ops if o.how == "manual" for b in o.body
            if b.primitive in BODY_COLLECTIVES))  # fmt: skip
    return out


def run(config, workdir: str) -> dict:
    """Every case of ``config.cases`` (``library:dtype:mesh``, comma-separated) in every mode of
    ``config.given_layout`` (comma-separated, :data:`GIVEN_LAYOUTS`; a case's own modes as a
    fourth field, ``keras:float32:2axis:authors+none``), measured."""
    os.makedirs(workdir, exist_ok=True)
    modes = config.get("given_layout", "authors").split(",")
    if unknown := set(modes) - set(GIVEN_LAYOUTS):
        raise ValueError(
            f"config.given_layout: {sorted(unknown)} are not among {list(GIVEN_LAYOUTS)}"
        )
    results = []
    for spec in config.cases.split(","):
        library, dtype, mesh, *own = spec.split(":")  # a fourth field: this case's modes
        case_modes = own[0].split("+") if own else modes
        if unknown := set(case_modes) - set(GIVEN_LAYOUTS):
            raise ValueError(
                f"case {spec!r}: {sorted(unknown)} are not among {list(GIVEN_LAYOUTS)}"
            )
        try:
            case = build_case(library, dtype, mesh)
        except ImportError as e:
            results += [{"library": library, "dtype": dtype, "mesh": mesh, "given_layout": m,
                         "skipped": str(e)} for m in case_modes]  # fmt: skip
            continue
        authors: dict = {}  # made by the first mode, the same in the others
        for mode in case_modes:
            row = {"library": library, "dtype": dtype, "mesh": mesh, "given_layout": mode}
            row.update(measure(case, config.repeats, mode, authors,
                               config.get("rank_by", "model")))  # fmt: skip
            results.append(row)
            logging.warning("%s", json.dumps(row))
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report(results))
    return {"results": results, "workdir": workdir}


def report(results: list[dict]) -> str:
    """The table: per case and given layout, compiled memory and measured time of the plan against
    the authors' layout, both predictions, the search's seconds, the largest state difference
    and the state leaves returned in another layout than taken."""
    lines = [
        "| library | dtype | mesh | given layout | compiled MiB plan / authors "
        "| measured ms plan / authors | predicted ms plan / authors | search s "
        "| state / loss difference | state moved |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        case = f"| {r['library']} | {r['dtype']} | {r['mesh']} | {r.get('given_layout', 'authors')}"
        if "skipped" in r:
            lines.append(f"{case} | skipped: not installed | | | | | |")
            continue
        timed = (f"{r['plan_ms']:.0f} / {r['authors_ms']:.0f} = "
                 f"{r['plan_ms'] / r['authors_ms']:.2f}x" if "plan_ms" in r else "not timed")  # fmt: skip
        lines.append(
            f"{case} | {r['plan_mib']:.1f} / "
            f"{r['authors_mib']:.1f} = {r['plan_mib'] / r['authors_mib']:.2f}x | {timed} | "
            f"{r['predicted_plan_ms']:.0f} / {r['predicted_authors_ms']:.0f} | "
            f"{r['search_s']:.1f} | {r['difference']:.1e} / {r['metrics_difference']:.1e} | "
            f"{r.get('state_moved', '')} |"
        )
    return "\n".join(lines + ranking_lines(results)) + "\n"


def ranking_lines(results: list[dict]) -> list[str]:
    """Where a row was planned with ``rank_by="compiled"``: each candidate's compiled program,
    priced by the calibration, and its compiled memory (``*`` the one returned), and the seconds
    ``planner.plan`` took with its compiles."""
    ranked = [r for r in results if r.get("compiled_ranking")]
    if not ranked:
        return []
    lines = ["", "Ranked by compiling the best candidates (`rank_by=\"compiled\"`): each compiled "
             "program priced by the calibration, ms / MiB (`*` returned).", "",
             "| library | dtype | mesh | plan s | candidates |", "|---|---|---|---|---|"]  # fmt: skip
    for r in ranked:
        cells = "; ".join(
            f"{'*' if c['chosen'] else ''}{c['label']} {c['compiled_s'] * 1e3:.1f} / "
            f"{c['compiled_bytes'] / 2**20:.1f}" for c in r["compiled_ranking"])  # fmt: skip
        lines.append(f"| {r['library']} | {r['dtype']} | {r['mesh']} | {r['plan_s']:.1f} | "
                     f"{cells} |")  # fmt: skip
    return lines


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from experiments.measure import force_host_devices

    force_host_devices(8)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # MaxText's imports (transformers, TensorFlow) load Keras: on JAX, as keras-hub's step needs
    os.environ.setdefault("KERAS_BACKEND", "jax")
    print(json.dumps(run(flags.FLAGS.config, flags.FLAGS.workdir), indent=1))


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", "configs/real_code/default.py", "Config file.")
    flags.DEFINE_string("workdir", "workdir/real_code", "Where outputs go.")
    app.run(main)
