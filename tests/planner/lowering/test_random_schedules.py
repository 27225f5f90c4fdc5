"""Differential test: random valid schedules of every corpus program, on three meshes, lowered and
compared with the unsharded program (exact for integers and booleans, 1e-4 for floats)."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh
from planner_checks import assert_same
from planner_programs import PROGRAMS, random_schedule

import planner
from planner.layout.dataflow import dataflow
from planner.program.schedule import make_schedule

MESHES = {"2x2x2": ((2, 2, 2), ("a", "b", "c")), "4x2": ((4, 2), ("a", "b")),
          "2x3": ((2, 3), ("a", "b"))}  # fmt: skip
EXAMPLES = {"2x2x2": 3, "4x2": 1, "2x3": 1}


def make_mesh(name: str) -> Mesh:
    shape, names = MESHES[name]
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_random_schedules_compute_the_program(program, mesh_name):
    fn, make = PROGRAMS[program]
    args = make(np.random.default_rng(0))
    prog = planner.analyze(fn, *args)
    want = jax.jit(fn)(*args)
    mesh = make_mesh(mesh_name)
    sizes = dict(mesh.shape)

    @settings(max_examples=EXAMPLES[mesh_name], deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.integers(0, 2**31 - 1))
    def check(seed):
        assign = random_schedule(prog, sizes, random.Random(seed))
        sched = make_schedule(prog, assign, sizes, default="replicate")
        assert_same(planner.lower(prog, sched, mesh)(*args), want)

    check()


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_random_schedules_are_valid_and_split_something(program):
    fn, make = PROGRAMS[program]
    prog = planner.analyze(fn, *make(np.random.default_rng(0)))
    split = 0
    for seed in range(20):
        for sizes in ({"a": 2, "b": 2, "c": 2}, {"a": 4, "b": 2}, {"a": 2, "b": 3}):
            assign = random_schedule(prog, sizes, random.Random(seed))
            make_schedule(prog, assign, sizes, default="replicate")  # raises if invalid
            split += any(assign.values())
    assert split > 0


def test_the_harness_catches_a_wrong_combiner(monkeypatch):
    """A lowering that combines partial maxima with psum (the bug this harness exists for)."""
    from planner.lowering import kernels as lowering

    monkeypatch.setitem(lowering.COLLECTIVE, "max", "psum")
    fn, make = PROGRAMS["max_of_product"]
    args = make(np.random.default_rng(0))
    prog = planner.analyze(fn, *args)
    mesh = make_mesh("2x2x2")
    assign = {"dot_general_0": {"n": ("a", "b", "c")}}
    sched = make_schedule(prog, assign, dict(mesh.shape))
    with pytest.raises(AssertionError):
        assert_same(planner.lower(prog, sched, mesh)(*args), jax.jit(fn)(*args))


REDUCERS = {
    "sum": jnp.sum,
    "max": jnp.max,
    "min": jnp.min,
    "any": lambda v, axis: jnp.any(v > 0, axis),
}


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    m=st.sampled_from([6, 12, 24]), k=st.sampled_from([6, 12]), n=st.sampled_from([4, 6, 12]),
    kind=st.sampled_from(sorted(REDUCERS)), axis=st.sampled_from([0, 1]),
    mesh_name=st.sampled_from(sorted(MESHES)), seed=st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_random_shapes_reductions_and_schedules(m, k, n, kind, axis, mesh_name, seed):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    fn = lambda x, w: REDUCERS[kind](jnp.tanh(x @ w) - 0.1, axis=axis)  # noqa: E731
    prog = planner.analyze(fn, x, w)
    mesh = make_mesh(mesh_name)
    sizes = dict(mesh.shape)
    sched = make_schedule(prog, random_schedule(prog, sizes, random.Random(seed)), sizes,
                          default="replicate")  # fmt: skip
    assert_same(planner.lower(prog, sched, mesh)(x, w), jax.jit(fn)(x, w))


# Schedules that once failed, found by running the harness with more examples.
REGRESSIONS = [
    # XLA:CPU gave the slices of a decomposed all-to-all different layouts on size-1 dims
    ("causal_attention", "2x2x2", 843),
]


@pytest.mark.parametrize("backend", ["explicit", "per-op"])
@pytest.mark.parametrize("program, mesh_name, seed", REGRESSIONS)
def test_schedules_that_once_failed(program, mesh_name, seed, backend):
    fn, make = PROGRAMS[program]
    args = make(np.random.default_rng(0))
    prog = planner.analyze(fn, *args)
    mesh = make_mesh(mesh_name)
    sizes = dict(mesh.shape)
    assign = random_schedule(prog, sizes, random.Random(seed))
    sched = make_schedule(prog, assign, sizes, default="replicate")
    assert_same(planner.lower(prog, sched, mesh, backend)(*args), jax.jit(fn)(*args))


@pytest.mark.parametrize("moves", ["redist", "auto"])
@pytest.mark.parametrize(
    "program", ["mlp_training_step", "scan_layers_grad", "cond", "checkpoint_grad", "dropout",
                "custom_rules", "embedding_grad", "fori_static_and_traced"]
)  # fmt: skip
def test_random_schedules_through_xla_with_redist_moves(program, moves):
    """What plan.jit runs: the user's ops under sharding constraints (inside regions too), the
    layout changes made by redist (all of them, or those chosen against XLA's)."""
    for prog, sched, mesh, args, want in _random_plans(program, 2):
        f = planner.lower(prog, sched, mesh, "xla", moves=moves)
        if moves == "redist":
            assert all(c.use_redist for c in f.choices.values())
        assert_same(f(*args), want)


@pytest.mark.parametrize("program", ["mlp_training_step", "scan_layers_grad", "cond"])
def test_random_schedules_per_op_reference(program):
    """The per-op lowering (the reference the one-region lowering grew from) stays exact."""
    for prog, sched, mesh, args, want in _random_plans(program, 3):
        assert_same(planner.lower(prog, sched, mesh, "per-op")(*args), want)


def _random_plans(program: str, count: int):
    """``count`` random valid schedules of a corpus program on 2x2x2, with its arguments and
    its unsharded result."""
    fn, make = PROGRAMS[program]
    args = make(np.random.default_rng(0))
    prog = planner.analyze(fn, *args)
    mesh = make_mesh("2x2x2")
    want = jax.jit(fn)(*args)
    for seed in range(count):
        assign = random_schedule(prog, dict(mesh.shape), random.Random(seed))
        yield (
            prog,
            make_schedule(prog, assign, dict(mesh.shape), default="replicate"),
            mesh,
            args,
            want,
        )


def test_the_harness_catches_an_operand_added_per_part(monkeypatch):
    """A scatter-add split over its updates must add its operand once, not once per device."""
    from planner.lowering import kernels as lowering

    monkeypatch.setattr(lowering, "SCATTER_ADD", frozenset())
    fn, make = PROGRAMS["scatter_add_onto_values"]
    args = make(np.random.default_rng(0))
    prog = planner.analyze(fn, *args)
    mesh = make_mesh("2x2x2")
    op = next(o for o in prog.ops if o.primitive == "scatter-add")
    sched = make_schedule(prog, {op.name: {"r0": ("a", "b")}}, dict(mesh.shape))
    with pytest.raises(AssertionError):
        assert_same(planner.lower(prog, sched, mesh)(*args), jax.jit(fn)(*args))


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_the_predictions_breakdown_adds_up(program):
    """What ``explain()`` prints is read from the prediction: for random plans of every corpus
    program the collectives by kind add up to its communication, and the ops it says run whole
    (with a reason) are those the plan splits nowhere."""
    fn, make = PROGRAMS[program]
    prog = planner.analyze(fn, *make(np.random.default_rng(0)))
    sizes = dict(make_mesh("2x2x2").shape)
    for seed in range(3):
        assign = random_schedule(prog, sizes, random.Random(seed))
        pred = planner.simulate(prog, make_schedule(prog, assign, sizes, default="replicate"))
        traffic = pred.traffic().values()
        assert sum(t.seconds for t in traffic) == pytest.approx(
            sum(c.comm_s for c in pred.ops), rel=1e-9, abs=1e-15
        )
        assert sum(t.bytes for t in traffic) == pytest.approx(pred.comm_bytes, rel=1e-9, abs=1e-9)
        assert all(t.count > 0 for t in traffic)
        sched = make_schedule(prog, assign, sizes, default="replicate")
        steps = {st.op.name: st for st in dataflow(prog, sched)}
        split = {o.name for o in prog.ops if o.how == "region" or any(sched.assign.get(o.name, {}).values())
                 or steps[o.name].pending}  # fmt: skip
        whole = {c.op for c in pred.ops if c.whole is not None}
        assert whole == {o.name for o in prog.ops} - split
