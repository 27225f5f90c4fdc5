"""Spatial partitioning: convolutions split along their spatial dimensions, each device taking the
halo its windows need from its neighbours; exact against the unsharded program, forward and
gradient, for strides, dilations, padding, kernel sizes and groups."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType

import planner
from planner.halo import Window, split

DN = ("NHWC", "HWIO", "NHWC")


def _padding(mode: str, size: int, k: int, s: int, d: int, ld: int) -> tuple[int, int]:
    if mode == "SAME":  # as lax computes it on the dilated input
        out = -(-((size - 1) * ld + 1) // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - ((size - 1) * ld + 1))
        return total // 2, total - total // 2
    return {"VALID": (0, 0), "wide": (2, 3), "cropped": (-1, 1)}[mode]


def _tiles(x: np.ndarray, parts: int, cut) -> list[np.ndarray]:
    """Each device's tile of ``x`` (last axis) extended by its halo, zeros past the ends."""
    tile = x.shape[-1] // parts
    padded = np.concatenate([np.zeros_like(x[..., :tile]), x, np.zeros_like(x[..., :tile])], -1)
    return [padded[..., tile * (k + 1) - cut.left : tile * (k + 2) + cut.right] for k in range(parts)]


def test_halo_arithmetic_computes_the_whole_convolution():
    """Every split :func:`planner.halo.split` accepts, emulated tile by tile on one device:
    the output's tiles (or, split by the window, the partial sums) make the whole result."""
    rng = np.random.default_rng(0)
    accepted = refused_valid = 0
    grid = itertools.product((8, 12, 16), (1, 2, 3, 5), (1, 2), (1, 2), (1, 2),
                             ("SAME", "VALID", "wide", "cropped"), (2, 4))  # fmt: skip
    for size, k, s, d, ld, mode, parts in grid:
        pad = _padding(mode, size, k, s, d, ld)
        x = rng.standard_normal((1, 1, size)).astype(np.float32)
        kern = rng.standard_normal((1, 1, k)).astype(np.float32)
        conv = lambda a, b, p: np.asarray(lax.conv_general_dilated(a, b, (s,), [p], (ld,), (d,)))  # noqa: E731
        whole = conv(x, kern, pad)
        if whole.shape[-1] < 1:
            continue
        w = Window(2, "s0", True, size, whole.shape[-1], k, s, ld, d, pad)
        cut = split(w, parts)
        if cut is None:
            refused_valid += mode == "VALID" and k > 1
            continue
        got = np.concatenate([conv(t, kern, cut.pad) for t in _tiles(x, parts, cut)], -1)
        np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)
        accepted += 1
        # the kernel's gradient: the output gradient is the window, split with the input
        if ld == 1 and mode == "SAME":
            dy = rng.standard_normal(whole.shape).astype(np.float32)
            _, vjp = jax.vjp(lambda kk: lax.conv_general_dilated(x, kk, (s,), [pad], (1,), (d,)), kern)
            eqn = next(e for e in jax.make_jaxpr(vjp)(dy).jaxpr.eqns
                       if e.primitive.name == "conv_general_dilated")  # fmt: skip
            p = eqn.params
            grad = np.asarray(eqn.primitive.bind(x, dy, **p))
            w = Window(2, "w0", False, size, grad.shape[-1], dy.shape[-1], p["window_strides"][0],
                       p["lhs_dilation"][0], p["rhs_dilation"][0], tuple(p["padding"][0]))  # fmt: skip
            cut = split(w, parts)
            if cut is not None:
                win = dy.shape[-1] // parts
                parts_sum = sum(
                    np.asarray(eqn.primitive.bind(t, dy[..., j * win : (j + 1) * win],
                                                  **{**p, "padding": (cut.pad,)}))  # fmt: skip
                    for j, t in enumerate(_tiles(x, parts, cut))
                )
                np.testing.assert_allclose(parts_sum, grad, rtol=1e-4, atol=1e-4)
    assert accepted >= 100 and refused_valid > 0  # "VALID" output tiles do not line up


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
    spatial = 0
    for trial in range(2):
        assign = {}
        for o in convs:
            axes = list(rng.permutation(["a", "b", "c"]))
            loops = {}
            for w in o.windows:
                take = tuple(axes[: rng.integers(0, 3)])
                if take and split(w, 2 ** len(take)) is not None:
                    loops[w.owner], axes = take, axes[len(take) :]
            for lp in ("n", "g", "o"):
                if axes and lp in o.loop and o.loop[lp].extent % 2 == 0 and rng.random() < 0.5:
                    loops[lp], axes = axes[0], axes[1:]
            spatial += any(w.owner in loops for w in o.windows)
            assign[o.name] = loops
        sched = prog.schedule(assign, mesh)
        for backend in ("explicit", "xla"):
            got = jax.tree.leaves(planner.lower(prog, sched, mesh, backend=backend)(*args))
            for g, e in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-4, atol=2e-4)
    assert spatial >= 2


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
    assert "halo" in p.explain()
