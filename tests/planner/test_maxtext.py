"""MaxText's training step (experiments.maxtext_model), shrunk: planned exactly under its remat
policies, grouped-query attention and mixed precision, by the search, the expert strategies and
random schedules; and the recipe's own layout (MaxText's logical axis rules) is the same step."""

import dataclasses
import random
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from planner_programs import random_schedule

import planner
from experiments import recipes
from experiments.maxtext_model import MODELS, REMAT_POLICIES, maxtext_step, remat_policy
from planner.program.schedule import make_schedule

TINY = dataclasses.replace(MODELS["llama2-70b"], emb=32, heads=4, kv_heads=2, head_dim=8, mlp=48,
                           layers=2, vocab=64)  # fmt: skip
LR = 1e-4


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))


@pytest.fixture(scope="module")
def unsharded():
    """``unsharded(dtype, attention)``: the unsharded step of ``TINY``'s results (``jax.jit(step)``)
    on the arguments ``maxtext_step`` makes for a batch of 8 sequences of 16 tokens, compiled
    once per module. A remat policy changes what the backward pass keeps, not what the step
    computes, so one reference serves the step under every policy (as it does under an
    offloading one), and blockwise attention's is that of its key blocks of 4."""
    cache = {}

    def run(dtype="bfloat16", attention="dense"):
        key = (dtype, attention)
        if key not in cache:
            step, args = maxtext_step(TINY, batch=8, seq=16, remat="full", dtype=dtype,
                                      attention=attention, block=4)  # fmt: skip
            cache[key] = jax.jit(step)(*args)
        return cache[key]

    return run


@pytest.fixture(scope="module")
def experts_of(mesh):
    """``experts_of(remat)``: ``(step, args, expert plans)`` of ``TINY``'s step under ``remat`` on
    the module's mesh (a batch of 8 sequences of 16 tokens), made once per module."""
    cache = {}

    def make(remat):
        if remat not in cache:
            step, args = maxtext_step(TINY, batch=8, seq=16, remat=remat)
            experts = planner.expert_plans(step, *args, mesh=mesh, data_axes=("data", "fsdp"))
            cache[remat] = step, args, experts
        return cache[remat]

    return make


def assert_same_step(got, want, dtype):
    """Parameters, optimizer state and loss of two runs of one step: equal up to the reduction
    order of float32 (``dtype`` float32), or of bfloat16 activations."""
    loose = dtype == "bfloat16"
    np.testing.assert_allclose(got[2], want[2], rtol=2e-2 if loose else 1e-5)
    for g, w in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2])):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = max(np.max(np.abs(w)), 1e-30)
        tol = (3 * LR if g.ndim and scale > 10 * LR else 0.2 * scale) if loose else 1e-4 * scale
        np.testing.assert_allclose(g, w, rtol=0, atol=tol + 1e-12)


@pytest.mark.parametrize("remat, expert", [("full", "fsdp")])
def test_searched_and_expert_plans_compute_the_step(remat, expert, mesh, unsharded, experts_of):
    """One policy and one expert: each search and run of the step costs seconds, and the other
    policies and experts are planned and run by other tests here. ``minimal`` is searched with
    blockwise attention (``test_blockwise_attention_is_planned_exactly``, with ``fsdp_tensor``);
    ``save_dot_except_mlpwi`` runs under random schedules and under the recipe's own FSDP and
    tensor layout (``test_the_recipe_layout_runs_the_same_step``, in bfloat16);
    ``data_parallel`` is ``fsdp`` without its parameters stored split (its batch split, gradient
    all-reduce and exactness checked on other steps by ``test_baselines.py``)."""
    step, args, experts = experts_of(remat)
    want = unsharded()
    assert set(experts) == {"data_parallel", "fsdp", "fsdp_tensor"}
    assert any(experts[expert].schedule.assign.values())
    for p in (planner.plan(step, *args, mesh=mesh), experts[expert]):
        assert_same_step(p(*args), want, "bfloat16")


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_every_op_of_the_step_is_understood(attention):
    """No op runs replicated for want of a rule (on JAX 0.12 a checkpointed scan inside the
    layer's scan leaves an ``eval_jaxpr`` call in the gradient, inlined like ``jit``)."""
    step, args = maxtext_step(TINY, batch=8, seq=16, remat="minimal", attention=attention,
                              block=8)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planner.analyze(step, *args)
    assert not [str(w.message) for w in caught if "not understood" in str(w.message)]


def test_random_schedules_compute_the_step_in_float32(unsharded):
    """On 4 devices of two axes: a random schedule of the step compiles to some 25,000 lines of
    HLO there, 34,000 on the module's 8 devices of three axes (in twice the time)."""
    step, args = maxtext_step(TINY, batch=8, seq=16, remat="save_dot_except_mlpwi",
                              dtype="float32")  # fmt: skip
    want = unsharded(dtype="float32")
    prog = planner.analyze(step, *args)
    mesh = jax.make_mesh((2, 2), ("data", "fsdp"))
    sizes = dict(mesh.shape)
    for seed in range(1):
        sched = make_schedule(prog, random_schedule(prog, sizes, random.Random(seed)), sizes,
                              default="replicate")  # fmt: skip
        flat = planner.lower(prog, sched, mesh)(*args)  # the program's outputs, flat
        assert_same_step(jax.tree.unflatten(jax.tree.structure(want), flat), want, "float32")


def test_grouped_query_attention_splits_key_value_heads_over_the_tensor_axis(experts_of):
    _, _, experts = experts_of("full")
    specs = jax.tree.leaves(experts["fsdp_tensor"].in_specs[0]["layers"]["key"])
    assert "tensor" in str(specs), specs  # (layers, embed, kv_heads, head_dim): heads split


def test_the_recipe_layout_runs_the_same_step(unsharded):
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    recipe = dict(recipes.RECIPES["tiny_v5p_8"], model=TINY, per_device_batch=1, seq=16)
    _, args = maxtext_step(TINY, batch=8, seq=16, remat=recipe["remat"])
    want = unsharded()
    constrained, _ = recipes.recipe_step(dict(recipe, topology="cpu:2x2x2"), mesh)
    shardings = recipes.recipe_shardings(args, mesh)
    assert shardings[0]["layers"]["wi_0"].spec == P(None, "fsdp", "tensor")
    assert shardings[0]["embedding"].spec == P("tensor", "fsdp")
    assert shardings[2].spec == P(("data", "fsdp"), None)
    laid_out = jax.jit(constrained, in_shardings=shardings)
    assert_same_step(laid_out(*args), want, "bfloat16")
    text = laid_out.lower(*args).as_text()
    assert "sharding_constraint" in text or "Sharding" in text


def test_remat_policies_are_maxtexts_and_bad_names_are_refused():
    assert remat_policy("full") is jax.checkpoint_policies.nothing_saveable
    assert remat_policy("minimal") is jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
    assert set(REMAT_POLICIES) >= {"full", "minimal", "save_dot_except_mlpwi", "none"}
    with pytest.raises(ValueError, match="remat_policy='offload'"):
        remat_policy("offload")
    with pytest.raises(ValueError, match="do not share"):
        maxtext_step(dataclasses.replace(TINY, kv_heads=3), batch=2, seq=4)


def test_blockwise_attention_computes_dense_attention(unsharded):
    blocks = unsharded(dtype="float32", attention="blockwise")  # key blocks of 4
    assert_same_step(blocks, unsharded(dtype="float32"), "float32")
    with pytest.raises(ValueError, match="does not split into key blocks of 6"):
        maxtext_step(TINY, batch=4, seq=16, attention="blockwise", block=6)[0](
            *maxtext_step(TINY, batch=4, seq=16)[1])  # fmt: skip
    with pytest.raises(ValueError, match="attention='flash'"):
        maxtext_step(TINY, batch=4, seq=16, attention="flash")


def test_blockwise_attention_is_planned_exactly(mesh, unsharded):
    """Under MaxText's ``minimal`` policy (planned here only, with blockwise attention)."""
    step, args = maxtext_step(TINY, batch=8, seq=16, remat="minimal", dtype="float32",
                              attention="blockwise", block=4)  # fmt: skip
    want = unsharded(dtype="float32", attention="blockwise")
    experts = planner.expert_plans(step, *args, mesh=mesh, data_axes=("data", "fsdp"))
    for p in (planner.plan(step, *args, mesh=mesh), experts["fsdp_tensor"]):
        assert_same_step(p(*args), want, "float32")


def test_blockwise_attention_is_priced_without_the_scores():
    """At a sequence where the scores dominate, the blockwise step's predicted peak is far below
    the dense one's: one key block's scores at a time, not the sequence's square."""
    model = dataclasses.replace(TINY, layers=1, heads=8, kv_heads=2, head_dim=16, emb=128)
    peaks = {}
    for attention in ("dense", "blockwise"):
        step, args = maxtext_step(model, batch=8, seq=1024, remat="full", attention=attention,
                                  block=128, shapes_only=True)  # fmt: skip
        # data parallelism priced (the memory model under test, not the search)
        dp = planner.expert_plans(step, *args, mesh={"data": 8}, data_axes=("data",),
                                  tensor_axis=None)["data_parallel"]  # fmt: skip
        peaks[attention] = dp.prediction.peak_bytes
    scores = 8 * 8 * 1024 * 1024 * 4 // 8  # float32 scores of the whole batch, per device
    assert peaks["dense"] - peaks["blockwise"] > scores, peaks


def test_jax_nn_dot_product_attention_is_planned_exactly_and_priced_as_compiled(mesh):
    """``jax.nn.dot_product_attention`` (causal, XLA's implementation: the scores made and
    kept for the gradient, as the compiler does): a planned step equals the unsharded one, and
    its predicted peak is within 10% of the compiled total on XLA:CPU."""
    import jax.numpy as jnp

    heads, head_dim, d = 8, 32, 64

    def loss(w, x):
        q, k, v = (jnp.einsum("bsd,dhk->bshk", x, w[n]) for n in "qkv")
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.mean(jnp.einsum("bshk,hkd->bsd", o, w["o"]) ** 2)

    def step(w, x):
        return jax.tree.map(lambda a, g: a - 0.1 * g, w, jax.grad(loss)(w, x))

    rng = np.random.default_rng(0)
    w = {n: jnp.asarray(rng.standard_normal((d, heads, head_dim)) / 8, "float32") for n in "qkv"}
    w["o"] = jnp.asarray(rng.standard_normal((heads, head_dim, d)) / 8, "float32")
    x = jnp.asarray(rng.standard_normal((8, 256, d)), "float32")
    want = jax.jit(step)(w, x)
    p = planner.plan(step, w, x, mesh=mesh)
    for g, e in zip(jax.tree.leaves(p(w, x)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)
    m = p.jit().lower(w, x).compile().memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)  # fmt: skip
    assert 0.9 <= p.prediction.peak_bytes / total <= 1.1, (p.prediction, total)


TINY_MOE = dataclasses.replace(MODELS["mixtral-8x7b"], emb=32, heads=4, kv_heads=2, head_dim=8,
                               mlp=128, layers=2, vocab=64, experts=8)  # fmt: skip
"""Eight experts of hidden width 128: held to half its free plan's peak, the search splits the
experts (with 4, their width; with a width of 48, it searches under the limit twice as long)."""


@pytest.fixture(scope="module")
def moe_plans(mesh):
    """``(step, args, free, tight)``: ``TINY_MOE``'s float32 step (a batch of 8 sequences of 16
    tokens) planned for v5p chips on the module's mesh freely and under half the free plan's
    peak, made once for the module's two mixture-of-experts tests."""
    from redist.calibration import Calibration

    step, args = maxtext_step(TINY_MOE, batch=8, seq=16, remat="full", dtype="float32",
                              attention="blockwise", block=8)  # fmt: skip
    cal = Calibration.named("tpu_v5p")
    free = planner.plan(step, *args, mesh=mesh, calibration=cal)
    tight = planner.plan(step, *args, mesh=mesh, calibration=cal,
                         memory_limit_bytes=0.5 * free.prediction.peak_bytes)  # fmt: skip
    return step, args, free, tight


def test_mixture_of_experts_is_planned_exactly(moe_plans):
    """The routed experts (top-k, capacity, one-hot dispatch) planned freely and under a memory
    limit that forces their weights apart."""
    step, args, free, tight = moe_plans
    want = jax.jit(step)(*args)
    assert any(tight.in_specs[0]["layers"]["moe_wi_0"])  # its weights split
    for p in (free, tight):
        assert_same_step(p(*args), want, "float32")


def test_the_search_splits_the_experts_when_memory_forces_it(moe_plans):
    """Under half the peak of the plan searched without a limit, the search splits the experts:
    the plans of the test above, whose two searches of the step this would repeat."""
    _, _, free, tight = moe_plans
    assert tight.prediction.peak_bytes <= 0.5 * free.prediction.peak_bytes
    for name in ("moe_wi_0", "moe_wi_1", "moe_wo"):  # (layers, experts, ...): experts split
        spec = tight.in_specs[0]["layers"][name]
        assert len(spec) > 1 and spec[1], (name, spec)


def test_plans_on_explicit_axes_keep_their_layouts_inside():
    """On a mesh of Explicit axes (``jax.make_mesh``'s default) an FSDP plan compiles to what it
    does on the same mesh with Auto axes: its activations stay split as planned (left to the
    typing rules of Explicit axes, XLA held them whole: 3x the temporary memory on this step)."""
    from planner.target.compiled import input_structs

    model = dataclasses.replace(TINY, emb=128, heads=4, kv_heads=2, head_dim=32, mlp=256,
                                layers=2, vocab=256)  # fmt: skip
    step, args = maxtext_step(model, batch=16, seq=128, remat="full", dtype="float32",
                              attention="blockwise", block=32, shapes_only=True)  # fmt: skip
    temp = {}
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(kind,) * 3)
        p = planner.expert_plans(step, *args, mesh=mesh, data_axes=("data", "fsdp"))["fsdp"]
        temp[kind] = p.jit().lower(*input_structs(p)).compile().memory_analysis().temp_size_in_bytes
    assert temp[AxisType.Explicit] <= 1.05 * temp[AxisType.Auto], temp


def test_a_policy_that_offloads_to_the_host_is_planned_exactly(mesh, unsharded):
    """MaxText's ``remat_policy: custom`` with the layer input and projections offloaded to
    ``pinned_host`` (its v6e Llama 3.1 8B recipe): the transfers are part of the planned step."""
    step, args = maxtext_step(TINY, batch=8, seq=16, remat="offload_qkvo", dtype="float32")
    assert "device_put" in {o.primitive for o in planner.analyze(step, *args).ops}
    want = unsharded(dtype="float32")  # the step without offloading (remat "full")
    assert_same_step(planner.plan(step, *args, mesh=mesh)(*args), want, "float32")


def test_the_offloading_candidate_of_a_remat_choice_is_the_offloading_step():
    """Under ``planner.remat_policy`` the step traced with its offloading candidate offloads the
    same values (the layer's input among them) as the step written with that policy."""
    from planner.cost.buffers import host_values
    from planner.program.remat import choosing

    fixed_step, fixed_args = maxtext_step(TINY, batch=8, seq=16, remat="offload_qkvo")
    fixed = planner.analyze(fixed_step, *fixed_args)
    choice = planner.remat_policy(full=remat_policy("full"),
                                  offload_qkvo=remat_policy("offload_qkvo"))  # fmt: skip
    step, args = maxtext_step(TINY, batch=8, seq=16, remat=choice)
    jax.clear_caches()  # JAX caches traces regardless of what the policy answers
    with choosing("offload_qkvo"):
        chosen = planner.analyze(step, *args)
    jax.clear_caches()
    puts = [sum(o.primitive == "device_put" for o in p.ops) for p in (fixed, chosen)]
    assert puts[0] == puts[1] == 10  # five names, each to the host and back
    assert len(host_values(chosen)) == len(host_values(fixed)) > 0
