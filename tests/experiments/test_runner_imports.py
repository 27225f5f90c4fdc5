"""The runners import one another without cycles (function-level imports included): what
several share lives in a small module of its own (experiments/recipe_rows.py, measure.py...)."""

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[2] / "experiments"


def imports_of(source: str) -> set[str]:
    """The ``experiments.*`` modules ``source`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("experiments.")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "experiments":
                found |= {f"experiments.{a.name}" for a in node.names}
            elif node.module.startswith("experiments."):
                found.add(node.module)
    return found


def cycles(sources: dict[str, str]) -> list[list[str]]:
    graph = nx.DiGraph()
    for name, source in sources.items():
        graph.add_node(name)
        graph.add_edges_from((name, t) for t in imports_of(source) if t in sources and t != name)
    return list(nx.simple_cycles(graph))


def test_the_runners_import_without_cycles():
    sources = {f"experiments.{p.stem}": p.read_text() for p in ROOT.glob("*.py")}
    assert "experiments.recipes" in sources and cycles(sources) == []


def test_the_check_finds_a_cycle_through_a_function_level_import():
    sources = {"experiments.a": "from experiments.b import f\n",
               "experiments.b": "def f():\n    from experiments import a\n"}  # fmt: skip
    assert [sorted(c) for c in cycles(sources)] == [["experiments.a", "experiments.b"]]
