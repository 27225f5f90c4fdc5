"""Two processes x four CPU devices on JAX's multi-controller runtime (gloo): one 2x4 mesh, and a
move from one process's devices to the other's (disaggregated weight sync)."""

import os
import sys

from experiments.measure import free_port, run_processes

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "multihost.py")


def test_redistribute_across_two_processes():
    port, transfers = str(free_port()), [str(free_port()) for _ in (0, 1)]
    outs = run_processes([[sys.executable, WORKER, port, str(pid), transfers[pid]]
                          for pid in (0, 1)], timeout_s=300)  # fmt: skip
    for pid, (code, out, err) in enumerate(outs):
        assert code == 0, f"process {pid} failed:\n{err[-3000:]}"
        assert f"process {pid} OK 5" in out
