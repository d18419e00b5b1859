"""What a rank does at start-up instead of DeepSpeed's defaults (:mod:`lightning_hetero.runtime.startup`)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, run_bounded

# In a fresh interpreter: build the strategy (the first DeepSpeed import), then what the process holds.
PROBE = """
import json, sys
{before}
from lightning_hetero import HeteroStrategy
HeteroStrategy()
import deepspeed.autotuning.autotuner as autotuner
imported_mlflow = "mlflow" in sys.modules
import mlflow  # still importable: Lightning's MLFlowLogger needs it
print(json.dumps({{"mlflow_at_start": imported_mlflow, "autotuner_has_mlflow": autotuner.has_mlflow,
                  "mlflow_after": mlflow.__name__}}))
"""


def probe(before: str = "") -> dict:
    code, output = run_bounded([sys.executable, "-c", PROBE.format(before=before)], timeout=120, cwd=REPO)
    assert code == 0, output[-3000:]
    return json.loads(output.strip().splitlines()[-1])


@pytest.mark.multiprocess
def test_deepspeed_is_imported_without_mlflow_which_stays_importable():
    pytest.importorskip("mlflow")  # (in the test extra: what a machine with MLflow pays)
    fresh = probe()
    assert not fresh["mlflow_at_start"] and fresh["autotuner_has_mlflow"] is False
    assert fresh["mlflow_after"] == "mlflow"
    # A process that imported MLflow itself keeps DeepSpeed's own behaviour.
    already = probe("import mlflow")
    assert already["mlflow_at_start"] and already["autotuner_has_mlflow"] is True
