"""The planner on the code people run: MaxText's own training step, keras-hub's Llama and gemma's
Gemma 3, tiny, planned and run exactly (``experiments/real_code.py``, in a subprocess: importing
MaxText replaces ``jax.lax.with_sharding_constraint`` for the whole process).

Needs Python >= 3.12 with the libraries (the ``test`` extra installs them there); skipped
elsewhere."""

import fcntl
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from configs.real_code import smoke

LIBRARIES = ("maxtext", "keras_hub", "gemma")
SOURCES = {"maxtext": "nnx_decoders.py", "maxtext_deepseek3": "attention_mla.py",
           "maxtext_qwen3": "qwen3.py", "maxtext_qwen3sparse": "moe.py", "maxtext_qwen3ring": "moe.py",
           "keras": "llama_decoder.py",
           "gemma": "_modules.py"}  # fmt: skip

# The state after two AdamW steps, relative to each leaf's largest value: an update is about the
# learning rate times the sign of the gradient, so a gradient at rounding level (gemma's bfloat16
# products) may move a weight the other way. Top-k routing amplifies more: a token near a tie
# between two experts changes expert under any reassociation (DeepSeek-V3's own step, fed its first
# step's state times 1 + 1e-7 noise, moves the same experts' first moments by 0.098; its plan's
# first step is within 7e-6 of MaxText's); the ring of experts runs in bfloat16, where MaxText's
# step and its replicated jit differ by 0.23 after one step.
TOLERANCE = {"gemma": 1e-2, "maxtext_deepseek3": 0.15, "maxtext_qwen3ring": 0.3}
# The loss after two steps, relative: 1e-5, bfloat16's ring 1e-3 (its rounding is 4e-3).
METRICS_TOLERANCE = {"maxtext_qwen3ring": 1e-3}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(name) is None for name in LIBRARIES),
        reason="MaxText, keras-hub and gemma are installed by the test extra on Python >= 3.12",
    ),
]


# the smoke run's cases by library, run in three subprocesses (one import of MaxText for its
# five cases would leave one worker with most of the work; one per case imports it five times)
CASES = {spec.split(":")[0]: spec for spec in smoke.get_config().cases.split(",")}
GROUPS = (("maxtext", "maxtext_deepseek3"),
          ("maxtext_qwen3", "maxtext_qwen3sparse", "maxtext_qwen3ring"),
          ("keras", "gemma"))  # fmt: skip


def test_every_case_of_the_smoke_run_is_in_one_group():
    grouped = [library for group in GROUPS for library in group]
    assert sorted(grouped) == sorted(CASES) and len(set(grouped)) == len(grouped)


@pytest.fixture(scope="session")
def rows(tmp_path_factory):
    """``rows(library)``: the smoke run's rows of one case by given layout ("authors", "none"),
    run once a session with the rest of its group (:data:`GROUPS`) in a subprocess, whichever
    worker asks first (the others wait for its file)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the session's folder, above each worker's
        shared = shared.parent
    shared = shared / "real_code"
    shared.mkdir(exist_ok=True)

    def rows_of(library: str) -> dict:
        (group,) = [g for g in GROUPS if library in g]
        name = "+".join(group)
        done_path = shared / f"{name}.json"
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done_path.exists():
                _run_cases([CASES[c] for c in group], shared / name, done_path)
        with open(done_path) as f:
            return {r["given_layout"]: r for r in json.load(f) if r["library"] == library}

    return rows_of


def _run_cases(specs: list[str], workdir, done_path) -> None:
    # unoptimised kernels (as conftest.py: the same memory_analysis(); the smoke run times nothing)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    done = subprocess.run(
        [sys.executable, "-m", "experiments.real_code", "--config=configs/real_code/smoke.py",
         f"--config.cases={','.join(specs)}", f"--workdir={workdir}"],
        env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    os.replace(workdir / "results.json", done_path)


@pytest.mark.parametrize("library", list(CASES))
def test_the_librarys_own_step_plans_runs_and_equals_the_authors(rows, library):
    """Two steps of the plan equal two of the authors' layout (float32, reassociated sums: the
    loss; the state where AdamW's first step does not amplify rounding, see the experiment);
    every op is understood; explain() names the library's own source files; the plan is never
    predicted slower than the authors' layout, which it priced, and compiles to no more memory
    than the authors' jitted step (``memory_analysis()``, which does not drift)."""
    r = rows(library)["authors"]
    assert "skipped" not in r, r.get("skipped")
    assert r["metrics_difference"] < METRICS_TOLERANCE.get(library, 1e-5)
    assert r["difference"] < TOLERANCE.get(library, 1e-4)
    assert r["not_understood"] == []
    assert SOURCES[library] in r["sources"], r["sources"]
    assert r["predicted_plan_ms"] <= r["predicted_authors_ms"] * 1.03
    _assert_memory_as_predicted(r)


def _assert_memory_as_predicted(r: dict) -> None:
    """The plan compiles to more memory than the authors' only where it predicted so, trading it
    for time (MaxText's llama2: FSDP over both axes, predicted 8% faster for 2.6% more memory,
    compiles to 1.6% more; issue 75 wants <= 1.00x), within 4%: the memory model of the experts'
    ``shard_map`` is 2-3% short of the compiler's ratio (Qwen3 sparse and ring)."""
    predicted = r["predicted_plan_mib"] / r["predicted_authors_mib"]
    assert 0 < r["plan_mib"] <= r["authors_mib"] * max(1.0, predicted) * 1.04, (
        r["plan_mib"], r["authors_mib"], predicted)  # fmt: skip


def test_maxtexts_constraints_are_read_and_reported(rows):
    """MaxText constrains every activation: the plan says how many and which it departs from."""
    r = rows("maxtext")["authors"]
    (line,) = r["departures"]
    assert line.startswith("Sharding constraints: 44 in the program")
    same = (r["predicted_plan_ms"], r["predicted_plan_mib"]) == (r["predicted_authors_ms"],
                                                                 r["predicted_authors_mib"])  # fmt: skip
    if "departs" not in line and same:  # MaxText's layout, run as MaxText's own jit runs it
        assert r["plan_mib"] == pytest.approx(r["authors_mib"], rel=1e-4)  # 64 bytes apart
        assert r["difference"] == 0.0 and r["metrics_difference"] == 0.0
    else:  # it keeps the constraints and lays out other ops otherwise, where predicted better
        assert r["predicted_plan_ms"] < r["predicted_authors_ms"] or (
            r["predicted_plan_mib"] < r["predicted_authors_mib"])  # fmt: skip


def test_maxtexts_sparse_experts_reduce_scatter_their_weight_gradients(rows):
    """MaxText's MoE ``shard_map`` reads each device's experts whole over fsdp; its backward sums
    their gradients over fsdp, which the plan splits as it sums (``psum_scatter``) and keeps
    split (the optimizer's layout), exactly as MaxText's own step computes them."""
    r = rows("maxtext_qwen3sparse")["authors"]
    assert r["shard_map_collectives"].get("reduce_scatter", 0) >= 3, r["shard_map_collectives"]
    assert r["difference"] < 1e-4
    _assert_memory_as_predicted(r)


def test_maxtexts_ring_of_experts_runs_its_steps_through_the_plan(rows):
    """MaxText's ring of experts (tokens gathered over the expert axis, a capped ragged buffer,
    outputs reduce-scattered back) with its step-level dropless fallback: the plan's two steps
    update the state (no overflow rolled them back) and equal MaxText's own."""
    r = rows("maxtext_qwen3ring")["authors"]
    assert r["overflowed"] is False
    assert r["moved"] > 1e-3, r["moved"]
    assert r["shard_map_collectives"].get("all_gather", 0) >= 2, r["shard_map_collectives"]
    assert r["difference"] < TOLERANCE["maxtext_qwen3ring"]
    assert r["metrics_difference"] < METRICS_TOLERANCE["maxtext_qwen3ring"]


@pytest.mark.parametrize("library", ["maxtext", "keras"])
def test_on_its_own_the_plan_is_exact_and_returns_the_state_as_it_took_it(rows, library):
    """Handed nothing (``constraints="drop", compare=None``), the plan of the library's own step
    computes the authors' two steps, returns every state leaf in the layout it takes it (keras-hub's
    step is not donated: 16 of its 65 leaves came back moved), and is no slower predicted than
    the authors' layout, which it did not see (MaxText's: 125.5 against 135.8 ms, where before the
    expert strategies took RMSNorm's scale product's width for the batch it was 174.8)."""
    r = rows(library)["none"]
    assert r["state_moved"] == 0
    assert r["metrics_difference"] < 1e-5 and r["difference"] < 1e-4
    assert r["predicted_plan_ms"] <= r["predicted_authors_ms"] * 1.03
    _assert_memory_as_predicted(r)
