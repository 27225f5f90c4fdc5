"""Spatial partitioning: convolutions split along their spatial dimensions, each device taking the
halo its windows need from its neighbours; exact against the unsharded program, forward and
gradient, for strides, dilations, padding, kernel sizes and groups."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType

import planner
from planner.program.halo import Window, split

DN = ("NHWC", "HWIO", "NHWC")


def _padding(mode: str, size: int, k: int, s: int, d: int, ld: int) -> tuple[int, int]:
    if mode == "SAME":  # as lax computes it on the dilated input
        out = -(-((size - 1) * ld + 1) // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - ((size - 1) * ld + 1))
        return total // 2, total - total // 2
    return {"VALID": (0, 0), "wide": (2, 3), "cropped": (-1, 1)}[mode]


def _conv1d(x, k, s: int, pad, ld: int = 1, d: int = 1) -> np.ndarray:
    """The 1-D convolution (cross-correlation) lax computes, in numpy: ``x`` dilated by ``ld``,
    padded by ``pad`` (negative: cropped), windows of ``k`` dilated by ``d``, every ``s``-th."""
    xd = np.zeros((len(x) - 1) * ld + 1, x.dtype)
    xd[::ld] = x
    lo, hi = pad
    xd = np.concatenate([np.zeros(max(lo, 0)), xd[max(-lo, 0) : len(xd) - max(-hi, 0)],
                         np.zeros(max(hi, 0))])  # fmt: skip
    reach = (len(k) - 1) * d + 1
    return np.array([xd[o : o + reach : d] @ k for o in range(0, len(xd) - reach + 1, s)])


def _tiles(x: np.ndarray, parts: int, cut) -> list[np.ndarray]:
    """Each device's tile of ``x`` extended by its halo, zeros past the ends."""
    tile = len(x) // parts
    padded = np.concatenate([np.zeros(tile), x, np.zeros(tile)])
    return [padded[tile * (k + 1) - cut.left : tile * (k + 2) + cut.right] for k in range(parts)]


def test_halo_arithmetic_computes_the_whole_convolution():
    """Every split :func:`planner.program.halo.split` accepts, emulated tile by tile: the output's
    tiles (or, split by the window, the partial sums) make the whole result. The kernel's gradient
    is the convolution JAX's transpose makes (the output gradient as the window)."""
    rng = np.random.default_rng(0)
    accepted = refused_valid = 0
    grid = itertools.product((8, 12, 16), (1, 2, 3, 5), (1, 2), (1, 2), (1, 2),
                             ("SAME", "VALID", "wide", "cropped"), (2, 4))  # fmt: skip
    for size, k, s, d, ld, mode, parts in grid:
        pad = _padding(mode, size, k, s, d, ld)
        x, kern = rng.standard_normal(size), rng.standard_normal(k)
        whole = _conv1d(x, kern, s, pad, ld, d)
        if len(whole) < 1:
            continue
        cut = split(Window(0, "s0", True, size, len(whole), k, s, ld, d, pad), parts)
        if cut is None:
            refused_valid += mode == "VALID" and k > 1
            continue
        got = np.concatenate([_conv1d(t, kern, s, cut.pad, ld, d) for t in _tiles(x, parts, cut)])
        np.testing.assert_allclose(got, whole, rtol=1e-9, atol=1e-9)
        accepted += 1
    assert accepted >= 100 and refused_valid > 0  # "VALID" output tiles do not line up
    window_splits = 0
    for size, k, s, d, parts in itertools.product((8, 16), (1, 3, 5), (1, 2), (1, 2), (2, 4)):
        x = rng.standard_normal((1, 1, size)).astype(np.float32)
        forward = functools.partial(lax.conv_general_dilated, x, window_strides=(s,),
                                    padding="SAME", rhs_dilation=(d,))  # fmt: skip
        y, vjp = jax.vjp(forward, np.ones((1, 1, k), np.float32))
        dy = rng.standard_normal(y.shape).astype(np.float32)
        eqn = next(e for e in jax.make_jaxpr(vjp)(dy).jaxpr.eqns
                   if e.primitive.name == "conv_general_dilated")  # fmt: skip
        p = eqn.params
        st, pad, dil = p["window_strides"][0], tuple(p["padding"][0]), p["rhs_dilation"][0]
        grad = _conv1d(x[0, 0], dy[0, 0], st, pad, 1, dil)
        np.testing.assert_allclose(grad, np.asarray(vjp(dy)[0])[0, 0], rtol=1e-4, atol=1e-4)
        cut = split(Window(0, "w0", False, size, k, dy.shape[-1], st, 1, dil, pad), parts)
        if cut is None:
            continue
        win = dy.shape[-1] // parts
        partial = [_conv1d(t, dy[0, 0, j * win : (j + 1) * win], st, cut.pad, 1, dil)
                   for j, t in enumerate(_tiles(x[0, 0], parts, cut))]  # fmt: skip
        np.testing.assert_allclose(sum(partial), grad, rtol=1e-4, atol=1e-4)
        window_splits += 1
    assert window_splits >= 20


CASES = [
    # (kernel, stride, dilation, padding, groups): groups 4 of 4 channels is depthwise
    (3, 1, 1, "SAME", 1),
    (5, 1, 2, "SAME", 1),
    (3, 2, 1, "SAME", 1),
    (2, 1, 1, "SAME", 2),
    (3, 1, 1, ((1, 1), (1, 1)), 4),
    (1, 1, 1, "SAME", 1),
]


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)


@pytest.mark.parametrize("case", CASES, ids=[f"k{c[0]}s{c[1]}d{c[2]}g{c[4]}" for c in CASES])
def test_spatially_split_convolutions_are_exact_forward_and_gradient(case, mesh):
    """Two convolutions and their gradients (the input's: a convolution of the output gradient,
    input-dilated by the stride; the kernel's: the output gradient as the window) with random
    splits of their rows and columns (and batch, features, groups where they divide), lowered
    with shard_map and with XLA, against the unsharded step."""
    k, s, d, pad, groups = case
    rng = np.random.default_rng(k * 7 + s * 3 + d + groups)

    def step(x, k1, k2):
        y = lax.conv_general_dilated(x, k1, (s, s), pad, rhs_dilation=(d, d),
                                     dimension_numbers=DN, feature_group_count=groups)  # fmt: skip
        y = lax.conv_general_dilated(jnp.tanh(y), k2, (1, 1), "SAME", dimension_numbers=DN)
        return jnp.sum(y**2)

    args = [rng.standard_normal(sh).astype(np.float32) / 2
            for sh in [(2, 16, 16, 4), (k, k, 4 // groups, 8), (3, 3, 8, 4)]]  # fmt: skip
    fn = jax.value_and_grad(step, argnums=(0, 1, 2))
    prog = planner.analyze(fn, *args)
    want = jax.tree.leaves(fn(*args))
    convs = [o for o in prog.ops if o.primitive == "conv_general_dilated"]
    assert all(o.windows for o in convs)  # every one has its rule, the kernel gradients too
    assign, spatial = {}, 0
    for o in convs:
        axes = list(rng.permutation(["a", "b", "c"]))
        loops = {}
        for w in o.windows:
            take = tuple(axes[: rng.integers(1, 3)])
            if split(w, 2 ** len(take)) is not None:
                loops[w.owner], axes = take, axes[len(take) :]
        minor = {lp for a in o.operands + o.results for d in a.dims for lp in d[1:]}
        for lp in sorted({"n", "g", "o"} - minor):
            if axes and lp in o.loop and o.loop[lp].extent % 2 == 0 and rng.random() < 0.5:
                loops[lp], axes = axes[0], axes[1:]
        spatial += any(w.owner in loops for w in o.windows)
        assign[o.name] = loops
    sched = prog.schedule(assign, mesh)
    for backend in ("explicit", "xla"):
        got = jax.tree.leaves(planner.lower(prog, sched, mesh, backend=backend)(*args))
        for g, e in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-4, atol=2e-4)
    assert spatial >= 3  # of the 6 convolutions of the step


def test_splits_whose_tiles_do_not_line_up_are_refused_by_name(mesh):
    def f(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=DN)

    args = [np.ones((2, 16, 16, 4), np.float32), np.ones((3, 3, 4, 8), np.float32)]
    prog = planner.analyze(f, *args)
    (conv,) = prog.ops
    with pytest.raises(ValueError, match="s0.*cannot be split in 2 tiles with a halo"):
        prog.schedule({conv.name: {"s0": "a"}}, mesh)


def test_the_search_splits_rows_when_the_batch_is_too_small(mesh):
    """Two 512x512 images on 8 devices: the search splits the rows (with halos) where the batch
    cannot go further, predicted well under the best split of batch and channels alone."""

    def net(x, k1, k2):
        y = jax.nn.relu(lax.conv_general_dilated(x, k1, (1, 1), "SAME", dimension_numbers=DN))
        return jnp.mean(lax.conv_general_dilated(y, k2, (1, 1), "SAME", dimension_numbers=DN) ** 2)

    shapes = [(2, 512, 512, 4), (3, 3, 4, 16), (3, 3, 16, 4)]
    step = jax.value_and_grad(net, argnums=(1, 2))
    structs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    p = planner.plan(step, *structs, mesh=mesh, memory_limit_bytes=None)
    convs = [o for o in p.program.ops if o.primitive == "conv_general_dilated"]
    split_rows = [o for o in convs if any(p.schedule.axes_of(o, w.owner) for w in o.windows)]
    assert len(split_rows) == len(convs)
    channels = p.program.schedule(
        {o.name: {"n": "a", "o" if o.loop["o"].extent >= 4 else "i": ("b", "c")} for o in convs},
        mesh,
    )
    assert p.prediction.time_s < 0.8 * planner.simulate(p.program, channels).time_s
    assert "rows 512 over" in p.explain() and "with a halo of 1" in p.explain()
    rng = np.random.default_rng(1)
    args = [rng.standard_normal(s).astype(np.float32) / 4 for s in shapes]
    for g, e in zip(jax.tree.leaves(p(*args)), jax.tree.leaves(jax.jit(step)(*args))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-6)


def test_a_depthwise_kernel_gradient_splits_its_groups_and_rows(mesh):
    """A depthwise convolution's kernel gradient (``batch_group_count`` 4: group ``g`` of the
    output features reads channel ``g`` of the input) with its groups, its window (the output
    gradient's rows) and its images split, lowered both ways, exact."""

    def step(x, k):
        y = lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=DN,
                                     feature_group_count=4)  # fmt: skip
        return jnp.sum(jnp.sin(y) * y)

    rng = np.random.default_rng(3)
    args = [rng.standard_normal(sh).astype(np.float32) for sh in [(4, 16, 16, 4), (3, 3, 1, 8)]]
    fn = jax.value_and_grad(step, argnums=(0, 1))
    prog = planner.analyze(fn, *args)
    (kernel_gradient,) = [o for o in prog.ops if o.eqn.params.get("batch_group_count", 1) > 1]
    assert [w.owner for w in kernel_gradient.windows] == ["w0", "w1"]
    assert kernel_gradient.loop["g"].extent == 4
    sched = prog.schedule({kernel_gradient.name: {"g": "a", "w0": "b", "i": "c"}}, mesh)
    want = jax.tree.leaves(fn(*args))
    for backend in ("explicit", "xla"):
        got = jax.tree.leaves(planner.lower(prog, sched, mesh, backend=backend)(*args))
        for g, e in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-4)


POOLS = [("max", (3, 3), (1, 1), "SAME"), ("max", (2, 2), (2, 2), "VALID"),
         ("max", (3, 3), (2, 2), "SAME"), ("max", (3, 3), (2, 2), ((0, 0), (1, 1), (1, 1), (0, 0))),
         ("avg", (3, 3), (2, 2), "SAME"), ("min", (5, 5), (1, 1), "SAME")]  # fmt: skip


def _pool_id(p) -> str:
    pad = p[3] if isinstance(p[3], str) else "PAD" + "".join(str(a) for a in p[3][1])
    return f"{p[0]}{p[1][0]}s{p[2][0]}{pad}"


@pytest.mark.parametrize("pool", POOLS, ids=[_pool_id(p) for p in POOLS])
def test_spatially_split_pooling_is_exact_forward_and_gradient(pool, mesh):
    """Max, min and average pooling with their rows and columns split (a max-pool's halo is -inf
    past the ends, as its padding), and their gradients split the same way: a max-pool's
    (``select_and_scatter_add``: its operand and source windows with halos, its result cropped
    to each device's rows) and an average pool's (a window sum over the output gradient dilated
    by the stride), lowered both ways, against the unsharded step."""
    kind, window, strides, pad = pool
    reducer = {"max": (lax.max, -jnp.inf), "min": (lax.min, jnp.inf), "avg": (lax.add, 0.0)}[kind]

    def step(x):
        y = lax.reduce_window(x, reducer[1], reducer[0], (1, *window, 1), (1, *strides, 1), pad)
        return jnp.sum(jnp.sin(y) * y)

    x = np.random.default_rng(len(kind)).standard_normal((2, 16, 16, 4)).astype(np.float32)
    fn = jax.value_and_grad(step)
    prog = planner.analyze(fn, x)
    windowed = [o for o in prog.ops if o.windows]
    op = windowed[0]  # the forward
    assert [w.owner for w in op.windows] == ["i1", "i2"]
    # the gradient: a max- or min-pool's select_and_scatter_add; an average pool's pad and
    # stride-1 window sum, folded into one window sum over the output gradient dilated by the stride
    gradient = windowed[1:]
    want_gradient = "reduce_window_sum" if kind == "avg" else "select_and_scatter_add"
    assert [o.primitive for o in gradient] == [want_gradient]
    assert kind != "avg" or [w.lhs_dilation for w in gradient[0].windows] == list(strides)
    assert not [o for o in prog.ops if o.primitive == "pad"]
    want = jax.tree.leaves(fn(x))
    for loops in ({"i1": "a", "i2": ("b", "c")}, {"i1": ("c", "a"), "i0": "b"}):
        assign = {}
        for o in (op, *gradient):
            owners = {w.owner: w for w in o.windows}
            assign[o.name] = {lp: ax for lp, ax in loops.items()
                              if lp not in owners or split(owners[lp], 2 ** len(ax)) is not None}  # fmt: skip
        assert all(set(a) == set(loops) for a in assign.values())  # every window split
        sched = prog.schedule(assign, mesh)
        for backend in ("explicit", "xla"):
            got = jax.tree.leaves(planner.lower(prog, sched, mesh, backend=backend)(x))
            for g, e in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)


def test_a_max_pool_gradient_splits_where_its_windows_line_up():
    """The halo of a max-pool's gradient: the windows covering a device's rows and the operand
    rows they read, for the usual pools; refused where the windows do not line up."""
    from planner.program.halo import Window, scatter_split

    def cut(window, stride, pad, size=16, parts=2):
        out = (size + sum(pad) - window) // stride + 1
        return scatter_split(
            Window(1, "i1", True, size, out, window, stride, 1, 1, pad, True), parts
        )

    # rows 8-15 of 16 on the second device; window j reads rows [j s - lo, j s - lo + w)
    assert cut(3, 1, (1, 1)) == split_of(2, 2, (1, 1))  # windows 7-16, rows 6-17
    assert cut(2, 2, (0, 0)) == split_of(0, 0, (0, 0))  # windows inside the tiles: no halo
    assert cut(3, 2, (0, 1)) == split_of(2, 1, (1, 0))  # windows 3-7, rows 6-16
    assert cut(3, 2, (1, 1)) == split_of(1, 2, (0, 1))  # windows 4-8, rows 7-17
    assert cut(3, 2, (0, 0)) is None  # 'VALID' 3x3 stride 2: 7 windows for 16 rows


def split_of(left, right, source):
    from planner.program.halo import Split

    return Split(left, right, (0, 0), source)


def test_batch_and_channel_splits_of_a_convnet_are_exact(mesh):
    """The hand strategy the benchmark sets against spatial partitioning: batch over one axis,
    output channels over the others; lowered, exact."""
    from experiments.workloads import workload
    from planner import baselines

    fn, args = workload("convnet", [2, 16, 8, 2], np.random.default_rng(2))
    prog = planner.analyze(fn, *args)
    assign = baselines.batch_and_channels(prog, ("a",), ("b", "c"), dict(mesh.shape))
    assert all(loops.get("o") == ("b", "c") for loops in assign.values())
    got = planner.lower(prog, prog.schedule(assign, mesh), mesh)(*args)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(fn)(*args))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-6)


def test_a_pad_folds_into_a_window_sum_only_when_zero_and_read_once(mesh):
    """A zero pad read only by a window sum becomes the sum's base dilation and padding; a pad
    of another value, or one read twice, stays an op of its own; all exact under a row split."""

    def pooled(x, value, twice):
        k = lax.pad(x, jnp.asarray(value, x.dtype), ((0, 0, 0), (2, 1, 1), (2, 1, 1), (0, 0, 0)))
        y = lax.reduce_window(k, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "VALID")
        return (y, k) if twice else y

    x = np.random.default_rng(4).standard_normal((2, 8, 8, 4)).astype(np.float32)
    for value, twice, folds in ((0.0, False, True), (1.0, False, False), (0.0, True, False)):
        fn = functools.partial(pooled, value=value, twice=twice)
        prog = planner.analyze(fn, x)
        (window_sum,) = [o for o in prog.ops if o.primitive == "reduce_window_sum"]
        assert bool([o for o in prog.ops if o.primitive == "pad"]) != folds
        assert [w.lhs_dilation for w in window_sum.windows] == ([2, 2] if folds else [1, 1])
        sched = prog.schedule({window_sum.name: {"i0": "a"}}, mesh)
        if folds:
            sched = prog.schedule({window_sum.name: {"i1": "b", "i2": "c", "i0": "a"}}, mesh)
        for g, e in zip(jax.tree.leaves(planner.lower(prog, sched, mesh)(x)),
                        jax.tree.leaves(jax.jit(fn)(x))):  # fmt: skip
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hand", ["batch_and_channels", "batch_and_rows"])
def test_hand_splits_of_a_convnet_with_pools_are_exact(hand, mesh):
    """The two hand strategies of the spatial benchmark on a network with depthwise
    convolutions, max and average pools: batch over one axis, channels (groups) or rows over
    the others; lowered both ways, exact."""
    from experiments.workloads import workload
    from planner import baselines

    fn, args = workload("convpool", [2, 16, 8, 2], np.random.default_rng(5))
    prog = planner.analyze(fn, *args)
    assign = getattr(baselines, hand)(prog, ("a",), ("b", "c"), dict(mesh.shape))
    chosen = [o for o in prog.ops if o.windows]  # pools follow the convolutions' channels
    if hand == "batch_and_channels":
        chosen = [o for o in chosen if o.primitive == "conv_general_dilated"]
    assert set(assign) == {o.name for o in chosen}
    split_by_hand = [o for o in chosen if set(assign[o.name].values()) >= {("a",), ("b", "c")}]
    assert len(split_by_hand) >= len(chosen) // 2
    if hand == "batch_and_rows":
        assert all(assign[o.name].get(o.windows[0].owner) == ("b", "c") for o in split_by_hand)
    want = jax.tree.leaves(jax.jit(fn)(*args))
    for backend in ("explicit", "xla"):
        got = planner.lower(prog, prog.schedule(assign, mesh), mesh, backend=backend)(*args)
        for g, e in zip(jax.tree.leaves(got), want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-6)
