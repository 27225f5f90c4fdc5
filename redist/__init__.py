"""redist: memory-bounded redistribution of sharded JAX arrays.

``plan`` and the types are pure (no JAX import); ``redistribute`` imports JAX on first use.
"""

from redist import moved
from redist.reference import run_reference
from redist.specs import plan
from redist.steps import Plan, Step
from redist.types import DistDim, DistType, MeshShape

__all__ = [
    "DistDim",
    "DistType",
    "MeshShape",
    "Plan",
    "Step",
    "plan",
    "redistribute",
    "run_reference",
]


def __getattr__(name: str):
    if name == "redistribute":
        from redist.api import redistribute

        return redistribute
    return moved.renamed_attribute("redist", name, globals())


moved.install()
