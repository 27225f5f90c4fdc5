"""The documentation's code runs: every ```python block of README.md and docs/*.md.

Each page is one test: its python blocks run in order in one fresh namespace, like a doctest
session (a block may use the names of the blocks before it on the same page). A block that cannot
run here says so on the line before its fence, ``<!-- not run: REASON -->``; a block that needs an
optional compiler says ``<!-- needs: libtpu -->`` or ``<!-- needs: xla-gpu -->``, and its page is
skipped where that compiler is missing. Blocks in other languages (bash, text) are not run. The
test process already has 8 CPU devices (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import os
import pathlib
import re

import jax
import pytest

from planner.target.gpus import xla_gpu_missing

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*(not run|needs)\s*:(.*?)-->\s*$")
_NEEDS = {
    "libtpu": lambda: importlib.util.find_spec("libtpu") is None,
    "xla-gpu": xla_gpu_missing,
}


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: its language, source, first line (1-based) and its marker."""

    lang: str
    source: str
    line: int
    not_run: str | None = None  # the reason, where marked <!-- not run: ... -->
    needs: str | None = None  # an optional compiler, where marked <!-- needs: ... -->


def blocks(text: str) -> list[Block]:
    """Every fenced block of a markdown text, in order, with the marker on the line before it."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"unclosed code fence at line {start + 1}")
        mark = _MARK.match(lines[start - 1].strip()) if start else None
        kind, arg = (mark.group(1), mark.group(2).strip()) if mark else (None, None)
        out.append(
            Block(
                lang=m.group(1),
                source="\n".join(body) + "\n",
                line=start + 2,
                not_run=arg if kind == "not run" else None,
                needs=arg if kind == "needs" else None,
            )
        )
        i += 1
    return out


def python_blocks(text: str) -> list[Block]:
    return [b for b in blocks(text) if b.lang == "python"]


def run_page(text: str, page: str) -> dict:
    """Runs a page's python blocks, not those marked not run, in order in one namespace; returns
    it. Output is swallowed; an exception propagates, its traceback naming ``page:blockN``."""
    namespace: dict = {"__name__": "docs_" + re.sub(r"\W", "_", page)}
    for i, block in enumerate(python_blocks(text)):
        if block.not_run is not None:
            continue
        code = compile(block.source, f"{page}:block{i}", "exec")
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, namespace)
    return namespace


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_page_python_blocks_run(path: pathlib.Path) -> None:
    text = path.read_text()
    found = python_blocks(text)
    missing = sorted({b.needs for b in found if b.needs and _NEEDS[b.needs]()})
    if missing:
        pytest.skip(f"{path.name} needs {', '.join(missing)}")
    if not found:
        pytest.skip(f"{path.name} has no python blocks")
    # Blocks set XLA_FLAGS to 8 CPU devices, as a user would before importing JAX: start JAX's
    # backends first, with conftest's flags, so that those lines change nothing for this process
    # or the tests after it, and leave the variable as it was.
    assert len(jax.devices()) == 8
    flags = os.environ.get("XLA_FLAGS")
    try:
        run_page(text, path.name)
    finally:
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags


def test_markers_name_a_reason_or_a_known_compiler() -> None:
    for path in PAGES:
        for b in blocks(path.read_text()):
            where = f"{path.name}:{b.line}"
            assert b.not_run is None or b.not_run, f"{where}: '<!-- not run: -->' needs a reason"
            assert b.needs is None or b.needs in _NEEDS, (
                f"{where}: needs {b.needs!r}, not one of {list(_NEEDS)}"
            )


def test_extractor_finds_the_readme_example_and_the_runner_fails_on_errors() -> None:
    readme = python_blocks((ROOT / "README.md").read_text())
    assert any("redist.redistribute(" in b.source and b.not_run is None for b in readme)
    page = "\n".join(
        [
            "Text.",
            "```python",
            "x = 1",
            "```",
            "```bash",
            "exit 1",
            "```",
            "<!-- not run: a fragment -->",
            "```python",
            "undefined_name",
            "```",
            "```python",
            "assert x == 1  # the first block's names",
            "raise RuntimeError('boom')",
            "```",
        ]
    )
    found = python_blocks(page)
    assert [b.not_run for b in found] == [None, "a fragment", None]
    assert found[0].source == "x = 1\n" and found[0].line == 3
    with pytest.raises(RuntimeError, match="boom") as info:
        run_page(page, "synthetic.md")
    tb = info.tb
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_filename == "synthetic.md:block2"
    assert run_page(page.replace("raise RuntimeError('boom')", ""), "synthetic.md")["x"] == 1
    with pytest.raises(ValueError, match="unclosed"):
        blocks("```python\nx = 1\n")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    out, fence = set(), False
    for line in path.read_text().splitlines():
        fence ^= line.startswith("```")
        if not fence and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def test_relative_links_resolve() -> None:
    """Every relative link of the pages names a file that exists, and a heading that does."""
    for path in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", path.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            dest = (path.parent / target).resolve() if target else path
            assert dest.exists(), f"{path.name}: {target}"
            if anchor and dest.suffix == ".md":
                assert anchor[1:] in _anchors(dest), f"{path.name}: {target}{anchor}"
