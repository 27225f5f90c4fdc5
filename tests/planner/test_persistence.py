"""Plans saved as JSON and loaded without searching (in this process and in a fresh one), the
refusals of a plan for another program, other arguments or another mesh, and plans made for
meshes without devices bound to devices."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from workers.planner_persistence import SHAPES, X, sgd, shapes

import planner
from planner import persistence
from planner.solver import schedule_search

WORKER = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "workers", "planner_persistence.py"
)
ABSTRACT = AbstractMesh((2, 2, 2), ("a", "b", "c"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    p = planner.plan(sgd, *shapes(), lr=0.1, mesh=ABSTRACT)
    path = str(tmp_path_factory.mktemp("plans") / "sgd.plan.json")
    p.save(path)
    return p, path


@pytest.fixture
def no_search(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("load searched")

    monkeypatch.setattr(planner.auto, "search_within", refuse)
    monkeypatch.setattr(schedule_search, "search", refuse)


def test_a_saved_plan_is_plain_versioned_json(saved):
    p, path = saved
    with open(path) as f:
        doc = json.load(f)
    assert doc["format"] == "redist.planner.plan" and doc["version"] == 1
    assert doc["mesh"] == [["a", 2], ["b", 2], ["c", 2]]
    assert doc["program"]["fingerprint"].startswith("sha256:")
    assert doc["calibration"]["name"] == "cpu"
    assert doc["prediction"]["time_s"] == p.prediction.time_s
    assert [a["argument"] for a in doc["arguments"]] == ["args[0]", "args[1]", "lr"]
    assert doc["arguments"][2] == {"argument": "lr", "static": "0.1", "keyword": True}
    assert set(doc["schedule"]["assign"]) == {o.name for o in p.program.ops}


@pytest.mark.parametrize("mesh", [ABSTRACT, {"a": 2, "b": 2, "c": 2}], ids=["abstract", "dict"])
def test_load_restores_the_plan_without_searching(saved, no_search, mesh):
    p, path = saved
    q = planner.load(path, sgd, *shapes(), lr=0.1, mesh=mesh)
    assert q.schedule.assign == p.schedule.assign and q.schedule.stored == p.schedule.stored
    assert q.in_specs == p.in_specs and q.out_specs == p.out_specs
    assert q.spec_mesh == p.spec_mesh
    assert q.prediction == p.prediction and q.calibration == p.calibration
    assert persistence.document(q) == persistence.document(p)


def test_a_loaded_plan_runs_in_a_fresh_process(saved):
    """Saved here on an abstract mesh; loaded onto the 8 CPU devices in another process (another
    hash seed), run and compared with the unsharded step, and searched again there."""
    p, path = saved
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONHASHSEED"] = "12345"
    out = subprocess.run([sys.executable, WORKER, path], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "OK" and lines[-2] == str(p.in_specs)


def _variant(activation, scale):
    def loss(params, x):
        return jnp.mean((activation(x @ params["w1"]) @ params["w2"]) ** 2)

    def step(params, x, *, lr):
        grads = jax.grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - (lr * scale) * g, params, grads)

    return step


def _resized(k, n):
    params, x = shapes()
    params["w2"] = jax.ShapeDtypeStruct((SHAPES["w2"][0], n), jnp.float32)
    return params, jax.ShapeDtypeStruct(X, jnp.float32)


@pytest.mark.parametrize(
    "fn, args, kwargs, mesh, message",
    [
        (_variant(jnp.tanh, 2), shapes(), {"lr": 0.1}, ABSTRACT,
         r"another program: this one has the same ops, with other parameters"),
        (_variant(jax.nn.relu, 1), shapes(), {"lr": 0.1}, ABSTRACT,
         r"another program: this one (has \d+ ops, the plan's \d+; )?op 1 is 'max_1', the plan's "
         r"is 'tanh_1'"),
        (sgd, _resized("w2", 64), {"lr": 0.1}, ABSTRACT,
         r"args\[0\]\['w2'\] has shape \(512, 64\), the plan's is \(512, 128\)"),
        (sgd, shapes(jnp.bfloat16), {"lr": 0.1}, ABSTRACT,
         r"args\[0\]\['w1'\] has dtype bfloat16, the plan's is float32"),
        (sgd, shapes(), {"lr": 0.2}, ABSTRACT, r"lr is the static value 0.2, the plan's is 0.1"),
        (sgd, shapes(), {"lr": 0.1}, AbstractMesh((2, 4, 1), ("a", "b", "c")),
         r"mesh axis 'b' has size 4, the plan's has 2; mesh axis 'c' has size 1"),
        (sgd, shapes(), {"lr": 0.1}, {"a": 2, "b": 2, "d": 2},
         r"mesh axes \('a', 'b', 'd'\), the plan's are \('a', 'b', 'c'\)"),
        (sgd, shapes(), {"lr": 0.1}, {"a": 2, "c": 2, "b": 2}, r"in another order"),
    ],
    ids=["parameters", "ops", "shape", "dtype", "static", "sizes", "names", "order"],
)  # fmt: skip
def test_load_refuses_what_the_plan_was_not_made_for(saved, no_search, fn, args, kwargs, mesh,
                                                     message):  # fmt: skip
    _, path = saved
    with pytest.raises(ValueError, match=message):
        planner.load(path, fn, *args, mesh=mesh, **kwargs)


def test_load_names_the_first_op_that_differs(saved, no_search):
    _, path = saved

    def longer(params, x, *, lr):
        return jax.tree.map(jnp.sin, sgd(params, x, lr=lr))

    with pytest.raises(
        ValueError, match=r"has \d+ ops, the plan's (\d+); op \1 is 'sin_\1', the plan has none"
    ):
        planner.load(path, longer, *shapes(), lr=0.1, mesh=ABSTRACT)


def test_a_plan_for_a_mesh_without_devices_binds_to_one(saved):
    p, _ = saved
    with pytest.raises(ValueError, match="without devices"):
        p.in_shardings  # noqa: B018
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    b = p.bind(mesh)
    assert b.mesh is mesh and b.in_specs == p.in_specs and b.schedule is p.schedule
    shardings = jax.tree.leaves(b.in_shardings)
    assert len(shardings) == 3 and all(s.mesh.axis_names == ("a", "b", "c") for s in shardings)
    rng = np.random.default_rng(1)
    params = {k: rng.standard_normal(s).astype(np.float32) / 8 for k, s in SHAPES.items()}
    x = rng.standard_normal(X).astype(np.float32)
    want = sgd(params, x, lr=0.1)
    for g, w in zip(jax.tree.leaves(b(params, x, lr=0.1)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match=r"mesh axis 'b' has size 4, the plan's has 2"):
        p.bind(jax.make_mesh((2, 4, 1), ("a", "b", "c")))
    with pytest.raises(ValueError, match="needs a jax.sharding.Mesh with devices"):
        p.bind(ABSTRACT)
