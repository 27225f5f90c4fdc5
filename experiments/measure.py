"""Measuring compiled programs: collectives and their bytes from HLO, temporary memory, XLA's
rematerialization warnings, and interleaved wall-clock timing.

Example:
    >>> stats = compile_stats(jax.jit(f), x)        # doctest: +SKIP
    >>> stats.collectives, stats.temp_bytes
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from redist.hlo import Collective, captured_stderr, hlo_collectives  # noqa: F401  (re-exported)

REMAT_WARNING = "Involuntary full rematerialization"


def force_host_devices(n: int) -> None:
    """Ask for ``n`` simulated CPU devices (replacing an earlier count); effective only before
    JAX starts its backends (an import of JAX, as ``redist.plan``'s dtype check makes, starts
    none)."""
    if "jax" in sys.modules:
        from jax._src import xla_bridge  # no public way to ask whether backends have started

        if xla_bridge.backends_are_initialized():
            return
    flag = "--xla_force_host_platform_device_count="
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"{flag}{n}"])


def parse_mesh(text: str) -> dict[str, int]:
    """``"a:2,b:2"`` -> ``{"a": 2, "b": 2}``."""
    out = {}
    for part in text.split(","):
        name, _, size = part.strip().partition(":")
        if not name or not size.isdigit():
            raise ValueError(f"mesh must look like 'a:2,b:2,c:2', got {text!r}")
        out[name] = int(size)
    return out


def auto_mesh(text: str):
    """A ``jax.sharding.Mesh`` of Auto axes over the devices in order, from ``"a:2,b:2"``."""
    import jax
    from jax.sharding import AxisType

    sizes = parse_mesh(text)
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                         axis_types=(AxisType.Auto,) * len(sizes))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """A compiled program's collectives, its temporary memory per device (on TPU the
    temporaries live at the compiler's peak, :func:`planner.target.compiled.compiler_peak_bytes`, less
    arguments and outputs; elsewhere ``memory_analysis().temp_size_in_bytes``) and whether XLA
    rematerialized an array in full."""

    collectives: tuple[Collective, ...]
    temp_bytes: int
    full_remat: bool

    @property
    def collective_bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)

    @property
    def collective_kinds(self) -> dict[str, int]:
        """How many collectives of each kind, e.g. ``{"all-to-all": 3}``."""
        kinds: dict[str, int] = {}
        for c in self.collectives:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        return kinds

    def sequence(self) -> str:
        return " ".join(f"{c.kind}({c.bytes / 2**20:.2f}MB)" for c in self.collectives)


def collectives_cell(kinds: dict[str, int], full_remat: bool = False) -> str:
    """A table cell naming collectives by kind: ``"all-gather x2, all-to-all x1"`` (``-``: none).

    Example:
        >>> collectives_cell({"all-to-all": 1}, full_remat=True)
        'all-to-all x1 (full rematerialization)'
    """
    cell = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "-"
    return cell + " (full rematerialization)" if full_remat else cell


def compile_stats(jitted, *args) -> tuple[object, CompileStats]:
    """Compile ``jitted`` for ``args``; return the executable and its statistics."""
    from planner.target.compiled import compiler_peak_bytes  # imports JAX: after force_host_devices

    with captured_stderr() as log:
        compiled = jitted.lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else 0
    peak = compiler_peak_bytes(compiled, memory=mem)
    if peak is not None:  # TPU: the temporaries live at the compiler's peak
        temp = (
            peak - mem.argument_size_in_bytes - mem.output_size_in_bytes + mem.alias_size_in_bytes
        )
    stats = CompileStats(hlo_collectives(compiled.as_text()), temp, REMAT_WARNING in log[0])
    return compiled, stats


def interleaved_times(
    fns: Sequence[Callable[[], object]], repeats: int, warmup: int = 1, min_time_s: float = 0.0
) -> list[dict[str, float]]:
    """Median and min seconds of each thunk, run alternately (order reversed every repeat).

    At least ``repeats`` rounds, and more until every thunk has run for ``min_time_s`` in all
    (short programs get more rounds, so their medians are as trustworthy as long ones').
    """
    for _ in range(warmup):
        for f in fns:
            _block(f())
    times: list[list[float]] = [[] for _ in fns]
    r = 0
    while r < repeats or min(sum(ts) for ts in times) < min_time_s and r < 100 * repeats:
        order = list(range(len(fns)))
        if r % 2:
            order.reverse()
        for k in order:
            t = time.perf_counter()
            _block(fns[k]())
            times[k].append(time.perf_counter() - t)
        r += 1
    return [{"median": statistics.median(ts), "min": min(ts)} for ts in times]


def _block(x):
    import jax

    return jax.block_until_ready(x)


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` (saying so) when matplotlib
    is not installed (``pip install -e ".[figures]"``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed: no figures (pip install -e ".[figures]")')
        return None
    return plt


def save_figure(fig, path: str) -> None:
    """Lay out, write as PNG and close ``fig``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratio_axis(ax, axis: str, lo: float, hi: float) -> None:
    """A log ``axis`` ("x" or "y") of ``ax`` whose ticks are the powers of two in ``[lo, hi]``,
    written 0.5×, 1×, 2×, 4×: readable where matplotlib's log ticks print "3×10⁰4×10⁰"."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = [2.0**k for k in range(math.floor(math.log2(lo)), math.ceil(math.log2(hi)) + 1)]
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(ticks))
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    target.set_minor_locator(NullLocator())


def plain_log_ticks(ax) -> None:
    """Both log axes of ``ax`` labelled with plain numbers (1, 10, 100) rather than 10⁰."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for target in (ax.xaxis, ax.yaxis):
        target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        target.set_minor_formatter(NullFormatter())


def free_port() -> int:
    """A TCP port free on this host now (for a coordinator or a transfer socket)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(
    commands: Sequence[Sequence[str]], timeout_s: float
) -> list[tuple[int, str, str]]:
    """Run ``commands`` at once (the processes of one multi-controller program, ``XLA_FLAGS``
    left to each); ``(returncode, stdout, stderr)`` of each, all killed if one outlives
    ``timeout_s``."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen(list(c), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in commands]  # fmt: skip
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs
