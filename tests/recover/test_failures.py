"""Unit tests for lightning_hetero.recover.failures: which errors are a lost peer, what a survivor says, the store."""

from __future__ import annotations

import pytest
import torch.distributed

from lightning_hetero.recover import failures


@pytest.mark.parametrize(
    ("exception", "lost_peer"),
    [
        (RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer. GLHF!"), True),
        (RuntimeError("[pair.cc:589] Connection closed by peer [127.0.0.1]:29500"), True),
        (RuntimeError("Broken pipe"), True),
        (RuntimeError("NCCL communicator was aborted on rank 1"), True),
        (RuntimeError("training_step failed"), False),
        (ValueError("Connection reset by peer"), False),  # not a collective's error type
        (KeyboardInterrupt(), False),
    ],
)
def test_is_lost_peer_error(exception, lost_peer):
    assert failures.is_lost_peer_error(exception) is lost_peer


def test_the_explanation_names_the_first_failed_rank_and_the_others():
    text = failures.lost_peer_explanation(0, {2: "ValueError: b", 1: "RuntimeError: a"}, store_reachable=True)
    assert text.startswith("HeteroStrategy: rank 1 failed with RuntimeError: a; rank 2 also failed (ValueError: b).")
    assert "Rank 0 stopped" in text


def test_the_explanation_without_records_says_what_is_known(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    gone = failures.lost_peer_explanation(1, {}, store_reachable=False)
    assert "rank 0, which hosts the rendezvous store, no longer answers" in gone and "exits with code 75" in gone
    killed = failures.lost_peer_explanation(0, {}, store_reachable=True)
    assert "recorded no error: it was probably killed" in killed and "Rank 0 exits with code 75" in killed
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "the torchrun agent, which hosts" in failures.lost_peer_explanation(1, {}, store_reachable=False)


def test_reading_failures_from_a_frozen_store_returns_within_its_wait(monkeypatch):
    """A store call to a frozen host blocks whatever the store's timeout: the read gives up after its wait."""
    import threading
    import time

    thawed = threading.Event()

    class Frozen:
        timeout = None

        def set_timeout(self, timeout):
            thawed.wait()

    monkeypatch.setattr(failures, "_default_store", lambda: Frozen())
    started = time.monotonic()
    assert failures.read_failures(world_size=2, exclude=0, wait=0.2) == ({}, False)
    assert time.monotonic() - started < 3
    thawed.set()


def test_publish_then_read_through_a_store(monkeypatch):
    store = torch.distributed.HashStore()
    monkeypatch.setattr(failures, "_default_store", lambda: store)
    failures.publish_failure(1, RuntimeError("boom"))
    found, reachable = failures.read_failures(world_size=3, exclude=0, wait=0.2)
    assert reachable and found == {1: "RuntimeError: boom"}
    assert store.timeout.total_seconds() == 300  # the store's own timeout is put back
    # A rank does not read its own record; with nothing recorded the read gives up after `wait`.
    assert failures.read_failures(world_size=3, exclude=1, wait=0.1) == ({}, True)


def test_a_store_that_fails_reads_as_unreachable(monkeypatch):
    class DeadStore:
        def set_timeout(self, timeout):
            raise RuntimeError("Connection refused")

        def set(self, key, value):
            raise RuntimeError("Connection refused")

    monkeypatch.setattr(failures, "_default_store", lambda: DeadStore())
    failures.publish_failure(0, RuntimeError("boom"))  # best effort: no exception of its own
    assert failures.read_failures(world_size=2, exclude=1, wait=0.1) == ({}, False)
