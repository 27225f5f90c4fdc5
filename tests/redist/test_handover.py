"""The staging of moves onto other devices (:mod:`redist.handover`): which server axes are spread,
and every staging the code can choose handed over exactly, here within one process (the
cross-process runs are in ``test_multihost.py``)."""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from redist.handover import Staging, spread_axes
from redist.linear import Reshard, hand_over


@pytest.mark.parametrize(
    "sizes, entries, k, expected",
    [
        ({"ep": 2, "tp": 4}, ("ep", "tp"), 4, ("tp",)),
        ({"ep": 2, "tp": 4}, (("ep", "tp"),), 4, ("tp",)),
        ({"ep": 2, "tp": 4}, (("tp", "ep"),), 4, None),  # tp is not the minor part
        ({"ep": 2, "tp": 4}, (("tp", "ep"),), 2, ("ep",)),
        ({"dp": 2, "tp": 2}, (None, "tp"), 2, ("dp",)),  # an axis no entry names: whole copies
        ({"a": 2, "b": 2, "c": 2}, (("a", "b", "c"),), 4, ("b", "c")),
        ({"a": 2, "b": 2, "c": 2}, ("a", "b", "c"), 8, ("a", "b", "c")),
        ({"a": 2, "b": 3}, ("a",), 4, None),  # no axes multiply to 4
    ],
)
def test_spread_axes(sizes, entries, k, expected):
    assert spread_axes(sizes, entries, k) == expected


def _specs(names, ndim):
    """Every layout of ``ndim`` dimensions over ``names`` (each axis at most once)."""
    choices = [None, *names, *itertools.permutations(names, 2)]
    for entries in itertools.product(choices, repeat=ndim):
        used = [a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)]
        if len(used) == len(set(used)):
            yield P(*entries)


def test_every_staging_hands_over_exactly():
    """From 2 devices onto 4 (spread), 4 onto 4 and 4 onto 2 (copies), every layout of a 2-d
    array on a 2x2 server mesh or of a 4-device one: staged, cut, put and reassembled here."""
    devices = np.array(jax.devices())
    shape = (8, 12)
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    servers = [Mesh(devices[4:].reshape(2, 2), ("dp", "tp")), Mesh(devices[6:], ("tp",))]
    trainers = [Mesh(devices[:2], ("fsdp",)), Mesh(devices[:4], ("fsdp",))]
    checked = 0
    for server, trainer in itertools.product(servers, trainers):
        x = jax.device_put(value, NamedSharding(trainer, P("fsdp")))
        for spec in _specs(server.axis_names, 2):
            if any(n % (np.prod([server.shape[a] for a in ((e,) if isinstance(e, str) else e)]))
                   for n, e in zip(shape, spec) if e is not None):  # fmt: skip
                continue
            dst = NamedSharding(server, spec)
            move = Reshard(trainer, P("fsdp"), dst, shape, "float32", 4, ("bytes", 0))
            (y,) = hand_over([x], [move])
            assert y.sharding == dst, (spec, y.sharding)
            for shard in y.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
            checked += 1
    assert checked >= 28  # the layouts whose axes divide (8, 12), on four pairs of meshes


def test_a_staging_it_cannot_make_is_refused():
    devices = np.array(jax.devices())
    server = NamedSharding(Mesh(devices[4:], ("tp",)), P("tp"))
    with pytest.raises(NotImplementedError, match="divide"):
        Staging.of(devices[:3], server, 2)
    wide = NamedSharding(Mesh(devices.reshape(2, 4), ("ep", "tp")), P(("tp", "ep")))
    with pytest.raises(NotImplementedError, match="minor part"):
        Staging.of(devices[:2], wide, 1)
