"""Fitting again in one process, as a notebook does (issue 29 item 5): after the first fit, nothing accumulates."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, WORKERS, run_bounded

pytestmark = pytest.mark.multiprocess


def test_three_fits_in_one_process_return_to_the_level_after_the_first(tmp_path):
    """Threads, worker processes and open files after the second and third fits are those after the first; memory
    grows by less than 40 MiB; each trainer, dropped with its model and loaders, is freed (persistent loader workers
    included: none is left)."""
    code, output = run_bounded(
        [sys.executable, str(WORKERS / "fit_three_times.py"), str(tmp_path)], timeout=300, cwd=REPO
    )
    assert code == 0, output[-3000:]
    fits = [json.loads(line) for line in output.splitlines() if line.startswith('{"fit"')]
    assert [fit["fit"] for fit in fits] == [0, 1, 2], output[-3000:]
    first = fits[0]
    print("\n".join(json.dumps(fit) for fit in fits))
    for later in fits:
        assert later["trainer_freed"] and later["children"] == []
        assert later["threads"] == first["threads"] and later["open_files"] == first["open_files"]
    assert fits[2]["rss_mib"] - first["rss_mib"] < 40
