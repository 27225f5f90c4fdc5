"""The program's own ``shard_map`` regions and Pallas kernels: kept in their layouts by every
schedule, priced by their bodies, and run exactly under every backend that can run them."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from planner_checks import assert_close
from planner_programs import random_schedule

import planner
from planner.cost.costs import op_flops
from planner.layout.dataflow import dataflow
from planner.program.schedule import make_schedule


def _mesh(shape=(4, 2), names=("fsdp", "tensor")) -> Mesh:
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


MESH = _mesh()


def _attend(q, k):
    """Attention of each device's heads of ``q`` against all of ``k`` (one device's tiles)."""
    s = jnp.einsum("bhd,bgd->bhg", q, k)
    return jax.nn.softmax(s, -1) @ k


def _step(w, x):
    """A projection, a shard_map over the batch and heads, a shard_map summing over the batch
    with its own collective, and a loss."""
    h = x @ w
    q = h.reshape(h.shape[0], 4, -1)
    o = jax.shard_map(_attend, mesh=MESH, in_specs=(P("fsdp", "tensor"), P("fsdp")),
                      out_specs=P("fsdp", "tensor"))(q, q)  # fmt: skip
    total = jax.shard_map(lambda a: jax.lax.psum(a.sum(0), "fsdp"), mesh=MESH,
                          in_specs=P("fsdp"), out_specs=P())(o)  # fmt: skip
    return jnp.tanh(o.reshape(h.shape) @ w.T).sum() + total.sum()


def _args():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.normal(size=(64, 64)) / 8, jnp.float32),
            jnp.asarray(rng.normal(size=(16, 64)), jnp.float32))  # fmt: skip


def test_a_shard_map_is_one_op_its_layouts_pinned_in_every_schedule():
    prog = planner.analyze(_step, *_args())
    manual = [o for o in prog.ops if o.how == "manual"]
    assert [o.primitive for o in manual] == ["shard_map", "shard_map"]
    sizes = dict(MESH.shape)
    for seed in range(5):  # whatever the other ops do, the shard_maps keep their layouts
        assign = random_schedule(prog, sizes, random.Random(seed))
        sched = make_schedule(prog, assign, sizes, default="replicate")
        steps = {st.op.name: st for st in dataflow(prog, sched)}
        first, second = (steps[o.name] for o in manual)
        fsdp = ("fsdp#0", "fsdp#1")
        assert first.in_specs == ((fsdp, ("tensor",), ()), (fsdp, (), ()))
        assert first.out_specs == ((fsdp, ("tensor",), ()),)
        assert second.in_specs == ((fsdp, (), ()),) and second.out_specs == (((), ()),)
        assert not first.pending and not second.pending


def test_a_shard_map_is_priced_by_its_body_on_the_tiles():
    prog = planner.analyze(_step, *_args())
    first = next(o for o in prog.ops if o.how == "manual")
    # per device: q (4, 2, 16) against k (4, 4, 16): two products of 2 * 4*2*4*16 flops each,
    # an exponential per score
    flops, transcendentals = op_flops(first)
    assert flops >= 2 * (2 * 4 * 2 * 4 * 16)
    assert transcendentals == 4 * 2 * 4
    assert first.flops == 8 * sum(b.flops * b.trips for b in first.body)  # on 8 devices


@pytest.mark.parametrize("backend", ["xla", "per-op"])
def test_random_schedules_around_a_shard_map_compute_the_program(backend):
    args = _args()
    prog = planner.analyze(_step, *args)
    want = jax.jit(_step)(*args)
    sizes = dict(MESH.shape)
    for seed in range(3):
        assign = random_schedule(prog, sizes, random.Random(seed), xla=backend == "xla")
        sched = make_schedule(prog, assign, sizes, default="replicate", xla=backend == "xla")
        got = planner.lower(prog, sched, MESH, backend=backend)(*args)
        assert_close(got, want)


def test_plans_keep_the_shard_map_exact_under_jit_grad_and_vmap():
    w, x = _args()
    for name, fn, args in [
        ("jit", _step, (w, x)),
        ("grad", jax.grad(_step), (w, x)),
        ("vmap", jax.vmap(_step, in_axes=(None, 0)), (w, jnp.stack([x, 2 * x]))),
    ]:
        want = jax.jit(fn)(*args)
        for context in (lambda: jax.set_mesh(MESH), _no_context):
            with context():
                got = planner.plan(fn, *args, mesh=MESH).jit()(*args)
            assert_close(got, want), name
    plan = planner.plan(_step, w, x, mesh=MESH)
    assert "the program's shard_map, as it lays itself out: in P('fsdp', 'tensor')" in (
        plan.explain()
    )
    assert "no rule understands it" not in plan.explain()


class _no_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_mesh_without_the_shard_maps_axes_is_refused_naming_them():
    with pytest.raises(
        ValueError, match=r"test_shard_map.py:\d+\) is a shard_map over mesh axis 'tensor'"
    ):
        planner.plan(_step, *_args(), mesh={"fsdp": 4, "model": 2})
    with pytest.raises(ValueError, match=r"shard_map over mesh axis 'fsdp' \(factor 'fsdp#0'"):
        planner.plan(_step, *_args(), mesh={"fsdp": 2, "tensor": 2})


def test_the_explicit_backend_runs_a_shard_maps_body_on_its_tiles():
    """Its collectives (a psum over fsdp:4, two prime factors) over the factors: exact under
    random schedules of the step and of its gradient."""
    args = _args()
    sizes = dict(MESH.shape)
    for fn in (_step, jax.grad(_step)):  # the gradient's shard_maps: the bodies transposed
        prog = planner.analyze(fn, *args)
        want = jax.jit(fn)(*args)
        for seed in range(3):
            assign = random_schedule(prog, sizes, random.Random(seed))
            sched = make_schedule(prog, assign, sizes, default="replicate")
            assert_close(planner.lower(prog, sched, MESH, backend="explicit")(*args), want)


def _collectives(x):
    """Every collective a body may call, over a composite axis (fsdp: 4) and a prime one."""
    i = jax.lax.axis_index("fsdp")
    y = jax.lax.ppermute(x * (i + 1), "fsdp", [(k, (k + 1) % 4) for k in range(4)])
    g = jax.lax.all_gather(y, "tensor", axis=1, tiled=True)
    s = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=1, tiled=True)
    t = jax.lax.all_to_all(s, "fsdp", 0, 1, tiled=True)
    return jax.lax.pmax(t, "tensor") + jax.lax.psum(t.sum(), ("fsdp", "tensor"))


def test_every_collective_of_a_body_runs_over_the_axis_factors():
    def step(x):
        f = jax.shard_map(_collectives, mesh=MESH, in_specs=P("fsdp", "tensor"),
                          out_specs=P("fsdp", "tensor"), check_vma=False)  # fmt: skip
        return jnp.sin(f(x))

    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 32)), jnp.float32)
    prog = planner.analyze(step, x)
    sched = make_schedule(prog, {}, dict(MESH.shape), default="replicate")
    assert_close(planner.lower(prog, sched, MESH, backend="explicit")(x), jax.jit(step)(x))

    # a collective inside a loop of the body is not rewritten: refused, naming it
    def looped(x):
        body = lambda c, _: (c + jax.lax.axis_index("fsdp"), None)  # noqa: E731
        return jax.lax.scan(body, x, None, length=2)[0]

    def step2(x):
        return jax.shard_map(looped, mesh=MESH, in_specs=P("fsdp"), out_specs=P("fsdp"))(x)

    prog = planner.analyze(step2, x)
    sched = make_schedule(prog, {}, dict(MESH.shape), default="replicate")
    with pytest.raises(
        NotImplementedError, match="a collective inside a scan of the program's shard_map"
    ):
        planner.lower(prog, sched, MESH, backend="explicit")(x)

    # a collective it has no rule for (XLA:CPU has no ragged all-to-all: refused as traced)
    def ragged(x):
        sizes = jnp.full((4,), 1, jnp.int32)
        offsets = jnp.arange(4, dtype=jnp.int32)
        return jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), offsets, sizes, offsets, sizes,
                                         axis_name="fsdp")  # fmt: skip

    def step3(x):
        return jax.shard_map(ragged, mesh=MESH, in_specs=P("fsdp"), out_specs=P("fsdp"))(x)

    prog = planner.analyze(step3, x)
    sched = make_schedule(prog, {}, dict(MESH.shape), default="replicate")
    with pytest.raises(NotImplementedError, match="the collective ragged_all_to_all"):
        jax.jit(planner.lower(prog, sched, MESH, backend="explicit")).lower(x)


def _blocked_matmul(x, w):
    """A Pallas kernel (interpreted here): each grid point multiplies one block of rows."""

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] @ w_ref[...]

    return pl.pallas_call(
        kernel, grid=(4,), in_specs=[pl.BlockSpec((8, 64), lambda i: (i, 0)),
                                     pl.BlockSpec((64, 32), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((8, 32), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((32, 32), jnp.float32), interpret=True,
    )(x, w)  # fmt: skip


def test_a_pallas_kernel_is_priced_by_its_body_times_its_grid_and_runs_whole():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)

    def fn(x, w):
        return jnp.tanh(_blocked_matmul(x * 2, w)).sum()

    prog = planner.analyze(fn, x, w)
    kernel = next(o for o in prog.ops if o.primitive == "pallas_call")
    assert kernel.how == "replicated"
    assert op_flops(kernel)[0] == 4 * 2 * 8 * 64 * 32  # the grid's 4 blocks of rows
    plan = planner.plan(fn, x, w, mesh=MESH)
    assert_close(plan.jit()(x, w), jax.jit(fn)(x, w))


def test_a_kernel_whose_grid_is_sized_at_run_time_is_priced_by_its_own_estimate():
    """megablox's grouped matmul tiles its rows as the groups fill them (a grid dimension
    sized at run time): its body once per static grid point would be one row tile of 8, so it
    is priced as its own cost estimate says, as the compiler prices it."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    from planner.cost.costs import body_flops, op_flops

    lhs = jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((4, 512, 256), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    prog = planner.analyze(lambda a, b, g: gmm(a, b, g, tiling=(512, 512, 256)), lhs, rhs, sizes)
    (kernel,) = [o for o in prog.ops if o.primitive == "pallas_call"]
    assert kernel.how == "replicated"
    assert op_flops(kernel)[0] == kernel.flops == 2 * 4096 * 512 * 256
    assert body_flops(kernel)[0] < op_flops(kernel)[0] / 4  # what its grid alone gave
    assert op_flops(_static_kernel())[0] == body_flops(_static_kernel())[0]


def _static_kernel():
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    prog = planner.analyze(_blocked_matmul, x, w)
    return next(o for o in prog.ops if o.primitive == "pallas_call")


def test_the_collectives_a_shard_map_calls_are_priced_over_its_axes():
    from planner.cost.simulator import body_traffic
    from redist.calibration import Calibration
    from redist.types import MeshShape

    prog = planner.analyze(_step, *_args())
    second = [o for o in prog.ops if o.how == "manual"][1]
    mesh = MeshShape.of(dict(MESH.shape))
    cal = Calibration.default()
    (traffic,) = body_traffic(second, mesh.factor_size, mesh, cal)
    tile = 4 * 16 * 4  # its psum over fsdp's 4 devices of a (4, 16) float32 tile
    assert traffic.kind == "all-reduce" and traffic.count == 1
    assert traffic.bytes == 2 * tile * 3 / 4
    assert traffic.seconds == cal.collective_time("all-reduce", tile, 4)


def test_a_ragged_all_to_all_is_priced_at_its_smaller_buffer():
    """MaxText's expert dispatch sends each device's rows into a buffer sized for the worst
    case (all rows to one device): priced as an all-to-all of the rows it sends when they
    spread evenly, the smaller of its two buffers, not of the two and its offsets together."""
    from planner.cost.simulator import body_traffic
    from redist.calibration import Calibration, wire_bytes
    from redist.types import MeshShape

    def dispatch(x):
        sizes = jnp.full((4,), 1, jnp.int32)
        offsets = jnp.arange(4, dtype=jnp.int32)
        buffer = jnp.zeros((4 * x.shape[0], x.shape[1]), x.dtype)  # 4x: the worst case
        return jax.lax.ragged_all_to_all(x, buffer, offsets, sizes, offsets, sizes,
                                         axis_name="fsdp")  # fmt: skip

    def step(x):
        return jax.shard_map(dispatch, mesh=MESH, in_specs=P("fsdp"), out_specs=P("fsdp"),
                             check_vma=False)(x)  # fmt: skip

    x = jnp.ones((32, 16), jnp.float32)
    (op,) = [o for o in planner.analyze(step, x).ops if o.how == "manual"]
    mesh = MeshShape.of(dict(MESH.shape))
    cal = Calibration.default()
    (traffic,) = body_traffic(op, mesh.factor_size, mesh, cal)
    rows = 32 // 4 * 16 * 4  # a device's (8, 16) float32 rows
    assert traffic.kind == "all-to-all"
    assert traffic.bytes == wire_bytes("all-to-all", rows, 4)
    assert traffic.seconds == cal.collective_time("all-to-all", rows, 4)


def test_tiles_other_than_a_shard_maps_specs_are_refused_by_the_explicit_backend():
    from planner.lowering.on_factors import check_layouts, factor_axes

    names = factor_axes(dict(MESH.shape))
    check_layouts("sm", [P("fsdp", None)], [(("fsdp#0", "fsdp#1"), ())], names, [2])
    with pytest.raises(NotImplementedError, match="sm: the plan lays an operand"):
        check_layouts("sm", [P("fsdp", None)], [(("fsdp#0",), ())], names, [2])
