"""Weight sync: moving a model's parameters from the training layout to the serving layout.

Usage:
    python -m experiments.weight_sync --workdir=workdir/weight_sync
    python -m experiments.weight_sync --config.layers=2

``--config.model``: ``llama`` (below) or a frontier model's tree shrunk to this host
(``qwen3_235b``, ``deepseek_v3``: :data:`experiments.frontier_weights.SHRUNK`, MaxText's
``fsdp x expert`` to vLLM's ``ep x tp``; ``configs/weight_sync/frontier_small.py``). With
``--config.memory_budget_kib``, a fourth method, ``redist_budget``, moves the tree eagerly within
that budget in flight per device (``redistribute(..., memory_budget=...)``).

The parameters of a Llama-like model (token embedding, per layer: attention q/k/v/o, SwiGLU
gate/up/down, two RMSNorm scales; final norm, output head) live FSDP-sharded on a training mesh
(``fsdp:8``: every matrix split by rows). Serving wants Megatron tensor parallelism on another mesh
over the same 8 devices (``dp:2, tp:4``): q/k/v, gate and up split by columns over ``tp``, o and
down by rows, embedding and head by vocabulary, norms replicated. This is the weight-sync step of RL
post-training. Three ways to do it, on the same arrays, timed interleaved:

- ``redist``: ``redist.redistribute(params, serving_shardings)`` inside one ``jax.jit``;
- ``xla``: ``jax.jit(lambda p: p, out_shardings=serving_shardings)``;
- ``device_put``: ``jax.device_put(params, serving_shardings)``.

Each result is compared with the parameters element for element. Compiled temporary memory and
the collectives come from the compiled programs (``device_put`` has none to inspect). Writes
``results.json``, ``report.md`` and ``weight_sync.png`` under ``--workdir``.
"""

from __future__ import annotations

import json
import os

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.measure import force_host_devices, parse_mesh


def parameters(config, rng) -> dict:
    """A Llama-like parameter pytree (numpy), layer by layer."""
    import numpy as np

    d, f, v = config.d_model, config.ffn, config.vocab

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(config.dtype)

    layers = [
        {"attn": {"q": w(d, d), "k": w(d, d), "v": w(d, d), "o": w(d, d)},
         "mlp": {"gate": w(d, f), "up": w(d, f), "down": w(f, d)},
         "attn_norm": np.ones(d, config.dtype), "mlp_norm": np.ones(d, config.dtype)}
        for _ in range(config.layers)
    ]  # fmt: skip
    return {"embed": w(v, d), "layers": layers, "norm": np.ones(d, config.dtype), "head": w(d, v)}


def frontier_parameters(config, rng) -> tuple[dict, dict, dict]:
    """``config.model``'s shrunk tree (:data:`experiments.frontier_weights.SHRUNK`, numpy) and
    its training (``fsdp`` x ``expert``) and serving (``ep`` x ``tp``) specs per leaf."""
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from experiments.frontier_weights import parameters as frontier

    tree = frontier(config.model, shrunk=True)
    params = {k: (rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[-1])).astype(config.dtype)
              for k, leaf in tree.items()}  # fmt: skip
    return (params, {k: P(*leaf.train) for k, leaf in tree.items()},
            {k: P(*leaf.serve) for k, leaf in tree.items()})  # fmt: skip


def layouts(params) -> tuple[dict, dict]:
    """Training (FSDP: rows over ``fsdp``) and serving (Megatron over ``tp``) specs per leaf."""
    import jax
    from jax.sharding import PartitionSpec as P

    serve_layer = {"attn": {"q": P(None, "tp"), "k": P(None, "tp"), "v": P(None, "tp"),
                            "o": P("tp", None)},
                   "mlp": {"gate": P(None, "tp"), "up": P(None, "tp"), "down": P("tp", None)},
                   "attn_norm": P(), "mlp_norm": P()}  # fmt: skip
    serve = {"embed": P("tp", None), "layers": [serve_layer] * len(params["layers"]),
             "norm": P(), "head": P(None, "tp")}  # fmt: skip
    train = jax.tree.map(lambda a: P("fsdp") if a.ndim == 2 else P(), params)
    return train, serve


def tunix_states(config):
    """tunix's own Qwen3 (:mod:`experiments.libraries.tunix_grpo`, ``config``'s sizes;
    ``config.experts`` > 0: its mixture of experts) placed as tunix places a model on a mesh
    (its parameters' partition specs over ``fsdp`` and ``tp``): its ``nnx.Param`` state on the
    trainer mesh and on the sampler mesh (``config.disjoint``: the trainer on the first 4
    devices, the sampler on the other 4), as tunix's ``sync_weights`` hands them to
    ``reshard_pytree``."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    from experiments.libraries import tunix_grpo

    devices = np.array(jax.devices()[:8])
    halves = (devices[:4], devices[4:]) if config.disjoint else (devices, devices)
    model = _tunix_model(config)
    states = []
    for seed, (key, devs) in enumerate(zip(("train_mesh", "serve_mesh"), halves)):
        axes = parse_mesh(getattr(config, key))
        mesh = Mesh(devs.reshape(tuple(axes.values())), tuple(axes))
        states.append(nnx.state(tunix_grpo.placed(model, mesh, seed), nnx.Param))
    return states[0], states[1]


def _tunix_model(config):
    from experiments.libraries import tunix_grpo

    return tunix_grpo.qwen3_config(config.layers, config.vocab, config.d_model, config.ffn,
                                   config.heads, config.experts)  # fmt: skip


def tunix_loop(config) -> dict:
    """tunix's GRPO loop on the same model (:func:`experiments.libraries.tunix_grpo.train`),
    ``config.loop_steps`` updates each followed by a sync, run with tunix's sync and with
    redist's, ``config.loop_rounds`` times each, alternately: every sync's seconds (the first of
    a run compiles and is left out) and whether the sampler's weights and log-probabilities
    agree."""
    import jax
    import numpy as np

    from experiments.libraries import tunix_grpo

    kind = "disjoint" if config.disjoint else "colocated"
    runs: dict = {"tunix": [], "redist": []}
    for _ in range(config.loop_rounds):
        for sync in runs:
            runs[sync].append(tunix_grpo.train(_tunix_model(config), kind, config.loop_steps, sync))
    out: dict = {"steps": config.loop_steps, "rounds": config.loop_rounds, "meshes": kind}
    for sync, rs in runs.items():
        warm = [t for r in rs for t in r.sync_s[1:]]
        out[sync] = {"sync_s_median": float(np.median(warm)), "syncs": len(warm)}
    a, b = runs["redist"][0], runs["tunix"][0]
    out["same_sampler_weights"] = all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a.sampler_weights), jax.tree.leaves(b.sampler_weights))
    )
    out["same_logps"] = bool(np.array_equal(a.logps, b.logps))
    return out


def run_tunix(config, workdir: str) -> dict:
    """The sync of tunix's ``sync_weights`` (trainer to sampler, tunix's own Qwen3 states) by
    tunix's ``reshard_pytree`` and by redist's drop-in (``redist.integrations.tunix``), and, on
    one device set, by XLA's reshard of the tree in one ``jit``; timed interleaved."""
    import jax
    import numpy as np

    import redist
    from redist.integrations import tunix as redist_tunix

    source, target = tunix_states(config)
    src = jax.tree.map(lambda a: a.sharding, source)
    dst = jax.tree.map(lambda a: a.sharding, target)
    values = [np.asarray(a) for a in jax.tree.leaves(source)]
    tunix_own = redist_tunix.tunix_reshard_pytree()

    def tunix_path():  # on CPU its device_put copies through the host: allowed here
        with jax.transfer_guard("allow"):
            return tunix_own(source, target)

    thunks = {"tunix": tunix_path, "redist": lambda: redist_tunix.reshard_pytree(source, target)}
    result: dict = {"config": config.to_dict(), "methods": {}, "baseline": "tunix"}
    if config.memory_budget_kib:
        budget = int(config.memory_budget_kib * 1024)
        result["budget_bytes"] = budget
        thunks["redist_budget"] = lambda: redist_tunix.reshard_pytree(
            source, target, memory_budget=budget
        )
    if not config.disjoint:  # one device set: XLA's reshard, and both compiled programs' memory
        xla = jax.jit(lambda p: p, out_shardings=dst)
        thunks["xla"] = lambda: xla(source)
        programs = {"redist": jax.jit(lambda p: redist.redistribute(p, src, dst)), "xla": xla}
        for name, fn in programs.items():  # redist's is the program the drop-in runs
            result["methods"][name] = compiled_row(fn, source)
    result["param_bytes"] = sum(v.nbytes for v in values)
    result["train_bytes_per_device"] = per_device(values, jax.tree.leaves(src))
    result["serve_bytes_per_device"] = per_device(values, jax.tree.leaves(dst))
    # redist's as tunix's sync_weights runs it on CPU: no transfer between host and devices
    checked_and_timed(result, thunks, values, jax.tree.leaves(dst), config, "tunix",
                      guarded=[n for n in thunks if n != "tunix"])  # fmt: skip
    if config.loop_steps:
        result["loop"] = tunix_loop(config)
    return result


def compiled_row(fn, *args) -> dict:
    """What the compiled program of ``fn`` on ``args`` holds and sends, per device."""
    from experiments.measure import compile_stats

    compiled, stats = compile_stats(fn, *args)
    return {"temp_bytes": stats.temp_bytes, "collectives": stats.collective_kinds,
            "collective_bytes": stats.collective_bytes, "full_remat": stats.full_remat,
            "held_bytes": held_bytes(compiled)}  # fmt: skip


def held_bytes(compiled) -> int:
    """What a device holds during the call: arguments, results and temporaries, less the
    result buffers that reuse donated arguments."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)  # fmt: skip


def per_device(params, shardings) -> int:
    """Bytes of one device's tiles of every leaf."""
    import math

    import jax

    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))  # fmt: skip


def run(config, workdir: str) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    import redist
    from experiments.measure import compile_stats

    if config.model == "tunix_qwen3":
        return _written(run_tunix(config, workdir), workdir, config.figures)
    devices = np.array(jax.devices()[:8])
    meshes = {}
    for key in ("train_mesh", "serve_mesh"):
        axes = parse_mesh(getattr(config, key))
        meshes[key] = Mesh(devices.reshape(tuple(axes.values())), tuple(axes))
    if config.model == "llama":
        params = parameters(config, np.random.default_rng(0))
        train, serve = layouts(params)
    else:
        params, train, serve = frontier_parameters(config, np.random.default_rng(0))
    is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)  # noqa: E731
    src = jax.tree.map(lambda s: NamedSharding(meshes["train_mesh"], s), train, is_leaf=is_spec)
    dst = jax.tree.map(lambda s: NamedSharding(meshes["serve_mesh"], s), serve, is_leaf=is_spec)
    x = jax.device_put(params, src)
    programs = {
        "redist": jax.jit(lambda p: redist.redistribute(p, src, dst)),
        "xla": jax.jit(lambda p: p, out_shardings=dst),
    }
    result: dict = {"config": config.to_dict(), "methods": {}}
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    result["param_bytes"] = total
    for name, fn in programs.items():
        result["methods"][name] = compiled_row(fn, x)
    donated = jax.jit(lambda p: redist.redistribute(p, src, dst), donate_argnums=0)
    compiled, _ = compile_stats(donated, x)
    result["methods"]["redist"]["held_bytes_donated"] = held_bytes(compiled)
    result["train_bytes_per_device"] = per_device(params, src)
    result["serve_bytes_per_device"] = per_device(params, dst)
    thunks = {"redist": lambda: programs["redist"](x), "xla": lambda: programs["xla"](x),
              "device_put": lambda: jax.device_put(x, dst)}  # fmt: skip
    if config.memory_budget_kib:  # eager, bucket by bucket (slices of a leaf over the budget)
        budget = int(config.memory_budget_kib * 1024)
        result["budget_bytes"] = budget
        thunks["redist_budget"] = lambda: redist.redistribute(x, src, dst, memory_budget=budget)
    checked_and_timed(result, thunks, jax.tree.leaves(params), jax.tree.leaves(dst), config, "xla")
    return _written(result, workdir, config.figures)


def checked_and_timed(result: dict, thunks: dict, values: list, dsts: list, config,
                      baseline: str, guarded: tuple | list = ()) -> None:  # fmt: skip
    """Each thunk's result checked leaf by leaf against ``values`` (exact) and ``dsts``
    (placed), those named in ``guarded`` run with transfers between host and devices
    forbidden; then all timed interleaved, with speed-ups against ``baseline``'s time, into
    ``result["methods"]``."""
    import jax
    import numpy as np

    from experiments.measure import interleaved_times

    for name, thunk in thunks.items():
        if name in guarded:
            with jax.transfer_guard_host_to_device("disallow_explicit"), \
                    jax.transfer_guard_device_to_host("disallow_explicit"):  # fmt: skip
                out = thunk()
        else:
            out = thunk()
        leaves = jax.tree.leaves(out)
        same = all(np.array_equal(np.asarray(a), b) for a, b in zip(leaves, values))
        placed = all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(leaves, dsts))
        result["methods"].setdefault(name, {}).update(exact=same, placed=placed)
    times = interleaved_times(list(thunks.values()), config.repeats, config.warmup,
                              config.min_time_s)  # fmt: skip
    for name, t in zip(thunks, times):
        result["methods"][name]["time_s"] = t["median"]
    base = result["methods"][baseline]["time_s"]
    for m in result["methods"].values():
        m[f"speedup_vs_{baseline}"] = base / m["time_s"]


def _written(result: dict, workdir: str, figures: bool) -> dict:
    """``result`` written under ``workdir``: results.json, report.md, weight_sync.png."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(markdown(result))
    if figures:
        figure(result, os.path.join(workdir, "weight_sync.png"))
    return result


def markdown(result: dict) -> str:
    from experiments.measure import collectives_cell

    c = result["config"]
    mib = 2**20
    sizes = f"{c['layers']} layers, d_model {c['d_model']}, ffn {c['ffn']}, vocab {c['vocab']}"
    model = {"llama": sizes,
             "tunix_qwen3": f"tunix's own Qwen3 (tunix.models.qwen3), {sizes}"
                            + (f", {c['experts']} experts" if c.get("experts") else "")
             }.get(c["model"], f"{c['model']} shrunk (experiments.frontier_weights)")  # fmt: skip
    base = result.get("baseline", "xla")
    where = ("the first 4 devices to the other 4" if c.get("disjoint")
             else "the same 8 devices")  # fmt: skip
    tunix = (" `tunix` is tunix's own `reshard_pytree` (outside Pathways one `jax.device_put` of "
             "the tree; on CPU a copy through the host), `redist` the drop-in "
             "`redist.integrations.tunix.reshard_pytree`, run with tunix's CPU transfer guards."
             if base == "tunix" else "")  # fmt: skip
    budget = (f" `redist_budget` moves the tree eagerly within {result['budget_bytes'] / mib:.2f} "
              "MiB in flight per device." if "budget_bytes" in result else "")  # fmt: skip
    lines = [
        "# Weight sync: FSDP training layout to tensor-parallel serving layout",
        "",
        f"{model}, "
        f"{c['dtype']}: {result['param_bytes'] / mib:.1f} MiB of parameters; per device "
        f"{result['train_bytes_per_device'] / mib:.2f} MiB when training, "
        f"{result['serve_bytes_per_device'] / mib:.2f} MiB when serving. "
        f"Mesh `{c['train_mesh']}` to mesh `{c['serve_mesh']}` over {where}.{budget}{tunix}",
        "",
        "Temporary memory is the compiled program's scratch per device; held is what a device "
        "holds during the call (parameters in and out plus scratch, less donated buffers reused).",
        "",
        f"| method | exact | placed | time ms | vs {base} | temp MiB | held MiB | collectives |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in result["methods"].items():
        temp = f"{m['temp_bytes'] / mib:.2f}" if "temp_bytes" in m else "-"
        held = f"{m['held_bytes'] / mib:.2f}" if "held_bytes" in m else "-"
        if "held_bytes_donated" in m:
            held += f" ({m['held_bytes_donated'] / mib:.2f} donated)"
        colls = collectives_cell(m.get("collectives", {}), m.get("full_remat", False))
        lines.append(f"| {name} | {m['exact']} | {m['placed']} | {m['time_s'] * 1e3:.2f} | "
                     f"{m['speedup_vs_' + base]:.2f}x | {temp} | {held} | {colls} |")  # fmt: skip
    if "loop" in result:
        lp = result["loop"]
        t, r = lp["tunix"], lp["redist"]
        lines += ["", f"In tunix's own GRPO loop (`experiments.libraries.tunix_grpo`, the same "
                  f"model, {lp['steps']} updates per run, {lp.get('rounds', 2)} runs each way, "
                  "alternately), each sync timed to its result: tunix "
                  f"{t['sync_s_median'] * 1e3:.2f} ms, redist "
                  f"{r['sync_s_median'] * 1e3:.2f} ms (medians of {t['syncs']} / {r['syncs']} "
                  "syncs, each run's first, which compiles, left out); the sampler's weights "
                  f"{'equal' if lp['same_sampler_weights'] else 'DIFFER'} and its "
                  f"log-probabilities {'equal' if lp['same_logps'] else 'DIFFER'} after the "
                  "loop."]  # fmt: skip
    return "\n".join(lines) + "\n"


def figure(result: dict, path: str) -> None:
    from experiments.measure import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    names = list(result["methods"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    a.bar(names, [result["methods"][n]["time_s"] * 1e3 for n in names], color="#4477aa")
    a.set_ylabel("time (ms)")
    a.set_title("weight sync time")
    mem = [n for n in names if "temp_bytes" in result["methods"][n]]
    b.bar(mem, [result["methods"][n]["temp_bytes"] / 2**20 for n in mem], color="#cc6677")
    b.axhline(result["serve_bytes_per_device"] / 2**20, color="gray", linestyle="--",
              linewidth=1, label="serving parameters per device")  # fmt: skip
    if "budget_bytes" in result:
        b.axhline(result["budget_bytes"] / 2**20, color="#228833", linestyle=":", linewidth=1,
                  label="redist_budget: in flight at most")  # fmt: skip
    b.set_ylabel("compiled temporary memory (MiB)")
    b.set_title("memory")
    b.legend(fontsize=7)
    save_figure(fig, path)


def main(argv):
    del argv
    force_host_devices(8)
    logging.set_verbosity(logging.WARNING)  # no INFO lines about absent TPU backends
    result = run(flags.FLAGS.config, flags.FLAGS.workdir)
    print(markdown(result))
    print(f"outputs in {flags.FLAGS.workdir}")


if __name__ == "__main__":
    config_flags.DEFINE_config_file("config", "configs/weight_sync/default.py", "Config file.")
    flags.DEFINE_string("workdir", "workdir/weight_sync", "Where outputs go.")
    app.run(main)
