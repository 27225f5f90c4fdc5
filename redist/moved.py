"""Old import paths of moved modules and renamed names, kept for a release with a
``DeprecationWarning`` that names the new place (see ``CHANGELOG.md``).

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     from redist.lower import lower
    >>> lower is __import__("redist.concrete").concrete.concretize, caught[0].category.__name__
    (True, 'DeprecationWarning')
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED_MODULES: dict[str, str] = {
    "redist.lower": "redist.concrete",
    "redist.planning": "redist.specs",
    "redist.synthesize": "redist.synthesis",
    "planner.costmodel": "redist.calibration",
    "planner.compiled": "planner.target.compiled",
    "planner.compiled_time": "planner.target.compiled_time",
    "planner.confirm": "planner.target.confirm",
    "planner.gpus": "planner.target.gpus",
    "planner.buffers": "planner.cost.buffers",
    "planner.costs": "planner.cost.costs",
    "planner.memory": "planner.cost.memory",
    "planner.simulator": "planner.cost.simulator",
    "planner.dataflow": "planner.layout.dataflow",
    "planner.donation": "planner.layout.donation",
    "planner.explanation": "planner.layout.explanation",
    "planner.staging": "planner.layout.staging",
    "planner.pipeline": "planner.lowering.gpipe",
    "planner.xla_moves": "planner.lowering.xla_moves",
    "planner.analysis": "planner.program.analysis",
    "planner.discover": "planner.program.discover",
    "planner.halo": "planner.program.halo",
    "planner.jaxpr_params": "planner.program.jaxpr_params",
    "planner.microbatch": "planner.program.microbatch",
    "planner.ir": "planner.program.ops",
    "planner.pad_folding": "planner.program.pad_folding",
    "planner.rules": "planner.program.rules",
    "planner.schedule": "planner.program.schedule",
    "planner.chain": "planner.solver.chain",
    "planner.schedule_search": "planner.solver.schedule_search",
    "planner.summary": "planner.report.summary",
}
"""Old module path -> where it lives now. (``redist.simulate``, ``redist.plan`` and
``planner.analyze`` were modules too, but those names are functions of the packages now, which an
import of the old module would replace: ``redist.simulate`` is the renamed
:func:`redist.run_reference`.)"""

RENAMED: dict[str, dict[str, str]] = {
    "redist": {"simulate": "run_reference"},
    "redist.lower": {"lower": "concretize"},
    "redist.linear": {"Move": "Reshard"},
}
"""Per module (old path or current): old name -> new name."""


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is now ``new`` (``stacklevel``: the frame that used the old name)."""
    warnings.warn(
        f"{old} is deprecated: use {new} (the old name is removed in the next release; see "
        "CHANGELOG.md)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_attribute(module: str, name: str, namespace: dict):
    """The value of ``name``, renamed in ``module``, from ``namespace`` (with the warning), or
    ``AttributeError`` as a module's ``__getattr__`` raises it."""
    new = RENAMED.get(module, {}).get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    deprecated(f"{module}.{name}", f"{module}.{new}", stacklevel=4)
    return namespace[new]


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as a module holding the new module's names."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED_MODULES else None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module) -> None:
        new_name = MOVED_MODULES[module.__name__]
        deprecated(f"module {module.__name__}", new_name)
        new = importlib.import_module(new_name)
        module.__dict__.update({k: v for k, v in vars(new).items() if not k.startswith("__")})
        for old, current in RENAMED.get(module.__name__, {}).items():
            setattr(module, old, getattr(new, current))


def install() -> None:
    """Make the old module paths importable (once per process)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
