"""planner.analyze: iteration spaces from the rule table, generic discovery, nested jaxprs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import planner
from planner.program.schedule import splits

F = jnp.float32


def only(fn, *shapes, dtype=F):
    """The single op of ``fn`` (or the named primitive's op) on arguments of ``shapes``."""
    prog = planner.analyze(fn, *(jax.ShapeDtypeStruct(s, dtype) for s in shapes))
    return prog


def op_of(prog, primitive):
    ops = [o for o in prog.ops if o.primitive == primitive]
    assert ops, f"no {primitive} in\n{prog}"
    return ops[0]


def dims(acc):
    return [d for d in acc.dims]


def test_elementwise_and_scalars():
    prog = only(lambda x: jnp.tanh(x) * 2.0 + 1.0, (4, 6))
    for o in prog.ops:
        assert o.how == "rule" and [lp.extent for lp in o.loops] == [4, 6]
        assert o.results[0].dims == (("i0",), ("i1",))
    mul = op_of(prog, "mul")
    assert len(mul.operands) == 1  # the literal 2.0 is not an array operand


def test_elementwise_size_one_dims_are_broadcast():
    prog = only(lambda x, b: x + b, (8, 32), (32,))
    add = op_of(prog, "add")
    assert add.how == "rule"
    assert [a.dims for a in add.operands] == [(("i0",), ("i1",)), ((), ("i1",))]


def test_broadcast_transpose_convert_select():
    prog = only(lambda x: jnp.broadcast_to(x[:, None], (4, 5, 6)), (4, 6))
    b = op_of(prog, "broadcast_in_dim")
    assert b.operands[0].dims == (("i0",), ("i2",)) or b.operands[0].dims[0] == ("i0",)
    t = op_of(only(lambda x: x.T, (3, 5)), "transpose")
    assert t.operands[0].dims == (("i1",), ("i0",)) and t.results[0].dims == (("i0",), ("i1",))
    c = op_of(only(lambda x: x.astype(jnp.int32), (3, 5)), "convert_element_type")
    assert c.operands[0].dims == (("i0",), ("i1",))
    s = op_of(only(lambda x: lax.select(x > 0, x, -x), (3, 5)), "select_n")
    assert len(s.operands) == 3 and s.how == "rule"


def test_reshape_split_and_merge():
    split = op_of(only(lambda x: x.reshape(8, 2, 16), (8, 32)), "reshape")
    assert split.operands[0].dims == (("i0",), ("i1", "i2"))
    assert [lp.extent for lp in split.loops] == [8, 2, 16]
    merge = op_of(only(lambda x: x.reshape(8, 32), (8, 2, 16)), "reshape")
    assert merge.results[0].dims == (("i0",), ("i1", "i2"))
    odd = op_of(only(lambda x: x.reshape(6, 4), (4, 6)), "reshape")
    assert not any(lp.partitionable for lp in odd.loops)


def test_squeeze_expand_dims_iota():
    sq = op_of(only(lambda x: lax.squeeze(x, (1,)), (4, 1, 3)), "squeeze")
    assert sq.operands[0].dims == (("i0",), (), ("i1",))
    ex = op_of(only(lambda x: lax.expand_dims(x, (0,)), (4, 3)), "broadcast_in_dim")
    assert ex.results[0].dims[1:] == (("i1",), ("i2",))
    io = op_of(only(lambda: lax.iota(jnp.int32, 7)), "iota")
    assert io.loops[0].extent == 7 and io.operands == ()


def test_dot_general_batch_free_contracting():
    prog = only(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), (2, 3, 4), (2, 4, 5))
    d = op_of(prog, "dot_general")
    assert [(lp.name, lp.extent) for lp in d.loops] == [("b0", 2), ("m", 3), ("n", 5), ("k", 4)]
    assert d.reductions == (("k", "sum"),)
    assert d.operands[0].dims == (("b0",), ("m",), ("k",))
    assert d.operands[1].dims == (("b0",), ("k",), ("n",))
    assert str(d).startswith("dot_general_0: b0=2 m=3 n=5 k=4 (sum over k)")


@pytest.mark.parametrize(
    "fn, kind",
    [(jnp.sum, "sum"), (jnp.max, "max"), (jnp.min, "min"), (jnp.prod, "prod")],
)
def test_reductions(fn, kind):
    r = [o for o in only(lambda x: fn(x, axis=1), (4, 6)).ops if o.reductions][0]
    assert r.reductions == (("r1", kind),)
    assert r.results[0].dims == (("i0",),)


def test_argmax_is_not_partitionable_along_its_axis():
    a = op_of(only(lambda x: jnp.argmax(x, axis=1), (4, 6)), "argmax")
    assert a.loop["r1"].partitionable is False and a.loop["i0"].partitionable


def test_concatenate_and_indexing_ops_keep_their_indexed_dims_whole():
    c = op_of(only(lambda x, y: jnp.concatenate([x, y], axis=1), (4, 3), (4, 5)), "concatenate")
    assert c.loop["i1"].partitionable is False and c.operands[0].dims == (("i0",), ())
    ds = op_of(only(lambda x: lax.dynamic_slice(x, (1, 2), (2, 3)), (4, 6)), "dynamic_slice")
    assert ds.operands[0].dims == ((), ()) and not any(lp.partitionable for lp in ds.loops)
    ds = op_of(only(lambda x: lax.dynamic_slice(x, (1, 0), (2, 6)), (4, 6)), "dynamic_slice")
    assert ds.operands[0].dims == ((), ("i1",)) and ds.loop["i1"].partitionable
    # an embedding lookup: the looked-up positions and the feature dimension split; the
    # vocabulary is a masked loop summed over (each device looks up its own rows: XLA only)
    g = op_of(only(lambda x, i: x[i], (10, 3), (4,), dtype=jnp.int32), "gather")
    assert g.operands[0].dims == (("r0",), ("i1",)) and g.operands[1].dims == (("i0",), ())
    assert g.loop["i0"].partitionable and g.loop["i1"].partitionable
    assert g.loop["r0"].masked and g.loop["r0"].extent == 10 and g.reductions == (("r0", "sum"),)
    assert not splits(g, "r0", 2) and splits(g, "r0", 2, xla=True)
    # its gradient, a scatter-add: each device writes the rows in its range (XLA only)
    grad = jax.grad(lambda x, i: jnp.sum(x[i] ** 2))
    s = op_of(planner.analyze(grad, jax.ShapeDtypeStruct((10, 3), F),
                              jax.ShapeDtypeStruct((4,), jnp.int32)), "scatter-add")  # fmt: skip
    assert s.loop["i0"].masked and s.results[0].dims == (("i0",), ("i1",))
    assert not splits(s, "i0", 2) and splits(s, "i0", 2, xla=True)
    cs = op_of(only(lambda x: jnp.cumsum(x, axis=1), (4, 6)), "cumsum")
    assert cs.loop["i0"].partitionable and not cs.loop["i1"].partitionable


def test_conv_batch_features_and_halo():
    def conv(x, w):
        return lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )

    c = op_of(only(conv, (2, 3, 8, 8), (4, 3, 3, 3)), "conv_general_dilated")
    assert c.loop["n"].extent == 2 and c.loop["o"].extent == 4 and c.loop["i"].extent == 3
    assert ("i", "sum") in c.reductions
    assert c.operands[0].halo[2:] == ((1, 1), (1, 1))
    # the output rows own the input's rows (split with a halo); the 3-wide window stays whole
    assert c.loop["s0"].partitionable and not c.loop["w0"].partitionable
    assert [w.owner for w in c.windows] == ["s0", "s1"] and c.windows[0].dim == 2


def test_nested_jaxprs_are_inlined():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))

    @jax.custom_vjp
    def g(x):
        return x * 3.0

    g.defvjp(lambda x: (x * 3.0, None), lambda _, ct: (ct * 3.0,))

    def fn(x):
        y = jax.jit(lambda z: z + 1.0)(x)
        y = jax.checkpoint(lambda z: jnp.exp(z))(y)
        return g(f(y))

    prog = only(fn, (4, 5))
    prims = [o.primitive for o in prog.ops]
    assert prims == ["add", "exp", "sin", "mul"], prog
    # Values flow through the inlined calls: each op reads the previous op's result.
    for a, b in zip(prog.ops, prog.ops[1:]):
        assert b.operands[0].value == a.results[0].value
    assert prog.outputs[0] == prog.ops[-1].results[0].value


@pytest.mark.parametrize(
    "fn, shapes, expect",
    [
        (lambda x: lax.bessel_i0e(x), [(4, 6)], {"i0": True, "i1": True}),
        (lambda x, y: lax.igamma(x, y), [(4, 6), (4, 6)], {"i0": True, "i1": True}),
        (lambda x: lax.cumlogsumexp(x, axis=1), [(4, 6)], {"i0": True, "i1": False}),
    ],
)
def test_generic_discovery_of_unknown_primitives(fn, shapes, expect, monkeypatch):
    # The table knows these primitives; without it, discovery must find the same loops.
    monkeypatch.setattr(planner.program.rules, "rule_for", lambda primitive: None)
    prog = planner.analyze(fn, *(jnp.abs(jnp.ones(s)) + 0.5 for s in shapes))
    op = prog.ops[-1]
    assert op.how == "discovered", prog
    assert {lp.name: lp.partitionable for lp in op.loops} == expect


def test_discovery_of_an_op_with_several_results(monkeypatch):
    """An unstack (the gradient of keras-hub's rotary ``stack``) without its rule: each result
    is a row of the operand, its other dimensions split as the operand's."""
    monkeypatch.setattr(planner.program.rules, "rule_for", lambda primitive: None)
    prog = planner.analyze(lambda x: jnp.unstack(x * 2.0, axis=0), jnp.ones((2, 4, 6)))
    op = op_of(prog, "unstack")
    assert op.how == "discovered" and len(op.results) == 2
    assert {lp.name: lp.partitionable for lp in op.loops} == {"i0": True, "i1": True}
    assert all(r.dims == (("i0",), ("i1",)) for r in op.results)
    assert op.operands[0].dims[1:] == (("i0",), ("i1",))


def test_discovery_finds_a_sum_reduction():
    # A combiner JAX does not recognize as add, so the generic reduce primitive remains.
    fn = lambda x: lax.reduce(x, np.float32(0), lambda a, b: a + 2.0 * b - b, (1,))  # noqa: E731
    op = op_of(only(fn, (4, 6)), "reduce")
    assert op.how == "discovered" and op.reductions == (("r0", "sum"),)
    assert op.operands[0].dims == (("i0",), ("r0",))


def test_unknown_primitive_that_cannot_be_split_runs_replicated():
    fn = lambda x: lax.reduce(x, np.float32(-1e9), lambda a, b: jnp.maximum(a, b) + 0.0 * a, (0, 1))  # noqa: E731
    op = op_of(only(fn, (3, 5)), "reduce")
    assert op.how in ("discovered", "replicated")
    assert not any(lp.partitionable for lp in op.loops)
    assert "discovered" in str(op) or "replicated" in str(op)


def test_program_prints_one_line_per_op():
    prog = only(lambda x, w: jax.nn.relu(x @ w), (8, 16), (16, 4))
    lines = str(prog).splitlines()
    assert len(lines) == 1 + len(prog.ops)
    assert lines[1].startswith("dot_general_0: m=8 n=4 k=16 (sum over k) | in0[m,k] in1[k,n]")


def test_iota_counted_dimension_is_not_partitionable():
    io = op_of(only(lambda: lax.broadcasted_iota(jnp.int32, (4, 6), 1)), "iota")
    assert io.loop["i0"].partitionable and not io.loop["i1"].partitionable


def _mlp_sgd(params, x):
    loss = lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])  # noqa: E731
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, jax.grad(loss)(params))


def test_dead_code_is_not_planned():
    """A gradient step computes its loss and drops it; XLA removes that code, and so does
    analyze (else the plan prices a product and the moves that feed it)."""
    params = {"w1": jax.ShapeDtypeStruct((16, 64), F), "w2": jax.ShapeDtypeStruct((64, 16), F)}
    prog = planner.analyze(_mlp_sgd, params, jax.ShapeDtypeStruct((64, 16), F))
    outputs = {v.name for v in prog.outputs}
    for o in prog.ops:
        assert any(r.value.name in prog.uses or r.value.name in outputs for r in o.results), o
    assert [o.primitive for o in prog.ops].count("dot_general") == 4  # of five traced
    assert [v.shape for v in prog.inputs] == [(16, 64), (64, 16), (64, 16)]  # all kept


def test_device_put_is_an_identity_on_each_value_and_complex_is_elementwise():
    """MaxText's DeepSeek-V3 offloads its layers' inputs (device_put to host memory, several
    values at once) and builds rotary embeddings with complex numbers."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def fn(x, y):
        a, b = jax.device_put((x, y), sharding)
        return lax.complex(a, b)

    prog = only(fn, (4, 6), (4, 6))
    put, cplx = op_of(prog, "device_put"), op_of(prog, "complex")
    assert put.how == "rule" and cplx.how == "rule"
    assert [dims(a) for a in put.operands] == [dims(r) for r in put.results]
    assert len({lp for a in put.operands for d in a.dims for lp in d}) == 4  # two per value
    assert dims(cplx.operands[0]) == dims(cplx.operands[1]) == dims(cplx.results[0])
