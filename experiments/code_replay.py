"""How :mod:`experiments.maxtext_code` plans a recipe's step (:func:`planned`), and the replay of
its committed rows on today's planner: a row's plan searched again without the compiles it
recorded (a replayed search, :func:`replay_search_rows`, :func:`replay_variant_rows`; the own
settings' plan of a variant search measured again, :func:`own_plan_replayed`) and the compiled
estimate of rows measured without one (:func:`estimate_rows`).

Each takes the recipe's ``build(name, layers=None, variant=None)``
(:func:`experiments.maxtext_code.build`). A row whose plan the planner no longer makes (another
plan, or a compile the row did not record) is left as it was, with a note saying why
(``replay_note``, ``estimate_note``): it is to be measured again.

Example:
    >>> replay_search_rows("llama2_7b_v5p_128", rows, build)                # doctest: +SKIP
    1
"""

from __future__ import annotations

from absl import logging

from experiments import code_estimate


class PlanChanged(ValueError):
    """A row's plan searched again predicts other than it did: the planner changed since."""


def planned(built, on_its_own: bool = False, **options):
    """The planner's plan of ``built``'s step with its defaults (memory limit from the chip's
    HBM, confirmed by compiling), MaxText's input layouts priced beside it; ``on_its_own``: with
    nothing of MaxText's handed over (its constraints dropped, no input layouts to compare);
    ``options``: more of :func:`planner.plan`'s."""
    import planner

    given = (dict(constraints="drop", compare=None) if on_its_own
             else dict(compare=built.in_shardings))  # fmt: skip
    with built.context():
        return planner.plan(built.step, *built.args, mesh=built.mesh,
                            donate_argnums=built.donate_argnums, **given, **options)  # fmt: skip


def _same_plan(p, row: dict, how: str):
    """``p`` where it is taken for ``row``'s plan: it predicts the row's seconds (the memory
    model may have changed the bytes it predicts since, not the time; two plans of one step
    predicted at the same seconds to the last bit are taken for one); else raises
    :class:`PlanChanged`."""
    if p.prediction.time_s != row["predicted_s"]:
        raise PlanChanged(
            f"{row['recipe']} {row['strategy']}: {how}, its plan predicts "
            f"{(p.prediction.time_s, p.prediction.peak_bytes)} (seconds, bytes), the row's "
            f"{(row['predicted_s'], row['predicted_peak_bytes'])}; measure the row again"
        )
    return p


def planned_again(built, row: dict, exact: bool = True):
    """The plan of ``row`` searched again (the limit of its last memory check, trusted): raises
    :class:`PlanChanged` where no plan fits or, ``exact``, where it is not the row's plan
    (:func:`_same_plan`)."""
    from planner.cost.memory import MemoryLimitError

    checks = row.get("memory_checks") or []
    limit = checks[-1]["searched_limit"] if checks else "auto"
    try:
        p = planned(built, memory_limit_bytes=limit, check_memory="predicted")
    except MemoryLimitError as e:
        raise PlanChanged(f"{row['recipe']} {row['strategy']}: searched again, no plan fits "
                          f"({str(e)[:120]}); measure the row again") from e  # fmt: skip
    return _same_plan(p, row, "searched again") if exact else p


def replayed_plan(built, row: dict):
    """The plan of ``row`` (a ``searched`` row of the step ``built``) searched again with each
    compile of its memory check (:mod:`planner.target.confirm`) answered by what the row
    recorded for that plan (the same layout, predicted at the same bytes), so that the search
    takes the row's path; where no check of the row has the bytes a compiled plan is predicted
    at (the memory model predicts it otherwise now), the search's k-th compile of a layout is
    answered by the row's k-th check of that layout. Raises :class:`PlanChanged` where the
    search asks for a compile the row did not record or finds another plan."""
    from unittest import mock

    from planner.target import confirm

    recorded, tape = {}, {}  # tape: per layout, the row's checks in their order
    for c in row.get("memory_checks") or []:
        recorded[(c.get("layout", "searched"), c["predicted_bytes"])] = c
        tape.setdefault(c.get("layout", "searched"), []).append(c)
    asked: dict[str, int] = {}

    def compiled(plan, searched, target, layout="searched"):
        k = asked[layout] = asked.get(layout, -1) + 1
        check = recorded.get((layout, plan.prediction.peak_bytes))
        if check is None and k < len(tape.get(layout, ())):
            check = tape[layout][k]
        if check is None:
            raise PlanChanged(
                f"{row['recipe']}: the replayed search compiles a plan the row did not ({layout}, "
                f"predicted {plan.prediction.peak_bytes} bytes); measure the row again"
            )
        return confirm.MemoryCheck(searched, plan.prediction.peak_bytes,
                                   check["compiled_bytes"], 0.0, target, layout)  # fmt: skip

    with mock.patch.object(confirm, "_compiled_check", compiled):
        return _same_plan(planned(built), row, "searched again without compiling")


def own_plan_replayed(name: str, built, rows):
    """The plan of recipe ``name``'s own settings from its ``searched`` row among ``rows``,
    replayed (:func:`replayed_plan`: a variant search measured again need not compile the own
    settings' plan, which that row did), or None where there is no such row or it does not
    replay."""
    row = next((r for r in rows if r["recipe"] == name and r["strategy"] == "searched"
                and "predicted_s" in r), None)  # fmt: skip
    if row is None:
        return None
    try:
        return replayed_plan(built, row)
    except PlanChanged as e:
        logging.warning("%s; the own settings are searched with compiles", e)
        return None


def _replayed(row: dict, seconds: float, peak_bytes: int) -> None:
    """``row``'s search seconds replaced by today's ``seconds`` (its first measurement kept as
    ``"search_s_measured"``), its predicted bytes by today's ``peak_bytes`` for its plan (the
    measured ones kept as ``"predicted_peak_bytes_measured"``), its replay note dropped."""
    if peak_bytes != row["predicted_peak_bytes"]:
        row.setdefault("predicted_peak_bytes_measured", row["predicted_peak_bytes"])
        row["predicted_peak_bytes"] = peak_bytes
    row.setdefault("search_s_measured", row["search_s"])
    row["search_s"] = seconds
    row.pop("replay_note", None)
    logging.warning("%s %s: searches replayed in %.1f s (measured %.1f s), predicted %d bytes",
                    row["recipe"], row["strategy"], seconds, row["search_s_measured"],
                    peak_bytes)  # fmt: skip


def _noted(row: dict, e: PlanChanged) -> None:
    row["replay_note"] = str(e)[:300]
    logging.warning("%s", row["replay_note"])


def replay_search_rows(name: str, rows: list[dict], build) -> int:
    """Search recipe ``name``'s ``searched`` rows again on today's planner, in place, without
    compiling (:func:`replayed_plan`). Where it finds the row's plan, ``row["search_s"]`` and
    ``row["predicted_peak_bytes"]`` become today's (the first measurements kept beside:
    :func:`_replayed`); else ``row["replay_note"]`` says why not and the row keeps its figures.
    Returns how many rows it replayed. (The search is what the planner's changes make faster;
    the compiles are the compiler's, minutes to half an hour each here.)"""
    todo = [r for r in rows if r["recipe"] == name and r["strategy"] == "searched"
            and "predicted_s" in r]  # fmt: skip
    if not todo:
        return 0
    built = build(name)
    replayed = 0
    for row in todo:
        try:
            p = replayed_plan(built, row)
        except PlanChanged as e:
            _noted(row, e)
            continue
        _replayed(row, p.search_s, p.prediction.peak_bytes)
        replayed += 1
    return replayed


def replay_variant_rows(name: str, rows: list[dict], build) -> int:
    """Search each variant of recipe ``name``'s ``searched_variants`` rows again on today's
    planner, in place, without compiling: every variant the row planned (``row["variants"]``)
    is searched again under the limit it was searched under (:func:`planned_again`: the chosen
    one's last memory check's, trusted; the others' the default, whose compile checks the row
    did not record). Where the chosen variant finds the plan it found and no other variant's
    plan is now predicted faster, ``row["search_s"]`` becomes today's sum and the row's
    predicted bytes the chosen plan's today (:func:`_replayed`); else ``row["replay_note"]``
    says why not. Each variant takes the bytes its plan is predicted at today; an unchosen one
    that finds another plan, still slower than the chosen one, takes today's figures (the
    measured ones kept as ``"predicted_s_measured"`` and ``"predicted_peak_bytes_measured"``):
    the row's choice stands. Returns how many rows it replayed. A variant whose plan was the
    searched row's (``"from"``) takes that row's replay (:func:`replay_search_rows`, run first),
    as the variant search took its plan; where that row did not replay, it is searched again as
    the others."""
    todo = [r for r in rows if r["recipe"] == name and r["strategy"] == "searched_variants"
            and r.get("variant") and r.get("variants")]  # fmt: skip
    searched = next((r for r in rows if r["recipe"] == name and r["strategy"] == "searched"), {})
    replayed = 0
    for row in todo:
        seconds, found = 0.0, {}  # found: per variant, today's (seconds, bytes)
        try:
            for key, tried in row["variants"].items():
                if "predicted_s" not in tried:  # no plan fitted: not counted in the row's sum
                    continue
                if (tried.get("from") == "the searched row" and "replay_note" not in searched
                        and searched.get("predicted_s") == tried["predicted_s"]):  # fmt: skip
                    seconds += searched["search_s"]  # replayed with that row, above
                    found[key] = (tried["predicted_s"], searched["predicted_peak_bytes"])
                    continue
                variant = None if key == "None" else key
                chosen = variant == row["variant"]
                p = planned_again(build(name, variant=variant), {
                    "recipe": name, "strategy": f"searched_variants ({key})",
                    "memory_checks": row.get("memory_checks") if chosen else [],
                    "predicted_s": tried["predicted_s"],
                    "predicted_peak_bytes": tried["predicted_peak_bytes"]}, exact=chosen)  # fmt: skip
                seconds += p.search_s
                found[key] = (p.prediction.time_s, p.prediction.peak_bytes)
                if not chosen and p.prediction.time_s < row["predicted_s"]:
                    raise PlanChanged(f"{name} searched_variants ({key}): searched again, its "
                                      f"plan predicts {p.prediction.time_s} s, faster than the "
                                      "chosen variant's; measure the row again")  # fmt: skip
        except PlanChanged as e:
            _noted(row, e)
            continue
        for key, (time_s, peak) in found.items():
            tried = row["variants"][key]
            if time_s != tried["predicted_s"]:
                tried.setdefault("predicted_s_measured", tried["predicted_s"])
                tried.setdefault("predicted_peak_bytes_measured", tried["predicted_peak_bytes"])
                tried["predicted_s"] = time_s
                tried.pop("from", None)  # (searched again here, not the searched row's plan)
            tried["predicted_peak_bytes"] = peak
        _replayed(row, seconds, found[str(row["variant"])][1])
        replayed += 1
    return replayed


def estimate_rows(name: str, rows: list[dict], build) -> int:
    """Add, in place, the compiled estimate to recipe ``name``'s compiled ``rows`` that have none
    (measured with ``layer_estimate`` off, or refused as over HBM before the recipe's flags let
    the compiler finish such programs), from their layouts at the depths
    :func:`experiments.code_estimate.depths`: MaxText's own, or the plan searched again under the
    row's searched limit, which must predict what the row's plan predicted
    (:func:`planned_again`; where it does not, ``row["estimate_note"]`` says so and the row is
    left to be measured again). Returns how many rows it filled."""
    from planner.cost.memory import default_calibration

    todo = [r for r in rows if r["recipe"] == name and "compiled_collective_s" in r
            and "estimate_s" not in r]  # fmt: skip
    if not todo:
        return 0
    built = build(name)
    cal = default_calibration(built.mesh)
    layers, at = built.config.num_decoder_layers, code_estimate.depths(built.config)
    filled = 0
    for row in todo:
        variant, plan = row.get("variant"), None
        if not row["strategy"].startswith("recipe"):
            try:
                plan = planned_again(built if variant is None else build(name, variant=variant),
                                     row)  # fmt: skip
            except PlanChanged as e:  # the row is to be measured again
                row["estimate_note"] = str(e)[:300]
                logging.warning("%s", row["estimate_note"])
                continue
        kernels = code_estimate.kernels(lambda d, v=variant: build(name, d, v), layers, cal, at,
                                        plan)  # fmt: skip
        if kernels is None:
            continue
        row.pop("estimate_note", None)
        code_estimate.with_estimate(row, kernels)
        logging.warning("%s %s: estimate %.2f s", name, row["strategy"], row["estimate_s"])
        filled += 1
    return filled
