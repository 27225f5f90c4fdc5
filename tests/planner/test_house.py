"""The planner's house: stages as packages, each importing only the stages below it, and caches
held by the stage that fills them.

Reads every module's imports from its source (``ast``, nothing imported) and fails on an import
cycle, on an import from a later stage, on a ``planner`` import deferred into a function (the way
cycles hide), on a deferred import of anything else without a reason on its line, and on JAX
imported by a stage that prices or searches (those stay pure). A ``TYPE_CHECKING`` import is for
annotations only: it may not reach a later stage, and it is left out of the cycle check. A module
writing into another object's ``__dict__`` (a hidden cache) fails too.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "planner"
STAGES = {"program": 0, "layout": 1, "cost": 2, "solver": 3, "lowering": 3, "": 4}
"""Stage -> rank; a module imports its own stage or a lower rank ("": the user's objects)."""
PURE = frozenset({"layout", "cost", "solver"})
"""Stages whose modules do not import JAX (their inputs are programs, schedules and numbers)."""


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stage_of(module: str) -> str:
    """``planner.cost.simulator`` -> ``"cost"``; ``planner.auto``, ``planner`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else ""


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.Module, lines: list[str], modules: set[str]):
    """``(target module, kind, line number, has a comment)`` of every import in ``tree``; kind
    ``"top"``, ``"typing"`` (under ``if TYPE_CHECKING``) or ``"deferred"`` (in a def or class)."""

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        # ``from planner.program import rules`` imports the module planner.program.rules
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]

    out = []

    def walk(nodes, kind):
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                comment = "#" in lines[node.lineno - 1]
                out.extend((t, kind, node.lineno, comment) for t in targets(node))
            elif isinstance(node, ast.If) and _type_checking(node):
                walk(node.body, "typing")
                walk(node.orelse, kind)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(node.body, "deferred")
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    walk(getattr(node, field, []) or [], kind)

    walk(tree.body, "top")
    return out


def problems(sources: dict[str, str]) -> list[str]:
    """Everything wrong with the house whose modules are ``sources`` (module name -> text)."""
    modules = set(sources)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    found = []
    for name, text in sorted(sources.items()):
        lines = text.splitlines()
        here = stage_of(name)
        tree = ast.parse(text)
        found += [f"{name}:{n.lineno} keeps state in an object's __dict__ (a cache is a "
                  "planner.program.memo.PerObject its stage owns)"
                  for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "__dict__"]  # fmt: skip
        for target, kind, line, comment in imports(tree, lines, modules):
            where = f"{name}:{line} imports {target}"
            if target.split(".")[0] in ("jax", "jaxlib") and here in PURE and kind == "top":
                found.append(f"{where}: the {here} stage does not import JAX")
            if target.split(".")[0] != "planner":
                if kind == "deferred" and not comment:
                    found.append(f"{where} inside a function without a reason on its line")
                continue
            if kind == "deferred":
                found.append(f"{where} inside a function (import it at the top)")
            there = stage_of(target)
            if there != here and STAGES[there] >= STAGES[here]:
                found.append(f"{where}: stage {here or 'top'!r} may not import {there or 'top'!r}")
            if kind == "top" and target in modules and target != name:
                graph.add_edge(name, target)
    found += [f"import cycle: {' -> '.join(c)}" for c in nx.simple_cycles(graph)]
    return found


def planner_sources() -> dict[str, str]:
    return {module_name(p, ROOT): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_the_planner_imports_only_downwards_without_cycles():
    sources = planner_sources()
    assert {stage_of(m) for m in sources} == set(STAGES), sorted(sources)
    assert problems(sources) == []


@pytest.mark.parametrize(
    "sources, expected",
    [
        ({"planner.cost.a": "from planner.solver.b import f\n", "planner.solver.b": "f = 1\n"},
         "stage 'cost' may not import 'solver'"),
        ({"planner.solver.a": "from planner.lowering.spmd.b import f\n", "planner.lowering.spmd.b": ""},
         "stage 'solver' may not import 'lowering'"),
        ({"planner.auto": "from planner.summary import f\n",
          "planner.summary": "from planner.auto import g\n"}, "import cycle"),
        ({"planner.program.a": "def f():\n    from planner.program.b import g\n",
          "planner.program.b": ""}, "inside a function (import it at the top)"),
        ({"planner.program.a": "def f():\n    import numpy\n"}, "without a reason"),
        ({"planner.cost.a": "import jax\n"}, "does not import JAX"),
        ({"planner.cost.a": "def f(p):\n    p.__dict__['_k'] = 1\n"}, "keeps state in an object's"),
        ({"planner.program.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from planner.cost.b import C\n", "planner.cost.b": ""},
         "stage 'program' may not import 'cost'"),
    ],
)  # fmt: skip
def test_the_check_finds_what_it_forbids(sources, expected):
    found = problems(sources)
    assert any(expected in p for p in found), found


def test_allowed_houses_pass_the_check():
    sources = {
        "planner.program.ir": "from planner.program.schedule import make\n",
        "planner.program.schedule": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from planner.program.ir import Program\n",
        "planner.cost.memory": "def f():\n    import jax  # the host's devices\n",
        "planner.auto": "from planner.cost.memory import f\nfrom planner.program import ir\n",
    }
    assert problems(sources) == []
