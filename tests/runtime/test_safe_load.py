"""Checkpoint files are read without running code from them (lightning_hetero/runtime/safe_load.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, crafted, run_bounded, run_fit, write_deepspeed_checkpoint

from lightning_hetero.local.merges import STATE_DIRNAME, LocalTraining
from lightning_hetero.recover import checkpoint, elastic, export, from_deepspeed, universal
from lightning_hetero.recover.from_lightning import read_lightning_checkpoint
from lightning_hetero.recover.recovery import Recovery
from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.runtime.safe_load import (
    UnsafeCheckpointFile,
    load_deepspeed_file,
    load_lightning_file,
    load_package_file,
    unpickles_in_full,
)


def test_the_crafted_file_does_run_code_when_everything_is_unpickled(tmp_path):
    """(What the refusals below guard against: the same file, loaded as the package loaded it before.)"""
    marker = tmp_path / "ran"
    torch.load(crafted(tmp_path / "a.ckpt", marker), weights_only=False)
    assert marker.read_text() == "ran"


def test_a_crafted_package_file_is_refused_naming_it_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = crafted(tmp_path / "rank_0.pt", marker)
    with pytest.raises(UnsafeCheckpointFile, match=r"rank_0.pt holds objects that loading it could run code from"):
        load_package_file(path)
    assert not marker.exists()


def test_a_crafted_local_sgd_state_in_a_checkpoint_is_refused_at_resume(tmp_path):
    """The per-rank file local SGD adds to a checkpoint, replaced by a crafted one: the resume stops, nothing ran."""
    marker = tmp_path / "ran"
    (tmp_path / STATE_DIRNAME).mkdir()
    crafted(tmp_path / STATE_DIRNAME / "rank_0.pt", marker, steps_done=1, synchronizations=1)
    training = LocalTraining("local_sgd", 1, None, None)
    training.attach([torch.nn.Parameter(torch.zeros(2))], None)
    with pytest.raises(UnsafeCheckpointFile, match="altered or comes from elsewhere"):
        training.load(tmp_path, 0)
    assert not marker.exists()


@pytest.mark.parametrize("weights_only", [None, True])
def test_a_crafted_lightning_file_is_refused_unless_weights_only_is_false(weights_only, tmp_path):
    """A `.ckpt` resumed under `strategy="hetero"` (a DDP run's file): refused as Lightning's `weights_only=None` or
    `True` asks, with the fix named; only an explicit `weights_only=False` (the user trusts the file) unpickles it."""
    marker = tmp_path / "ran"
    path = crafted(tmp_path / "ddp.ckpt", marker)
    with pytest.raises(ResumeRefused, match=r"ddp.ckpt holds objects .* pass `weights_only=False` to `Trainer.fit`"):
        read_lightning_checkpoint(path, weights_only)
    assert not marker.exists()
    read_lightning_checkpoint(path, weights_only=False)
    assert marker.read_text() == "ran"


def test_what_lightning_and_the_package_write_loads_weights_only(tmp_path):
    """A Lightning checkpoint's plain data (hyper-parameters, which Lightning saves as a dict, loops) and the
    package's local-SGD state (its optimizers' states, the error feedback) load without `weights_only=False`."""
    path = tmp_path / "plain.ckpt"
    torch.save(
        {
            "state_dict": {"w": torch.ones(2)},
            "hyper_parameters": {"lr": 0.1},
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 1}}}},
        },
        path,
    )
    loaded = load_lightning_file(path)
    assert loaded["hyper_parameters"] == {"lr": 0.1} and torch.equal(loaded["state_dict"]["w"], torch.ones(2))
    parameter = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.Adam([parameter])
    parameter.grad = torch.ones(3)
    optimizer.step()
    saved = LocalTraining("diloco", 2, {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}, "int8")
    saved.attach([parameter], optimizer)
    saved.error_feedback = torch.full((3,), 0.5)
    saved.save(tmp_path, 0)
    restored = LocalTraining("diloco", 2, {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}, "int8")
    restored.attach([parameter], torch.optim.Adam([parameter]))
    restored.load(tmp_path, 0)
    assert torch.equal(restored.error_feedback, torch.full((3,), 0.5))
    assert restored._inner.state_dict()["state"][0]["step"] == 1


def test_a_pipeline_checkpoints_trainer_state_loads_as_weights_only_asks(tmp_path):
    """The pipeline checkpoint's trainer state holds what the user's module saved (a `Path` hyper-parameter): refused
    under Lightning's default, loaded with `weights_only=False`, while the rank files stay weights-only (a resume
    with `Trainer.fit(weights_only=False)` used to be refused with no way past it)."""
    from lightning_hetero.pipeline import state as pipeline_state

    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    trainer_state = {"hyper_parameters": {"data_dir": Path("/data/spirals")}, "epoch": 3}
    pipeline_state.save_stage(tmp_path, 0, module, optimizer, trainer_state)
    with pytest.raises(UnsafeCheckpointFile, match=r"pipeline_trainer_state.pt .*PosixPath.*`weights_only=False`"):
        pipeline_state.load_stage(tmp_path, module, optimizer)
    loaded = pipeline_state.load_stage(tmp_path, module, optimizer, weights_only=False)
    assert loaded == trainer_state
    marker = tmp_path / "ran"
    crafted(tmp_path / pipeline_state.RANK_FILE.format(rank=0), marker)
    with pytest.raises(UnsafeCheckpointFile, match="altered or comes from elsewhere"):
        pipeline_state.load_stage(tmp_path, module, optimizer, weights_only=False)
    assert not marker.exists()


def test_weights_only_none_is_torchs_default_as_for_lightning(tmp_path, monkeypatch):
    """`weights_only=None` goes to torch as Lightning hands it: torch's default, which a user may switch off with
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD; an explicit `True` still refuses."""
    path = tmp_path / "paths.ckpt"
    torch.save({"hyper_parameters": {"data_dir": Path("/data")}}, path)
    with pytest.raises(UnsafeCheckpointFile):
        load_lightning_file(path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert load_lightning_file(path)["hyper_parameters"]["data_dir"] == Path("/data")
    with pytest.raises(UnsafeCheckpointFile):
        load_lightning_file(path, weights_only=True)


@pytest.mark.multiprocess
def test_weights_only_true_checks_a_checkpoint_directory_through_trainer_fit_and_load_from_checkpoint(tmp_path):
    """`Trainer.fit(ckpt_path=<directory>, weights_only=True)` and `load_from_checkpoint(..., weights_only=True)`:
    a ZeRO-2 checkpoint (DeepSpeed's loss scaler, stage and fragment addresses inside) resumes and loads; once a
    file that runs code on unpickling lies among its files, both refuse it, naming the file, and nothing runs.
    (Lightning 2.6 does not hand `Trainer.fit`'s `weights_only` to a strategy that restores after setup: it was
    ignored, and DeepSpeed unpickled the directory's files in full.)"""
    import json
    import sys

    code, output = run_bounded([sys.executable, str(WORKERS / "weights_only_directory.py"), str(tmp_path)], timeout=300)
    assert code == 0, output[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["resume"] == "ok" and result["load"] == "ok", result
    refusal = r"UnsafeCheckpointFile: Checkpoint file .*extra_states.pt holds objects .*\(builtins.exec\)"
    assert re.match(refusal, result["crafted_resume"]) and re.match(refusal, result["crafted_load"]), result
    assert "pass `weights_only=False` to `Trainer.fit`" in result["crafted_resume"]
    assert result["ran"] is False


def test_the_trainer_calls_weights_only_is_found_up_the_stack():
    """What Lightning hands the strategy wins; without it, the `weights_only` of the `Trainer._run` frame up the
    stack (the trainer call's); None outside a trainer call."""
    from lightning.pytorch import Trainer

    from lightning_hetero.runtime.safe_load import requested_weights_only

    assert requested_weights_only((), {"weights_only": False}) is False
    assert requested_weights_only((True,), {}) is True
    assert requested_weights_only((), {}) is None
    seen = []

    class Stop(Exception):
        pass

    class StandIn:  # `_run` reads `self.state` first: the strategy's load runs there, inside the frame
        @property
        def state(self):
            seen.append(requested_weights_only((), {}))
            raise Stop

    for given in (False, True, None):
        with pytest.raises(Stop):
            Trainer._run(StandIn(), None, ckpt_path=None, weights_only=given)
    assert seen == [False, True, None]


def test_a_checkpoint_directory_checked_for_weights_only_has_no_way_around_the_scan(tmp_path):
    """What DeepSpeed's load would reach and a scan would not: a symbolic link inside, a `latest` naming a folder
    outside. Both refuse the checkpoint. A killed save's or conversion's staging folder (never loaded) is left out,
    and a link to the checkpoint itself (Lightning's `last.ckpt` link) is followed."""
    from lightning_hetero.runtime.safe_load import check_checkpoint_directory

    saved = tmp_path / "step=4.ckpt"
    (saved / "checkpoint").mkdir(parents=True)
    (saved / "latest").write_text("checkpoint")
    torch.save({"module": {"w": torch.zeros(2)}}, saved / "checkpoint" / "mp_rank_00_model_states.pt")
    (saved / ".universal.partial").mkdir()
    (saved / ".universal.partial" / "cut_short.pt").write_bytes(b"PK\x03")  # a conversion killed mid-write
    check_checkpoint_directory(saved)
    (tmp_path / "last.ckpt").symlink_to(saved)
    check_checkpoint_directory(tmp_path / "last.ckpt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    crafted(elsewhere / "mp_rank_00_model_states.pt", tmp_path / "ran")
    (saved / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").symlink_to(
        elsewhere / "mp_rank_00_model_states.pt"
    )
    with pytest.raises(UnsafeCheckpointFile, match=r"holds a symbolic link, .*optim_states.pt -> .*elsewhere"):
        check_checkpoint_directory(saved)
    (saved / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    (saved / "latest").write_text("../elsewhere")
    with pytest.raises(UnsafeCheckpointFile, match=r"its `latest` file names '../elsewhere', not a folder beside it"):
        check_checkpoint_directory(saved)
    # A tag naming a staging folder, which the scan leaves out: DeepSpeed would load it unchecked (found in review).
    crafted(saved / ".universal.partial" / "mp_rank_00_model_states.pt", tmp_path / "ran")
    (saved / "latest").write_text(".universal.partial")
    with pytest.raises(UnsafeCheckpointFile, match=r"its `latest` file names '.universal.partial', not a folder"):
        check_checkpoint_directory(saved)
    # A cached universal copy's own tag file (DeepSpeed loads `universal/` through it) naming a folder outside.
    (saved / "latest").write_text("checkpoint")
    (saved / "universal").mkdir()
    (saved / "universal" / "latest_universal").write_text("../../elsewhere")
    with pytest.raises(UnsafeCheckpointFile, match=r"its `universal/latest_universal` file names '../../elsewhere'"):
        check_checkpoint_directory(saved)
    (saved / "universal" / "latest_universal").write_text("checkpoint")
    check_checkpoint_directory(saved)
    assert not (tmp_path / "ran").exists()


# ------------------------------------------------------------------ every reader of a checkpoint directory (issue 51)

ADAM_STATE = {"state": {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2), "step": torch.tensor(3.0)}}}
MODEL_STATES = "checkpoint/mp_rank_00_model_states.pt"

# (what DeepSpeed's zero_to_fp32 reads from the model-states file before it opens the optimizer files)
DEEPSPEEDS_MODEL_STATES = {
    "buffer_names": [],
    "param_shapes": [{"w": torch.Size([2])}],
    "shared_params": {},
    "frozen_param_shapes": None,
    "frozen_param_fragments": None,
    "ds_version": "0.19.8",
}


def optim_states(rank: int) -> str:
    return f"checkpoint/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def directory_with(tmp_path: Path, crafted_file: str, manifest: bool) -> Path:
    """A ZeRO-2 checkpoint directory of 2 ranks (DeepSpeed's layout, Adam's state) whose ``crafted_file`` runs code
    when unpickled in full (writing tmp_path/ran); ``manifest``: the package's (written after, so the checksums
    agree), else the directory is shaped like Lightning's DeepSpeedStrategy's."""
    path = write_deepspeed_checkpoint(
        tmp_path / "step=3.ckpt", stage=2, optimizer_state=ADAM_STATE, **DEEPSPEEDS_MODEL_STATES
    )
    (path / crafted_file).parent.mkdir(parents=True, exist_ok=True)
    crafted(path / crafted_file, tmp_path / "ran", optimizer_state_dict={}, ds_config={})
    if manifest:
        facts = {"world_size": 2, "global_step": 3, "zero_stage": 2, "optimizer": "Adam"}
        checkpoint.write_manifest(path, facts)
    return path


class ZeRO3Optimizer:
    """What load_zero3 asks of DeepSpeed's ZeRO-3 optimizer before it reads the universal copy's files."""

    def load_module_checkpoint_state_from_checkpoint_dir_stage3(self, folder, load_from_fp32_weights):
        pass


def choosing(path: Path, weights_only):
    return Recovery(peer_timeout=None).choose(path, weights_only)  # (rank 0 of 1: its own choice)


def the_universal_zero_3_load(path: Path, weights_only):
    """The universal copy's global optimizer state, read by the package's ZeRO-3 loader inside DeepSpeed's load."""
    folder = path / "universal" / "checkpoint"
    return universal.load_zero3(ZeRO3Optimizer(), str(folder), True, True, unpickles_in_full(weights_only))


# (the reader, the file that runs code, whether the package's manifest is there): every path that reads one
READERS = {
    "recognising DeepSpeedStrategy's checkpoint (model states)": (choosing, MODEL_STATES, False),
    "recognising DeepSpeedStrategy's checkpoint (its optimizer's moments)": (choosing, optim_states(0), False),
    "DeepSpeed's engine load (checked at the choice)": (choosing, optim_states(1), True),
    "a pipeline rank file (checked at the choice)": (choosing, "pipeline_rank1.pt", True),
    "the universal copy's own files (checked at the choice)": (choosing, "universal/zero/optimizer_state.pt", True),
    "the check before a universal conversion": (
        lambda path, weights_only: elastic.check_convertible(
            path, checkpoint.read_manifest(path), 3, unpickles_in_full(weights_only)
        ),
        optim_states(0),
        True,
    ),
    "the universal conversion": (
        lambda path, weights_only: elastic.convert_to_universal(path, unpickles_in_full(weights_only)),
        optim_states(0),
        True,
    ),
    "the universal ZeRO-3 load": (the_universal_zero_3_load, "universal/checkpoint/zero/optimizer_state.pt", False),
    "load_from_checkpoint": (export.lightning_checkpoint, optim_states(1), True),
}


@pytest.mark.parametrize("weights_only", [None, True])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_no_reader_unpickles_a_file_in_full_before_its_globals_are_checked(reader, weights_only, tmp_path):
    """For each path that reads a checkpoint directory's files, a crafted file that would write a marker when
    unpickled in full: under Lightning's default `weights_only` and `True`, the reader refuses it naming the file and
    the marker never appears. (A DeepSpeedStrategy-shaped directory ran its payload under both, before the package
    refused it, and DeepSpeed's engine unpickled a checkpoint's files in full under the default.)"""
    read, crafted_file, manifest = READERS[reader]
    path = directory_with(tmp_path, crafted_file, manifest)
    with pytest.raises(UnsafeCheckpointFile, match=rf"{re.escape(crafted_file)} holds objects .*builtins.exec"):
        read(path, weights_only)
    assert not (tmp_path / "ran").exists()


def test_weights_only_false_is_the_users_trust_honoured_as_lightning_honours_it(tmp_path, monkeypatch):
    """An explicit `weights_only=False` (or torch's TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD with nothing passed) unpickles
    DeepSpeedStrategy's files in full, as Lightning does; TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides even that."""
    assert [unpickles_in_full(given) for given in (None, True, False)] == [False, False, True]
    path = directory_with(tmp_path, MODEL_STATES, manifest=False)
    choosing(path, weights_only=False)
    assert (tmp_path / "ran").read_text() == "ran"
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert unpickles_in_full(None) and not unpickles_in_full(True)
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    assert not unpickles_in_full(False)


def test_deepspeeds_own_files_read_weights_only_with_its_classes(tmp_path):
    """What the checks let through loads: DeepSpeed's loss scaler, ZeRO's stage and a fragment address, weights-only
    (a DeepSpeedStrategy directory's facts are read so); a file that is no torch checkpoint is no DeepSpeed one."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    saved = {
        "loss_scaler": DynamicLossScaler(
            init_scale=8.0,
            scale_window=10,
            min_scale=1.0,
            delayed_shift=1,
            consecutive_hysteresis=False,
            raise_error_at_min_scale=True,
            dtype=torch.float16,
        ),
        "zero_stage": ZeroStageEnum(2),
        "slice": fragment_address(numel=3, start=1),
    }
    torch.save(saved, tmp_path / "ds.pt")
    loaded = load_deepspeed_file(tmp_path / "ds.pt")
    assert loaded["loss_scaler"].cur_scale == 8.0 and loaded["zero_stage"] == 2 and loaded["slice"].start == 1
    path = write_deepspeed_checkpoint(tmp_path / "a.ckpt", stage=2, optimizer_state=ADAM_STATE, extra=saved)
    facts = from_deepspeed.deepspeed_strategy_facts(path)
    assert facts is not None and facts["optimizer"] == "Adam"


@pytest.mark.multiprocess
@pytest.mark.parametrize("weights_only", [None, "true"])
def test_a_crafted_deepspeedstrategy_checkpoint_stops_every_rank_of_a_fit_and_runs_nothing(weights_only, tmp_path):
    """The issue's run: a directory shaped like a DeepSpeedStrategy checkpoint (a `latest` naming `global_step1/`, in
    it a model-states file whose pickle writes a marker) given to a 2-rank `fit(ckpt_path=...)` under
    `HeteroStrategy(batch_sizes=[4, 4])`. The payload ran under the default and under `weights_only=True` (refused
    only after it ran); now both ranks stop naming the file, and nothing ran."""
    saved = tmp_path / "deepspeed.ckpt"
    (saved / "global_step1").mkdir(parents=True)
    (saved / "latest").write_text("global_step1")
    crafted(saved / "global_step1" / "mp_rank_00_model_states.pt", tmp_path / "ran", ds_config={}, dp_world_size=2)
    extra = ["--weights-only", weights_only] if weights_only else []
    run = run_fit(tmp_path / "run", "--batch-sizes", "4", "4", "--ckpt-path", str(saved), *extra)
    assert run.returncode != 0
    refusal = (
        "global_step1/mp_rank_00_model_states.pt holds objects that loading it could run code from (builtins.exec)"
    )
    assert run.output.count(refusal) >= 2, run.output[-4000:]  # (rank 0's error, and rank 1's naming it)
    assert "pass `weights_only=False` to `Trainer.fit`" in run.output
    assert not (tmp_path / "ran").exists()
