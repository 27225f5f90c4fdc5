"""How a plan is called: its arguments' structure, shapes and dtypes, which are static, and the
``jax.jit`` that takes the user's own arguments.

An argument (positional or keyword) with no array among its leaves (a Python number, a string, a
tuple of ints, ``None``, a configuration object) is static, as ``jax.jit``'s ``static_argnums`` /
``static_argnames`` make it: part of the signature, not an input of the program, and hashable.
The others are pytrees of arrays (JAX or numpy arrays, ``jax.ShapeDtypeStruct``s; a Python number
inside one is traced as ``jax.jit`` traces it). Dtypes are compared as JAX canonicalises them
(``float64`` is ``float32`` unless x64 is on), weak types not at all.

Example:
    >>> sig = Signature.of((x, 3), {"w": w})     # doctest: +SKIP
    >>> sig.check((x.astype(int), 3), {"w": w})  # ArgumentMismatch: args[0]: dtype int32, ...
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class ArgumentMismatch(TypeError, ValueError):
    """Arguments unlike those a plan was made for (a ``TypeError`` and a ``ValueError``)."""


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


@functools.cache
def _canonical(dtype):
    """``dtype`` as JAX canonicalises it; an extended dtype (a typed PRNG key's ``key<fry>``)
    as it is."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)


def _leaf(x) -> tuple[tuple[int, ...], np.dtype] | None:
    """``(shape, canonical dtype)`` of an array leaf, ``None`` if ``x`` is no array."""
    if _is_array(x):
        return tuple(x.shape), _canonical(x.dtype)
    if isinstance(x, (bool, int, float, complex)):  # traced by jax.jit as a weak-typed scalar
        return (), np.dtype(jnp.result_type(x))
    return None


def _paths(label: str, tree) -> tuple[str, ...]:
    skeleton = jax.tree.unflatten(tree, [0] * tree.num_leaves)
    return tuple(
        label + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(skeleton)
    )


def without_addresses(text: str) -> str:
    """``text`` without the memory addresses of reprs (``<function f at 0x7f...>``), so that it
    is the same in every process."""
    return _ADDRESS.sub("", text)


def static_repr(value) -> str:
    """A static value as text, the same in every process."""
    return without_addresses(repr(value))


@dataclasses.dataclass(frozen=True)
class Arg:
    """One positional (``label`` ``args[k]``) or keyword (``label`` its name) argument."""

    label: str
    static: bool
    tree: object = None  # an array argument's PyTreeDef
    leaves: tuple = ()  # its leaves' (shape, canonical dtype), in flattening order
    value: object = None  # a static argument's value

    @classmethod
    def of(cls, label: str, x) -> Arg:
        flat, tree = jax.tree.flatten(x)
        if not any(_is_array(v) for v in flat):
            try:
                hash(x)
            except TypeError:
                raise ArgumentMismatch(
                    f"{label} holds no arrays, so it is static (as with jax.jit's static_argnums), "
                    f"and static arguments must be hashable; got a {type(x).__name__}"
                ) from None
            return cls(label, True, value=x)
        leaves = tuple(map(_leaf, flat))
        if None in leaves:
            k = leaves.index(None)
            raise ArgumentMismatch(
                f"{_paths(label, tree)[k]} is a {type(flat[k]).__name__} inside an argument that "
                "holds arrays; pass it as an argument of its own to make it static"
            )
        return cls(label, False, tree, leaves)

    @property
    def key(self) -> tuple:
        if self.static:
            return (self.label, True, type(self.value), self.value)
        return (self.label, False, self.tree, self.leaves)

    def describe(self) -> dict:
        if self.static:
            return {"argument": self.label, "static": static_repr(self.value)}
        return {
            "argument": self.label,
            "structure": str(self.tree),
            "leaves": [
                {"path": p, "shape": list(s), "dtype": str(d)}
                for p, (s, d) in zip(_paths(self.label, self.tree), self.leaves)
            ],  # fmt: skip
        }


@dataclasses.dataclass(frozen=True)
class Signature:
    """The arguments a plan was made for: positional ``args``, keyword ``kwargs`` (by name)."""

    args: tuple[Arg, ...]
    kwargs: tuple[Arg, ...]

    @classmethod
    def of(cls, args: Sequence, kwargs: dict) -> Signature:
        return cls(
            tuple(Arg.of(f"args[{k}]", x) for k, x in enumerate(args)),
            tuple(Arg.of(name, kwargs[name]) for name in sorted(kwargs)),
        )

    @property
    def every(self) -> tuple[Arg, ...]:
        return self.args + self.kwargs

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.label for a in self.kwargs)

    @property
    def key(self) -> tuple:
        """Hashable; equal for calls a plan made for one of them serves."""
        return tuple(a.key for a in self.every)

    def arrays(self, args: Sequence, kwargs: dict) -> list:
        """The array leaves of ``args`` and ``kwargs`` (the program's inputs, in order)."""
        out = []
        for a, x in zip(self.every, [*args, *(kwargs[n] for n in self.names)]):
            if not a.static:
                out += jax.tree.leaves(x)
        return out

    def traced(self, fn: Callable, args: Sequence, kwargs: dict) -> tuple[Callable, list]:
        """``fn`` as a function of the non-static arguments (pytrees, positional then keyword),
        static ones bound, and those arguments. It bears ``fn``'s name and parameter names, so
        that JAX names the program's inputs as the user does (``params['dense']['kernel']``).
        Its inputs flattened are :meth:`arrays`."""
        names = _parameter_names(fn, len(self.args)) + list(self.names)
        values = [*args, *(kwargs[n] for n in self.names)]
        keep = [k for k, a in enumerate(self.every) if not a.static]
        n = len(self.args)

        def call(*given):
            it = iter(given)
            full = [a.value if a.static else next(it) for a in self.every]
            return fn(*full[:n], **dict(zip(self.names, full[n:])))

        call.__name__ = call.__qualname__ = getattr(fn, "__name__", "fn")
        call.__signature__ = inspect.Signature(
            [inspect.Parameter(names[k], inspect.Parameter.POSITIONAL_ONLY) for k in keep]
        )
        return call, [values[k] for k in keep]

    @property
    def in_tree(self):
        """The structure of ``in_specs``: a tuple over the positional arguments (a pair of it and
        a dict over the keyword arguments when there are some), ``None`` for static ones."""

        def skeleton(a: Arg):
            return None if a.static else jax.tree.unflatten(a.tree, [0] * len(a.leaves))

        positional = tuple(map(skeleton, self.args))
        if not self.kwargs:
            return jax.tree.structure(positional)
        return jax.tree.structure((positional, {a.label: skeleton(a) for a in self.kwargs}))

    def describe(self) -> list[dict]:
        """Plain data (for JSON): one entry per argument, positional first."""
        return [a.describe() for a in self.args] + [
            dict(a.describe(), keyword=True) for a in self.kwargs
        ]

    def check(self, args: Sequence, kwargs: dict) -> None:
        """Raise :class:`ArgumentMismatch` naming every argument unlike the signature's."""
        other = Signature.of(args, kwargs)
        if other.key != self.key:
            problems = differences(self.describe(), other.describe())
            raise ArgumentMismatch(
                "the plan was made for other arguments: " + "; ".join(problems or ["they differ"])
            )

    def jit(self, body: Callable, in_shardings: Sequence, out_shardings, out_tree, **jit_kwargs):
        """``jax.jit`` of ``body`` (a function of the flat arrays) taking the user's arguments.

        Static arguments are ``static_argnums``; every new signature is checked when traced
        (``jax.jit`` retraces on any change of structure, shape, dtype or static value), so a
        cached call costs nothing more. With keyword arguments, a :class:`KeywordJit`.
        """
        for k in ("static_argnums", "static_argnames"):
            if k in jit_kwargs:
                raise TypeError(f"the plan finds its static arguments itself; got {k}=")
        n, names = len(self.args), self.names
        donate = set(np.atleast_1d(jit_kwargs.pop("donate_argnums", ())).tolist())
        for name in np.atleast_1d(jit_kwargs.pop("donate_argnames", ())).tolist():
            if name not in names:
                raise ValueError(f"donate_argnames: no keyword argument {name!r}; have {names}")
            donate.add(n + names.index(name))
        it = iter(in_shardings)
        shardings = tuple(jax.tree.unflatten(a.tree, [next(it) for _ in a.leaves])
                          for a in self.every if not a.static)  # fmt: skip

        def run(*values):
            args, kwargs = values[:n], dict(zip(names, values[n:]))
            self.check(args, kwargs)  # at trace time, on tracers
            return jax.tree.unflatten(out_tree, list(body(*self.arrays(args, kwargs))))

        jitted = jax.jit(run, in_shardings=shardings, out_shardings=out_shardings,
                         static_argnums=tuple(k for k, a in enumerate(self.every) if a.static),
                         donate_argnums=tuple(sorted(donate)), **jit_kwargs)  # fmt: skip
        return PlannedJit(jitted, self, shardings, frozenset(donate))


def _parameter_names(fn: Callable, n: int) -> list[str]:
    """Names of ``fn``'s first ``n`` positional parameters (``args_k`` past them, or where the
    signature cannot be read)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out = positional[:n] + [f"args_{k}" for k in range(len(positional), n)]
    return [name if name.isidentifier() else f"args_{k}" for k, name in enumerate(out)]


class PlannedJit:
    """The ``jax.jit`` of a plan, called as the user's function: keyword arguments are passed
    positionally, after the others (``jax.jit`` refuses keyword arguments with ``in_shardings``),
    and arrays already placed in another layout (MaxText's state, committed to its own
    shardings) are moved to the plan's first (``jax.device_put``, donating the old buffers of
    donated arguments), where ``jax.jit`` would refuse them. Call it, ``lower`` it or ``trace``
    it; ``jitted`` is the ``jax.jit`` itself (its other attributes are the ``jax.jit``'s)."""

    def __init__(self, jitted, signature: Signature, shardings: tuple = (),
                 donated: frozenset = frozenset()):  # fmt: skip
        self.jitted, self.signature = jitted, signature
        self.shardings, self.donated = shardings, donated

    def __getattr__(self, name):
        return getattr(self.jitted, name)

    def _values(self, args, kwargs) -> tuple:
        n, names = len(self.signature.args), self.signature.names
        if len(args) != n or sorted(kwargs) != sorted(names):
            self.signature.check(args, kwargs)
        return (*args, *(kwargs[name] for name in names))

    def _placed(self, values: tuple) -> tuple:
        """``values`` with each committed array in another layout moved to the plan's."""
        dynamic = [k for k, a in enumerate(self.signature.every) if not a.static]
        if len(dynamic) != len(self.shardings):
            return values
        out = list(values)
        for k, shardings in zip(dynamic, self.shardings):
            out[k] = jax.tree.map(functools.partial(_placed, donate=k in self.donated), values[k],
                                  shardings)  # fmt: skip
        return tuple(out)

    def __call__(self, *args, **kwargs):
        return self.jitted(*self._placed(self._values(args, kwargs)))

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*self._values(args, kwargs))

    def trace(self, *args, **kwargs):
        return self.jitted.trace(*self._values(args, kwargs))


def _placed(x, sharding, donate: bool = False):
    """``x`` on ``sharding`` where it is a committed array laid out otherwise; else ``x``."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not x.committed:
        return x  # a tracer (the plan called under grad or vmap) is placed by the jit itself
    if x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return jax.device_put(x, sharding, donate=donate)


def differences(planned: list[dict], given: list[dict]) -> list[str]:
    """What differs between two :meth:`Signature.describe` lists, argument by argument."""
    out = []

    def split(desc):
        return ([d for d in desc if not d.get("keyword")],
                {d["argument"]: d for d in desc if d.get("keyword")})  # fmt: skip

    (pos_a, kw_a), (pos_b, kw_b) = split(planned), split(given)
    if len(pos_a) != len(pos_b):
        out.append(f"{len(pos_b)} positional argument(s), the plan takes {len(pos_a)}")
    if sorted(kw_a) != sorted(kw_b):
        out.append(f"keyword arguments {sorted(kw_b)}, the plan takes {sorted(kw_a)}")
    pairs = list(zip(pos_a, pos_b)) + [(kw_a[k], kw_b[k]) for k in sorted(kw_a) if k in kw_b]
    for a, b in pairs:
        label = a["argument"]
        if "static" in a or "static" in b:
            if "static" not in b:
                out.append(
                    f"{label} holds arrays where the plan has the static value {a['static']}"
                )
            elif "static" not in a:
                out.append(f"{label} is the static value {b['static']} where the plan has arrays")
            elif a["static"] != b["static"]:
                out.append(
                    f"{label} is the static value {b['static']}, the plan's is {a['static']}"
                )
            continue
        if a["structure"] != b["structure"]:
            out.append(f"{label} has structure {b['structure']}, the plan's is {a['structure']}")
            continue
        for la, lb in zip(a["leaves"], b["leaves"]):
            if list(la["shape"]) != list(lb["shape"]):
                out.append(f"{lb['path']} has shape {tuple(lb['shape'])}, the plan's is "
                           f"{tuple(la['shape'])}")  # fmt: skip
            if la["dtype"] != lb["dtype"]:
                out.append(f"{lb['path']} has dtype {lb['dtype']}, the plan's is {la['dtype']}")
    return out
