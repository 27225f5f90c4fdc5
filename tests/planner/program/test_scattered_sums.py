"""A ``shard_map`` result summed over mesh axes and left whole over them is summed and split
(``psum`` to ``psum_scatter``): the same array, every schedule around it exact, priced as the
reduce-scatter it now is."""

import dataclasses
import importlib.util
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from planner_checks import assert_close
from planner_programs import random_schedule

import planner
from planner.cost.simulator import body_traffic
from planner.program import analysis
from planner.program.scattered_sums import scatter_sums
from planner.program.schedule import make_schedule
from redist.calibration import Calibration
from redist.types import MeshShape

MESH = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"),
            axis_types=(AxisType.Auto,) * 2)  # fmt: skip


def _sums(x, w):
    """Sums a device's products over both axes, over one, and a scalar; one read twice."""

    def body(x, w):
        g = jnp.einsum("bi,bj->ij", x, x @ w)
        twice = lax.psum(g, "tensor")
        return (lax.psum(g, ("fsdp", "tensor")), lax.psum(x.sum(), "fsdp"),
                lax.psum(g, "fsdp"), twice, twice * 2)  # fmt: skip

    return jax.shard_map(body, mesh=MESH, in_specs=(P(("fsdp", "tensor")), P()),
                         out_specs=(P(), P(), P(None, "tensor"), P(), P()),
                         check_vma=False)(x, w)  # fmt: skip


def _args():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.normal(size=(64, 16)), jnp.float32),
            jnp.asarray(rng.normal(size=(16, 24)) / 4, jnp.float32))  # fmt: skip


def test_a_sum_left_whole_is_split_along_its_longest_whole_dimension_and_equal():
    traced = jax.make_jaxpr(_sums)(*_args())
    (eqn,) = scatter_sums(traced.jaxpr.eqns)
    # (16, 24) over all 8 devices: its 24 columns; the scalar cannot split; over fsdp, with the
    # columns on tensor: its 16 rows; a sum read again in the body stays a psum
    assert eqn.params["out_specs"] == (P(None, ("fsdp", "tensor")), P(), P("fsdp", "tensor"),
                                       P(), P())  # fmt: skip
    body = [e.primitive.name for e in eqn.params["jaxpr"].eqns]
    assert body.count("reduce_scatter") == 2 and body.count("psum") == 2
    rewritten = traced.replace(jaxpr=traced.jaxpr.replace(eqns=[eqn]))
    with jax.set_mesh(MESH):
        got = jax.jit(lambda *a: jax.core.eval_jaxpr(rewritten.jaxpr, rewritten.consts, *a))(
            *_args()
        )
    assert got[0].sharding.spec == P(None, ("fsdp", "tensor"))
    assert_close(list(got), list(jax.jit(_sums)(*_args())))


def test_checked_bodies_and_results_split_over_the_axes_are_left_alone():
    def checked(x):
        return jax.shard_map(lambda a: lax.psum(a, "fsdp"), mesh=MESH, in_specs=P("fsdp"),
                             out_specs=P())(x)  # fmt: skip

    def split_already(x):
        return jax.shard_map(lambda a: lax.psum(a, "fsdp"), mesh=MESH, in_specs=P("fsdp"),
                             out_specs=P(None, "fsdp"), check_vma=False)(x)  # fmt: skip

    def indivisible(x):
        return jax.shard_map(lambda a: lax.psum(a, "fsdp"), mesh=MESH, in_specs=P("fsdp"),
                             out_specs=P(), check_vma=False)(x)  # fmt: skip

    for fn, x in [(checked, jnp.ones((8, 8))), (split_already, jnp.ones((8, 8))),
                  (indivisible, jnp.ones((12, 3)))]:  # fmt: skip
        (eqn,) = jax.make_jaxpr(fn)(x).jaxpr.eqns
        assert scatter_sums([eqn])[0] is eqn, fn.__name__


def _experts(x, w):
    return jnp.tanh(x @ w)


def _loss(w, x):
    """A shard_map reading the weight whole over fsdp: its gradient is summed over fsdp."""
    y = jax.shard_map(_experts, mesh=MESH, in_specs=(P("fsdp"), P(None, "tensor")),
                      out_specs=P("fsdp", "tensor"), check_vma=False)(x, w)  # fmt: skip
    return (y**2).mean()


def _step(w, x):
    g = jax.grad(_loss)(w, x)
    return w - 0.1 * g, _loss(w, x)


def _copy_step(w, x):
    """:func:`_step` returning the new weight as a bfloat16 copy: not state returned in place of
    ``w`` (which comes back in the layout it went in), so its layout is the plan's to choose."""
    new, loss = _step(w, x)
    return new.astype(jnp.bfloat16), loss


def _step_args():
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.normal(size=(16, 32)) / 4, jnp.float32),
            jnp.asarray(rng.normal(size=(64, 16)), jnp.float32))  # fmt: skip


def _gradient_sum(prog):
    (op,) = [o for o in prog.ops if o.how == "manual" and any(
        b.primitive == "reduce_scatter" for b in o.body)]  # fmt: skip
    return op


@pytest.mark.parametrize("backend", ["xla", "per-op", "explicit"])
def test_random_schedules_around_a_split_gradient_sum_compute_the_step(backend):
    args = _step_args()
    prog = planner.analyze(_step, *args)
    _gradient_sum(prog)  # the weight's gradient is scattered, not summed whole
    want = jax.jit(_step)(*args)
    sizes = dict(MESH.shape)
    for seed in range(4):
        assign = random_schedule(prog, sizes, random.Random(seed), xla=backend == "xla")
        sched = make_schedule(prog, assign, sizes, default="replicate", xla=backend == "xla")
        assert_close(planner.lower(prog, sched, MESH, backend=backend)(*args), want)


def test_plans_of_a_split_gradient_sum_are_exact_under_jit_grad_and_vmap():
    w, x = _step_args()
    for name, fn, args in [
        ("jit", _step, (w, x)),
        ("grad", jax.grad(lambda w, x: _step(w, x)[1]), (w, x)),
        ("vmap", jax.vmap(_step, in_axes=(None, 0)), (w, jnp.stack([x, 2 * x]))),
    ]:
        want = jax.jit(fn)(*args)
        with jax.set_mesh(MESH):
            got = planner.plan(fn, *args, mesh=MESH).jit()(*args)
        assert_close(got, want), name


def test_the_split_sum_is_priced_as_a_reduce_scatter_and_predicted_faster(monkeypatch):
    """Where the summed gradient's update may stay split (:func:`_copy_step`; a weight returned
    in place must come back whole here, which costs a collective more than the sum saves on 8
    CPU devices), the plan with the reduce-scatter is predicted faster than with the sum."""
    args = _step_args()
    shape = MeshShape.of(dict(MESH.shape))
    cal = Calibration.default()
    op = _gradient_sum(planner.analyze(_step, *args))
    (traffic,) = body_traffic(op, shape.factor_size, shape, cal)
    tile = 16 * 16 * 4  # the (16, 16) float32 gradient tile each device sums over fsdp's 4
    assert traffic.kind == "reduce-scatter" and traffic.bytes == tile * 3 / 4
    assert traffic.seconds == cal.collective_time("reduce-scatter", tile, 4)
    split = planner.plan(_copy_step, *args, mesh=MESH, calibration=cal).prediction
    monkeypatch.setattr(analysis, "scatter_sums", list)
    whole = planner.plan(_copy_step, *args, mesh=MESH, calibration=cal).prediction
    reduced = {k: p.traffic().get("all-reduce") for k, p in (("split", split), ("whole", whole))}
    assert reduced["whole"].bytes > (reduced["split"].bytes if reduced["split"] else 0)
    assert split.time_s < whole.time_s


def _gathered_loss(w, x):
    """MaxText's pattern: the weight constrained whole, then read whole by a shard_map."""
    w = lax.with_sharding_constraint(w, NamedSharding(MESH, P()))
    y = jax.shard_map(_experts, mesh=MESH, in_specs=(P("fsdp"), P()), out_specs=P("fsdp"),
                      check_vma=False)(x, w)  # fmt: skip
    return (y**2).mean()


def _gathered_step(w, x):
    value, g = jax.value_and_grad(_gathered_loss)(w, x)
    return w - 0.1 * g, value


def test_refine_keeps_a_gradient_split_as_it_arrives_departing_from_its_constraint(monkeypatch):
    """The constraint's transpose asks the weight's gradient whole; the gradient arrives
    reduce-scattered. ``refine`` tries the layout it arrives in (no all-gather), keeps it where
    predicted faster, and the refined schedule runs exactly; without that option it stays."""
    from planner.layout.dataflow import dataflow
    from planner.solver import schedule_search as ss

    rng = np.random.default_rng(2)
    args = (jnp.asarray(rng.normal(size=(512, 1024)) / 20, jnp.float32),
            jnp.asarray(rng.normal(size=(64, 512)), jnp.float32))  # fmt: skip
    plan = planner.plan(_gathered_step, *args, mesh=MESH)
    prog, sizes = plan.program, dict(MESH.shape)
    made = {r.value: o for o in prog.ops for r in o.results}
    (grad,) = [o for o in prog.ops if o.primitive == "sharding_constraint"
               and made.get(o.operands[0].value) is _gradient_sum(prog)]  # fmt: skip
    whole = dataclasses.replace(plan.schedule, assign={**plan.schedule.assign, grad.name: {}})
    evaluate = ss._Evaluator(prog, sizes, plan.calibration, None, ss.groups(prog))
    before = evaluate.schedule(whole)
    (step,) = dataflow(prog, whole, only=(grad.name,))
    arriving = ss.arriving_layouts(grad, step.moves)
    assert arriving and all(arriving)  # the gradient's own split, as it arrives
    after = ss.refine(before, evaluate, MeshShape.of(sizes))
    assert after[2].assign[grad.name] in arriving and after[0] < before[0]
    got = planner.lower(prog, after[2], MESH, backend="xla")(*args)
    assert_close(got, jax.jit(_gathered_step)(*args))
    monkeypatch.setattr(ss, "arriving_layouts", lambda op, moves: [])
    assert ss.refine(before, evaluate, MeshShape.of(sizes))[2].assign.get(grad.name) == {}


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs the TPU compiler")
@pytest.mark.parametrize("topology, axes, summed, split", [
    ("v5p:2x2x2", {"fsdp": 8}, "fsdp", False),  # every device: v5p builds it as an all-reduce
    ("v5p:2x2x2", {"fsdp": 4, "tensor": 2}, "fsdp", True),
    ("v4:2x2x2", {"fsdp": 8}, "fsdp", False),
    ("v6e:2x4", {"fsdp": 8}, "fsdp", True),  # v6e keeps the reduce-scatter
])  # fmt: skip
def test_a_sum_over_every_device_stays_where_the_compiler_builds_it_as_an_all_reduce(
    topology, axes, summed, split
):
    mesh = planner.topology_mesh(topology, axes)

    def fn(x):
        return jax.shard_map(lambda a: lax.psum(a, summed), mesh=mesh, in_specs=P(summed),
                             out_specs=P(), check_vma=False)(x)  # fmt: skip

    (eqn,) = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((64, 16), jnp.float32)).jaxpr.eqns
    rewritten = scatter_sums([eqn])[0]
    assert (rewritten is not eqn) == split
    assert (summed in str(rewritten.params["out_specs"])) == split
