"""Plans under the transformations users apply: ``jax.jit`` of a plan, ``jax.grad`` through it,
``jax.vmap`` over it, and all three inside ``jax.set_mesh`` of a mesh whose axis of size 4 the
plan splits into its prime factors; searched plans and pipelined ones, both lowering backends,
against the unsharded function."""

import dataclasses

import jax
import pytest
from jax.sharding import AxisType
from planner_checks import assert_close, transformed
from planner_programs import residual_layers_args, residual_layers_loss

import planner
from planner.program.schedule import Stages, make_schedule


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("a", "pipe"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def args():
    """The arguments of every test here: a batch of 128 rows, which the search splits over the
    whole mesh (at 16 it keeps the function whole)."""
    return residual_layers_args(1, batch=128, d=16, hidden=32)


@pytest.fixture(scope="module")
def want(args, mesh):
    """The unsharded function under the transformations, run once for the module's tests."""
    return transformed(residual_layers_loss, args, mesh)


@pytest.mark.parametrize("backend", ["xla", "explicit"])
def test_a_pipelined_plan_under_jit_grad_vmap_and_set_mesh(backend, mesh, args, want):
    prog = planner.analyze(residual_layers_loss, *args)
    (scan,) = [r for r in prog.regions if r.kind == "scan"]
    base = make_schedule(prog, {}, dict(mesh.shape), default="replicate")
    sched = dataclasses.replace(base, stages=(Stages(scan.start, "pipe", 2),))
    low = planner.lower(prog, sched, mesh, backend=backend)
    got = transformed(low, args, mesh)
    assert set(got) == set(want)
    for name in want:
        assert_close(got[name], want[name])


def test_a_searched_plan_under_jit_grad_vmap_and_set_mesh(mesh, args, want):
    p = planner.plan(residual_layers_loss, *args, mesh=mesh, memory_limit_bytes=None)
    used = {a for loops in p.schedule.assign.values() for axes in loops.values() for a in axes}
    assert any(a.startswith("pipe#") for a in used)  # the plan splits by factors of pipe:4
    got = transformed(p, args, mesh)
    for name in want:
        assert_close(got[name], want[name])
