"""A calibrated cost model: compute throughput, local copy bandwidth, and per collective kind a
latency + bandwidth line. Calibrate on the current backend with ``python -m
experiments.calibrate``; ``Calibration.default()`` loads the file shipped for CPU, and
``Calibration.named("h100_sxm")`` / ``named("tpu_v5p")`` / ``for_backend()`` the ones written from
published figures (each file lists its sources).

Links per mesh axis: devices are numbered row-major over the mesh, and the first
``domain_devices`` of them share the fast network (NVLink in a GPU host, ICI in a TPU slice). A
collective whose group spans devices of different domains is priced on the slower network
(``cross_latency_s`` / ``cross_bytes_per_s``: InfiniBand, data-center network): an axis whose
stride times size exceeds the domain crosses it, so minor axes are the fast ones.

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
    domain_devices: int | None = None  # devices on the fast network; None: all of them
    cross_latency_s: dict[str, float] | None = None  # the slower network between domains
    cross_bytes_per_s: dict[str, float] | None = None
    sources: tuple[str, ...] = ()  # where the figures come from

    def collective_time(self, kind: str, nbytes: float, n: int, crosses: bool = False) -> float:
        """Seconds for ``kind`` over ``n`` devices; ``crosses``: the group spans two domains."""
        if n <= 1:
            return 0.0
        if crosses and self.cross_bytes_per_s:
            return (
                self.cross_latency_s[kind]
                + wire_bytes(kind, nbytes, n) / self.cross_bytes_per_s[kind]
            )
        return self.latency_s[kind] + wire_bytes(kind, nbytes, n) / self.bytes_per_s[kind]

    def crosses(self, mesh, factors) -> bool:
        """Whether a collective over mesh ``factors`` (names of ``mesh``'s prime factors; a
        :class:`redist.MeshShape`) leaves the fast domain: some factor's stride times size, in
        the row-major device numbering, exceeds ``domain_devices``."""
        if not self.domain_devices or mesh.num_devices <= self.domain_devices:
            return False
        from redist.meshes import digits

        d = digits(mesh)
        return any(d[f][0] * d[f][1] > self.domain_devices for f in factors)

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
        if "sources" in data:
            data["sources"] = tuple(data["sources"])
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

    @classmethod
    def named(cls, name: str) -> Calibration:
        """A shipped calibration by name: ``"cpu"``, ``"h100_sxm"`` or ``"tpu_v5p"``."""
        path = os.path.join(os.path.dirname(__file__), "calibrations", f"{name}.json")
        if not os.path.exists(path):
            names = sorted(f[:-5] for f in os.listdir(os.path.dirname(path)) if f.endswith(".json"))
            raise ValueError(f"no calibration named {name!r}; shipped: {names}")
        return cls.load(path)

    @classmethod
    def for_backend(cls, backend: str | None = None) -> Calibration:
        """The shipped calibration for ``backend`` (default ``jax.default_backend()``): ``"gpu"``
        / ``"cuda"`` -> H100 SXM, ``"tpu"`` -> TPU v5p, anything else the CPU file."""
        if backend is None:
            import jax

            backend = jax.default_backend()
        return cls.named(
            {"gpu": "h100_sxm", "cuda": "h100_sxm", "tpu": "tpu_v5p"}.get(backend, "cpu")
        )


@functools.cache
def _default() -> Calibration:
    return Calibration.load(DEFAULT_FILE)
