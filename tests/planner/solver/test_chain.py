"""planner.solver.chain: segments, the cost decomposition, the DP, and Alpa's 6-layer MLP
oracles."""

import dataclasses
import itertools

import numpy as np
import pytest

import planner
from experiments.workloads import workload
from planner.cost.simulator import op_seconds, seconds
from planner.layout.dataflow import dataflow
from planner.program.schedule import Schedule, make_schedule
from planner.solver.chain import ChainDP, subprogram
from planner.solver.schedule_search import _options, anchors, groups, search
from redist.calibration import Calibration

MESH = {"a": 2, "b": 2, "c": 2}


def _program(kind, sizes):
    # analysed only: the arguments' shapes (no arrays drawn, no flax initialisation to run)
    fn, args = workload(kind, sizes, np.random.default_rng(0), shapes_only=True)
    return planner.analyze(fn, *args)


def _whole_mesh_candidates(prog, mesh):
    parts = int(np.prod(list(mesh.values())))
    opts = [_options(o, {}, parts, mesh) for o in anchors(prog)]
    return [[{loop: tuple(mesh)} if loop else {} for loop in opt] for opt in opts]


def test_segments_cover_every_op_once_and_mlp_layers_form_a_chain():
    prog = _program("mlp", [64, 32, 4])
    dp = ChainDP(prog, groups(prog), MESH, Calibration.default())
    names = [o.name for s in dp.segments for o in s]
    assert sorted(names) == sorted(o.name for o in prog.ops)
    assert len(dp.segments) == 4 and dp.is_chain
    assert dp.edges == [(0, 1), (1, 2), (2, 3)]
    deep = _program("transformer", [2, 8, 2, 4, 2])
    assert not ChainDP(deep, groups(deep), MESH, Calibration.default()).is_chain  # residuals


@pytest.mark.parametrize("kind,sizes", [("mlp", [64, 32, 4]), ("mlp", [16, 128, 3])])
def test_decomposed_cost_equals_the_simulation_on_chains(kind, sizes):
    prog = _program(kind, sizes)
    dp = ChainDP(prog, groups(prog), MESH, Calibration.default())
    cands = _whole_mesh_candidates(prog, MESH)
    rng = np.random.default_rng(0)
    for _ in range(6):
        picks = [int(rng.integers(len(c))) for c in cands]
        assign = dp.assignment([c[k] for c, k in zip(cands, picks)])
        sched = make_schedule(prog, assign, MESH, default="replicate")
        full = planner.simulate(prog, sched).time_s
        assert dp.total(cands, picks) == pytest.approx(full, rel=1e-9)


def test_dp_minimises_the_decomposed_cost_exactly_on_a_chain():
    prog = _program("mlp", [64, 32, 4])
    dp = ChainDP(prog, groups(prog), MESH, Calibration.default())
    cands = _whole_mesh_candidates(prog, MESH)
    best = min(
        dp.total(cands, picks) for picks in itertools.product(*(range(len(c)) for c in cands))
    )
    assert dp.total(cands, dp.solve(cands)) == pytest.approx(best, rel=1e-12)


# The DP passes alone optimal on small chains: test_schedule_search.py
# (test_dynamic_programming_search_is_optimal_on_small_chains), beside the full search's test on
# the same chains, whose brute force the two share.


def test_repeated_layers_are_priced_once():
    counts = []
    for layers in (4, 12):
        prog = _program("mlp", [64, 32, layers])
        dp = ChainDP(prog, groups(prog), MESH, Calibration.default())
        dp.solve(_whole_mesh_candidates(prog, MESH))
        counts.append(dp.evaluations)
    assert counts[1] == counts[0]  # 3x the layers, no more sub-program simulations


@pytest.mark.parametrize(
    "kind,sizes", [("transformer", [4, 16, 2, 4, 2]), ("lm_scan", [4, 8, 16, 2, 2, 32])]
)
def test_border_priced_from_its_ops_equals_simulating_the_pair(kind, sizes):
    """Every border cost the DP uses, priced from the ops at the border alone, equals simulating
    the two segments together minus each alone, for every pair of candidates."""
    prog = _program(kind, sizes)
    dp = ChainDP(prog, groups(prog), MESH, Calibration.default())
    cands = _whole_mesh_candidates(prog, MESH)
    checked = 0
    for i, j in dp.edges:
        for a, b in itertools.product(cands[i], cands[j]):
            together = dp.cost((i, j), (a, b))
            alone = dp.cost((i,), (a,)) + dp.cost((j,), (b,))
            if np.isfinite(together):
                assert dp.border(i, j, a, b) == pytest.approx(together - alone, abs=1e-15)
                checked += 1
    assert checked > 20


def test_windows_of_layers_laid_out_alike_share_their_layouts_and_price_exactly():
    """A deep transformer's layers give windows laid out alike whose kernels differ (the
    residual chain's reads grow with depth), so the DP walks their layouts once: every segment
    cost and border it prices equals pricing that window from its own data flow, to the bit, and
    does not depend on which window of the layers was priced first."""
    prog = _program("transformer", [4, 16, 2, 4, 4])
    cal = Calibration.default()
    cands = _whole_mesh_candidates(prog, MESH)
    forward = ChainDP(prog, groups(prog), MESH, cal)
    backward = ChainDP(prog, groups(prog), MESH, cal)
    pairs = [(i, j, a, b) for i, j in forward.edges
             for a, b in itertools.product(cands[i], cands[j])]  # fmt: skip
    priced = [forward.border(*p) for p in pairs]
    assert [backward.border(*p) for p in reversed(pairs)] == priced[::-1]

    def window(*segs):
        ops = sorted(
            (o for s in segs for o in forward.segments[s]), key=lambda o: prog.index[o.name]
        )
        return subprogram(prog, ops)

    def alone(g, a):
        sub = window(g)
        sched = make_schedule(sub, forward.grids(g, a), MESH, default="replicate")
        time_s, times = seconds(sub, sched, cal)
        return time_s - cal.step_s, dict(zip((o.name for o in sub.ops), times))

    checked = 0
    for i, j, a, b in pairs:
        names = forward.crossing(i, j)
        if names is None or forward.grids(i, a) is None or forward.grids(j, b) is None:
            continue
        (cost_i, before_i), (cost_j, before_j) = alone(i, a), alone(j, b)
        assert (forward.cost((i,), (a,)), forward.cost((j,), (b,))) == (cost_i, cost_j)
        sub = window(i, j)
        named = {**forward.grids(i, a), **forward.grids(j, b)}
        together = op_seconds(sub, Schedule(sub, forward.factor_size, named), names, cal)
        before = {**before_i, **before_j}
        want = sum(together.values()) - sum(before[n] for n in together)
        assert forward.border(i, j, a, b) == want
        checked += 1
    assert checked > 100


def _psums(prog, sched):
    return [st.op.name for st in dataflow(prog, sched) if st.pending]


def test_alpa_oracle_small_batch_large_hidden_gives_megatron_alternation():
    prog = _program("mlp", [32, 256, 6])
    sched, _ = search(prog, {"a": 2, "b": 2})
    loops = [next(iter(sched.assign[o.name])) for o in anchors(prog)]
    assert loops == ["n", "k"] * 3  # column, row, column, ...
    assert all(len(sched.assign[o.name][lp]) == 2 for o, lp in zip(anchors(prog), loops))
    assert len(_psums(prog, sched)) == 5  # L - 1 all-reduces


def test_alpa_oracle_large_batch_small_hidden_gives_data_parallelism_on_a_fast_network():
    # With collective latencies of ~0.6 ms against ~0.1 ms of compute per layer the plan is to
    # replicate; with latencies 1000x smaller, as on an accelerator interconnect, it is pure data
    # parallelism: the batch split everywhere, one all-reduce per weight gradient (the loss the
    # step drops is dead code, not planned).
    prog = _program("mlp", [256, 32, 6])
    base = Calibration.default()
    cpu = dataclasses.replace(base, latency_s={k: 6e-4 for k in base.latency_s})
    fast = dataclasses.replace(cpu, latency_s={k: v / 1000 for k, v in cpu.latency_s.items()})
    sched, _ = search(prog, {"a": 2, "b": 2}, fast)
    assert [sched.assign[o.name] for o in anchors(prog)] == [{"m": ("a", "b")}] * 6
    psums = _psums(prog, sched)
    assert len(psums) == 6 and all(p.startswith("dot_general") for p in psums)
    replicated, _ = search(prog, {"a": 2, "b": 2}, cpu)
    assert all(not replicated.assign[o.name] for o in anchors(prog))


@pytest.mark.parametrize("kind,sizes", [("transformer", [8, 8, 2, 4, 2]), ("moe", [64, 8, 8, 16])])
def test_training_step_runs_exactly_under_its_plan(kind, sizes):
    import jax
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
    fn, args = workload(kind, sizes, np.random.default_rng(0))
    cpu = Calibration.default()  # at this size CPU latencies say replicate: price a fast network
    fast = dataclasses.replace(cpu, latency_s={k: v / 1000 for k, v in cpu.latency_s.items()})
    p = planner.plan(fn, *args, mesh=mesh, calibration=fast)
    split = sum(bool(loops) for loops in p.schedule.assign.values())
    assert split > len(p.program.ops) // 2  # most ops are split
    # the unsharded step compiled whole (run op by op it compiles every op on its own)
    for got, want in zip(jax.tree.leaves(p(*args)), jax.tree.leaves(jax.jit(fn)(*args))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sizes", [[8, 16, 8, 16, 1], [8, 8, 8, 32, 2]])
def test_search_never_predicts_worse_than_a_hand_strategy(sizes):
    from planner import baselines

    prog = _program("transformer", sizes)
    _, pred = search(prog, MESH)
    axes = tuple(MESH)
    for assign in (
        baselines.data_parallel(prog, axes),
        baselines.megatron(prog, axes),
        baselines.data_and_model(prog, axes[:1], axes[1:]),
    ):
        hand = planner.simulate(prog, make_schedule(prog, assign, MESH)).time_s
        assert pred.time_s <= hand * (1 + 1e-9)
