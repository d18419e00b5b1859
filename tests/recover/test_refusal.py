"""A resume refused for what it was given fails the same way on every restart: exit code 78 and a message saying so
(lightning_hetero/recover/refusal.py); the multi-process checks are in test_elastic.py."""

from __future__ import annotations

import json

from lightning_hetero.recover.refusal import EXIT_CODE_WILL_FAIL_AGAIN, ResumeRefused, record_for_torchrun
from lightning_hetero.runtime.shutdown import requested_exit_code


def test_a_refused_resume_says_a_restart_cannot_help_and_asks_for_its_exit_code():
    refused = ResumeRefused("Checkpoint x was saved by 2 ranks.", environ={})
    assert str(refused) == (
        "Checkpoint x was saved by 2 ranks. A restart of the same command on as many ranks fails the same way, so this"
        " process exits with code 78 (retrying cannot help)."
    )
    assert requested_exit_code(refused) == EXIT_CODE_WILL_FAIL_AGAIN == 78
    under_torchrun = str(ResumeRefused("x.", {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1"}))
    assert "it will try 2 more times (--max-restarts), each refused like this one unless the number of ranks" in (
        under_torchrun
    )
    last_try = str(ResumeRefused("x.", {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "3"}))
    assert "more time" not in last_try and "exits with code 78" in last_try


def test_under_torchrun_the_refusal_is_written_to_the_workers_error_file_for_the_failure_summary(tmp_path, monkeypatch):
    refused = ResumeRefused("Checkpoint x was saved by 2 ranks.", environ={})
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    record_for_torchrun(refused)  # not under torchrun: nothing to write, nowhere
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise refused
    except ResumeRefused as error:
        record_for_torchrun(error)
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.startswith("ResumeRefused: Checkpoint x was saved by 2 ranks. A restart of the same command")
