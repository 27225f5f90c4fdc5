"""Weight sync at frontier size: Qwen3-235B-A22B's and DeepSeek-V3's parameters moved from a
MaxText-style training layout to a vLLM-style serving layout on the same TPU v5p chips (or the
8 H100s of one host), within a memory budget, compiled ahead of time by the TPU compiler (or
XLA:GPU) on this host (nothing runs).

Usage:
    python -m experiments.frontier_sync --workdir=workdir/frontier_sync
    python -m experiments.frontier_sync --config.cases=qwen3_235b@v5p-128
    python -m experiments.frontier_sync --config.cases=qwen3_235b@h100x8,deepseek_v3@h100x8

On a pod slice the whole sync is one program per method. On 8 H100s the trees alone outgrow a
GPU (Qwen3-235B: 59 GB per GPU each in bfloat16, DeepSeek-V3: 168 GB), so the sync is compiled
as the eager budgeted path runs it: one program per bucket (:func:`bucketed`), each holding its
pieces' source and destination tiles plus at most the budget; the rows give the largest.

The trees and layouts are :mod:`experiments.frontier_weights`'s (bfloat16). The serving mesh is
the training mesh's devices in the same order with its axes renamed (``ep`` is ``fsdp``, ``tp``
is ``expert``), so both layouts are written on one mesh. Per case and method:

- ``redist``: ``redist.redistribute(params, src, dst, memory_budget=...)`` in one ``jax.jit``;
- ``xla``: ``jax.jit(lambda p: p, out_shardings=dst)``.

Each row gives the compiled arguments, outputs and temporaries per chip (the budget bounds the
temporaries: what is alive beyond the two trees), whether the program fits the chip's HBM, the
bytes each chip sends under redist's plans against the lower bound (a chip must receive its
destination tiles less what it already holds), and redist's predicted time on the v5p
calibration (the buckets in series: each bucket's moves summed). Writes ``results.jsonl`` and
``report.md`` under ``--workdir``.

``--config.layouts=tunix``: the layouts MaxText's RL trainer (``maxtext.trainers.post_train.rl
.train_rl``, which runs on tunix's ``RLCluster``) gives these weights, trainer and sampler on the
same chips (:func:`measure_tunix`). tunix 0.1.7 itself has neither model (``tunix.models``
has Qwen3 up to 32B and 30B-A3B, no DeepSeek), so at this size tunix's trainer is MaxText's. From MaxText 0.2.5
(PyPI ``maxtext``), tunix 0.1.7 (``google-tunix``) and vLLM's TPU backend
(``vllm-project/tpu-inference``):

- the trainer (actor) mesh: MaxText's mesh (``configs/base.yml:636``, ``mesh_axes``) over the
  sampler's chips (``utils/model_creation_utils.py``, ``setup_configs_and_devices``: one slice
  gives the trainer and the sampler every chip, unless Pathways is on and there are two VMs or
  more, where ``rl.yml:19-20`` halves them; halves are not one program and tunix moves them
  through pathwaysutils, so the colocated case is the one compiled here), ``fsdp`` x ``expert``:
  ``ici_fsdp_parallelism: -1`` (``base.yml:783``) with ``ici_expert_parallelism=8`` (the
  recipe variant the vLLM-layout rows use; the default is 1);
- the trainer's specs: ``rl.yml:283-352`` (``logical_axis_rules``): ``embed`` over ``fsdp`` x
  ``expert`` (``rl.yml:342``; the attention projections' ``embed_attn``, MLA's ``q_lora`` /
  ``kv_lora`` and the table's ``embed_vocab`` likewise), the experts ``("exp", "embed_moe",
  "mlp_moe")`` / ``("exp", "mlp_moe", "embed_moe")`` (``layers/moe.py:937-938``) to ``expert``,
  ``fsdp``, unsharded (``rl.yml:326-328``), Qwen3's router ``("embed", None)``
  (``models/qwen3.py:1383``) and DeepSeek's ``("embed_router", None)`` (``layers/moe.py:4783``,
  ``fsdp`` alone, ``rl.yml:330``), norms on ``tensor`` (size 1), weights in bfloat16
  (``rl.yml:88``). These are :mod:`experiments.frontier_weights`' training layouts;
- the sampler (rollout) mesh: vLLM on TPU, ``tensor_parallel_size`` x ``data_parallel_size``
  (``get_rollout_kwargs_for_parallelism``, ``model_creation_utils.py:694-751``; rl.yml's
  defaults ``rollout_tensor_parallelism: 1``, ``rollout_data_parallelism: -1``,
  ``rollout_expert_parallelism: 1``, ``rl.yml:25-27``). Tensor parallelism 1 does not hold
  either model on a chip, and MaxText's guides set it by hand (8 for Llama 3.1 70B on v5p-128,
  4 for Qwen3-30B-A3B); here it is the smallest power of two at which the sampler's weights
  and its KV cache (below) fit in the share of HBM vLLM takes (``hbm_utilization_vllm: 0.72``,
  ``rl.yml:167``): 16 for Qwen3-235B, 32 for DeepSeek-V3 on v5p; on 8 H100s none does, and it
  is 8. Data parallelism is the rest of the chips. Same chips in the same order: the mesh is
  ``outer`` x ``middle`` x ``inner``, the trainer's ``fsdp`` and ``expert`` and the sampler's
  data and tensor axes each a run of them (:func:`tunix_mesh_axes`);
- the sampler's specs: by default (no ``maxtext_config`` in ``vllm_additional_config``,
  ``integration/vllm/maxtext_vllm_rollout.py:590``) vLLM runs its own model and tunix copies
  MaxText's weights into it with ``transfer_state_with_mappings`` (``tunix/generate/utils.py``,
  the target shardings read off the sampler's own arrays), by MaxText's tables
  (``integration/tunix/weight_mapping/qwen3.py:67-131``, ``deepseek3.py:64-152``; ``model``
  is vLLM's tensor axis): vocabulary, heads and MLP columns over ``model``, projections back
  to the model dimension by rows, norms replicated; the routed experts ``("expert", None,
  "model")`` with vLLM's ``expert`` axis of size 1 (expert parallelism off), i.e. every expert
  on every chip of a tensor-parallel group, hidden dimension over ``model``, as
  tpu-inference's own DeepSeek-V3 shards them without expert parallelism
  (``tpu_inference/models/jax/deepseek_v3.py``, ``moe_edf_sharding`` of ``GMM_TP``; its router
  replicated). Qwen3's table lists no experts; they are taken as DeepSeek's. Approximations:
  Qwen3's 4 key/value heads are split over the flattened ``heads x head`` columns where vLLM
  repeats a head on each chip past 4 (the weights differ by 0.15 GB per chip at tensor 16);
- the move (``transfer_state_with_mappings``): tunix first unstacks MaxText's scanned weights
  into one array per layer (``_unroll_scanned_layers``, ``tunix/generate/utils.py:464-512``;
  each slice a new array in the trainer's layout, all alive until the move ends: a second
  copy of the trainer's stacked weights), puts them in the sampler's state in place of its
  old weights (released before the move), then reshards that per-layer tree in one
  ``reshard_pytree`` call (``reshard_chunk_size: null``, ``rl.yml:71``), outside Pathways
  ``jax.device_put(tree, shardings)`` (``tunix/rl/reshard.py``), the trainer's weights kept
  (not donated: the trainer goes on with them).

Methods on these layouts:

- ``redist``, as ``redist.integrations.tunix.reshard_pytree`` runs with a ``memory_budget``:
  eagerly, one program per bucket (:func:`bucketed`, on the stacked weights cut where one alone
  holds more than the budget, the same moves as on tunix's per-layer arrays: a sampler tile of
  a stacked expert weight is 9.4 GB per chip for Qwen3-235B at tensor 16);
- ``device_put``: what JAX (0.10.2, as 0.12) runs for tunix's ``device_put`` on a pod slice.
  There no one process addresses an array whole, and ``device_put`` reshards each by
  ``jax.jit(identity, out_shardings=dst)`` of that array alone (``jax/_src/dispatch.py``,
  ``_device_put_sharding_impl`` -> ``_different_device_order_reshard``): one program per
  array of the per-layer tree, in its order. (On one host, where every array is addressable,
  it copies each array whose tiles differ through host memory instead:
  ``jax/_src/array.py``, ``shard_sharded_device_array_slow_path``; no program, its device
  peak the trees);
- ``xla_whole_tree``: MaxText's stacked tree in one ``jax.jit(lambda p: p,
  out_shardings=dst)``, the program a whole-tree ``device_put`` would be if it were one.

A row's peak is what a chip holds at once over the sync: the trainer's weights (and for
``redist`` and ``device_put`` tunix's per-layer copy of them), the sampler's weights made so
far, and the running program's peak as the compiler gives it. The KV-cache check adds the
sampler's KV cache for a stated serving configuration
(:func:`experiments.frontier_weights.kv_cache_bytes_per_chip`; 256 resident sequences per
sampler replica, vLLM's ``max_num_seqs`` default, of 1,280 tokens, ``train_rl.py:460``'s
``kv_cache_size`` = ``max_target_length`` 1024 + ``kv_cache_buffer`` 256,
``rl.yml:165-166``): MaxText frees the cache around the sync by default
(``free_kv_cache_during_weight_sync: true``, ``rl.yml:177``), and that column says whether the
sync would fit without freeing it. The trainer's optimizer state is not counted. Besides the
bytes redist's plans send against the lower bound, the rows give the bytes the compiled
programs' collectives return per chip (XLA's identity reshard of an expert weight all-reduces
the whole layer on every chip).
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.frontier_weights import kv_cache_bytes_per_chip, parameter_count, parameters

RENAME = {"ep": "fsdp", "tp": "expert"}
"""The serving axes on the training mesh (the same devices in the same order)."""

TOPOLOGIES = {
    "v5p-128": ("tpu", "v5p:4x4x4", 64),
    "v5p-512": ("tpu", "v5p:8x8x4", 256),
    "v5p-1024": ("tpu", "v5p:8x8x8", 512),
    "h100x8": ("gpu", "h100_sxm", 8),
}
"""Per topology name: the compiler, its topology (TPU, as MaxText's ``compile_topology``) or
GPU calibration, and the chips (a v5p-N slice has N TensorCores, N / 2 chips)."""

CHIPS = {name: chips for name, (_, _, chips) in TOPOLOGIES.items()}
"""Chips per topology name."""


def mesh_axes(chips: int, expert: int = 8) -> dict[str, int]:
    """The training mesh: ``fsdp`` x ``expert`` (MaxText's expert parallelism 8)."""
    if chips % expert:
        raise ValueError(f"{chips} chips do not divide into expert parallelism {expert}")
    return {"fsdp": chips // expert, "expert": expert}


def specs(model: str) -> tuple[dict, dict, dict]:
    """``(shapes, train specs, serve specs)`` by path, the serving specs on the training axes."""
    from jax.sharding import PartitionSpec as P

    def spec(axes):
        return P(*[RENAME.get(a, a) if isinstance(a, str) else
                   (tuple(RENAME.get(b, b) for b in a) if a else None) for a in axes])  # fmt: skip

    tree = parameters(model)
    return ({k: leaf.shape for k, leaf in tree.items()},
            {k: spec(leaf.train) for k, leaf in tree.items()},
            {k: spec(leaf.serve) for k, leaf in tree.items()})  # fmt: skip


TUNIX = dict(expert=8, hbm_utilization=0.72, sequences=256, tokens=1280)
"""MaxText RL's settings for the tunix layouts (see the module): the trainer's expert
parallelism, vLLM's share of HBM, and the serving configuration whose KV cache is checked."""


def tunix_mesh_axes(chips: int, expert: int, tp: int) -> tuple[dict, dict, dict]:
    """``(mesh axes, trainer axes, sampler axes)``: one mesh over ``chips`` on which the trainer's
    ``fsdp`` x ``expert`` (``chips / expert`` x ``expert``) and the sampler's data x tensor
    (``chips / tp`` x ``tp``) are both the same devices in the same order, each a run of its
    axes ``outer`` x ``middle`` x ``inner``; the trainer's and the sampler's axes map their
    names (``fsdp``, ``expert``; ``tp``) to those.

    Example:
        >>> tunix_mesh_axes(512, expert=8, tp=16)
        ({'outer': 32, 'middle': 2, 'inner': 8}, {'fsdp': ('outer', 'middle'), 'expert': ('inner',)}, {'tp': ('middle', 'inner')})
    """  # noqa: E501
    small, big = sorted((expert, tp))
    if big % small or chips % big:
        raise ValueError(f"{chips} chips make no mesh of expert {expert} and tensor {tp}")
    axes = {"outer": chips // big, "middle": big // small, "inner": small}
    if expert <= tp:
        return (
            axes,
            {"fsdp": ("outer", "middle"), "expert": ("inner",)},
            {"tp": ("middle", "inner")},
        )
    return axes, {"fsdp": ("outer",), "expert": ("middle", "inner")}, {"tp": ("inner",)}


def _spec(names: dict, axes: tuple):
    """A :class:`experiments.frontier_weights.Leaf`'s axes per dimension as a ``PartitionSpec``
    on the mesh axes ``names`` maps them to."""
    from jax.sharding import PartitionSpec as P

    out = []
    for a in axes:
        mine = () if a is None else (a,) if isinstance(a, str) else a
        out.append(tuple(m for n in mine for m in names[n]) or None)
    return P(*out)


def tunix_specs(model: str, chips: int, tp: int, expert: int = 8) -> tuple[dict, dict, dict, dict]:
    """``(mesh axes, shapes, trainer specs, sampler specs)`` by path: the tunix layouts of
    ``model`` on ``chips`` chips, the sampler at tensor parallelism ``tp``."""
    axes, train_names, serve_names = tunix_mesh_axes(chips, expert, tp)
    tree = parameters(model, layouts="tunix")
    return (axes, {k: leaf.shape for k, leaf in tree.items()},
            {k: _spec(train_names, leaf.train) for k, leaf in tree.items()},
            {k: _spec(serve_names, leaf.serve) for k, leaf in tree.items()})  # fmt: skip


def sampler_bytes_per_chip(model: str, tp: int) -> int:
    """The sampler's weights on one chip in bfloat16, its tunix layout at tensor ``tp``."""
    return sum(2 * leaf.size // (tp if "tp" in leaf.serve else 1)
               for leaf in parameters(model, layouts="tunix").values())  # fmt: skip


def rollout_tp(
    model: str,
    chips: int,
    hbm_bytes: float,
    expert: int = TUNIX["expert"],
    hbm_utilization: float = TUNIX["hbm_utilization"],
    sequences: int = TUNIX["sequences"],
    tokens: int = TUNIX["tokens"],
) -> int:
    """The sampler's tensor parallelism: the smallest power of two (dividing ``chips``, a
    multiple or divisor of ``expert``, and every dimension the sampler splits) at which its
    weights and KV cache per chip fit in ``hbm_utilization`` of ``hbm_bytes``; the largest
    such where none does."""
    tree = parameters(model, layouts="tunix")
    ok = [t for t in (2**i for i in range(chips.bit_length())) if chips % t == 0
          and (t % expert == 0 or expert % t == 0)
          and all(n % t == 0 for leaf in tree.values()
                  for n, a in zip(leaf.shape, leaf.serve) if a == "tp")]  # fmt: skip
    for t in ok:
        weights = sampler_bytes_per_chip(model, t)
        if (
            weights + kv_cache_bytes_per_chip(model, t, sequences, tokens)
            <= hbm_utilization * hbm_bytes
        ):
            return t
    return ok[-1]


def received_lower_bound(shape, itemsize: int, src, dst) -> int:
    """The most bytes any device must receive to move an array of ``shape`` from sharding
    ``src`` to ``dst``: its destination tile less what its source tile already holds of it."""
    have, want = src.devices_indices_map(tuple(shape)), dst.devices_indices_map(tuple(shape))
    most = 0
    for device, region in want.items():
        size = overlap = 1
        for d, (w, h) in enumerate(zip(region, have[device])):
            w0, w1, _ = w.indices(shape[d])
            h0, h1, _ = h.indices(shape[d])
            size *= w1 - w0
            overlap *= max(0, min(w1, h1) - max(w0, h0))
        most = max(most, size - overlap)
    return most * itemsize


def measure(model: str, topology: str, budget_gib: float) -> list[dict]:
    """The rows of one case (see the module)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    import planner

    compiler, target, chips = TOPOLOGIES[topology]
    axes = mesh_axes(chips, expert=min(8, chips))
    if compiler == "gpu":
        mesh, calibration = planner.gpu_mesh(axes, gpu=target), target
    else:
        mesh, calibration = planner.topology_mesh(target, axes), "tpu_v5p"
    shapes, train, serve = specs(model)
    src = {k: NamedSharding(mesh, s) for k, s in train.items()}
    dst = {k: NamedSharding(mesh, s) for k, s in serve.items()}
    dtype = jnp.bfloat16
    structs = {
        k: jax.ShapeDtypeStruct(shape, dtype, sharding=src[k]) for k, shape in shapes.items()
    }
    budget = int(budget_gib * 2**30)
    sent, bound, seconds = _sent(shapes, train, serve, src, dst, dict(mesh.shape), calibration)
    base = {"model": model, "parameters": parameter_count(model), "topology": topology,
            "chips": mesh.size, "budget_bytes": budget, "leaves": len(shapes),
            "train_bytes_per_chip": _per_chip(structs, src),
            "serve_bytes_per_chip": _per_chip(structs, dst)}  # fmt: skip
    rows = []
    # On a few chips the trees alone outgrow one (Qwen3-235B: 59 GB per H100 each): one program
    # per bucket, as the eager budgeted sync runs them; on a pod slice one program in all.
    groups = (bucketed(shapes, train, serve, src, dst, mesh, budget, calibration)
              if compiler == "gpu" else [[(k, shape) for k, shape in shapes.items()]])  # fmt: skip
    for name in ("redist", "xla"):
        start = time.perf_counter()
        reports = [_compiled(name, group, src, dst, budget, dtype) for group in groups]
        report = max(reports, key=lambda r: r.total_bytes)
        row = {**base, "method": name, "compile_s": time.perf_counter() - start,
               "programs": len(groups),
               "argument_bytes": report.argument_bytes, "output_bytes": report.output_bytes,
               "temp_bytes": max(r.temp_bytes for r in reports),
               "total_bytes": report.total_bytes, "fits": all(r.fits for r in reports)}  # fmt: skip
        if name == "redist":
            row |= {"sent_bytes_per_chip": sent, "lower_bound_bytes_per_chip": bound,
                    "predicted_s": seconds}  # fmt: skip
            if len(groups) > 1:
                row["held_over_sync"] = held_over_sync(reports, base["train_bytes_per_chip"])
        logging.warning("%s", row)
        rows.append(row)
    if len(groups) > 1:  # what a JAX user writes today: the whole tree in one jit
        start = time.perf_counter()
        whole = _compiled("xla", [(k, shape) for k, shape in shapes.items()], src, dst, budget,
                          dtype)  # fmt: skip
        row = {**base, "method": "xla_whole_tree", "compile_s": time.perf_counter() - start,
               "programs": 1, "argument_bytes": whole.argument_bytes,
               "output_bytes": whole.output_bytes, "temp_bytes": whole.temp_bytes,
               "total_bytes": whole.total_bytes, "fits": whole.fits}  # fmt: skip
        logging.warning("%s", row)
        rows.append(row)
    return rows


def _sent(shapes, train, serve, src, dst, sizes: dict, calibration: str):
    """``(bytes sent per chip, lower bound, predicted seconds)`` of redist's plans, every leaf
    whole, priced on ``calibration``."""
    import redist
    from redist.calibration import Calibration
    from redist.cost import plan_cost

    cal = Calibration.named(calibration)
    sent = bound = seconds = 0.0
    for k, shape in shapes.items():
        p = redist.plan(shape, train[k], serve[k], sizes, "bfloat16",
                        cost_model=f"calibrated:{calibration}")  # fmt: skip
        t, wire = plan_cost(p, cal)
        seconds, sent = seconds + t, sent + wire
        bound += received_lower_bound(shape, 2, src[k], dst[k])
    return sent, bound, seconds


def measure_tunix(
    model: str,
    topology: str,
    budget_gib: float,
    tp: int = 0,
    sequences: int = TUNIX["sequences"],
    tokens: int = TUNIX["tokens"],
    hbm_utilization: float = TUNIX["hbm_utilization"],
) -> list[dict]:
    """The rows of one case on the tunix layouts (see the module): ``redist`` within the
    budget (one program per bucket), ``device_put`` (one program per layer of each leaf, as
    tunix unstacks them; on one host a copy through host memory, not compiled) and
    ``xla_whole_tree`` (the stacked tree in one program); ``tp`` 0: the sampler's tensor
    parallelism by :func:`rollout_tp`."""
    import math

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    import planner
    from redist.calibration import Calibration

    compiler, target, chips = TOPOLOGIES[topology]
    calibration = target if compiler == "gpu" else "tpu_v5p"
    hbm = int(Calibration.named(calibration).device_memory_bytes(1))
    expert = min(TUNIX["expert"], chips)
    tp = tp or rollout_tp(model, chips, hbm, expert, hbm_utilization, sequences, tokens)
    axes, shapes, train, serve = tunix_specs(model, chips, tp, expert)
    mesh = (planner.gpu_mesh(axes, gpu=target) if compiler == "gpu"
            else planner.topology_mesh(target, axes))  # fmt: skip
    src = {k: NamedSharding(mesh, s) for k, s in train.items()}
    dst = {k: NamedSharding(mesh, s) for k, s in serve.items()}
    dtype = jnp.bfloat16
    structs = {
        k: jax.ShapeDtypeStruct(shape, dtype, sharding=src[k]) for k, shape in shapes.items()
    }
    budget = int(budget_gib * 2**30)
    sent, bound, seconds = _sent(shapes, train, serve, src, dst, dict(mesh.shape), calibration)
    kv = kv_cache_bytes_per_chip(model, tp, sequences, tokens)
    train_bytes = _per_chip(structs, src)
    # tunix unstacks MaxText's scanned weights (one slice per layer, each a new array in the
    # trainer's layout) before it reshards them: a second copy of the stacked leaves
    stacked = sorted(k for k in shapes if k.split("/")[0].endswith("layers"))
    unstacked_bytes = _per_chip({k: structs[k] for k in stacked}, src)

    def tiles(group, shardings):
        return sum(math.prod(shardings[k].shard_shape(piece)) * 2 for k, piece in group)

    base = {"model": model, "parameters": parameter_count(model), "topology": topology,
            "layouts": "tunix", "chips": mesh.size, "mesh": axes, "rollout_tp": tp,
            "budget_bytes": budget, "leaves": len(shapes), "train_bytes_per_chip": train_bytes,
            "unstacked_bytes_per_chip": unstacked_bytes,
            "serve_bytes_per_chip": _per_chip(structs, dst), "kv_bytes_per_chip": kv,
            "kv_sequences": sequences, "kv_tokens": tokens, "hbm_bytes": hbm}  # fmt: skip
    per_layer = [[(k, (1, *shapes[k][1:]) if k in stacked else shapes[k])]
                 for k in sorted(shapes) for _ in range(shapes[k][0] if k in stacked else 1)]  # fmt: skip
    methods = {  # (programs, what a chip holds besides them)
        "redist": (bucketed(shapes, train, serve, src, dst, mesh, budget, calibration),
                   train_bytes + unstacked_bytes),
        "device_put": (per_layer, train_bytes + unstacked_bytes),
        "xla_whole_tree": ([[(k, shapes[k]) for k in sorted(shapes)]], train_bytes),
    }  # fmt: skip
    rows = []
    if compiler == "gpu":  # one host: device_put copies each leaf through host memory
        del methods["device_put"]
        peak = train_bytes + unstacked_bytes + base["serve_bytes_per_chip"]
        rows.append({**base, "method": "device_put", "compile_s": 0.0, "programs": 0,
                     "temp_bytes": 0, "largest_program_bytes": 0, "compiled": True,
                     "collective_bytes_per_chip": 0, "peak_bytes": peak, "fits": peak <= hbm,
                     "fits_beside_kv_cache": peak + kv <= hbm,
                     "host_bytes": max(2 * math.prod(g[0][1]) for g in per_layer)})  # fmt: skip
    for name, (groups, kept) in methods.items():
        start = time.perf_counter()
        reports = [_compiled("redist" if name == "redist" else "xla", group, src, dst, budget,
                             dtype) for group in groups]  # fmt: skip
        held = held_kept(reports, [tiles(g, src) for g in groups],
                         [tiles(g, dst) for g in groups], kept)  # fmt: skip
        peak = max(held)
        compiled = all(r.error is None for r in reports)
        row = {**base, "method": name, "compile_s": time.perf_counter() - start,
               "programs": len(groups),
               # a program over HBM: the temporaries the compiler said it needs
               "temp_bytes": max(r.total_bytes if r.temp_bytes is None else r.temp_bytes
                                 for r in reports),
               "largest_program_bytes": max(r.total_bytes for r in reports),
               "compiled": compiled,
               # what the programs' collectives return per chip, every run summed
               "collective_bytes_per_chip": (sum(c.bytes for r in reports for c in r.collectives)
                                             if compiled else None),
               "peak_bytes": peak, "fits": compiled and peak <= hbm,
               "fits_beside_kv_cache": compiled and peak + kv <= hbm}  # fmt: skip
        if name == "redist":
            row |= {"sent_bytes_per_chip": sent, "lower_bound_bytes_per_chip": bound,
                    "predicted_s": seconds}  # fmt: skip
        if name == "device_put":
            row["refused"] = sorted({g[0][0] for g, r in zip(groups, reports) if r.error})
        if len(groups) > 1 and name == "redist":
            row["held_over_sync"] = held
        logging.warning("%s", {k: v for k, v in row.items() if k != "held_over_sync"})
        rows.append(row)
    order = ("redist", "device_put", "xla_whole_tree")
    return sorted(rows, key=lambda r: order.index(r["method"]))


def held_kept(reports: list, inputs: list[int], outputs: list[int], kept: int) -> list[int]:
    """Bytes per device held while each program runs, the trainer's weights kept (an RL trainer
    goes on with them): ``kept`` (the source tree, and any copy of it alive over the sync), the
    destination tiles already made, and the running program's peak (``total_bytes``, its own
    inputs counted once: ``inputs[i]`` and ``outputs[i]`` are the tiles program ``i`` reads
    and makes)."""
    held, made = [], 0
    for r, inp, out in zip(reports, inputs, outputs):
        held.append(kept - inp + made + r.total_bytes)
        made += out
    return held


def held_over_sync(reports: list, train_bytes: int) -> list[int]:
    """Bytes per device held while each bucket runs, the sources donated bucket by bucket (the
    eager ``redistribute(..., memory_budget=..., donate=True)``): the source tiles not yet moved,
    the destination tiles already made, and the running program's outputs and temporaries."""
    held, moved_in, made = [], 0, 0
    for r in reports:
        held.append(train_bytes - moved_in + made + r.output_bytes + r.temp_bytes)
        moved_in, made = moved_in + r.argument_bytes, made + r.output_bytes
    return held


def bucketed(shapes, train, serve, src, dst, mesh, budget: int, calibration: str) -> list:
    """The sync's programs within ``budget`` as the eager budgeted path runs them: buckets
    (:func:`redist.buckets.buckets`) of ``(leaf, shape)`` pieces, a leaf whose move alone holds
    more cut along a dimension neither layout splits (:func:`redist.buckets.cut`)."""
    import math

    import redist
    from redist.buckets import buckets, cut, in_flight_bytes, index_bytes

    pieces, sizes = [], []
    for k, shape in shapes.items():
        p = redist.plan(shape, train[k], serve[k], dict(mesh.shape), "bfloat16",
                        cost_model=f"calibrated:{calibration}")  # fmt: skip
        size = in_flight_bytes(p, math.prod(dst[k].shard_shape(shape)) * 2)
        dim, ranges = (cut(tuple(train[k]), tuple(serve[k]), shape, size, budget)
                       if size > budget else None) or (None, None)  # fmt: skip
        for a, b in ranges or [(0, shape[0])]:
            piece = shape if ranges is None else (*shape[:dim], b - a, *shape[dim + 1 :])
            pieces.append((k, tuple(piece)))
            sizes.append(size if ranges is None else (b - a) * index_bytes(size, shape[dim]))
    return [[pieces[i] for i in g] for g in buckets(sizes, budget, [k for k, _ in pieces])]


_REPORTS: dict = {}


def _compiled(method: str, group: list, src: dict, dst: dict, budget: int, dtype):
    """The compiled report of one bucket's program (``group``: ``(leaf, shape)`` pieces), cached
    by its pieces (a stacked weight's equal slices compile once)."""
    import jax

    import redist
    from planner.target.compiled import compiled_report

    key = (method, tuple(group), tuple(src[k] for k, _ in group), tuple(dst[k] for k, _ in group))
    if key not in _REPORTS:
        names = [f"{k}#{i}" for i, (k, _) in enumerate(group)]
        s = {n: src[k] for n, (k, _) in zip(names, group)}
        d = {n: dst[k] for n, (k, _) in zip(names, group)}
        structs = {n: jax.ShapeDtypeStruct(shape, dtype, sharding=s[n])
                   for n, (_, shape) in zip(names, group)}  # fmt: skip
        fn = (jax.jit(lambda p: redist.redistribute(p, s, d, memory_budget=budget))
              if method == "redist" else jax.jit(lambda p: p, out_shardings=d))  # fmt: skip
        _REPORTS[key] = compiled_report(fn, structs)
    return _REPORTS[key]


def _per_chip(structs: dict, shardings: dict) -> int:
    import math

    return sum(math.prod(shardings[k].shard_shape(s.shape)) * s.dtype.itemsize
               for k, s in structs.items())  # fmt: skip


def report(rows: list[dict]) -> str:
    gb = 1e9
    lines = [
        "| model | topology | method | programs | budget GB | temporaries GB / chip "
        "| in + out GB / chip (largest program) | fits | sent GB / chip (lower bound) "
        "| predicted s | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        trees = (r["argument_bytes"] + r["output_bytes"]) / gb
        sent = (f"{r['sent_bytes_per_chip'] / gb:.2f} ({r['lower_bound_bytes_per_chip'] / gb:.2f})"
                if "sent_bytes_per_chip" in r else "-")  # fmt: skip
        pred = f"{r['predicted_s']:.2f}" if "predicted_s" in r else "-"
        lines.append(f"| {r['model']} | {r['topology']} | {r['method']} | {r.get('programs', 1)} | "
                     f"{r['budget_bytes'] / gb:.1f} | {r['temp_bytes'] / gb:.2f} | {trees:.2f} | "
                     f"{r['fits']} | {sent} | {pred} | {r['compile_s']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def report_tunix(rows: list[dict]) -> str:
    """The report of the tunix layouts' rows."""
    gb = 1e9
    r0 = rows[0]
    lines = [
        "Tunix's layouts: MaxText RL's trainer (fsdp x expert 8) and its vLLM sampler (data x "
        "tensor `tp`, every expert on each chip of a tensor group) on the same chips, "
        "bfloat16. Peak: what a chip holds at once over the sync: the trainer's weights (kept), "
        "tunix's per-layer copy of them (`redist`, `device_put`: tunix unstacks MaxText's "
        "scanned weights before it reshards), the sampler's weights made so far and the running "
        "program's own peak. KV cache: the sampler's, "
        f"{r0['kv_sequences']} sequences of {r0['kv_tokens']} tokens per sampler replica (MaxText "
        "frees it around the sync by default); `fits beside KV` adds it to the peak. `redist`: "
        "the eager budgeted path (`redist.integrations.tunix` with a `memory_budget`), one "
        "program per bucket. `device_put`: what `jax.device_put` of tunix's per-layer tree runs "
        "on a pod, one program per array. `xla_whole_tree`: MaxText's stacked tree in one `jit`. "
        "Collectives: the bytes the compiled programs' collectives return per chip, every run "
        "summed (XLA's identity reshards of the experts all-reduce whole layers). A program the "
        "compiler refuses (out of HBM) counts the temporaries it said it needs.",
        "",
        "| model | topology | tp | method | programs | trainer + sampler GB / chip "
        "| temporaries GB / chip (largest) | peak GB / chip | KV cache GB / chip | HBM GB | fits "
        "| fits beside KV | sent GB / chip (lower bound) | collectives GB / chip | predicted s "
        "| compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    host = [r for r in rows if "host_bytes" in r]
    for r in rows:
        trees = f"{r['train_bytes_per_chip'] / gb:.2f} + {r['serve_bytes_per_chip'] / gb:.2f}"
        sent = (f"{r['sent_bytes_per_chip'] / gb:.2f} ({r['lower_bound_bytes_per_chip'] / gb:.2f})"
                if "sent_bytes_per_chip" in r else "-")  # fmt: skip
        coll = r.get("collective_bytes_per_chip")
        coll = "-" if coll is None or r.get("programs") == 0 else f"{coll / gb:.1f}"
        pred = f"{r['predicted_s']:.2f}" if "predicted_s" in r else "-"
        lines.append(f"| {r['model']} | {r['topology']} | {r['rollout_tp']} | {r['method']} | "
                     f"{r['programs']} | {trees} | {r['temp_bytes'] / gb:.2f} | "
                     f"{r['peak_bytes'] / gb:.2f} | {r['kv_bytes_per_chip'] / gb:.2f} | "
                     f"{r['hbm_bytes'] / gb:.1f} | "
                     f"{r['fits'] if r['compiled'] else 'False (refused)'} | "
                     f"{r['fits_beside_kv_cache']} | {sent} | {coll} | {pred} | "
                     f"{r['compile_s']:.0f} |")  # fmt: skip
    refused = [r for r in rows if r.get("refused")]
    if refused:
        lines += ["", "Refused per-layer programs: " + "; ".join(
            f"{r['model']} on {r['topology']}: {', '.join(r['refused'])}" for r in refused) + "."]  # fmt: skip
    if host:
        lines += ["", "On one host every array is addressable and `device_put` copies each array "
                  "whose tiles differ through host memory (no program): its peak is the trees, "
                  "and the host holds the largest array whole ("
                  + ", ".join(f"{r['model']} {r['host_bytes'] / gb:.1f} GB" for r in host)
                  + ")."]  # fmt: skip
    return "\n".join(lines) + "\n"


def run(config, workdir: str) -> list[dict]:
    os.makedirs(workdir, exist_ok=True)
    rows = []
    layouts = config.get("layouts", "vllm")
    for case in config.cases.split(","):
        model, _, topology = case.strip().partition("@")
        if layouts == "tunix":
            rows += measure_tunix(model, topology, config.budget_gib, config.rollout_tp,
                                  config.kv_sequences, config.kv_tokens, config.hbm_utilization)  # fmt: skip
        elif layouts == "vllm":
            rows += measure(model, topology, config.budget_gib)
        else:
            raise ValueError(f"layouts must be 'vllm' or 'tunix', got {layouts!r}")
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)
    with open(os.path.join(workdir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(report_tunix(rows) if layouts == "tunix" else report(rows))
    if layouts == "vllm" and any("held_over_sync" in r for r in rows):
        figure(rows, os.path.join(workdir, "memory_over_sync.png"))
    return rows


def figure(rows: list[dict], path: str) -> None:
    """Per-device memory over the sync: the budgeted, donating redist bucket by bucket against
    XLA's whole-tree program, with the chip's memory."""
    from experiments.measure import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    cases = [r for r in rows if "held_over_sync" in r]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.2), squeeze=False)
    gb = 1e9
    for ax, r in zip(axes[0], cases):
        held = r["held_over_sync"]
        xs = [i / len(held) for i in range(len(held) + 1)]
        ax.step(xs, [h / gb for h in held] + [held[-1] / gb], where="post", color="#4477aa",
                label=f"redist, {r['budget_bytes'] / 2**30:.0f} GiB budget, donating")  # fmt: skip
        whole = [w for w in rows if w["model"] == r["model"] and w["topology"] == r["topology"]
                 and w["method"] == "xla_whole_tree"]  # fmt: skip
        if whole:
            ax.axhline(whole[0]["total_bytes"] / gb, color="#cc6677",
                       label="XLA, the whole tree in one jit")  # fmt: skip
        ax.axhline(80, color="gray", linestyle="--", linewidth=1, label="H100 memory (80 GB)")
        ax.set_title(f"{r['model']} on {r['topology']}", fontsize=9)
        ax.set_xlabel("fraction of the buckets run")
        ax.set_ylabel("GB per device")
        ax.legend(fontsize=6)
    save_figure(fig, path)


def main(argv):
    del argv
    run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", "configs/weight_sync/frontier.py", "Config file.")
    flags.DEFINE_string("workdir", "workdir/frontier_sync", "Where outputs go.")
    app.run(main)
