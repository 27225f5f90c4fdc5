"""A redistribution as a linear JAX primitive, whose transpose is the reverse redistribution.

JAX would otherwise differentiate a move through the collectives that implement it, and those
transpose into sums: an all-gather into a reduce-scatter of copies (inexact on groups of 3), the
reduction of a pending sum into a broadcast that a replicated cotangent multiplies by the group
size. A redistribution only moves numbers, so ``redistribute_p`` carries its own rules:

| transformation        | rule                                                              |
|-----------------------|-------------------------------------------------------------------|
| ``jvp``               | the same move of the tangent                                      |
| transpose (``grad``)  | the reverse move, dst layout to src layout, within the same bound; |
|                       | a pending sum's cotangent goes to every partial unchanged         |
| ``vmap``              | the move with the batch dimension in front, keeping the batch     |
|                       | dimension's own sharding where dst leaves its axes free           |
| ``jit`` / eager       | one ``shard_map`` of collectives on the mesh's prime factors      |

Example:
    >>> move = Reshard(mesh, P("a"), NamedSharding(mesh, P(None, "a")), (8, 8), "float32", 4,
    ...                ("bytes", 0))                                   # doctest: +SKIP
    >>> y = redistribute_p.bind(x, move=move)                          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from redist import moved
from redist.execute import shard_mapped
from redist.handover import Staging
from redist.meshes import factor_spec, translate
from redist.specs import dist_type, entry_axes, mesh_shape, padded_entries
from redist.steps import Plan
from redist.synthesis import synthesize_uneven
from redist.transfer import transfer


def is_explicit(mesh) -> bool:
    """Whether ``mesh`` has Explicit axes (sharding is part of a value's type inside ``jit``)."""
    return any(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ()))


def device_ids(mesh) -> tuple[int, ...] | None:
    """The ids of ``mesh``'s devices in its order, or ``None`` for a mesh without devices."""
    try:
        devices = getattr(mesh, "devices", None)
    except (NotImplementedError, ValueError):  # an AbstractMesh has no devices
        return None
    if devices is None:
        return None
    return tuple(int(d.id) for d in devices.flat)


def same_mesh(a, b) -> bool:
    """Same axes and sizes, and the same devices in the same order where both are known."""
    if dict(a.shape) != dict(b.shape) or tuple(a.axis_names) != tuple(b.axis_names):
        return False
    ia, ib = device_ids(a), device_ids(b)
    return ia is None or ib is None or ia == ib


def _addressable(*meshes) -> bool:
    """Whether every device of ``meshes`` is this process's."""
    here = jax.process_index()
    return all(d.process_index == here for m in meshes for d in m.devices.flat)


def _on_devices(mesh, like):
    """``mesh`` over ``like``'s devices (in ``like``'s order) when ``mesh`` is abstract and
    ``like`` is not: inside ``jit`` two meshes of one move share their devices and order. A
    ``shard_map`` on an abstract mesh is lowered on the context's concrete mesh, whose axis
    names need not be the factored mesh's."""
    if device_ids(mesh) is not None or device_ids(like) is None:
        return mesh
    if math.prod(mesh.axis_sizes) != like.devices.size:
        return mesh
    return jax.sharding.Mesh(like.devices.reshape(tuple(mesh.axis_sizes)), tuple(mesh.axis_names),
                             axis_types=tuple(mesh.axis_types))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Reshard:
    """One redistribution as JAX sees it: an array of ``shape`` on ``mesh``, laid out as ``src``
    (``unreduced`` axes are a pending sum), goes to the placement ``dst`` (on ``mesh`` or on
    another mesh). Hashable: it is the primitive's parameter, and caches key on it."""

    mesh: Any
    src: PartitionSpec
    dst: NamedSharding
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    options: tuple[str, int]

    @property
    def explicit(self) -> bool:
        return is_explicit(self.mesh)

    @functools.cached_property
    def _route(self) -> tuple[str, Plan | None, Any]:
        """``(kind, plan, run_mesh)``: ``"place"`` (nothing to move), ``"plan"`` (collectives on
        ``run_mesh``'s prime factors), ``"transfer"`` (devices in another order, all in this
        process) or ``"stage"`` (devices of other processes: :attr:`staged`, then handed over)."""
        m = mesh_shape(self.mesh)
        s = dist_type(self.src, self.shape, m, argname="src", padded=True)
        if s.global_size == 0:  # a zero-size array: only its sharding changes
            return "place", None, None
        dst_spec = PartitionSpec(*padded_entries(self.dst.spec, len(self.shape)))  # not `reduced`
        mesh, dst_mesh = (
            _on_devices(self.mesh, self.dst.mesh),
            _on_devices(self.dst.mesh, self.mesh),
        )
        if same_mesh(mesh, dst_mesh):
            d = dist_type(dst_spec, self.shape, m, argname="dst", padded=True)
            plan = synthesize_uneven(m, s, d, self.shape, self.dtype, self.itemsize, *self.options)
            return "plan", plan, mesh
        other = mesh_shape(dst_mesh, argname="dst.mesh")
        d = dist_type(dst_spec, self.shape, other, argname="dst", padded=True)
        a, b = device_ids(self.mesh), device_ids(self.dst.mesh)
        if a is not None and b is not None and a != b:
            if not _addressable(self.mesh, self.dst.mesh):
                return "stage", self.staged.plan, None
            return "transfer", None, None
        if m.num_devices != other.num_devices:
            raise ValueError(f"dst's mesh {other} and x's mesh {m} differ in size")
        on_src = translate(d, other, m)
        if on_src is not None:
            run_mesh, s_run, d_run = mesh, s, on_src
        else:
            on_dst = translate(s, m, other)
            if on_dst is None:
                raise NotImplementedError(
                    f"moving between meshes {m} and {other}: their prime factors lie in different "
                    "orders in the device list, so neither mesh writes both layouts; reorder the "
                    "axes of one mesh so that the prime factors of equal size line up"
                )
            run_mesh, s_run, d_run = dst_mesh, on_dst, d
        plan = synthesize_uneven(mesh_shape(run_mesh), s_run, d_run, self.shape, self.dtype,
                                 self.itemsize, *self.options)  # fmt: skip
        return "plan", plan, run_mesh

    @functools.cached_property
    def staging(self) -> Staging:
        """How the move onto other processes' devices is staged (:mod:`redist.handover`)."""
        return Staging.of(self.mesh.devices, self.dst, len(self.shape))

    @functools.cached_property
    def staged(self) -> Reshard:
        """The move to ``dst``'s layout on a mesh of ``x``'s devices shaped and named as
        ``dst``'s (:attr:`staging`): from there every tile is handed over whole to the device of
        ``dst`` that holds it, the least a device set can receive from another (across processes
        by ``jax.device_put``'s cross-host transfers)."""
        stage = NamedSharding(self.staging.mesh, self.staging.spec)
        return Reshard(self.mesh, self.src, stage, self.shape, self.dtype, self.itemsize,
                       self.options)  # fmt: skip

    @property
    def eager_only(self) -> bool:
        """Whether the move runs only eagerly (a transfer between device orders or processes)."""
        return self._route[0] in ("transfer", "stage")

    @property
    def stageable(self) -> bool:
        """Whether the move can be staged on ``x``'s devices and its tiles handed over whole
        (:mod:`redist.handover`: one device count divides the other)."""
        try:
            self.staging.mesh  # noqa: B018 (checks the sizes)
        except NotImplementedError:
            return False
        return True

    @property
    def across_processes(self) -> bool:
        """Whether the move reaches devices of other processes (see :func:`hand_over`)."""
        return self._route[0] == "stage"

    @property
    def plan(self) -> Plan | None:
        """The synthesized plan (``None`` for a zero-size array or a transfer; for a move across
        processes, the plan of its :attr:`staged` move)."""
        return self._route[1]

    @property
    def uneven(self) -> bool:
        """Whether a layout of the move is uneven (a dimension its axes do not divide)."""
        return self.plan is not None and self.plan.uneven

    def check_uneven(self, eager: bool) -> None:
        """Raises ``ValueError`` where JAX cannot hold this move's uneven layouts: outside ``jit``
        (``jax.device_put`` and ``jit``'s arguments and results refuse them) and on Explicit axes
        (a value's type must divide); inside ``jit`` on Auto axes XLA pads them."""
        if not self.uneven:
            return
        if eager or self.explicit or is_explicit(self.dst.mesh):
            padded = [(n, p) for n, p in zip(self.shape, self.plan.src.global_shape) if n != p]
            padded += [(n, p) for n, p in zip(self.shape, self.plan.dst.global_shape) if n != p]
            n, p = padded[0]
            where = "outside jax.jit" if eager else "on a mesh with Explicit axes"
            raise ValueError(
                f"src {self.src} or dst {self.dst.spec} splits a dimension of size {n} of the "
                f"array of shape {self.shape} unevenly (its tiles are padded to {p} rows), and JAX "
                f"holds no such array {where}: move it inside jax.jit on a mesh with Auto axes, "
                "where XLA pads the last tiles, or choose axes whose sizes divide the dimension"
            )

    def check_traceable(self) -> None:
        """Raises ``ValueError`` if this move cannot run inside ``jax.jit``."""
        if self.eager_only:
            a, b = device_ids(self.mesh), device_ids(self.dst.mesh)
            raise ValueError(
                f"inside jax.jit, dst's mesh must list the devices of x's mesh in the same order "
                f"(JAX runs one jit on one device order); x's mesh has devices {a}, dst's {b}. "
                "Call redistribute outside jit for a transfer between such meshes"
            )
        if self._route[0] == "plan" and self.explicit != is_explicit(self.dst.mesh):
            raise ValueError(
                "inside jax.jit, x's mesh and dst's mesh must both have Explicit axes or both Auto "
                f"ones (x's are {'Explicit' if self.explicit else 'Auto'}); call redistribute "
                "outside jit to move between them"
            )
        self.check_uneven(eager=False)

    def traced(self, x):
        """The move of ``x`` inside a trace (``jit``)."""
        self.check_traceable()
        kind, plan, run_mesh = self._route
        if kind == "place":
            return _place(x, self.dst)
        return _across(plan, run_mesh, self.dst, self.explicit)(x)

    def eager(self, x, donate: bool = False):
        """The move of a concrete array ``x`` (``donate`` gives its buffers to the call)."""
        kind, plan, run_mesh = self._route
        if isinstance(getattr(x, "sharding", None), jax.sharding.SingleDeviceSharding) and \
                len(device_ids(self.mesh)) > 1:  # fmt: skip
            # A cotangent an eager jax.grad made on one device (the ones of a sum): its value,
            # placed as the move's source.
            x = jax.device_put(x, NamedSharding(self.mesh, self.src))
        self.check_uneven(eager=True)
        if kind == "place":
            return jax.device_put(x, self.dst, donate=donate)
        if kind == "transfer":
            return transfer(x, self.dst, donate=donate)
        if kind == "stage":
            return hand_over([x], [self], donate)[0]
        return _across_jitted(plan, run_mesh, self.dst, donate, self.explicit)(x)

    def source_hint(self) -> NamedSharding:
        """Where ``x`` is: on ``mesh``, or across meshes on the prime factors the plan runs on."""
        kind, plan, run_mesh = self._route
        if kind != "plan" or same_mesh(self.mesh, self.dst.mesh):
            return NamedSharding(self.mesh, self.src)
        return NamedSharding(_factored(run_mesh, self.explicit), _factor_pspec(plan.src))

    @functools.cached_property
    def reverse(self) -> Reshard:
        """The transpose: ``dst`` back to ``src`` with its pending axes replicated (each partial
        receives the whole cotangent; JAX types such a cotangent ``reduced``), within the same
        memory bound."""
        pending = frozenset(getattr(self.src, "unreduced", ()) or ())
        back = PartitionSpec(*padded_entries(self.src, len(self.shape)), reduced=pending)
        return Reshard(self.dst.mesh, self.dst.spec, NamedSharding(self.mesh, back), self.shape,
                    self.dtype, self.itemsize, self.options)  # fmt: skip

    def batched(self, size: int, entry) -> Reshard:
        """The move of a stack of ``size`` such arrays (batch dimension first) whose batch
        dimension is split as ``entry``; it stays split where ``dst`` leaves its axes free."""
        src = padded_entries(self.src, len(self.shape))
        dst = padded_entries(self.dst.spec, len(self.shape))
        taken = {a for e in dst for a in entry_axes(e)}
        keep = entry if same_mesh(self.mesh, self.dst.mesh) and not taken & set(entry_axes(entry)) \
            else None  # fmt: skip
        return Reshard(
            self.mesh,
            PartitionSpec(entry, *src, unreduced=self.src.unreduced),
            NamedSharding(self.dst.mesh, PartitionSpec(keep, *dst)),
            (size, *self.shape),
            self.dtype,
            self.itemsize,
            self.options,
        )

    def out_aval(self, aval):
        """The result's abstract value: ``dst``'s sharding on Explicit axes."""
        if not is_explicit(self.dst.mesh):
            return aval.update(sharding=aval.sharding.update(spec=PartitionSpec()))
        mesh = getattr(self.dst.mesh, "abstract_mesh", self.dst.mesh)
        reduced = frozenset(getattr(self.dst.spec, "reduced", ()) or ())
        spec = PartitionSpec(*padded_entries(self.dst.spec, len(self.shape)), reduced=reduced)
        return aval.update(sharding=NamedSharding(mesh, spec))


redistribute_p = Primitive("redistribute")


def _impl(x, *, move: Reshard):
    return move.eager(x)


def _transpose(ct, x, *, move: Reshard):
    del x
    return [redistribute_p.bind(ct, move=move.reverse)]


def _batch(args, dims, *, move: Reshard):
    (x,), (d,) = args, dims
    x = jax.numpy.moveaxis(x, d, 0)
    return redistribute_p.bind(x, move=move.batched(x.shape[0], _leading_entry(x, move))), 0


def _leading_entry(x, move: Reshard):
    """How ``x``'s first dimension is split on ``move.mesh``, where its sharding says so."""
    if isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)
        if sharding is None or not is_explicit(sharding.mesh):
            return None
    else:
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding) or not same_mesh(sharding.mesh, move.mesh):
            return None
    entry = padded_entries(sharding.spec, 1)[0]
    return entry if entry_axes(entry) and dict(sharding.mesh.shape) == dict(move.mesh.shape) \
        else None  # fmt: skip


redistribute_p.def_impl(_impl)
redistribute_p.def_abstract_eval(lambda aval, *, move: move.out_aval(aval))
mlir.register_lowering(
    redistribute_p, mlir.lower_fun(lambda x, *, move: move.traced(x), multiple_results=False)
)
ad.deflinear2(redistribute_p, _transpose)
batching.primitive_batchers[redistribute_p] = _batch


def _place(x, target: NamedSharding):
    """``x`` with sharding ``target``: eagerly ``device_put``; traced, ``reshard`` on Explicit axes
    and a sharding constraint on Auto ones (free when the placement is the same)."""
    if not isinstance(x, jax.core.Tracer):
        return jax.device_put(x, target)
    if is_explicit(target.mesh):
        return jax.sharding.reshard(x, target)
    return jax.lax.with_sharding_constraint(x, target)


def _factored(mesh, explicit: bool):
    """``mesh`` with every axis split into its prime factors (same devices, same order), all of
    them Explicit or all Auto (as the axes of the value moved)."""
    ms = mesh_shape(mesh)
    names = ms.factor_names
    sizes = tuple(f.size for f in ms.factors)
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    kinds = (kind,) * len(sizes)
    if device_ids(mesh) is None:
        return jax.sharding.AbstractMesh(sizes, names, axis_types=kinds)
    return jax.sharding.Mesh(mesh.devices.reshape(sizes), names, axis_types=kinds)


def _resized(v, shape: tuple[int, ...], where: NamedSharding):
    """``v`` zero-padded or cut at the end to ``shape``, placed as ``where``: XLA lays out an
    uneven dimension as the padded one, so with the same axes neither moves data."""
    if tuple(v.shape) == tuple(shape):
        return v
    if all(n <= m for n, m in zip(v.shape, shape)):
        v = jax.numpy.pad(v, [(0, m - n) for n, m in zip(v.shape, shape)])
    else:
        v = v[tuple(slice(0, m) for m in shape)]
    return _place(v, where)


def _tile_permutation(plan: Plan) -> bool:
    """Whether ``plan`` is an uneven move of whole padded tiles between devices, which XLA's
    partitioner makes itself: one collective-permute of the padded layout as it lies. A
    ``shard_map`` must first pad the array, a masked pass over the tile (measured on 8 CPU
    devices: 0.36-0.58x XLA's time on such moves, and a tile of temporaries XLA does without).

    Example:
        >>> _tile_permutation(plan((1479, 124), P("a", "b"), P("b", "a"), mesh))   # doctest: +SKIP
        True
    """
    return plan.uneven and [s.kind for s in plan.steps] == ["allpermute"]


def _factor_pspec(t) -> PartitionSpec:
    """``t`` as a ``PartitionSpec`` over the factored mesh (pending factors unreduced)."""
    return PartitionSpec(*factor_spec(t), unreduced=frozenset(t.pending))


def hand_over(xs: list, moves: list[Reshard], donate: bool = False) -> list:
    """Moves across processes, all at once: every ``x`` moved to its destination's layout on its
    own devices (:attr:`Reshard.staged`, cut into pieces where the destination has more devices:
    one ``jit`` for all), then every tile handed over whole by batched ``jax.device_put``s, one
    per pair of device lists (:func:`_handed`; JAX's cross-host transfers; they need ``jax_cross_host_transfer_socket_address`` where the
    backend has no transfers of its own).

    Example:
        >>> ys = hand_over([x], [move])  # doctest: +SKIP
    """
    staged = iter(_staging(tuple(moves), donate)(*xs))
    pieces = [[m.staging.handed(next(staged)) for _ in m.staging.pieces] for m in moves]
    handed = iter(_handed([p for ps in pieces for p in ps],
                          [t for m in moves for t in m.staging.targets()]))  # fmt: skip
    ys = [m.staging.received([next(handed) for _ in ps], m.shape, ps[0].dtype)
          for m, ps in zip(moves, pieces)]  # fmt: skip
    # staged is freed when dropped, once sent: deleting it by hand could free it before the
    # receiver reads it. A donated x whose buffers XLA could not use is freed here (never one
    # the program forwards: with donation jit copies or aliases, it does not forward).
    for x in xs if donate else ():
        if not x.is_deleted():
            x.delete()
    return ys


def _handed(xs: list[jax.Array], targets: list[NamedSharding]) -> list[jax.Array]:
    """``xs`` put on ``targets`` across processes: one batched ``jax.device_put`` per pair of
    source and destination device lists, in the order they first appear. (JAX's batch groups its
    cross-host copies by that pair in an order of its own, which two processes need not share;
    measured on CPU: a two-group batch swapped the groups' data on the receiver.)"""
    groups: dict[tuple, list[int]] = {}
    for i, (x, t) in enumerate(zip(xs, targets)):
        groups.setdefault((device_ids(x.sharding.mesh), device_ids(t.mesh)), []).append(i)
    out: list = [None] * len(xs)
    for group in groups.values():
        for i, y in zip(group, jax.device_put([xs[i] for i in group], [targets[i] for i in group])):
            out[i] = y
    return out


@functools.lru_cache(maxsize=256)
def _staging(moves: tuple[Reshard, ...], donate: bool):
    """One ``jit`` making every move's stage (:attr:`Reshard.staged`) and cutting it into the
    pieces handed over (on one device set, across meshes of those devices)."""

    def run(*xs):
        out = []
        for x, m in zip(xs, moves):
            out += m.staging.cut(redistribute_p.bind(x, move=m.staged), m.shape)
        return out

    shardings = [m.staged.dst for m in moves for _ in m.staging.pieces]
    donated = tuple(range(len(moves))) if donate else ()
    return jax.jit(run, out_shardings=shardings, donate_argnums=donated)


@functools.lru_cache(maxsize=1024)
def _across_jitted(plan: Plan, run_mesh, dst: NamedSharding, donate: bool, explicit: bool):
    run = _across(plan, run_mesh, dst, explicit, hand_over=False)  # out_shardings hands over
    return jax.jit(run, out_shardings=dst, donate_argnums=(0,) if donate else ())


@functools.lru_cache(maxsize=1024)
def _across(plan: Plan, run_mesh, dst: NamedSharding, explicit: bool, hand_over: bool = True):
    """The function running ``plan`` on ``run_mesh``'s prime factors and handing the result over
    to ``dst`` (the same placement, so neither hand-over moves data). On the factored mesh a
    plan's device groups are named axes far more often than on the user's (measured: all of 300
    random plans on {a:4, b:2}, against 264), which ``vmap`` needs."""
    factored = _factored(run_mesh, explicit)
    s_spec, d_spec = _factor_pspec(plan.src), _factor_pspec(plan.dst)
    abstract = getattr(factored, "abstract_mesh", factored)

    def run(v):
        with jax.sharding.use_abstract_mesh(abstract):
            v = _place(v, NamedSharding(factored, s_spec))
            if plan.steps and not explicit and _tile_permutation(plan):
                v = _place(v, NamedSharding(factored, d_spec))  # XLA's collective-permute
            elif plan.steps:
                # uneven layouts: padding the last tiles, and dropping it, moves nothing
                v = _resized(v, plan.src.global_shape, NamedSharding(factored, s_spec))
                v = shard_mapped(plan, factored, s_spec, d_spec)(v)
                v = _resized(v, plan.global_shape, NamedSharding(factored, d_spec))
        return _place(v, dst) if hand_over else v

    return run


def __getattr__(name: str):
    """``Move``, the old name of :class:`Reshard`, with a ``DeprecationWarning``."""
    return moved.renamed_attribute("redist.linear", name, globals())
