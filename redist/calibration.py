"""A calibrated cost model: compute throughput, local copy bandwidth, and per collective kind a
latency + bandwidth line. Calibrate on the current backend with ``python -m
experiments.calibrate``; ``Calibration.default()`` loads the file shipped for CPU, and
``Calibration.named("h100_sxm")`` / ``named("tpu_v5p")`` (``tpu_v5e``, ``tpu_v6e``,
``tpu_v7x``, ``tpu_v4``) / ``for_backend()`` / ``for_device_kind()`` the ones written from published figures (each file lists
its sources).

Memory per device: ``memory_bytes`` (with ``memory_source``, where the figure comes from). The TPU
files give what the TPU compiler reports as available HBM per device (slightly less than the chip's
published capacity); the H100 file the datasheet's 80 GB. The CPU file says ``"memory_bytes":
"host"``: the machine's physical memory (or its cgroup limit, whichever is smaller), read when the
file is loaded, which the CPU devices of one process share (``host_memory``; see
:meth:`Calibration.device_memory_bytes`).

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

from redist.collectives import CollectiveKind

KINDS = tuple(CollectiveKind)  # what a calibration prices, as its files name them
DEFAULT_FILE = os.path.join(os.path.dirname(__file__), "calibrations", "cpu.json")


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends for ``kind`` over ``n`` devices (see the table above)."""
    if n <= 1:
        return 0.0
    if kind == CollectiveKind.PERMUTE:
        return float(nbytes)
    if kind == CollectiveKind.ALL_REDUCE:
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
    write_bytes_per_s: float | None = None  # a kernel writing its result; None: copy's rate
    domain_devices: int | None = None  # devices on the fast network; None: all of them
    cross_latency_s: dict[str, float] | None = None  # the slower network between domains
    cross_bytes_per_s: dict[str, float] | None = None
    sources: tuple[str, ...] = ()  # where the figures come from
    memory_bytes: float | None = None  # per device (per host if host_memory); None: unknown
    memory_source: str = ""  # where memory_bytes comes from
    host_memory: bool = False  # memory_bytes is the host's, shared by its devices (cpu)
    # The largest chunk for which folding a final permutation into the all-to-all before it
    # (rounds of collective-permute, redist.concrete) pays; None: any size. TPU: 4 MiB, from
    # compiling 10 folded and unfolded plans for v5p:2x2x2, where its compiler stages every
    # round: folded, Fig. 13's P1 (10 MB chunks) needs 115 MB of temporaries, unfolded 59
    # (XLA's program 58); below 2 MB chunks folding needs less or within 4 %.
    fold_max_bytes: int | None = None
    # A calibrated plan gives way to the paper's bytes-optimal one where that holds less at once
    # (``Plan.held_bytes``, a step's input and output tiles) and is predicted at most this much
    # slower; 0: never. TPU: 0.1, where the compiler's temporaries follow the tiles held (Fig.
    # 13's P4 on v5p:2x2x2: 256 MiB for the all-to-all and one all-gather, 384 for the
    # permutation and two all-gathers predicted 5 % faster; XLA 320). Not on GPUs: XLA:GPU runs
    # an all-to-all as rounds of collective-permutes, and there P4's all-to-all needs 32 MiB, the
    # permutation and two all-gathers 16.
    memory_tie: float = 0.0
    # Run a folded all-to-all's rounds of collective-permutes one after another (a round slices
    # its pieces once the round before has landed), and a plan's last all-gather into a
    # dimension after a split one as such rounds too (``redist.synthesis.in_series``). XLA:GPU
    # otherwise starts every round at once, each with its own buffers, and stages such an
    # all-gather's whole result to transpose it into place. 8 compiled H100s, temporaries over
    # the bound: r0014 1.25 -> 0.5 (XLA 1.0), P1 0.375 -> 0.25, r0016 1.5 -> 1.0 (XLA 1.0),
    # P2 0.75 -> 0.5. Not on TPU, whose compiler keeps more alive when the rounds are in series.
    serial_rounds: bool = False
    # Matmul and convolution rates by operand dtype, and ``"<dtype>:<precision>"`` where a
    # precision (``high``, ``highest``) runs slower than the default; others: flops_per_s.
    dense_flops_per_s: dict[str, float] | None = None
    # Small matmuls do not reach those rates: Hockney's half-performance size, the flops of one
    # matmul on one device that runs at half its key's rate (a matmul of f flops takes
    # (f + half) / rate seconds), by the same keys; a key without one: no size effect.
    dense_half_flops: dict[str, float] | None = None
    # Kernels of a loop the compiler keeps rolled (a scan's body, a while's) run this many times
    # slower than the same kernels unrolled: no fusion across iterations, stacked operands
    # sliced and written each iteration.
    loop_body_factor: float = 1.0
    # Fixed costs: each kernel of a program (a launch and its tail), and each call of a compiled
    # program (dispatch).
    kernel_s: float = 0.0
    step_s: float = 0.0
    # What the compiler builds a reduce-scatter over every device of the mesh as: None, a
    # reduce-scatter; "all-reduce": the all-reduce of the whole input and a slice (the TPU
    # compiler for v5p and v4; over part of the mesh it chooses per collective).
    whole_mesh_reduce_scatter: str | None = None

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

    def compute_time(
        self, flops: float, read_bytes: float, written_bytes: float = 0.0,
        flops_per_s: float | None = None,
    ) -> float:  # fmt: skip
        """Roofline: the slower of arithmetic (at ``flops_per_s``, by default the file's
        ``flops_per_s``) and memory traffic (operands read at the streaming rate, results
        written at the write rate, by default the copy rate)."""
        read_rate = self.read_bytes_per_s or self.copy_bytes_per_s
        write_rate = self.write_bytes_per_s or self.copy_bytes_per_s
        traffic = read_bytes / read_rate + written_bytes / write_rate
        return max(flops / (flops_per_s or self.flops_per_s), traffic)

    def dense_rate(
        self, dtype: str, precision: str = "default", flops: float | None = None
    ) -> float:
        """Flops per second of a matmul or convolution on ``dtype`` operands at ``precision``
        (``"default"``, ``"high"``, ``"highest"``): the file's rate for ``"<dtype>:<precision>"``,
        else for ``dtype`` at the default precision, else ``flops_per_s``; given the matmul's
        ``flops`` on one device, times ``flops / (flops + half)`` where the file has a
        ``dense_half_flops`` for that key (Hockney's r_inf, n_1/2).

        Example:
            >>> cal = Calibration.named("h100_sxm")
            >>> cal.dense_rate("float32") > cal.dense_rate("float32", "highest")
            True
            >>> cal.dense_rate("bfloat16", flops=2 * 512**3) < cal.dense_rate("bfloat16") / 10
            True
        """
        rates = self.dense_flops_per_s or {}
        key = dtype
        if precision != "default" and f"{dtype}:{precision}" in rates:
            key = f"{dtype}:{precision}"
        rate = rates.get(key, self.flops_per_s)
        half = (self.dense_half_flops or {}).get(key, 0.0)
        if flops is None or not half:
            return rate
        return rate * flops / (flops + half) if flops > 0 else rate

    def device_memory_bytes(self, devices_per_host: int = 1) -> float | None:
        """Memory of one device: ``memory_bytes``, or for a host's memory shared by its devices
        (``host_memory``, the CPU file) that divided by ``devices_per_host`` (the planner passes
        the mesh's devices on this host: the smaller of the mesh's size and the process's CPU
        device count). None when the file states no memory."""
        if self.memory_bytes is None:
            return None
        if self.host_memory:
            return self.memory_bytes / max(1, devices_per_host)
        return self.memory_bytes

    def to_json(self) -> str:
        """The file's text: every field but those left at their defaults of none (``None``, no
        sources)."""
        data = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and v != ()}
        if self.host_memory:  # read again from the machine that loads the file
            data["memory_bytes"] = HOST
            del data["host_memory"]
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        data = json.loads(text)
        missing = [k for k in KINDS if k not in data.get("latency_s", {})]
        if missing:
            raise ValueError(f"calibration lacks collective kinds {missing}")
        if "sources" in data:
            data["sources"] = tuple(data["sources"])
        if data.get("memory_bytes") == HOST:
            data["memory_bytes"] = float(host_memory_bytes())
            data["host_memory"] = True
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
        """A shipped calibration by name: ``"cpu"``, ``"h100_sxm"``, ``"tpu_v5p"``, ``"tpu_v5e"``,
        ``"tpu_v6e"``, ``"tpu_v7x"`` (Ironwood, per TensorCore) or ``"tpu_v4"``."""
        path = os.path.join(os.path.dirname(__file__), "calibrations", f"{name}.json")
        if not os.path.exists(path):
            names = sorted(f[:-5] for f in os.listdir(os.path.dirname(path)) if f.endswith(".json"))
            raise ValueError(f"no calibration named {name!r}; shipped: {names}")
        return cls.load(path)

    @classmethod
    def for_backend(cls, backend: str | None = None) -> Calibration:
        """The shipped calibration for ``backend`` (default ``jax.default_backend()``): ``"gpu"``
        / ``"cuda"`` -> H100 SXM, ``"tpu"`` -> TPU v5p, anything else the CPU file."""
        return cls.named(backend_calibration(backend))

    @classmethod
    def for_device_kind(cls, kind: str) -> Calibration | None:
        """The shipped calibration for a JAX ``device.device_kind`` (``"TPU v5"`` -> v5p, ``"TPU v5
        lite"`` -> v5e, ``"TPU v6 lite"`` -> v6e, ``"TPU7x"`` -> Ironwood, ``"TPU v4"``, H100s,
        ``"cpu"``); None if none."""
        name = device_kind_calibration(kind)
        return cls.named(name) if name else None


def backend_calibration(backend: str | None = None) -> str:
    """The shipped calibration's name for ``backend`` (default ``jax.default_backend()``)."""
    if backend is None:
        import jax  # only here: the pure core names calibrations without JAX

        backend = jax.default_backend()
    return {"gpu": "h100_sxm", "cuda": "h100_sxm", "tpu": "tpu_v5p"}.get(backend, "cpu")


def device_kind_calibration(kind: str) -> str | None:
    """The shipped calibration's name for a JAX ``device.device_kind``, None if none."""
    name = DEVICE_KINDS.get(kind.strip().lower())
    if name is None and "h100" in kind.lower():
        name = "h100_sxm"
    return name


HOST = "host"  # "memory_bytes": "host" in a file: this machine's memory, shared by its devices

# JAX device kinds (lower case) -> shipped calibration files.
DEVICE_KINDS = {
    "tpu v5": "tpu_v5p", "tpu v5p": "tpu_v5p", "tpu v5 lite": "tpu_v5e", "tpu v5e": "tpu_v5e",
    "tpu v6 lite": "tpu_v6e", "tpu v6e": "tpu_v6e", "tpu v4": "tpu_v4", "cpu": "cpu",
    "tpu7x": "tpu_v7x", "tpu v7x": "tpu_v7x",
}  # fmt: skip


def host_memory_bytes() -> int:
    """This machine's physical memory (``os.sysconf``), or the process's cgroup memory limit where
    that is smaller (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


@functools.cache
def _default() -> Calibration:
    return Calibration.load(DEFAULT_FILE)
