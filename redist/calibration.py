"""A calibrated cost model: compute throughput, local copy bandwidth, and per collective kind a
latency + bandwidth line. Calibrate on the current backend with ``python -m
experiments.calibrate``; ``Calibration.default()`` loads the file shipped for CPU.

Wire bytes per device for a collective over ``n`` devices (``B`` the bytes named):

| kind                | B is            | wire bytes       |
|---------------------|-----------------|------------------|
| all-gather          | the output      | B (n - 1) / n    |
| all-to-all          | the tile        | B (n - 1) / n    |
| collective-permute  | the tile        | B                |
| all-reduce          | the buffer      | 2 B (n - 1) / n  |
| reduce-scatter      | the input       | B (n - 1) / n    |

Example:
    >>> cal = Calibration.default()
    >>> cal.collective_time("all-reduce", 2**20, 8) > cal.collective_time("all-reduce", 2**10, 8)
    True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

KINDS = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
DEFAULT_FILE = os.path.join(os.path.dirname(__file__), "calibrations", "cpu.json")


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends for ``kind`` over ``n`` devices (see the table above)."""
    if n <= 1:
        return 0.0
    if kind == "collective-permute":
        return float(nbytes)
    if kind == "all-reduce":
        return 2.0 * nbytes * (n - 1) / n
    if kind in KINDS:
        return nbytes * (n - 1) / n
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured throughputs of one backend (seconds, bytes, flops)."""

    backend: str
    flops_per_s: float
    copy_bytes_per_s: float
    latency_s: dict[str, float]
    bytes_per_s: dict[str, float]
    read_bytes_per_s: float | None = None  # streaming a resident operand; None: copy's rate

    def collective_time(self, kind: str, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        return self.latency_s[kind] + wire_bytes(kind, nbytes, n) / self.bytes_per_s[kind]

    def compute_time(self, flops: float, read_bytes: float, written_bytes: float = 0.0) -> float:
        """Roofline: the slower of arithmetic and memory traffic (operands read at the streaming
        rate, results written at the copy rate)."""
        read_rate = self.read_bytes_per_s or self.copy_bytes_per_s
        traffic = read_bytes / read_rate + written_bytes / self.copy_bytes_per_s
        return max(flops / self.flops_per_s, traffic)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        data = json.loads(text)
        missing = [k for k in KINDS if k not in data.get("latency_s", {})]
        if missing:
            raise ValueError(f"calibration lacks collective kinds {missing}")
        return cls(**data)

    @classmethod
    def load(cls, path: str) -> Calibration:
        with open(path) as f:
            return cls.from_json(f.read())

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def default(cls) -> Calibration:
        """The shipped CPU calibration (loaded once)."""
        return _default()


@functools.cache
def _default() -> Calibration:
    return Calibration.load(DEFAULT_FILE)
