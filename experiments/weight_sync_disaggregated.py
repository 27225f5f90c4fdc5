"""Disaggregated weight sync: a frontier model's tree (shrunk) from a trainer's devices to a
server's, across two processes of JAX's multi-controller runtime (four CPU devices each).

Usage:
    python -m experiments.weight_sync_disaggregated --workdir=workdir/weight_sync_disaggregated
    python -m experiments.weight_sync_disaggregated --config.model=deepseek_v3

The launcher starts two processes of this module (``--process_id=0`` and ``1``). Process 0 is the
trainer: the tree lives on its four devices in MaxText's ``fsdp x expert`` layout. Process 1 is the
inference server: the tree must arrive on its four devices in vLLM's ``ep x tp`` layout. JAX's
``jax.device_put`` refuses this move (its cross-host transfers only hand over tiles of the same
layout). Three ways that work, timed interleaved on the receiving process (both processes meet
at a barrier before each call, and the clock stops when the server holds the tree):

- ``redist``: ``redist.redistribute(tree, server_shardings)`` (eager): each leaf moved to the
  serving layout on the trainer's devices by redist's collectives, then handed over tile for tile
  by JAX's cross-host transfer (:attr:`redist.linear.Reshard.staged`);
- ``redist_budget``: the same within ``--config.memory_budget_kib`` in flight per device;
- ``xla``: what JAX offers: ``jax.jit(lambda p: p, out_shardings=...)`` to the serving layout on
  the trainer's devices, then ``jax.device_put`` of the tree to the server.

Each server tile is compared with the parameters element for element. The trainer reports the
compiled temporaries of the two on-trainer programs. Every server device receives its tile once,
the least a device holding nothing of the tree can receive. Writes ``results.json`` and
``report.md`` under ``--workdir``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.measure import (
    collectives_cell,
    force_host_devices,
    free_port,
    parse_mesh,
    run_processes,
)


def launch(config_path: str, overrides: list[str], workdir: str, timeout_s: float) -> dict:
    """Run the two processes and merge what they write under ``workdir``."""
    os.makedirs(workdir, exist_ok=True)
    port, transfers = free_port(), [free_port(), free_port()]
    done = run_processes([[sys.executable, "-m", "experiments.weight_sync_disaggregated",
                           f"--config={config_path}", *overrides, f"--workdir={workdir}",
                           f"--process_id={pid}", f"--port={port}",
                           f"--transfer_port={transfers[pid]}"] for pid in (0, 1)],
                         timeout_s)  # fmt: skip
    errors = [err for _, _, err in done]
    failed = [pid for pid, (code, _, _) in enumerate(done) if code]
    if failed:  # the first to fail explains; the other dies waiting for it
        first = min(failed, key=lambda pid: "Traceback" not in errors[pid])
        raise RuntimeError(f"process {first} failed:\n{errors[first][-6000:]}")
    parts = []
    for pid in (0, 1):
        path = os.path.join(workdir, f"process_{pid}.json")
        with open(path) as f:
            parts.append(json.load(f))
        os.remove(path)
    result = parts[1]
    for name, m in parts[0]["methods"].items():
        result["methods"].setdefault(name, {}).update(m)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(workdir, "report.md"), "w") as f:
        f.write(markdown(result))
    return result


def worker(config, workdir: str, pid: int, port: int, transfer_port: int) -> None:
    """One process: build the tree, move it three ways, write ``process_<pid>.json``."""
    force_host_devices(4)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{transfer_port}")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    import redist
    from experiments.measure import compile_stats
    from experiments.weight_sync import frontier_parameters, per_device

    own = [np.array([d for d in jax.devices() if d.process_index == i]) for i in (0, 1)]
    meshes = []
    for devices, key in zip(own, ("train_mesh", "serve_mesh")):
        axes = parse_mesh(getattr(config, key))
        meshes.append(Mesh(devices.reshape(tuple(axes.values())), tuple(axes)))
    stage = Mesh(own[0].reshape(meshes[1].devices.shape), meshes[1].axis_names)
    params, train, serve = frontier_parameters(config, np.random.default_rng(0))
    src = {k: NamedSharding(meshes[0], s) for k, s in train.items()}
    dst = {k: NamedSharding(meshes[1], s) for k, s in serve.items()}
    staged = {k: NamedSharding(stage, s) for k, s in serve.items()}
    x = {k: jax.make_array_from_callback(v.shape, src[k], lambda i, v=v: v[i], dtype=v.dtype)
         for k, v in params.items()}  # fmt: skip
    budget = int(config.memory_budget_kib * 1024)
    xla_stage = jax.jit(lambda p: p, out_shardings=staged)
    # the server names the trainer's staged tree without running the trainer's program
    shells = {k: jax.make_array_from_single_device_arrays(v.shape, staged[k], [], dtype=v.dtype)
              for k, v in params.items()} if pid else None  # fmt: skip
    thunks = {
        "redist": lambda: redist.redistribute(x, dst),
        "redist_budget": lambda: redist.redistribute(x, dst, memory_budget=budget),
        "xla": lambda: jax.device_put(xla_stage(x) if pid == 0 else shells, dst),
    }
    result: dict = {"config": config.to_dict(), "methods": {name: {} for name in thunks}}
    try:
        jax.device_put(x, dst)
        result["device_put"] = "moved"
    except (ValueError, NotImplementedError) as e:  # JAX refuses a layout change across hosts
        result["device_put"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if pid == 0:  # the programs on the trainer's devices
        redist_stage = jax.jit(lambda p: redist.redistribute(p, src, staged))
        for name, fn in (("redist", redist_stage), ("xla", xla_stage)):
            _, stats = compile_stats(fn, x)
            result["methods"][name] |= {"trainer_temp_bytes": stats.temp_bytes,
                                        "trainer_collectives": stats.collective_kinds,
                                        "full_remat": stats.full_remat}  # fmt: skip
    else:
        result |= {"param_bytes": sum(v.nbytes for v in params.values()), "leaves": len(params),
                   "budget_bytes": budget, "train_bytes_per_device": per_device(params, src),
                   "serve_bytes_per_device": per_device(params, dst)}  # fmt: skip
    for name, thunk in thunks.items():
        out = jax.block_until_ready(thunk())
        same = all(np.array_equal(np.asarray(s.data), params[k][s.index])
                   for k, y in out.items() for s in y.addressable_shards)  # fmt: skip
        placed = all(y.sharding == dst[k] for k, y in out.items())
        result["methods"][name] |= {"exact": same, "placed": placed}
    times: list[list[float]] = [[] for _ in thunks]
    fns = list(thunks.values())
    for r in range(config.warmup + config.repeats):
        for k in range(len(fns)) if r % 2 else reversed(range(len(fns))):
            _barrier(f"sync {r} {k}")
            start = time.perf_counter()
            jax.block_until_ready(fns[k]())
            if r >= config.warmup:
                times[k].append(time.perf_counter() - start)
    for name, ts in zip(thunks, times):
        result["methods"][name]["time_s"] = float(np.median(ts))
    _barrier("done")
    with open(os.path.join(workdir, f"process_{pid}.json"), "w") as f:
        json.dump(result, f, indent=2)
    jax.distributed.shutdown()


def _barrier(name: str, timeout_s: float = 300) -> None:
    """Wait until both processes get here, on the coordination service (no device program:
    a collective over both processes' devices hung on CPU after XLA's staged move, JAX 0.10.2)."""
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


def markdown(result: dict) -> str:
    c = result["config"]
    mib = 2**20
    base = result["methods"]["xla"]["time_s"]
    lines = [
        "# Disaggregated weight sync: trainer and server in two processes",
        "",
        f"{c['model']} shrunk (experiments.frontier_weights), {c['dtype']}: "
        f"{result['param_bytes'] / mib:.1f} MiB in {result['leaves']} leaves; per device "
        f"{result['train_bytes_per_device'] / mib:.2f} MiB on the trainer (process 0, mesh "
        f"`{c['train_mesh']}`), {result['serve_bytes_per_device'] / mib:.2f} MiB on the server "
        f"(process 1, mesh `{c['serve_mesh']}`). `redist_budget`: "
        f"{result['budget_bytes'] / mib:.2f} MiB in flight per device.",
        "",
        f"`jax.device_put(tree, server_shardings)`: {result['device_put']}.",
        "",
        "Time: on the server, from a barrier until it holds the tree (median). Trainer temp: the "
        "compiled scratch per device of the move to the serving layout on the trainer's devices.",
        "",
        "| method | exact | placed | time ms | vs XLA | trainer temp MiB | trainer collectives |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in result["methods"].items():
        temp = f"{m['trainer_temp_bytes'] / mib:.2f}" if "trainer_temp_bytes" in m else "-"
        colls = collectives_cell(m.get("trainer_collectives", {}), m.get("full_remat", False))
        lines.append(f"| {name} | {m['exact']} | {m['placed']} | {m['time_s'] * 1e3:.2f} | "
                     f"{base / m['time_s']:.2f}x | {temp} | {colls} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv):
    logging.set_verbosity(logging.WARNING)
    f = flags.FLAGS
    if f.process_id >= 0:
        worker(f.config, f.workdir, f.process_id, f.port, f.transfer_port)
        return
    del argv
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    result = launch(f["config"].config_filename, overrides, f.workdir, f.timeout_s)
    print(markdown(result))
    print(f"outputs in {f.workdir}")


if __name__ == "__main__":
    config_flags.DEFINE_config_file(
        "config", "configs/weight_sync/disaggregated.py", "Config file."
    )
    flags.DEFINE_string("workdir", "workdir/weight_sync_disaggregated", "Where outputs go.")
    flags.DEFINE_integer("process_id", -1, "Set by the launcher: which process this is.")
    flags.DEFINE_integer("port", 0, "Set by the launcher: the coordinator's port.")
    flags.DEFINE_integer("transfer_port", 0, "Set by the launcher: this process's transfer port.")
    flags.DEFINE_float("timeout_s", 900, "Seconds the two processes may take.")
    app.run(main)
