"""A differential harness: ``redistribute`` under every JAX transformation, against references.

Each random problem (a mesh, a shape, ``src`` and ``dst`` layouts) runs under every composition
below; values must equal the array bit for bit, results must carry ``dst``, and gradients must
equal what moving numbers gives: the gradient of ``sum(redistribute(x) * w)`` is ``w`` exactly,
a ``vjp`` returns its cotangent, a ``jvp`` its tangent (``jax.sharding.reshard`` gives the same,
and is checked where it runs).

| composition | what runs |
|---|---|
| eager, jit | ``redistribute(x, src, dst)``; two-argument form where JAX can read ``src`` |
| grad, jit(grad), vjp, jvp | of ``sum(redistribute(x) * w)`` / the move itself |
| vmap, jit(vmap) | over a new batch dimension, split over a free mesh axis or not |
| set_mesh | the above under ``jax.set_mesh(mesh)`` |
| other mesh | ``dst`` a ``NamedSharding`` on another mesh over the same devices |

Usage:
    python -m experiments.transformations --workdir=workdir/transformations \
        --config=configs/transformations/default.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import random
import time
from collections.abc import Callable

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/transformations/default.py")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/transformations", "Where results go.")

MESHES = ({"a": 2, "b": 2, "c": 2}, {"a": 4, "b": 2}, {"a": 2, "b": 3}, {"a": 6}, {"a": 8})


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: ``arr`` laid out as ``src`` on ``mesh`` goes to ``dst`` (maybe another mesh)."""

    mesh: object  # jax.sharding.Mesh
    src: object  # PartitionSpec
    dst: object  # NamedSharding
    arr: object  # np.ndarray
    weights: object  # np.ndarray, the loss's weights

    def x(self):
        import jax
        from jax.sharding import NamedSharding

        return jax.device_put(self.arr, NamedSharding(self.mesh, self.src))

    @property
    def explicit(self) -> bool:
        return any(str(t).endswith("Explicit") for t in self.mesh.axis_types)


def _mesh_of(sizes: dict[str, int], explicit: bool, devices=None):
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    n = math.prod(sizes.values())
    devs = np.array(jax.devices()[:n] if devices is None else devices)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(devs.reshape(tuple(sizes.values())), tuple(sizes), axis_types=(kind,) * len(sizes))


def _other_sizes(sizes: dict[str, int], rng: random.Random) -> dict[str, int] | None:
    """Another factorisation of the device count (new axis names), or ``None``."""
    from redist.types import MeshShape

    def primes(axes) -> list[int]:  # prime factors in device order: equal ones line up
        named = {f"o{k}": n for k, n in enumerate(axes)} if isinstance(axes, tuple) else axes
        return [f.size for f in MeshShape.of(named).factors]

    n = math.prod(sizes.values())
    options = [(n,), (2, n // 2), (n // 2, 2)] if n % 2 == 0 else [(n,)]
    options = [o for o in options if min(o) > 1 and o != tuple(sizes.values())
               and primes(o) == primes(sizes)]  # fmt: skip
    if not options:
        return None
    return {f"o{k}": s for k, s in enumerate(rng.choice(options))}


def random_case(rng: random.Random, sizes: dict[str, int], explicit: bool, other_mesh: bool):
    """A random problem of at most 4096 elements (distinct, non-integer values)."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from redist.problems import random_problem, random_spec

    p = random_problem(rng, sizes, max_rank=4, max_elems=4096)
    mesh = _mesh_of(sizes, explicit)
    shape = p.shape
    dst = NamedSharding(mesh, PartitionSpec(*p.dst))
    other = _other_sizes(sizes, rng) if other_mesh else None
    if other is not None:
        m2 = _mesh_of(other, explicit, devices=mesh.devices.flat)
        spec = random_spec(rng, other, len(shape))
        div = [math.prod(other[a] for a in ((e,) if isinstance(e, str) else e or ())) for e in spec]
        shape = tuple(math.lcm(n, d) for n, d in zip(shape, div))
        dst = NamedSharding(m2, PartitionSpec(*spec))
    gen = np.random.default_rng(rng.randrange(2**32))
    arr = (gen.standard_normal(shape) / 7).astype(np.float32)
    weights = (gen.standard_normal(shape) / 3).astype(np.float32)
    return Case(mesh, PartitionSpec(*p.src), dst, arr, weights)


def _same(name: str, got, want, sharding=None) -> None:
    import numpy as np

    g = np.asarray(got)
    if g.shape != np.shape(want) or not np.array_equal(g, want):
        diff = np.max(np.abs(g - want)) if g.shape == np.shape(want) else f"shape {g.shape}"
        raise AssertionError(f"{name}: values differ from the reference (max |diff| {diff})")
    if sharding is not None and not got.sharding.is_equivalent_to(sharding, g.ndim):
        raise AssertionError(f"{name}: result sharding {got.sharding} is not {sharding}")


def _free_axis(case: Case) -> str | None:
    """A mesh axis that neither layout uses on the source mesh (to split a batch over)."""
    used = set()
    for spec in (case.src, case.dst.spec if case.dst.mesh is case.mesh else case.src):
        for e in spec:
            used |= {e} if isinstance(e, str) else set(e or ())
    free = [a for a in case.mesh.axis_names if a not in used]
    return free[0] if free else None


def compositions(case: Case) -> dict[str, Callable[[], None]]:
    """Every composition that applies to ``case``, each a check that raises on a mismatch."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import redist

    arr, w, dst, mesh, src = case.arr, case.weights, case.dst, case.mesh, case.src
    three = lambda v: redist.redistribute(v, src, dst, mesh=mesh)  # noqa: E731
    two = lambda v: redist.redistribute(v, dst)  # noqa: E731
    loss = lambda f: lambda v: jnp.sum(f(v) * w)  # noqa: E731
    out: dict[str, Callable[[], None]] = {}

    # JAX differentiates programs on Explicit axes only under jax.set_mesh (jax.sharding.reshard
    # too: "Please enter your jit into a mesh context"); there the loss lives on dst's mesh.
    context = (lambda: jax.set_mesh(dst.mesh)) if case.explicit else contextlib.nullcontext

    def grad_of(f, jitted: bool):
        def run():
            with context():
                g = jax.grad(loss(f))
                _same("grad", (jax.jit(g) if jitted else g)(case.x()), w)

        return run

    forms = {"3-arg": three, "2-arg": two}
    for form, f in forms.items():
        out[f"eager {form}"] = lambda f=f: _same("eager", f(case.x()), arr, dst)
        if form == "3-arg" or case.explicit:  # Auto axes: src is not in a traced value's type
            out[f"jit {form}"] = lambda f=f: _same("jit", jax.jit(f)(case.x()), arr, dst)
            out[f"jit(grad) {form}"] = grad_of(f, True)
        out[f"grad {form}"] = grad_of(f, False)

    def vjp():
        with context():
            y, pull = jax.vjp(three, case.x())
            (ct,) = pull(jax.device_put(w, dst))
        _same("vjp value", y, arr, dst)
        _same("vjp cotangent", ct, w, NamedSharding(mesh, src))

    def jvp():
        with context():
            y, t = jax.jvp(three, (case.x(),), (jax.device_put(w, NamedSharding(mesh, src)),))
        _same("jvp value", y, arr, dst)
        _same("jvp tangent", t, w, dst)

    out["vjp"], out["jvp"] = vjp, jvp

    def vmapped(batch_axis, jitted: bool):
        stack = np.stack([arr, -arr, 2 * arr])
        if batch_axis is not None:
            stack = np.concatenate([stack] * mesh.shape[batch_axis])
        xs = jax.device_put(stack, NamedSharding(mesh, PartitionSpec(batch_axis, *src)))
        f = jax.vmap(three)
        y = (jax.jit(f) if jitted else f)(xs)
        _same("vmap", y, stack)
        if batch_axis is not None and case.explicit and dst.mesh is not mesh:
            return  # JAX's vmap reads the batch axis on the context mesh, here dst's mesh
        with context():
            g = jax.vmap(jax.grad(loss(three)))(xs)
        _same("vmap(grad)", g, np.broadcast_to(w, stack.shape))

    free = _free_axis(case)
    for axis in (None, free) if free else (None,):
        tag = "split" if axis else "whole"
        out[f"vmap {tag} batch"] = lambda a=axis: vmapped(a, False)
        out[f"jit(vmap) {tag} batch"] = lambda a=axis: vmapped(a, True)

    if case.explicit:  # the forward forms under jax.set_mesh too

        def under_mesh(fn):
            def run():
                with jax.set_mesh(mesh):
                    fn()

            return run

        for name in [n for n in out if n.startswith(("eager", "jit "))]:
            out[f"set_mesh {name}"] = under_mesh(out[name])
        if dst.mesh is mesh:

            def reshard_agrees():
                with jax.set_mesh(mesh):
                    ref = jax.jit(jax.grad(loss(lambda v: jax.sharding.reshard(v, dst))))(case.x())
                    got = jax.jit(jax.grad(loss(two)))(case.x())
                _same("reshard grad", got, np.asarray(ref))

            out["jit(grad) vs reshard"] = reshard_agrees
    return out


def check(case: Case) -> dict[str, str]:
    """``{composition: "ok" | error}`` for every composition of ``case``."""
    results = {}
    for name, fn in compositions(case).items():
        try:
            fn()
            results[name] = "ok"
        except Exception as e:  # noqa: BLE001 - the harness reports every failure
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return results


def run(config, workdir: str) -> dict:
    """Check ``config.problems_per_mesh`` random problems per mesh and axis kind; write
    ``results.json`` (failures listed) under ``workdir``."""
    rng = random.Random(config.seed)
    rows, failures = [], 0
    start = time.perf_counter()
    for sizes in MESHES:
        for explicit in (False, True):
            for k in range(config.problems_per_mesh):
                case = random_case(rng, sizes, explicit, other_mesh=k % 2 == 1)
                results = check(case)
                bad = {n: r for n, r in results.items() if r != "ok"}
                failures += len(bad)
                rows.append({
                    "mesh": sizes, "explicit": explicit, "shape": list(case.arr.shape),
                    "src": str(case.src), "dst": str(case.dst.spec),
                    "dst_mesh": dict(case.dst.mesh.shape), "checks": len(results), "failed": bad,
                })  # fmt: skip
    summary = {
        "problems": len(rows),
        "checks": sum(r["checks"] for r in rows),
        "failures": failures,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    out = pathlib.Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"{summary['checks']} checks on {summary['problems']} problems: "
          f"{failures} failed ({summary['seconds']} s); {out / 'results.json'}")  # fmt: skip
    return summary


def main(argv):
    del argv
    from experiments.measure import force_host_devices

    force_host_devices(8)
    run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
