"""Problems needing 12, 16 or 24 devices run in subprocesses with their own device count."""

import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "many_devices.py")


@pytest.mark.parametrize("devices, expected", [(12, 40), (16, 8), (24, 1)])
def test_problems_on_more_devices(devices, expected):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, WORKER, str(devices)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == f"OK {expected}"
