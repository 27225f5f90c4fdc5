"""Two processes x four CPU devices on JAX's multi-controller runtime (gloo): one 2x4 mesh, and a
move from one process's devices to the other's (disaggregated weight sync)."""

import os
import socket
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "multihost.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redistribute_across_two_processes():
    port, transfers = str(_free_port()), [str(_free_port()) for _ in (0, 1)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen([sys.executable, WORKER, port, str(pid), transfers[pid]], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for pid in (0, 1)
    ]  # fmt: skip
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    for pid, (code, out, err) in enumerate(outs):
        assert code == 0, f"process {pid} failed:\n{err[-3000:]}"
        assert f"process {pid} OK 5" in out
