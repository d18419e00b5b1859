"""The documentation cannot go stale: every Python snippet in README.md and docs/ runs, every relative link of the
README reaches a file, and each limit in docs/limits.md stays within two lines. (The site itself builds in CI with
warnings as errors: `.ci/run`.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Snippets that need more than this process: each with the test that runs its code.
RUN_ELSEWHERE = {
    "TorchTrainer(train_func": "tests/engines/test_ray.py runs Ray's recipe with RayHeteroStrategy on a local cluster",
}


def _snippets() -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in SNIPPET.finditer(text):
            line = text[: match.start()].count("\n") + 1
            found.append(pytest.param(match.group(1), id=f"{page.relative_to(ROOT)}:{line}"))
    return found


def _my_hook(state, bucket):  # the communication page's user hook: DDP's plain all-reduce
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(state, bucket)


@pytest.mark.parametrize("code", _snippets())
def test_every_python_snippet_runs(code):
    for marker, where in RUN_ELSEWHERE.items():
        if marker in code:
            pytest.skip(f"needs a Ray cluster: {where}")
    if not torch.cuda.is_available():  # the same code on CPU devices: the Trainer refuses cuda without a GPU
        code = code.replace('accelerator="cuda"', 'accelerator="cpu"')
    from lightning.pytorch import Trainer

    import lightning_hetero
    from lightning_hetero import HeteroMonitor, HeteroStrategy

    namespace = {
        "Trainer": Trainer,
        "HeteroStrategy": HeteroStrategy,
        "HeteroMonitor": HeteroMonitor,
        "lightning_hetero": lightning_hetero,
        "my_hook": _my_hook,
    }
    exec(compile(code, "<snippet>", "exec"), namespace)


def test_the_snippets_are_found():
    assert len(_snippets()) >= 7  # (the pattern must keep matching the pages' fences)


def test_every_relative_link_of_the_readme_reaches_a_file():
    text = (ROOT / "README.md").read_text()
    links = [target for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text) if "://" not in target]
    assert links
    missing = [target for target in links if not (ROOT / target).exists()]
    assert not missing, f"README.md links to files that are not there: {missing}"


def bullets(markdown: str) -> list[list[str]]:
    """The top-level bullets of a Markdown page, each as its lines (the first, then its indented continuations)."""
    found: list[list[str]] = []
    for line in markdown.splitlines():
        if line.startswith("- "):
            found.append([line])
        elif found and line.startswith("  ") and found[-1]:
            found[-1].append(line)
        elif found and found[-1]:
            found.append([])  # anything else ends the bullet
    return [bullet for bullet in found if bullet]


def test_bullets_are_read_with_their_continuation_lines():
    page = "# Title\n\n- one\n  two\n- three\n\ntext\n  not a continuation\n- four\n"
    assert bullets(page) == [["- one", "  two"], ["- three"], ["- four"]]


def test_each_limit_is_a_bullet_of_at_most_two_lines():
    """docs/limits.md is read as a list of what not to expect, grouped by feature: a limit that needs more than two
    lines is two limits, or has its details on the feature's page."""
    long = [bullet[0][:60] for bullet in bullets((ROOT / "docs" / "limits.md").read_text()) if len(bullet) > 2]
    assert not long, f"limits of more than two lines in docs/limits.md: {long}"
