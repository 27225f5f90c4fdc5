"""Names that moved keep working for a release: the old import path or attribute gives the new
object, with a DeprecationWarning naming where it lives now (redist.moved, CHANGELOG.md)."""

import importlib
import sys

import pytest

import planner
import redist
from redist import moved


def forget(old: str) -> None:
    """As if ``old`` had never been imported (its entry, and the attribute on its package)."""
    sys.modules.pop(old, None)
    parent, _, child = old.rpartition(".")
    if child in vars(sys.modules[parent]):
        delattr(sys.modules[parent], child)


@pytest.mark.parametrize("old, new", sorted(moved.MOVED_MODULES.items()))
def test_an_old_module_path_imports_the_new_module_with_a_warning(old, new):
    forget(old)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: use {new}"):
        module = importlib.import_module(old)
    current = importlib.import_module(new)
    public = [n for n in vars(current) if not n.startswith("_")]
    assert public and all(getattr(module, n) is getattr(current, n) for n in public)


def test_renamed_names_are_the_new_objects_with_a_warning():
    import redist.linear

    with pytest.warns(
        DeprecationWarning, match=r"redist\.simulate is deprecated: use redist\.run_reference"
    ):
        assert redist.simulate is redist.run_reference
    with pytest.warns(DeprecationWarning, match=r"redist\.linear\.Move .* redist\.linear\.Reshard"):
        assert redist.linear.Move is redist.linear.Reshard
    forget("redist.lower")
    with pytest.warns(DeprecationWarning, match=r"redist\.lower is deprecated"):
        from redist.lower import lower
    from redist.concrete import concretize

    assert lower is concretize
    forget("planner.compiled")
    with pytest.warns(DeprecationWarning, match=r"planner\.target\.compiled"):
        assert planner.compiled.topology_mesh is planner.topology_mesh


def test_no_old_path_shadows_a_name_of_its_package():
    """Importing ``a.b`` binds ``b`` on ``a``: no old path may be a name the package has."""
    for old in moved.MOVED_MODULES:
        package, _, child = old.rpartition(".")
        assert child not in vars(importlib.import_module(package)) or isinstance(
            getattr(importlib.import_module(package), child), type(moved)
        ), old


def test_unknown_names_are_still_attribute_errors():
    for module, name in ((redist, "simulat"), (planner, "compile")):
        with pytest.raises(AttributeError, match=rf"has no attribute '{name}'"):
            getattr(module, name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("planner.nothing_here")
