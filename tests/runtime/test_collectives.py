"""The strategy's own collectives: identities on one rank, and a failure on any rank stops every rank."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.runtime.collectives import Collectives, describe_failure
from lightning_hetero.runtime.shutdown import exit_with_if_uncaught, requested_exit_code


def test_one_rank_needs_no_process_group_and_pays_the_emulated_delay_before_each_collective():
    paid = []
    collectives = Collectives(1, torch.device("cpu"), lambda: paid.append(1))
    assert collectives.gather_objects({"a": 1}) == [{"a": 1}]
    tensor = torch.tensor([1.0, 2.0])
    assert collectives.gather_tensor(tensor)[0] is tensor
    assert collectives.gather_counts(7) == [7]
    assert collectives.sum(2.5) == 2.5
    assert not torch.distributed.is_initialized()
    assert paid == [1]  # gather_counts pays; sum on one rank makes no collective


def gathering(entries):
    """Collectives whose gather returns ``entries`` as the other ranks' parts (this rank's part first)."""
    collectives = Collectives(len(entries) + 1, torch.device("cpu"))
    collectives.gather_objects = lambda mine: [mine, *entries]
    return collectives


def test_gather_or_raise_returns_this_ranks_result_and_every_ranks_shared_part():
    collectives = gathering([{"shared": "b", "failure": None, "exit_code": None}])
    assert collectives.gather_or_raise("setup", lambda: ("local", "a")) == ("local", ["a", "b"])


def test_a_failure_on_this_rank_is_raised_as_it_is_after_the_gather():
    sent = []
    collectives = gathering([{"shared": "b", "failure": None, "exit_code": None}])
    other = {"shared": "b", "failure": None, "exit_code": None}
    collectives.gather_objects = lambda mine: sent.append(mine) or [mine, other]

    def fail():
        raise ValueError("bad loader")

    with pytest.raises(ValueError, match="bad loader"):
        collectives.gather_or_raise("setup", fail)
    # the others learn it in the gather
    assert sent == [{"shared": None, "failure": "ValueError: bad loader", "exit_code": None}]


def test_a_failure_on_another_rank_stops_this_one_naming_the_rank_and_the_error():
    collectives = gathering([{"shared": None, "failure": describe_failure(KeyError("x")), "exit_code": None}])
    with pytest.raises(RuntimeError, match=r"preparing the training loader failed on rank 1 \(KeyError: 'x'\)"):
        collectives.gather_or_raise("preparing the training loader", lambda: (None, "a"))


def test_a_failure_that_asks_for_an_exit_code_makes_every_rank_exit_with_it():
    """A refused resume on rank 0 (every restart would repeat it) exits 78 there: the others, which only learn it in the
    gather, must not exit 1 (which says "retry") instead."""
    sent = []
    refused = ValueError("refused")
    exit_with_if_uncaught(refused, 78)
    collectives = gathering([{"shared": None, "failure": None, "exit_code": None}])
    collectives.gather_objects = lambda mine: (
        sent.append(mine) or [mine, {"shared": None, "failure": None, "exit_code": None}]
    )

    def refuse():
        raise refused

    with pytest.raises(ValueError, match="refused"):
        collectives.gather_or_raise("choosing the checkpoint", refuse)
    assert sent[0]["exit_code"] == 78
    other = gathering([sent[0]])
    with pytest.raises(RuntimeError, match="choosing the checkpoint failed on rank 1") as raised:
        other.gather_or_raise("choosing the checkpoint", lambda: (None, None))
    assert requested_exit_code(raised.value) == 78
    plain = gathering([{"shared": None, "failure": "KeyError: 'x'", "exit_code": None}])
    with pytest.raises(RuntimeError) as raised:
        plain.gather_or_raise("choosing the checkpoint", lambda: (None, None))
    assert requested_exit_code(raised.value) is None
