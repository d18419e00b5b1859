"""The plan and run report with a tracking logger: never in its store root, and in the logger's run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import run_fit  # noqa: E402

pytestmark = pytest.mark.multiprocess


def test_with_mlflow_the_report_is_a_run_artifact_and_the_store_root_stays_mlflows(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")  # (in the test extra: `pip install -e ".[test]"`)
    store = tmp_path / "mlruns"
    # A file store, the one whose root the report used to land in (MLflow 3 asks to opt in to it).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run = run_fit(
        tmp_path / "out",
        "--batch-sizes",
        "3",
        "13",
        "--max-steps",
        "2",
        "--mlflow",
        str(store),
        env={"MLFLOW_ALLOW_FILE_STORE": "true"},
    )
    assert run.returncode == 0, run.output[-4000:]
    assert not (store / "hetero").exists()  # MLflow read it as a malformed experiment
    client = mlflow.tracking.MlflowClient(tracking_uri=f"file:{store}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "hetero-test"]
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    artifacts = {Path(a.path).name for a in client.list_artifacts(mlflow_run.info.run_id, "hetero")}
    assert {"plan.json", "rank_0.json", "rank_1.json", "report.json", "report.png"} <= artifacts
    # The local copy is the run's own folder under the Trainer's root, not shared with the next run.
    (local,) = (tmp_path / "out" / "hetero").iterdir()
    assert local.name == f"{experiment.experiment_id}_{mlflow_run.info.run_id}" and (local / "report.json").exists()
    assert "the plan and run report are in the MLflow run too" in run.output


def test_with_wandb_the_report_is_in_the_runs_files(tmp_path):
    pytest.importorskip("wandb")  # (in the test extra)
    save_dir = tmp_path / "wandb_runs"
    # Offline: W&B writes the run, its files included, under save_dir/wandb/offline-run-*/ and sends nothing.
    run = run_fit(
        tmp_path / "out",
        "--batch-sizes",
        "3",
        "13",
        "--max-steps",
        "2",
        "--wandb",
        str(save_dir),
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert run.returncode == 0, run.output[-4000:]
    assert not (save_dir / "hetero").exists()  # not in the logger's save directory (the store root)
    (local,) = (tmp_path / "out" / "hetero").iterdir()  # the run's own folder under the Trainer's root
    assert (local / "report.json").exists()
    (wandb_run,) = (save_dir / "wandb").glob("offline-run-*")
    assert wandb_run.name.endswith(local.name.rsplit("_", 1)[1])  # the folder is named after the W&B run
    files = {path.name for path in (wandb_run / "files" / local.name).iterdir()}
    assert {"plan.json", "rank_0.json", "rank_1.json", "report.json", "report.png"} <= files
    assert "the plan and run report are in the W&B run too" in run.output


FIT_WITHOUT_A_LOGGER = """
import sys
sys.path.insert(0, {repo!r})
from lightning.pytorch import Trainer
from examples.spirals import SpiralClassifier, SpiralDataModule
from lightning_hetero import HeteroStrategy
trainer = Trainer(accelerator="cpu", devices=1, strategy=HeteroStrategy(batch_sizes=[16]), max_steps=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, limit_val_batches=0{root})
trainer.fit(SpiralClassifier(hidden=8, depth=1), SpiralDataModule(batch_size=16, train_samples=64, val_samples=16))
"""


@pytest.mark.parametrize("root", [None, "named"])
def test_without_a_logger_nothing_is_written_unless_a_folder_is_named(root, tmp_path):
    """Lightning's convention (issue 51, item 4): `Trainer(logger=False)` with no `default_root_dir` wrote
    hetero/plan.json, rank_0.json and report.json into the working directory, which Lightning's test fixture flags as
    artifacts left behind. Now it writes nothing there and prints the plan and the summary; a `default_root_dir`
    given is a folder named: the files go to its hetero/."""
    from conftest import REPO, run_bounded

    work = tmp_path / "work"
    work.mkdir()
    given = f", default_root_dir={str(tmp_path / root)!r}" if root else ""
    (tmp_path / "fit.py").write_text(FIT_WITHOUT_A_LOGGER.format(repo=str(REPO), root=given))
    code, output = run_bounded([sys.executable, str(tmp_path / "fit.py")], timeout=120, cwd=work)
    assert code == 0, output[-3000:]
    assert "HeteroStrategy run report: 2 steps" in output and "micro-batch" in output  # (the summary, the plan)
    assert list(work.iterdir()) == []
    if root:
        assert {p.name for p in (tmp_path / root / "hetero").iterdir()} >= {"plan.json", "rank_0.json", "report.json"}
        assert f"written to {tmp_path / root / 'hetero'}" in output
    else:
        assert "written to" not in output
