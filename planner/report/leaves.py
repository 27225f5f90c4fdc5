"""The roles of a plan's arguments, by pytree path: parameters, optimizer state, the batch, or
plain inputs, and their layouts grouped where subtrees repeat (for ``explain()``'s layout and
memory lines).

How inputs are classified (a stated heuristic):

- an argument of the function is *state* when it comes back: an output (or an element of a
  tuple, list or dict output, or of one of those) has its tree structure, shapes and dtypes;
- state under an ``optax`` state object, or under a key naming one (``opt_state``,
  ``optimizer``), is *optimizer state*; other state is *parameters*;
- when some argument is state, the others are the *batch*, and the leading dimension of each
  batch array is what the heavy ops call "batch" (followed through the data flow); when none
  is, every argument is an *input*.

Example:
    >>> [leaf.kind for leaf in classify(prog, in_tree, out_tree)]   # doctest: +SKIP
    ['parameters', 'parameters', 'optimizer state', 'batch']
"""

from __future__ import annotations

import collections
import dataclasses

import jax

from planner.program.ir import Program

OPTIMIZER_KEYS = ("opt_state", "optimizer")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One input array: its pytree path (split into keys), value, kind and layout."""

    parts: tuple[str, ...]
    index: int
    kind: str  # "parameters", "optimizer state", "batch" or "input"

    @property
    def path(self) -> str:
        return "".join(self.parts)


def _arg_names(prog: Program, paths) -> list[str]:
    """The name of each argument: from the traced function's signature where JAX recorded it."""
    names: dict[int, str] = {}
    debug = getattr(getattr(prog.jaxpr, "jaxpr", None), "debug_info", None)
    arg_names = getattr(debug, "arg_names", None)
    for k, path in enumerate(paths):
        i = path[0].idx
        if i in names:
            continue
        suffix = jax.tree_util.keystr(tuple(path[1:]))
        full = arg_names[k] if arg_names and len(arg_names) == len(paths) else None
        if full and full.endswith(suffix) and len(full) > len(suffix):
            names[i] = full[: len(full) - len(suffix)]
        else:
            names[i] = f"args[{i}]"
    return [names[p[0].idx] for p in paths]


def _signature(tree, values) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((values[k].shape, values[k].dtype) for k in leaves)


def _nodes(tree, depth: int) -> list:
    """``tree`` and its subtrees down to ``depth`` levels (tuples, lists, dicts)."""
    out = [tree]
    if depth and isinstance(tree, (tuple, list, dict)):
        for child in tree.values() if isinstance(tree, dict) else tree:
            out += _nodes(child, depth - 1)
    return out


def _is_optax(x) -> bool:
    return type(x).__module__.split(".")[0] == "optax"


def state_pairs(prog: Program, in_tree, out_tree) -> list[tuple[int, int]]:
    """``(input, output)`` positions of the arrays a step returns in place of an argument: the
    argument's leaves against those of the first output node (the output, or an element of it
    down to two levels of tuples, lists and dicts; not a lone output array) that has the
    argument's tree structure, shapes and dtypes. Each output is returned in place of one
    argument at most: arguments with more leaves claim theirs first (the parameters a step
    returns, not a batch array of the shape of one of them)."""
    args = jax.tree_util.tree_unflatten(in_tree, list(range(len(prog.inputs))))
    outs = jax.tree_util.tree_unflatten(out_tree, list(range(len(prog.outputs))))
    nodes = [t for t in _nodes(outs, 2) if t is not outs or not isinstance(t, int)]
    pairs, claimed = [], set()
    for arg in sorted(args, key=lambda a: -len(jax.tree_util.tree_leaves(a))):
        sig = _signature(arg, prog.inputs)
        node = next((t for t in nodes if _signature(t, prog.outputs) == sig
                     and claimed.isdisjoint(jax.tree_util.tree_leaves(t))), None)  # fmt: skip
        if node is not None:
            claimed.update(jax.tree_util.tree_leaves(node))
            pairs += zip(jax.tree_util.tree_leaves(arg), jax.tree_util.tree_leaves(node))
    return sorted(pairs)


def _repeating_parameters(args, prog: Program, state: set[int]) -> set[int]:
    """Where no optax type or key names the optimizer state (a Keras optimizer's variables, a
    list beside the weights): the state leaves of an argument's part (an argument, or an element
    of one) whose arrays repeat the shapes of an earlier part's, scalars aside (Adam's moments of
    the parameters, besides its step count)."""
    parts = []
    for arg in args if isinstance(args, (tuple, list)) else (args,):
        children = list(arg.values()) if isinstance(arg, dict) else arg
        parts += list(children) if isinstance(children, (tuple, list)) else [arg]
    groups = [jax.tree_util.tree_leaves(p) for p in parts]
    groups = [g for g in groups if g and set(g) <= state]

    def shapes(g):
        return collections.Counter(prog.inputs[k].shape for k in g if prog.inputs[k].shape)

    out: set[int] = set()
    for i, g in enumerate(groups):
        mine = shapes(g)
        for earlier in groups[:i]:
            theirs = shapes(earlier)
            if mine and set(mine) <= set(theirs) and mine.total() >= theirs.total():
                out.update(g)
                break
    return out


def classify(prog: Program, in_tree, out_tree) -> list[Leaf]:
    """Every input with its path and kind (see the module docstring for the heuristic)."""
    args = jax.tree_util.tree_unflatten(in_tree, list(range(len(prog.inputs))))
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    names = _arg_names(prog, paths)
    state = {i for i, _ in state_pairs(prog, in_tree, out_tree)}
    optimizer = set()
    for path, sub in jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_optax)[0]:
        keys = jax.tree_util.keystr(tuple(path)).lower()
        if _is_optax(sub) or any(k in keys for k in OPTIMIZER_KEYS):
            optimizer.update(jax.tree_util.tree_leaves(sub))
    if not optimizer:
        optimizer = _repeating_parameters(args, prog, state)
    leaves = []
    for k, (path, name) in enumerate(zip(paths, names)):
        parts = (name, *(jax.tree_util.keystr((key,)) for key in path[1:]))
        kind = ("optimizer state" if k in optimizer else "parameters") if k in state else (
            "batch" if state else "input")  # fmt: skip
        leaves.append(Leaf(parts, k, kind))
    return leaves


def group_layouts(leaves: list[Leaf], shapes: dict, specs: dict) -> list[tuple[str, str, str]]:
    """``(paths, layout, kind)`` lines, one per input, except: a subtree whose arrays have the same
    relative paths, shapes and layouts as one already listed is written ``as`` that one (with its
    like neighbours), and a subtree of three or more arrays that all have one layout is written
    once."""
    root: dict = {}
    for leaf in leaves:
        node = root
        for part in leaf.parts[:-1]:
            node = node.setdefault(part, {})
        node[leaf.parts[-1]] = leaf

    def sig(node, prefix=()) -> tuple:
        if isinstance(node, Leaf):
            return ((prefix, shapes[node.index], specs[node.index]),)
        return tuple(s for key, child in node.items() for s in sig(child, (*prefix, key)))

    seen: dict[tuple, str] = {}
    lines: list[tuple[str, str, str]] = []

    def kind(node) -> str:
        while not isinstance(node, Leaf):
            node = next(iter(node.values()))
        return node.kind

    def emit(node, prefix: str) -> None:
        items = list(node.items())
        i = 0
        while i < len(items):
            key, child = items[i]
            name = prefix + key
            if isinstance(child, Leaf):
                lines.append((name, f"{shapes[child.index]:<14} {specs[child.index]}", child.kind))
                i += 1
                continue
            s = sig(child)
            alike = {spec for *_, spec in s}
            if len(s) > 1 and s in seen:
                run = [name]
                while i + len(run) < len(items):
                    key2, child2 = items[i + len(run)]
                    if isinstance(child2, Leaf) or sig(child2) != s:
                        break
                    run.append(prefix + key2)
                shown = ", ".join(run) if len(run) <= 3 else f"{run[0]} ... {run[-1]} ({len(run)})"
                lines.append((shown, f"as {seen[s]}", kind(child)))
                i += len(run)
                continue
            seen.setdefault(s, name)
            if len(s) > 2 and len(alike) == 1:
                lines.append(
                    (f"{name} ({len(s)} arrays)", f"{'all':<14} {alike.pop()}", kind(child))
                )
            else:
                emit(child, name)
            i += 1

    emit(root, "")
    return lines


def batch_loops(prog: Program, leaves: list[Leaf]) -> dict[str, set[str]]:
    """Op name -> its loops that run over the batch: the leading dimension of each batch input,
    followed through the ops' access maps."""
    dims: dict[str, list] = {}
    for leaf in leaves:
        v = prog.inputs[leaf.index]
        if leaf.kind == "batch" and v.shape:
            dims[v.name] = [True] + [False] * (len(v.shape) - 1)
    out: dict[str, set[str]] = {}
    for op in prog.ops:
        loops = set()
        for acc in op.operands:
            for d, batch in zip(acc.dims, dims.get(acc.value.name, ())):
                if d and batch:
                    loops.add(d[0])
        if loops:
            out[op.name] = loops
            for acc in op.results:
                dims[acc.value.name] = [bool(d) and d[0] in loops for d in acc.dims]
    return out
