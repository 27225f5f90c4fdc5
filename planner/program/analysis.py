"""Trace a function to a jaxpr and describe every equation as a loop nest (:func:`analyze`).

Nested calls (``jit``, ``closed_call``, JAX 0.12's ``eval_jaxpr``) are inlined. Constructs whose semantics the lowering must
keep become :class:`planner.program.ops.Region`\\ s of the flat program: ``scan`` (its body analysed
once, with boundary ops that bring operands in and hand the carry back, so the body's loops get
splits like any other op's), ``checkpoint`` (rematerialisation), ``custom_jvp_call`` /
``custom_vjp_call`` (differentiation rules). Each primitive gets its iteration space from the rule
table (:mod:`planner.program.rules`), else from generic discovery (:mod:`planner.program.discover`),
else it runs replicated, and :func:`analyze` warns naming it and its share of the flops.

Example:
    >>> prog = planner.analyze(lambda x, w: jnp.tanh(x @ w), x, w)   # doctest: +SKIP
    >>> print(prog)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import warnings
from collections.abc import Callable

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from planner.program import discover as discovery
from planner.program import manual, rules
from planner.program.dependence import result_operands
from planner.program.ir import Program
from planner.program.jaxpr_params import inner_jaxpr, live, scan_split
from planner.program.ops import Access, Loop, Op, Region, Value, is_key
from planner.program.pad_folding import fold_zero_pads
from planner.program.scattered_sums import scatter_sums

INLINED = frozenset("pjit jit closed_call core_call custom_lin eval_jaxpr".split())
KEPT = {
    "checkpoint": "checkpoint", "remat": "checkpoint", "remat2": "checkpoint",
    "custom_jvp_call": "custom_jvp", "custom_vjp_call": "custom_vjp",
    "custom_vjp_call_jaxpr": "custom_vjp",
}  # fmt: skip
SCAN_BOUNDARY = ("scan_const", "scan_carry", "scan_xs", "scan_carry_out", "scan_ys")
STACKING = {"scan_xs": "in", "scan_ys": "out"}  # boundary ops that drop / add the layer axis


def _inner(eqn) -> tuple[object, tuple] | None:
    """The inner jaxpr of a call-like equation and its constants, or ``None``."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if inner is None:
            continue
        if not hasattr(inner, "jaxpr") and not hasattr(inner, "eqns"):
            continue
        jaxpr, consts = inner_jaxpr(inner)
        if len(jaxpr.invars) == len(eqn.invars):
            return jaxpr, consts
    return None


_PACKAGE = re.compile(r"[/\\](?:site|dist)-packages[/\\]([^/\\]+)")

FRAMEWORKS = frozenset(
    "jax jaxlib flax keras optax kauldron etils equinox haiku chex numpy jaxtyping typeguard "
    "treescope orbax qwix aqt tokamax".split()
)
"""Packages that build models or optimizers for others: an op made inside one is reported at
the model's own line that called it (a model library's, such as MaxText's, keras-hub's or
gemma's, or the user's), "in" the framework."""


_PLANNER = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
SHIMS = ("tunix_adapter.py",)
"""Files that wrap JAX's own functions for the whole process (MaxText 0.2.5 replaces
``jax.lax.with_sharding_constraint`` with one of its own): their frames are not the model's."""


def _source(eqn, outer: tuple | None) -> tuple | None:
    """Where the user's code made ``eqn``: ``(file, line, library)`` (see :attr:`Op.source`).

    Where the op was made inside a model library (an installed package that is not a framework,
    :data:`FRAMEWORKS`: MaxText, keras-hub, gemma), the innermost frame of that library; else the
    innermost frame of its traceback outside JAX (JAX's own notion of the user's frame) and
    outside installed packages. ``library`` names the framework that line called into (an optax
    update is reported at the user's ``tx.update`` line, "in optax"; a Keras layer's kernel at
    keras-hub's line, "in keras"). Equations that kept no traceback (the bodies of nested jits)
    take ``outer``, their call's."""
    try:
        frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    except Exception:  # a JAX without this private module or attribute: no sources
        return outer
    called, framework, model = None, None, None
    for frame in frames:  # innermost first
        if frame.file_name.startswith(_PLANNER) or frame.file_name.endswith(SHIMS):
            continue  # the planner's own call of the user's function; shims around JAX's API
        package = _PACKAGE.search(frame.file_name)
        if package is None:  # the user's own line, or the model library's line it led to
            return model or (frame.file_name, frame.start_line, called)
        called = package.group(1).split(".")[0]
        if called in FRAMEWORKS:
            framework = called
        elif model is None:
            model = (frame.file_name, frame.start_line, framework)
    if model is not None:  # a model library's line, in a nested jit of it too
        return model
    if outer is not None:
        return outer
    return (frames[0].file_name, frames[0].start_line, None) if frames else None


def _identity(name: str, kind: str, srcs: list[Value], dst: Value, trips: int) -> Op:
    """A boundary op: ``dst`` is (each of) ``srcs``; a scan adds or drops the stacked axis."""
    whole = any(is_key(v.dtype) for v in srcs)
    core = dst.shape if STACKING.get(kind) == "in" else srcs[0].shape
    loops = tuple(Loop(f"i{d}", n, not whole) for d, n in enumerate(core))
    dims = tuple((lp.name,) for lp in loops)
    src_dims = ((),) + dims if STACKING.get(kind) == "in" else dims
    dst_dims = ((),) + dims if STACKING.get(kind) == "out" else dims
    return Op(name, kind, loops, tuple(Access(v, src_dims) for v in srcs),
              (Access(dst, dst_dims),), how="region", trips=trips)  # fmt: skip


class _Builder:
    def __init__(self, discover: bool = True):
        self.discover = discover  # off for opaque bodies, which are only priced
        self.ops: list[Op] = []
        self.consts: list[tuple[Value, object]] = []
        self.regions: list[Region] = []
        self.ties: list[tuple[str, str]] = []
        self.count = 0
        self.where: tuple | None = None  # the source of the equation being described

    def value(self, var, prefix="v") -> Value:
        aval = var.aval
        v = Value(f"{prefix}{self.count}", tuple(int(n) for n in aval.shape), str(aval.dtype))
        self.count += 1
        return v

    def const(self, var, array) -> Value:
        """A constant (a closed-over array or a literal) as a value of the program."""
        v = self.value(var, "c")
        self.consts.append((v, array))
        return v

    def read(self, env: dict, var) -> Value:
        if isinstance(var, jcore.Literal):
            return self.const(var, np.asarray(var.val, dtype=var.aval.dtype))
        return env[var]

    def walk(self, jaxpr, env: dict, trips: int = 1) -> None:
        outer = self.where
        for eqn in scatter_sums(fold_zero_pads(jaxpr)):
            self.where = _source(eqn, outer)  # nested bodies fall back on their construct's
            name = eqn.primitive.name
            if name in ("scan", "while", "cond"):
                getattr(self, {"while": "while_"}.get(name, name))(eqn, env, trips)
                continue
            nested = _inner(eqn) if name in INLINED or name in KEPT else None
            if nested is not None:
                self.call(eqn, nested, env, trips, KEPT.get(name))
                continue
            ins = [None if isinstance(v, jcore.Literal) else env[v] for v in eqn.invars]
            outs = [self.value(var) for var in eqn.outvars]
            for var, v in zip(eqn.outvars, outs):
                env[var] = v
            self.ops.append(self.describe(eqn, ins, outs, trips))
        self.where = outer

    def call(self, eqn, nested, env: dict, trips: int, kind: str | None) -> None:
        inner, consts = nested
        inner_env = {var: self.const(var, c) for var, c in zip(inner.constvars, consts)}
        ins = [self.read(env, v) for v in eqn.invars]
        inner_env.update(zip(inner.invars, ins))
        start = len(self.ops)
        self.walk(inner, inner_env, trips)
        outs = [self.read(inner_env, v) for v in inner.outvars]
        env.update(zip(eqn.outvars, outs))
        if kind is not None:
            self.regions.append(Region(kind, start, start, len(self.ops), tuple(ins),
                                       tuple(outs), eqn))  # fmt: skip

    def scan(self, eqn, env: dict, trips: int) -> None:
        p = eqn.params
        (inner, consts), length = inner_jaxpr(p["jaxpr"]), int(p["length"])
        split = scan_split(eqn)
        nc, nk = split.consts, split.carry
        inner_env = {var: self.const(var, c) for var, c in zip(inner.constvars, consts)}
        ins = [self.read(env, v) for v in eqn.invars]
        start = len(self.ops)
        entry = []
        for k, (var, outer) in enumerate(zip(inner.invars, ins)):
            kind = SCAN_BOUNDARY[0 if k < nc else 1 if k < nc + nk else 2]
            inner_env[var] = self.boundary(kind, [outer], var, trips).results[0].value
            entry.append(self.ops[-1])
        body = len(self.ops)
        self.walk(inner, inner_env, trips * length)
        outs = []
        for k, (var, outvar) in enumerate(zip(inner.outvars, eqn.outvars)):
            kind = SCAN_BOUNDARY[3 if k < nk else 4]
            op = self.boundary(kind, [self.read(inner_env, var)], outvar, trips * length)
            env[outvar] = op.results[0].value
            outs.append(env[outvar])
            if k < nk:
                self.ties.append((entry[nc + k].name, op.name))
        self.regions.append(Region("scan", start, body, len(self.ops), tuple(ins), tuple(outs),
                                   eqn))  # fmt: skip

    def boundary(self, kind: str, srcs: list[Value], var, trips: int) -> Op:
        op = _identity(f"{kind}_{len(self.ops)}", kind, srcs, self.value(var), trips)
        op = dataclasses.replace(op, source=self.where)
        self.ops.append(op)
        return op

    def while_(self, eqn, env: dict, trips: int) -> None:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        cond_env = {var: self.const(var, c) for var, c in zip(cond.jaxpr.constvars, cond.consts)}
        body_env = {var: self.const(var, c) for var, c in zip(body.jaxpr.constvars, body.consts)}
        ins = [self.read(env, v) for v in eqn.invars]
        start = len(self.ops)
        for var, outer in zip(cond.jaxpr.invars[:nc], ins[:nc]):
            cond_env[var] = self.boundary("while_const", [outer], var, trips).results[0].value
        for var, outer in zip(body.jaxpr.invars[:nb], ins[nc : nc + nb]):
            body_env[var] = self.boundary("while_const", [outer], var, trips).results[0].value
        entry = []
        for cvar, bvar, outer in zip(
            cond.jaxpr.invars[nc:], body.jaxpr.invars[nb:], ins[nc + nb :]
        ):
            entry.append(self.boundary("while_carry", [outer], bvar, trips))
            cond_env[cvar] = body_env[bvar] = entry[-1].results[0].value
        first = len(self.ops)
        self.walk(cond.jaxpr, cond_env, trips)
        predicate = self.read(cond_env, cond.jaxpr.outvars[0])
        second = len(self.ops)
        self.walk(body.jaxpr, body_env, trips)
        outs = []
        for op_in, var, outvar in zip(entry, body.jaxpr.outvars, eqn.outvars):
            op = self.boundary("while_carry_out", [self.read(body_env, var)], outvar, trips)
            env[outvar] = op.results[0].value
            outs.append(env[outvar])
            self.ties.append((op_in.name, op.name))
        self.regions.append(Region("while", start, first, len(self.ops), tuple(ins), tuple(outs),
                                   eqn, (second,), predicate))  # fmt: skip

    def cond(self, eqn, env: dict, trips: int) -> None:
        branches = eqn.params["branches"]
        ins = [self.read(env, v) for v in eqn.invars]
        start = len(self.ops)
        entered = [self.boundary("cond_operand", [outer], var, trips).results[0].value
                   for var, outer in zip(branches[0].jaxpr.invars, ins[1:])]  # fmt: skip
        parts, results = [], []
        for br in branches:
            parts.append(len(self.ops))
            br_env = {var: self.const(var, c) for var, c in zip(br.jaxpr.constvars, br.consts)}
            br_env.update(zip(br.jaxpr.invars, entered))
            self.walk(br.jaxpr, br_env, trips)
            results.append([self.read(br_env, v) for v in br.jaxpr.outvars])
        parts.append(len(self.ops))
        self.price_dearest(parts)
        outs = []
        for k, outvar in enumerate(eqn.outvars):
            op = self.boundary("cond_merge", [r[k] for r in results], outvar, trips)
            env[outvar] = op.results[0].value
            outs.append(env[outvar])
        self.regions.append(Region("cond", start, parts[0], len(self.ops), tuple(ins),
                                   tuple(outs), eqn, tuple(parts)))  # fmt: skip

    def price_dearest(self, parts: list[int]) -> None:
        """One run of a ``cond`` runs one branch: the ops of every branch but the dearest (the
        most flops; the first of equals) are priced at zero trips, as XLA's cost analysis prices
        a conditional by its dearest branch (a dropless fallback beside a capped fast path
        costs the fallback, not both)."""
        spans = list(zip(parts, parts[1:]))
        dearest = max(spans, key=lambda s: sum(o.flops * o.trips for o in self.ops[s[0] : s[1]]))
        for start, stop in spans:
            if (start, stop) != dearest:
                self.ops[start:stop] = [
                    dataclasses.replace(o, trips=0) for o in self.ops[start:stop]
                ]

    def describe(self, eqn, ins, outs, trips: int) -> Op:
        name = f"{eqn.primitive.name}_{len(self.ops)}"
        if eqn.primitive.name == "shard_map":
            op = dataclasses.replace(
                manual.shard_map_op(name, eqn, ins, outs, body_ops(eqn.params["jaxpr"])),
                feeds=result_operands(eqn, ins),
            )
        elif eqn.primitive.name == "pallas_call":  # opaque: its kernel's body, once per grid point
            grid = getattr(eqn.params.get("grid_mapping"), "grid", ())
            runs = math.prod(n for n in grid if isinstance(n, int))
            op = dataclasses.replace(_replicated(name, eqn, ins, outs),
                                     body=body_ops(eqn.params["jaxpr"], runs),
                                     kernel_flops=_estimated_flops(eqn, grid))  # fmt: skip
        elif any(is_key(v.dtype) for v in [*ins, *outs] if v is not None):
            op = rules.read_whole(name, eqn, ins, outs)  # PRNG keys: random ops run whole
        else:
            rule = rules.rule_for(eqn.primitive.name)
            op = rule(name, eqn, ins, outs) if rule is not None else None
            if op is None and self.discover:
                op = discovery.discover(name, eqn, ins, outs)
            if op is None:
                op = _replicated(name, eqn, ins, outs)
        return dataclasses.replace(op, eqn=eqn, trips=trips, source=self.where)


def _estimated_flops(eqn, grid) -> tuple[float, float] | None:
    """``(flops, transcendentals)`` of a Pallas kernel's own cost estimate where its ``grid`` has
    a dimension sized at run time (megablox's ``gmm``: ``(1, DynamicGridDim, 1)``, its row tiles
    as many as the groups fill); ``None`` for a static grid or no estimate."""
    estimate = eqn.params.get("cost_estimate")
    if estimate is None or all(isinstance(n, int) for n in grid):
        return None
    return float(estimate.flops), float(estimate.transcendentals)


def body_ops(closed, trips: int = 1) -> tuple[Op, ...]:
    """The ops of a nested body (a ``shard_map``'s on its tiles, a Pallas kernel's on its
    blocks), each run ``trips`` times per run of its owner; ops no rule understands are counted
    as running whole (no discovery: the body is only priced)."""
    jaxpr, consts = inner_jaxpr(closed)
    b = _Builder(discover=False)
    env = {var: b.const(var, c) for var, c in zip(jaxpr.constvars, consts)}
    env.update((var, b.value(var, "in")) for var in jaxpr.invars)
    b.walk(jaxpr, env, trips)
    return tuple(b.ops)


def _replicated(name, eqn, ins, outs) -> Op:
    loops = tuple(Loop(f"i{d}", n, False) for d, n in enumerate(outs[0].shape)) if outs else ()
    return Op(
        name, eqn.primitive.name, loops,
        tuple(Access(v, ((),) * len(v.shape)) for v in ins if v is not None),
        tuple(Access(o, ((),) * len(o.shape)) for o in outs), how="replicated",
    )  # fmt: skip


def replicated_report(prog: Program) -> str | None:
    """A sentence naming the ops that run replicated because neither the rule table nor discovery
    understands them, with their share of the program's flops; ``None`` if there are none."""
    total = sum(o.flops * o.trips for o in prog.ops) or 1
    by_kind: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for o in prog.ops:
        if o.how == "replicated":
            by_kind[o.primitive][0] += 1
            by_kind[o.primitive][1] += o.flops * o.trips
    if not by_kind:
        return None
    parts = [f"{p} x{n} ({100 * f / total:.1f}% of flops)" for p, (n, f) in sorted(by_kind.items())]
    return "planner: these ops are not understood and run replicated: " + ", ".join(parts)


def analyze(fn: Callable, *args, **kwargs) -> Program:
    """Trace ``fn(*args, **kwargs)`` and return its :class:`Program` of loop nests.

    Args:
        fn: a JAX-traceable function.
        *args, **kwargs: example arguments (arrays or ``jax.ShapeDtypeStruct``s, pytrees allowed).

    Returns:
        The program: ops in order, with loops, access maps, reductions and regions. Warns (a
        ``UserWarning``) naming the ops that run replicated because they are not understood.
    """
    closed = live(jax.make_jaxpr(fn)(*args, **kwargs))  # as XLA would, plan no dead code
    b = _Builder()
    env = {var: b.const(var, c) for var, c in zip(closed.jaxpr.constvars, closed.consts)}
    inputs = []
    for var in closed.jaxpr.invars:
        env[var] = b.value(var, "in")
        inputs.append(env[var])
    b.walk(closed.jaxpr, env)
    outputs = tuple(b.read(env, v) for v in closed.jaxpr.outvars)
    prog = Program(tuple(b.ops), tuple(inputs), outputs, closed, tuple(b.consts),
                   tuple(sorted(b.regions, key=lambda r: (r.start, -r.stop))), tuple(b.ties))  # fmt: skip
    report = replicated_report(prog)
    if report:
        warnings.warn(report, stacklevel=2)
    return prog
