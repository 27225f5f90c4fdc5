"""Load a saved plan in a fresh process and run it: ``python planner_persistence.py PLAN.json``.

Prints the loaded plan's ``in_specs`` and ``OK`` when the plan, loaded without searching onto the
8 CPU devices, computes the unsharded step, and planning again here gives the saved schedule."""

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

SHAPES = {"w1": (128, 512), "w2": (512, 128)}
X = (256, 128)


def loss(params, x):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"]) ** 2)


def sgd(params, x, *, lr):
    """A pytree argument, an array and a static keyword argument."""
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def shapes(dtype=jnp.float32):
    params = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in SHAPES.items()}
    return params, jax.ShapeDtypeStruct(X, dtype)


def main(path: str) -> None:
    import json

    import numpy as np

    import planner
    from planner import persistence
    from planner.solver import schedule_search

    def no_search(*args, **kwargs):
        raise AssertionError("load searched")

    real = schedule_search.search
    planner.auto.search = schedule_search.search = no_search
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) / 8 for k, s in SHAPES.items()}
    x = rng.standard_normal(X).astype(np.float32)
    p = planner.load(path, sgd, params, x, mesh=mesh, lr=0.1)
    want = jax.jit(sgd, static_argnames="lr")(params, x, lr=0.1)
    got = p(params, x, lr=0.1)
    for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                       jax.tree.leaves(p.out_shardings)):  # fmt: skip
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)
        assert g.sharding.is_equivalent_to(s, g.ndim), (g.sharding, s)
    explicit = p.lowered(params, x)
    for g, w in zip(explicit, jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)
    planner.auto.search = schedule_search.search = real
    again = planner.plan(
        sgd, *shapes(), lr=0.1, mesh=jax.sharding.AbstractMesh((2, 2, 2), ("a", "b", "c"))
    )
    with open(path) as f:
        saved = json.load(f)["schedule"]
    assert persistence.document(again)["schedule"] == saved, "the search differs between processes"
    print(p.in_specs)
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
