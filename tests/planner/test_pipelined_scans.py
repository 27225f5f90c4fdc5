"""Scans of a planned program run as GPipe pipelines (``Schedule.stages``): exact against the
unsharded training step, forward and backward scan, under random schedules of the other mesh
axes, random stage axes and microbatch counts, both lowering backends; bodies that mix
microbatches are refused by name."""

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh
from planner_checks import LR, assert_step_equal
from planner_programs import random_schedule

import planner
from planner.program.microbatch import NotPipelinable, microbatching
from planner.program.schedule import Stages, make_schedule


def _step(ws, x, y):
    """A training step over 4 scanned residual MLP layers: its jaxpr has the forward scan and
    the backward (reversed) one, whose stacked outputs are the weights' gradients."""

    def loss(ws):
        def layer(h, w):
            return jnp.tanh(h @ w[0] + w[2]) @ w[1] + h, jnp.sum(h, axis=1)

        h, sums = lax.scan(layer, x, ws)
        return jnp.mean((h - y) ** 2) + 0.01 * jnp.mean(sums**2)

    value, grads = jax.value_and_grad(loss)(ws)
    return jax.tree.map(lambda w, g: w - 0.1 * g, ws, grads), value


def _args(rng, layers=4, batch=16, d=8, hidden=16):
    f = np.float32
    ws = ((rng.standard_normal((layers, d, hidden)) / np.sqrt(d)).astype(f),
          (rng.standard_normal((layers, hidden, d)) / np.sqrt(hidden)).astype(f),
          rng.standard_normal((layers, hidden)).astype(f))  # fmt: skip
    return ws, rng.standard_normal((batch, d)).astype(f), rng.standard_normal((batch, d)).astype(f)


MESHES = {  # name -> (shape, axis names, stage axis)
    "pipe2xa2xb2": ((2, 2, 2), ("pipe", "a", "b"), "pipe"),
    "a2xpipe4": ((2, 4), ("a", "pipe"), "pipe"),
    "a4xpipe2": ((4, 2), ("a", "pipe"), "pipe"),
}


def _mesh(name):
    shape, names, stage = MESHES[name]
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape)), stage


def _scans(prog):
    return [r for r in prog.regions if r.kind == "scan"]


def _analyzed_and_run(seed: int, **sizes):
    """``(args, prog, want)``: ``_args`` of ``seed`` and ``sizes``, ``_step`` analyzed on them
    and run unsharded."""
    args = _args(np.random.default_rng(seed), **sizes)
    return args, planner.analyze(_step, *args), jax.jit(_step)(*args)


@pytest.fixture(scope="module")
def small():
    """:func:`_analyzed_and_run` on 4 layers (seed 0), made once for the module's tests."""
    return _analyzed_and_run(0)


@pytest.fixture(scope="module")
def eight_layers():
    """:func:`_analyzed_and_run` on 8 layers (seed 6), for the circular pipelines."""
    return _analyzed_and_run(6, layers=8)


SLICES = dict(layers=8, batch=64, d=256, hidden=1024)
"""The cross-slice tests' step: 16 MiB of weights, whose replicated step (weights, gradients and
new weights, 48 MiB) does not fit :data:`SLICE_LIMIT`."""
SLICE_LIMIT = 25 * 2**20


@pytest.fixture(scope="module")
def two_slices():
    """``(args, want)``: ``_step`` on :data:`SLICES` (seed 5), whose replicated weights do not
    fit the cross-slice tests' memory limit, and its unsharded results."""
    args = _args(np.random.default_rng(5), **SLICES)
    return args, jax.jit(_step)(*args)


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.shape(g) == np.shape(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "explicit"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_pipelined_training_step_is_the_unsharded_one(mesh_name, backend, small):
    args, prog, want = small
    mesh, stage = _mesh(mesh_name)
    sizes = dict(mesh.shape)
    others = {a: n for a, n in sizes.items() if a != stage}
    rng = random.Random(f"{mesh_name}-{backend}")
    # one random draw: the six cases draw k = 1, 2 and 4 on each backend, one scan or both
    assign = random_schedule(prog, others, rng)  # the layers split over the other axes
    base = make_schedule(prog, assign, sizes, default="replicate")
    chosen = [r for r in _scans(prog) if rng.random() < 0.7] or _scans(prog)
    k = rng.choice([1, 2, 4])
    sched = dataclasses.replace(base, stages=tuple(Stages(r.start, stage, k) for r in chosen))
    _assert_close(planner.lower(prog, sched, mesh, backend=backend)(*args), want)


def test_each_stage_keeps_its_layers_and_hands_activations_on(small):
    """The compiled program of a pipelined forward scan passes the carry between stages with a
    collective-permute and runs K + P - 1 ticks."""
    args, prog, _ = small
    mesh, stage = _mesh("a2xpipe4")
    sched = make_schedule(prog, {}, dict(mesh.shape), default="replicate")
    fwd = _scans(prog)[0]
    sched = dataclasses.replace(sched, stages=(Stages(fwd.start, stage, 4),))
    text = planner.lower(prog, sched, mesh, backend="xla").lower(*args).compile().as_text()
    assert "collective-permute" in text
    plain = make_schedule(prog, {}, dict(mesh.shape), default="replicate")
    text = planner.lower(prog, plain, mesh, backend="xla").lower(*args).compile().as_text()
    assert "collective-permute" not in text


def test_the_language_model_step_pipelines_both_scans():
    """The flax LM's training step: its forward scan's residuals and its backward scan's weight
    gradients split into microbatches exactly (layer norms, attention, tied embedding; the
    tolerances of ``planner_checks.assert_step_equal``, where the key bias' exact gradient is
    zero), with the batch split over another axis (weight gradients summed once after the
    ticks) on both backends. Not replicated as well: that pipeline is this one without the
    other axis' sums, and each run of the step costs seconds."""
    from experiments.language_model import lm_step
    from planner.layout.dataflow import dataflow
    from planner.layout.staging import deferred_sums
    from planner.solver.strategies import data_parallel

    step, args = lm_step(8, 8, 16, 2, 4, 32, scan=True, rng=np.random.default_rng(2))
    prog = planner.analyze(step, *args)
    scans = _scans(prog)
    kinds = [microbatching(prog, r).exits for r in scans]
    assert "batch" in kinds[0] and set(kinds[1]) == {"sum"}
    mesh, stage = _mesh("a2xpipe4")
    want = jax.jit(step)(*args)
    # the batch split over a: its 16 weight gradients summed once after the ticks
    base = make_schedule(prog, data_parallel(prog, ["a"]), dict(mesh.shape))
    sched = dataclasses.replace(base, stages=tuple(Stages(r.start, stage, 2) for r in scans))
    assert len(deferred_sums(prog, sched, dataflow(prog, sched))) == 16
    for backend in ("xla", "explicit"):
        got = jax.tree.unflatten(
            jax.tree.structure(want), planner.lower(prog, sched, mesh, backend)(*args)
        )
        assert_step_equal(got, want, param_atol=0.05 * LR)


def _batch_norm_layers(ws, x):
    def layer(h, w):
        h = h @ w
        return (h - jnp.mean(h, axis=0)) / (jnp.std(h, axis=0) + 1.0), None

    return lax.scan(layer, x, ws)[0]


def _counter_carry(ws, x):
    return lax.scan(lambda c, w: ((c[0] @ w, c[1] + 1), None), (x, 0), ws)[0]


@pytest.mark.parametrize(
    "fn, words",
    [(_batch_norm_layers, "a sum over the batch"), (_counter_carry, "no carry")],
    ids=["batch-statistics", "scalar-carry"],
)
def test_bodies_that_mix_microbatches_are_refused_by_name(fn, words):
    rng = np.random.default_rng(3)
    prog = planner.analyze(fn, rng.standard_normal((4, 8, 8)), rng.standard_normal((16, 8)))
    with pytest.raises(NotPipelinable, match=words):
        microbatching(prog, _scans(prog)[0])


def test_bad_pipelines_are_refused_by_name(small):
    args = _args(np.random.default_rng(4), layers=6)
    prog = planner.analyze(_step, *args)
    mesh, stage = _mesh("a2xpipe4")
    fwd = _scans(prog)[0]
    base = make_schedule(prog, {}, dict(mesh.shape), default="replicate")
    cases = [
        (Stages(fwd.start, stage, 2), "6 layers do not split into 4 pipeline stages"),
        (Stages(fwd.start, "nope", 2), "pipeline axis 'nope' is not a mesh axis"),
    ]
    for st, words in cases:
        with pytest.raises(ValueError, match=words):
            planner.lower(prog, dataclasses.replace(base, stages=(st,)), mesh, backend="xla")(*args)
    args, prog, _ = small
    fwd = _scans(prog)[0]
    base = make_schedule(prog, {}, dict(mesh.shape), default="replicate")
    with pytest.raises(ValueError, match="does not split into microbatches=3"):
        planner.lower(prog, dataclasses.replace(base, stages=(Stages(fwd.start, stage, 3),)),
                      mesh, backend="xla")(*args)  # fmt: skip
    dot = next(o for o in prog.ops[fwd.body : fwd.stop] if o.primitive == "dot_general")
    used = make_schedule(prog, {dot.name: {dot.loops[0].name: stage}}, dict(mesh.shape),
                         default="replicate")  # fmt: skip
    with pytest.raises(ValueError, match="uses the stage axis 'pipe'"):
        planner.lower(prog, dataclasses.replace(used, stages=(Stages(fwd.start, stage, 2),)),
                      mesh, backend="xla")(*args)  # fmt: skip


def _compiled_total(lowered, args) -> int:
    m = lowered.lower(*args).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)  # fmt: skip


def test_pipelined_memory_is_priced_per_microbatch():
    """A pipeline holds its layers' activations one microbatch at a time: with more
    microbatches both the predicted peak and XLA's compiled total fall (the stacked residuals,
    GPipe's in-flight activations, stay whole), and the prediction stays within 25% of the
    compiled program."""
    from planner.layout.staging import staged

    args = _args(np.random.default_rng(0), layers=4, batch=1024, d=64, hidden=256)
    mesh, stage = _mesh("pipe2xa2xb2")
    prog = planner.analyze(_step, *args)
    seen = {}
    for k in (2, 8):
        sched = staged(prog, prog.schedule({}, mesh), stage, k)
        predicted = planner.simulate(prog, sched).peak_bytes
        compiled = _compiled_total(planner.lower(prog, sched, mesh, backend="xla"), args)
        assert 0.75 <= predicted / compiled <= 1.25, (k, predicted, compiled)
        seen[k] = predicted, compiled
    assert seen[8][0] < 0.97 * seen[2][0] and seen[8][1] < 0.9 * seen[2][1], seen


def test_a_pipelines_sums_are_priced_per_tick_or_once_after_the_ticks():
    """Inside a pipeline, a sum over a batch split on another axis is all-reduced on every tick
    (one microbatch's part each time), so with more microbatches those all-reduces grow as
    ``(K + P - 1) / P`` while the layers' work shrinks; a weight gradient's sums are combined
    once after the ticks (:func:`planner.layout.staging.deferred_sums`), as the lowering runs
    them. The prediction's collectives (what ``explain()`` prints) add up to its communication."""
    from planner.layout.dataflow import dataflow
    from planner.layout.staging import deferred_sums, staged
    from redist.calibration import Calibration

    args = _args(np.random.default_rng(0), layers=4, batch=64, d=32, hidden=64)
    mesh, stage = _mesh("a4xpipe2")
    prog = planner.analyze(_step, *args)
    batch = {o.name: {o.loops[0].name: "a"} for o in prog.ops
             if o.primitive == "dot_general" and o.loops[0].extent == 64}  # fmt: skip
    base = prog.schedule(batch, mesh, default="propagate")
    counts = {}
    for k in (2, 8):
        sched = staged(prog, base, stage, k)
        once = {op for op, _ in deferred_sums(prog, sched, dataflow(prog, sched)).values()}
        pred = planner.simulate(prog, sched, Calibration.default())
        assert once
        for c in pred.ops:
            if c.op in once:
                assert all(t.count == prog.op(c.op).trips for t in c.traffic), c
        counts[k] = sum(t.count for c in pred.ops if c.op not in once and c.op in prog.index
                        and prog.op(c.op).trips > 1
                        for t in c.traffic if t.kind == "all-reduce")  # fmt: skip
        total = sum(t.seconds for t in pred.traffic().values())
        assert total == pytest.approx(sum(c.comm_s for c in pred.ops), rel=1e-9)
    assert counts[2] > 0 and counts[8] == pytest.approx(counts[2] * (8 + 2 - 1) / (2 + 2 - 1))


def test_plan_pipelines_across_slices_where_memory_forbids_replication(tmp_path, two_slices):
    """Two v5p slices of 4 chips joined by the data-centre network (``pipe`` crosses it), a
    memory limit that rules out replicated weights: the plans that fit without a pipeline move
    weights or gradients over the slow link, a pipeline only activations; ``plan`` chooses the
    pipeline, explains it, and runs it exactly (``plan(...)`` and ``plan.jit()``)."""
    import dataclasses as dc

    from planner.solver.schedule_search import search_within
    from redist.calibration import Calibration

    cal = dc.replace(Calibration.named("tpu_v5p"), domain_devices=4)
    args, want = two_slices
    mesh = jax.make_mesh((2, 4), ("pipe", "a"), axis_types=(AxisType.Auto,) * 2)
    limit = SLICE_LIMIT
    p = planner.plan(_step, *args, mesh=mesh, calibration=cal, memory_limit_bytes=limit,
                     pipeline_axis="pipe")  # fmt: skip
    assert len(p.schedule.stages) == 2 and p.prediction.peak_bytes <= limit
    _, flat = search_within(p.program, dict(mesh.shape), cal, limit)
    assert p.prediction.time_s < 0.6 * flat.time_s
    text = p.explain()
    assert "Pipeline (scan at" in text and "on stage 0 of `pipe`" in text
    assert "P('pipe'" in text  # the stacked weights rest split over the stages
    _assert_close(p(*args), want)  # plan(...) runs plan.jit() (AutoPlan._jitted)
    p.save(str(tmp_path / "plan.json"))  # a saved plan keeps its pipelines
    q = planner.load(str(tmp_path / "plan.json"), _step, *args, mesh=mesh)
    assert q.schedule.stages == p.schedule.stages
    _assert_close(q.jit()(*args), want)
    with pytest.raises(ValueError, match="pipeline_axis 'stage' is not a mesh axis"):
        planner.plan(_step, *args, mesh=mesh, pipeline_axis="stage")
    with pytest.raises(ValueError, match="microbatches needs a pipeline_axis"):
        planner.plan(_step, *args, mesh=mesh, microbatches=4)


def test_the_tpu_compiler_confirms_a_pipelined_plans_memory():
    """The cross-slice pipelined plan above, from shapes, compiled for 8 v5p chips: it fits, the
    predicted peak is within 25% of the compiled total, and each chip's arguments hold half the
    stacked weights (its stage's layers) and the batch."""
    import dataclasses as dc

    from redist.calibration import Calibration

    cal = dc.replace(Calibration.named("tpu_v5p"), domain_devices=4)
    layers, batch, d, hidden = SLICES["layers"], SLICES["batch"], SLICES["d"], SLICES["hidden"]
    f = jax.ShapeDtypeStruct
    ws = (f((layers, d, hidden), jnp.float32), f((layers, hidden, d), jnp.float32),
          f((layers, hidden), jnp.float32))  # fmt: skip
    args = (ws, f((batch, d), jnp.float32), f((batch, d), jnp.float32))
    sizes = {"pipe": 2, "a": 4}
    # The weights donated, as a training step's are: without, libtpu 0.0.50 (JAX 0.12) no longer
    # lets the loop's gradient accumulators share the output's buffers (+32 MiB of temporaries
    # for the same HLO at d 512, hidden 2048; plain jax.jit of the step regresses alike), and
    # 0.0.42 did.
    p = planner.plan(_step, *args, mesh=sizes, calibration=cal, memory_limit_bytes=SLICE_LIMIT,
                     pipeline_axis="pipe", donate_argnums=0)  # fmt: skip
    assert p.schedule.stages
    report = p.compiled_report(mesh=planner.topology_mesh("v5p:2x2x2", sizes))
    assert report.fits
    assert 0.75 <= p.prediction.peak_bytes / report.total_bytes <= 1.25
    weights = sum(np.prod(w.shape) * 4 for w in ws)
    assert report.argument_bytes <= weights / 2 + 2 * batch * d * 4 + 2**20


@pytest.mark.parametrize("backend", ["explicit", "xla"])
def test_weight_gradients_of_a_split_batch_are_summed_once_after_the_ticks(backend, small):
    """The pipelined backward scan's weight gradients, summed over a batch split over another
    axis, stay partial through the ticks (each stage adds its microbatches' parts; under XLA on
    an axis of parts of their own) and each stage's stacked gradients are all-reduced once,
    after the pipeline: exact, and the program's only all-reduces of a gradient are of the
    stage's stack (2 layers)."""
    from planner.layout.dataflow import dataflow
    from planner.layout.staging import deferred_sums
    from planner.solver.strategies import data_parallel

    args, prog, want = small
    mesh, stage = _mesh("a4xpipe2")
    sizes = dict(mesh.shape)
    base = make_schedule(prog, data_parallel(prog, ["a"]), sizes)  # the batch over a, 4 ways
    sched = dataclasses.replace(base, stages=tuple(Stages(r.start, stage, 2) for r in _scans(prog)))
    deferred = deferred_sums(prog, sched, dataflow(prog, sched))
    assert len(deferred) == 2, deferred  # the two weight matrices' gradients
    lowered = planner.lower(prog, sched, mesh, backend=backend)
    _assert_close(lowered(*args), want)
    text = lowered.lower(*args).compile().as_text()
    gradients = {prog.op(op).results[0].value.shape for op, _ in deferred.values()}
    stacks = {f"f32[2,{','.join(map(str, shape))}]" for shape in gradients}
    reduced = [line for line in text.splitlines() if " all-reduce(" in line]
    per_layer = [line for line in reduced for s in gradients
                 if f"f32[{','.join(map(str, s))}]" in line.split("=")[1][:40]]  # fmt: skip
    assert any(s in line for line in reduced for s in stacks), reduced
    assert not per_layer, per_layer
    # priced so: each gradient's all-reduce once per stage's stack, 1 / P of the loop's (every
    # tick's, (K + P - 1) / P of it, before)
    comm = {k: {c.op: c.comm_s for c in planner.simulate(prog, s).ops}
            for k, s in (("pipelined", sched), ("plain", base))}  # fmt: skip
    for op, _ in deferred.values():
        assert comm["plain"][op] > 0
        assert np.isclose(comm["pipelined"][op], comm["plain"][op] / 2), (op, comm)


def _scan_lengths(jaxpr) -> list[int]:
    """The lengths of every scan in a closed jaxpr, nested ones included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out.append(eqn.params["length"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
                if hasattr(sub, "eqns"):
                    out += _scan_lengths(sub)
    return out


@pytest.mark.parametrize("backend", ["xla", "explicit"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_circular_pipelines_are_the_unsharded_step(mesh_name, backend, eight_layers):
    """Both scans of the step as circular pipelines (each microbatch round the stages ``R``
    times, every stage running ``L / (R P)`` layers a tick): exact under random layouts of the
    other axes, microbatch and repeat counts; ``R K + P - 1`` ticks each; the forward scan's
    residuals pass to the backward one in circular order."""
    from planner.layout.dataflow import dataflow
    from planner.layout.staging import circular_passes

    args, prog, want = eight_layers
    mesh, stage = _mesh(mesh_name)
    sizes = dict(mesh.shape)
    p = sizes[stage]
    others = {a: n for a, n in sizes.items() if a != stage}
    rng = random.Random(f"circular-{mesh_name}-{backend}")
    # one random draw: each backend draws K = P and 2 P among the three meshes (R = 2 on all six)
    base = make_schedule(prog, random_schedule(prog, others, rng), sizes, default="replicate")
    reps = rng.choice([r for r in (2, 4) if (8 // p) % r == 0])
    k = rng.choice([p, 2 * p])
    sched = dataclasses.replace(
        base, stages=tuple(Stages(r.start, stage, k, reps) for r in _scans(prog))
    )
    lowered = planner.lower(prog, sched, mesh, backend=backend)
    _assert_close(lowered(*args), want)
    ticks = reps * k + p - 1
    assert _scan_lengths(jax.make_jaxpr(lowered)(*args).jaxpr).count(ticks) == 2
    # laid out alike on both sides, the residuals stay in circular order between the pipelines
    plain = make_schedule(prog, {}, sizes, default="replicate")
    sched = dataclasses.replace(
        plain, stages=tuple(Stages(r.start, stage, p, 2) for r in _scans(prog))
    )
    passed = circular_passes(prog, sched, dataflow(prog, sched))
    fwd = _scans(prog)[0]
    assert passed and passed <= {e.results[0].value.name for e in prog.ops[fwd.body : fwd.stop]}
    if mesh_name == "a2xpipe4":  # run once a backend: the random draws run both P = 2 and 4
        _assert_close(planner.lower(prog, sched, mesh, backend=backend)(*args), want)


def test_a_circular_pipeline_is_priced_by_its_ticks_reorders_and_copies():
    """Against GPipe with the same microbatches, a circular pipeline's layers cost
    ``(R K + P - 1) / R`` against ``K + P - 1`` stage-ticks, it hands over ``R K + P - 1`` times,
    pays for putting the weights (not the residuals, which pass in circular order) in circular
    order and their gradients back, and its predicted peak (the weights' circular copies) is
    within 25 % of XLA's compiled total."""
    from planner.layout.staging import staged

    args = _args(np.random.default_rng(0), layers=8, batch=256, d=64, hidden=256)
    mesh, stage = _mesh("pipe2xa2xb2")
    prog = planner.analyze(_step, *args)
    body = {o.name for r in _scans(prog) for o in prog.ops[r.body : r.stop]}
    seen = {}
    for reps in (1, 2, 4):
        sched = staged(prog, prog.schedule({}, mesh), stage, 4, reps)
        pred = planner.simulate(prog, sched)
        compute = sum(c.compute_s for c in pred.ops if c.op in body)
        hand = [c for c in pred.ops if c.op.startswith("pipeline hand-overs")]
        order = [c for c in pred.ops if c.op.startswith("circular order")]
        compiled = _compiled_total(planner.lower(prog, sched, mesh, backend="xla"), args)
        assert 0.75 <= pred.peak_bytes / compiled <= 1.25, (reps, pred.peak_bytes, compiled)
        seen[reps] = compute, hand, order, pred.peak_bytes
    for reps in (2, 4):
        compute, hand, order, peak = seen[reps]
        want = (reps * 4 + 1) / reps / (4 + 1)
        assert compute / seen[1][0] == pytest.approx(want, rel=1e-6)
        assert hand[0].comm_s / seen[1][1][0].comm_s == pytest.approx((reps * 4 + 1) / 5)
        assert len(order) == 2 and all(c.comm_s > 0 for c in order)
        assert not seen[1][2] and peak > seen[1][3]
    # what each pipeline reads (the weights, both) and returns (the gradients), not what passes
    # between them (the residuals), reordered: with P = R = 2, half of each stage's tile moves
    from planner.layout.dataflow import dataflow
    from planner.layout.staging import circular_passes

    sched = staged(prog, prog.schedule({}, mesh), stage, 4, 2)
    passed = circular_passes(prog, sched, dataflow(prog, sched))
    ends = [v for r in _scans(prog) for o in (*prog.ops[r.start : r.body], *prog.ops[r.body : r.stop])
            if o.primitive in ("scan_xs", "scan_ys")
            for v in [(o.operands if o.primitive == "scan_xs" else o.results)[0].value]
            if v.name not in passed]  # fmt: skip
    moved = sum(np.prod(v.shape) * 4 // 2 // 2 for v in ends)
    assert sum(c.comm_bytes for c in seen[2][2]) == pytest.approx(moved, rel=1e-6)
    assert len(ends) < sum(o.primitive in ("scan_xs", "scan_ys") for o in prog.ops)


@pytest.mark.parametrize(
    "layers, microbatches, repeats, words",
    [(4, 2, 4, "2 layers per stage do not split into repeats=4"),
     (4, 1, 2, "at least as many microbatches as stages"),
     (4, 2, 0, "repeats must be a positive integer")],
    ids=["layers", "microbatches", "zero"],
)  # fmt: skip
def test_bad_circular_pipelines_are_refused_by_name(layers, microbatches, repeats, words):
    args = _args(np.random.default_rng(4), layers=layers)
    prog = planner.analyze(_step, *args)
    mesh, stage = _mesh("a4xpipe2")
    st = Stages(_scans(prog)[0].start, stage, microbatches, repeats)
    sched = dataclasses.replace(make_schedule(prog, {}, dict(mesh.shape)), stages=(st,))
    with pytest.raises(ValueError, match=words):
        planner.lower(prog, sched, mesh, backend="xla")
    with pytest.raises(ValueError, match="pipeline_repeats needs a pipeline_axis"):
        planner.plan(_step, *args, mesh=mesh, pipeline_repeats=2)


def test_plan_weighs_explains_and_saves_a_circular_pipeline(tmp_path, two_slices):
    """Across two slices (as above) the search weighs circular pipelines and keeps GPipe: a
    circular one would put a stage's weights in circular order over the slow link every step.
    A plan with a circular pipeline says which layers stage 0 runs, runs exactly, and a saved
    plan keeps its repeats."""
    import dataclasses as dc

    from planner.solver.staged import search_staged
    from redist.calibration import Calibration

    cal = dc.replace(Calibration.named("tpu_v5p"), domain_devices=4)
    args, want = two_slices
    mesh = jax.make_mesh((2, 4), ("pipe", "a"), axis_types=(AxisType.Auto,) * 2)
    p = planner.plan(_step, *args, mesh=mesh, calibration=cal, memory_limit_bytes=SLICE_LIMIT,
                     pipeline_axis="pipe", microbatches=4)  # fmt: skip
    assert [st.repeats for st in p.schedule.stages] == [1, 1]
    sched, pred = search_staged(p.program, dict(mesh.shape), cal, None, "pipe", 4, 2)
    assert [st.repeats for st in sched.stages] == [2, 2]
    assert pred.time_s > p.prediction.time_s
    circular = dc.replace(p, schedule=sched, prediction=pred)
    assert "circular over 2 rounds (stage 0 runs layers 0-1, 4-5;" in circular.explain()
    _assert_close(circular.jit()(*args), want)
    circular.save(str(tmp_path / "plan.json"))
    q = planner.load(str(tmp_path / "plan.json"), _step, *args, mesh=mesh)
    assert q.schedule.stages == sched.stages


def test_the_search_goes_circular_where_the_bubble_outweighs_the_reorders():
    """The flax LM (batch 8 x 4,096 tokens, 16 layers of d 512) on 8 v5p stages: the batch
    allows at most 8 microbatches, GPipe's bubble is 7 / 15 of its ticks, and a circular pipeline
    of 2 rounds (7 / 23) is predicted faster than GPipe by more than 10 %, though its stages put
    their weights in circular order each step; with 4 stages (a bubble of 3 / 11) the gain is
    smaller. The stages alone: a data axis beside them would search the layers on it too, seconds
    a search (the tests above search pipelines beside other axes)."""
    from experiments.language_model import lm_step
    from planner.solver.staged import search_staged
    from redist.calibration import Calibration

    cal = Calibration.named("tpu_v5p")
    step, args = lm_step(8, 4096, 512, 8, 16, 8000, scan=True, shapes_only=True)
    prog = planner.analyze(step, *args)
    found = {}
    for stages in (8, 4):
        best = search_staged(prog, {"pipe": stages}, cal, None, "pipe")
        gpipe = search_staged(prog, {"pipe": stages}, cal, None, "pipe", repeats=1)
        found[stages] = best[0].stages[0].repeats, best[1].time_s / gpipe[1].time_s
    assert found[8][0] == 2 and found[8][1] < 0.9, found
    assert found[8][1] < found[4][1] <= 1.0, found  # fewer stages, a smaller bubble to win back
