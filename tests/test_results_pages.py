"""The benchmark results pages (docs/results/) are rendered from the committed JSON by `python benchmarks/render.py`:
a page that differs from what its JSON renders to fails here, so no figure in them can drift from its runs."""

from __future__ import annotations

import importlib.util
import math
import re
import sys

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def render():
    spec = importlib.util.spec_from_file_location("render", REPO / "benchmarks" / "render.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["render"] = module  # (its dataclasses look their module up while they are made)
    spec.loader.exec_module(module)
    return module


def test_a_cell_is_the_median_with_its_range_and_the_count_of_finite_rounds(render):
    assert render.cell([1.0, 0.9, 1.2]) == "1.000 [0.900-1.200], n=3"
    assert render.cell([1.0, 0.9, 1.2, 1.1]) == "1.050 [0.900-1.200], n=4"  # (the median of an even count)
    assert render.cell([1.5, math.nan, None]) == "1.500, n=1"  # (DDP's missing fit in a round: NaN)
    assert render.cell([]) == "-" and render.cell([math.nan]) == "-"


def test_every_committed_page_is_what_its_json_renders_to(render):
    pages = render.rendered_pages()
    assert pages, "no results page is rendered"
    for path, text in pages.items():
        assert path.exists(), f"{path} is missing: run `python benchmarks/render.py` and commit it"
        assert path.read_text() == text, f"{path} is stale: run `python benchmarks/render.py` and commit it"


def test_every_results_page_is_in_the_site_and_its_plots_exist(render):
    index = (REPO / "docs" / "index.md").read_text()
    for path, text in render.rendered_pages().items():
        assert f"results/{path.stem}" in index, f"docs/index.md's toctree lacks results/{path.stem}"
        plots = re.findall(r"!\[[^\]]*\]\(\.\./images/results/([^)]+)\)", text)
        assert plots
        for plot in plots:
            assert (render.IMAGES / plot).is_file(), plot


def test_every_measured_file_is_rendered_by_its_scripts_page(render):
    """A JSON in benchmarks/measured/ belongs to a script the renderer knows (its name's prefix), and its command
    is listed on that script's page."""
    for path in sorted(render.MEASURED.glob("*.json")):
        script = render.script_of(path.name)
        assert script in render.SCRIPTS, f"{path.name}: no renderer for its script (benchmarks/render.py SCRIPTS)"
        assert f"`{path.name}`: `" in render.page(script, render.sections_of(script))


def test_a_column_writes_its_figures_in_its_own_form(render):
    """A parameter difference or a time in seconds is no ratio: its column says how to write it."""
    assert render.cell([3.2e-7, 1.0e-8, 2.0e-6], ".1e") == "3.2e-07 [1.0e-08-2.0e-06], n=3"
    assert render.cell([12.25, 11.0], ".2f") == "11.62 [11.00-12.25], n=2"


def test_every_page_module_has_a_title_an_introduction_and_its_sections(render):
    """A page module in benchmarks/result_pages/ is found by its file; one that lacks a piece fails here, not when
    its first JSON is committed."""
    assert {"throughput", "throttled", "pipeline_balance", "communication"} <= set(render.SCRIPTS)
    for name, module in render.SCRIPTS.items():
        assert module.TITLE and module.INTRO, name
        assert callable(module.sections), name
        script = getattr(module, "SCRIPT", f"{name}.py")  # (a script in a folder of its own names itself)
        assert (REPO / "benchmarks" / script).is_file(), f"result_pages/{name}.py names no script"


def test_the_compatibility_page_counts_only_passed_tests(render):
    """An `xfail`, a skip or an error is no pass: the counts the drop-in page quotes are the tests that passed."""
    compat = render.SCRIPTS["lightning_compat"]
    assert compat.counts({"a": "PASSED", "b": "XFAIL", "c": "FAILED", "d": "PASSED", "e": "ERROR"}) == (2, 5)
    assert compat.counts({}) == (0, 0)
