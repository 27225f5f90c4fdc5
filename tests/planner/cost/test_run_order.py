"""The order the compiler runs a program's ops in (:mod:`planner.cost.run_order`): a checkpointed
layer's recomputation runs where it is read, and the memory model walks the ops in that order."""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import planner
from planner.cost import buffers
from planner.cost.buffers import lifetimes
from planner.cost.run_order import arranged_program, run_order
from planner.cost.simulator import peak_buffers, simulate
from redist.calibration import Calibration

BF16 = jnp.bfloat16


def layer(h, w):
    """An attention-like block (its output saved by the policy) then an MLP."""
    wq, wk, wo, w1, w2 = w
    q, k = h @ wq, h @ wk
    s = jnp.tanh(jnp.einsum("btd,bsd->bts", q, k))
    mid = checkpoint_name(h + (s @ h) @ wo, "mid")
    return mid + jax.nn.relu(mid @ w1) @ w2, None


SAVE_MID = jax.checkpoint_policies.save_only_these_names("mid")


def step(ws, x, policy=SAVE_MID):
    def loss(ws):
        y = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, ws)[0]
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.tree.map(lambda a, b: a - 0.1 * b, ws, jax.grad(loss)(ws))


def analyzed(fn=step, b=8, t=256, d=128, layers=4):
    ws = tuple(jax.ShapeDtypeStruct(s, BF16) for s in
               [(layers, d, d)] * 3 + [(layers, d, 4 * d), (layers, 4 * d, d)])  # fmt: skip
    return planner.analyze(fn, ws, jax.ShapeDtypeStruct((b, t, d), BF16))


def topological(prog, order) -> bool:
    """Every op runs after the ops making what it reads."""
    seen = {v.name for v in prog.inputs} | {v.name for v, _ in prog.consts}
    for k in order:
        if any(a.value.name not in seen for a in prog.ops[k].operands):
            return False
        seen |= {r.value.name for r in prog.ops[k].results}
    return True


def backward_checkpoint(prog):
    """The checkpoint region of the backward loop (the last one)."""
    return [r for r in prog.regions if r.kind == "checkpoint"][-1]


def test_the_attentions_recomputation_runs_after_the_mlps_backward():
    prog = analyzed()
    order = run_order(prog)
    assert sorted(order) == list(range(len(prog.ops))) and topological(prog, order)
    when = {k: t for t, k in enumerate(order)}
    region = backward_checkpoint(prog)
    dots = [k for k in range(region.start, region.stop) if prog.ops[k].primitive == "dot_general"]
    # program order: q, k, scores, ... (the layer again), then the MLP's backward, then the
    # attention's; the TPU compiler runs q and k after the MLP's backward products (seen in its
    # schedule of this step for 4 v5p chips)
    q, k = dots[0], dots[1]
    mlp_backward = [j for j in dots if j > q and prog.ops[j].results[0].value.shape[-1] == 512]
    assert mlp_backward and all(when[q] > when[j] and when[k] > when[j] for j in mlp_backward)
    assert q < min(mlp_backward)  # (so the order moved them)


def test_every_region_keeps_its_ops_together_and_the_arranged_program_reads_the_same():
    prog = analyzed()
    order = run_order(prog)
    arranged = arranged_program(prog, order)
    for r, a in zip(prog.regions, arranged.regions, strict=True):
        assert a.stop - a.start == r.stop - r.start
        assert {o.name for o in arranged.ops[a.start : a.stop]} == \
            {o.name for o in prog.ops[r.start : r.stop]}  # fmt: skip
    assert arranged.uses.keys() == prog.uses.keys()


def test_without_recomputation_next_to_nothing_moves():
    prog = analyzed(lambda ws, x: step(ws, x, jax.checkpoint_policies.everything_saveable))
    moved = [k for t, k in enumerate(run_order(prog)) if t != k]
    assert len(moved) <= 2  # a product past the zeros its reader adds it to
    plain = planner.analyze(lambda x: jnp.tanh(x @ x.T), jax.ShapeDtypeStruct((8, 8), BF16))
    assert run_order(plain) == tuple(range(len(plain.ops))) and lifetimes(plain, "tpu").order == ()


def test_an_op_moves_only_where_it_holds_no_larger_operand_longer():
    def g(x, w):
        big = jnp.exp(x @ w)  # [256, 1024]
        c = big @ w.T  # big's other reader, before the maxima
        of_big = jnp.max(big, axis=1)  # moved, it would hold big longer: stays
        of_x = jnp.max(x, axis=1)  # x is held anyway: runs where it is read
        d = jnp.tanh(c @ c.T)
        return d + of_big[:, None] + of_x[:, None]

    prog = planner.analyze(jax.checkpoint(g), jax.ShapeDtypeStruct((256, 64), BF16),
                           jax.ShapeDtypeStruct((64, 1024), BF16))  # fmt: skip
    assert [r.kind for r in prog.regions] == ["checkpoint"]
    when = {k: t for t, k in enumerate(run_order(prog))}
    maxima = [k for k, o in enumerate(prog.ops) if o.primitive == "reduce_max"]
    last_product = max(k for k, o in enumerate(prog.ops) if o.primitive == "dot_general")
    of_big, of_x = sorted(maxima, key=lambda k: prog.ops[k].operands[0].value.shape[1])[::-1]
    assert when[of_big] < when[last_product] < when[of_x]


def recomputed_whole(ws, x):
    """The layer recomputed whole: the MLP's recomputation reads the attention's."""
    return step(ws, x, jax.checkpoint_policies.nothing_saveable)


@pytest.mark.parametrize("fn, leaner", [(step, True), (recomputed_whole, False)])
def test_the_memory_model_walks_the_ops_in_run_order_on_tpu_only(fn, leaner, monkeypatch):
    prog = analyzed(fn)
    sched = prog.schedule({}, {"data": 4}, default="replicate")
    tpu, cpu = Calibration.named("tpu_v5p"), Calibration.default()
    sunk = simulate(prog, sched, tpu)
    assert lifetimes(prog, "tpu").order and not lifetimes(prog, cpu.backend).order
    monkeypatch.setattr(buffers, "SUNK_RECOMPUTATION", frozenset())
    buffers.LIFETIMES.get(prog, dict).clear()
    in_program_order = simulate(prog, sched, tpu)
    assert sunk.peak_bytes < in_program_order.peak_bytes if leaner else \
        sunk.peak_bytes == in_program_order.peak_bytes  # fmt: skip
    assert sunk.time_s == pytest.approx(in_program_order.time_s)
    monkeypatch.undo()
    buffers.LIFETIMES.get(prog, dict).clear()
    peak = peak_buffers(prog, sched, tpu)
    assert peak.bytes == sunk.peak_bytes and sum(b.bytes for b in peak.buffers) == peak.bytes
