"""Every folder of ``results/`` names the commands that made it (``experiments.catalog``), and
those commands reproduce the config the folder stores."""

from __future__ import annotations

import doctest
import importlib
import json
import pathlib

import pytest

from experiments import catalog, results
from experiments.catalog import FOLDERS

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "results"
# Its config.json records several runs over subsets of the recipes (the catalog's note says so).
SEVERAL_RUNS = {"recipes"}


def _folders() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_dir())


def test_the_catalog_lists_every_folder_and_only_those() -> None:
    assert _folders() == sorted(FOLDERS)


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_each_folder_stores_its_commands(name: str) -> None:
    assert (RESULTS / name / "command.txt").read_text() == FOLDERS[name].command_text()


def _config_of(run: catalog.Run) -> dict:
    """``run``'s config file with its ``--config.<field>`` flags applied, as a dict."""
    config = importlib.import_module("configs." + run.config.replace("/", ".")).get_config()
    for field, text in run.overrides().items():
        current = config[field]
        if isinstance(current, bool):
            value = {"True": True, "False": False}[text]
        else:
            value = type(current)(text.strip('"'))
        config[field] = value
    return config.to_dict()


@pytest.mark.parametrize(
    "name", [n for n in sorted(FOLDERS) if (RESULTS / n / "config.json").exists()]
)
def test_a_folders_command_reproduces_the_config_it_stores(name: str) -> None:
    if name in SEVERAL_RUNS:
        pytest.skip(f"{name}/config.json records several runs: {FOLDERS[name].note}")
    stored = json.loads((RESULTS / name / "config.json").read_text())
    made = _config_of(FOLDERS[name].runs[-1])
    assert {k: made.get(k) for k in stored} == stored


def test_a_changed_override_is_caught() -> None:
    """The check above can fail: a seed other than the stored one is told apart."""
    run = FOLDERS["random_heldout"].runs[0]
    stored = json.loads((RESULTS / "random_heldout" / "config.json").read_text())
    changed = catalog.Run(run.runner, run.config, (("config.seed", "2"),))
    assert _config_of(changed)["seed"] != stored["seed"]


def test_results_lists_strays_and_writes_commands(tmp_path: pathlib.Path) -> None:
    (tmp_path / "weight_sync").mkdir()
    (tmp_path / "mystery").mkdir()
    assert results.write_commands(str(tmp_path)) == ["mystery"]
    assert (tmp_path / "weight_sync" / "command.txt").read_text().splitlines()[-1] == (
        "python -m experiments.weight_sync --config=configs/weight_sync/default.py "
        "--workdir=results/weight_sync"
    )


def test_the_summary_reads_the_committed_folders() -> None:
    text = results.summary(str(RESULTS))
    assert "## Random redistributions against XLA" in text
    assert "## What made each folder" in text
    assert (RESULTS / "README.md").read_text() == text


def test_the_catalogs_docstring() -> None:
    assert doctest.testmod(catalog).failed == 0
