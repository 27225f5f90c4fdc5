"""Two meshes over one device list: the same placement, written on either mesh's prime factors.

Both meshes number their devices row-major, so a device's position ``L`` in the shared list has
one digit per prime factor on each mesh: factor ``f`` of size ``n`` with stride ``s`` (the product
of the factor sizes after it) reads ``(L // s) % n``. Two factors with the same size and stride
are the same digit, whatever their names; a type whose factors all have a twin on the other mesh
places every tile on the same device when written with the twins.

Example:
    >>> fsdp, serve = MeshShape.of({"fsdp": 8}), MeshShape.of({"dp": 2, "tp": 4})
    >>> t = DistType.from_spec((None, "tp"), (16, 16), serve)
    >>> str(translate(t, serve, fsdp))
    '[16, 4{fsdp#2,fsdp#1}16]'
"""

from __future__ import annotations

from redist.types import DistDim, DistType, MeshShape


def digits(mesh: MeshShape) -> dict[str, tuple[int, int]]:
    """``factor name -> (stride, size)`` of its digit in the row-major device position."""
    out, stride = {}, 1
    for f in reversed(mesh.factors):
        out[f.name] = (stride, f.size)
        stride *= f.size
    return out


def translate(t: DistType, mesh: MeshShape, onto: MeshShape) -> DistType | None:
    """``t`` (a type over ``mesh``'s factors) written over ``onto``'s factors with every tile on the
    same device, or ``None`` when some factor of ``t`` is no single digit of ``onto``.

    Raises:
        ValueError: if the meshes have different device counts.
    """
    if mesh.num_devices != onto.num_devices:
        raise ValueError(
            f"meshes {mesh} and {onto} have {mesh.num_devices} and {onto.num_devices} devices"
        )
    twin = {v: k for k, v in digits(onto).items()}
    ours = digits(mesh)
    dims = []
    for d in t.dims:
        axes = tuple(twin.get(ours[a]) for a in d.axes)
        if None in axes:
            return None
        dims.append(DistDim(d.local, axes, d.size))
    return DistType(tuple(dims))


def factor_spec(t: DistType) -> tuple[tuple[str, ...] | None, ...]:
    """``PartitionSpec`` entries of ``t`` in factor names, major first (for the factored mesh)."""
    return tuple(tuple(reversed(d.axes)) if d.axes else None for d in t.dims)
