"""The argument checks every way in shares: a positive integer, one entry per rank."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hetero.runtime.checks import check_one_per_rank, check_positive_int


@pytest.mark.parametrize("value", [1, 7, np.int64(3)])
def test_a_positive_integer_passes_numpy_ones_too(value):
    check_positive_int("sync_every", value, ": steps.")


@pytest.mark.parametrize("value", [0, -2, 2.0, True, "4", None])
def test_anything_else_is_refused_naming_the_argument_its_value_and_what_it_counts(value):
    with pytest.raises(ValueError, match=rf"^`sync_every={value!r}` must be a positive integer: steps between\.$"):
        check_positive_int("sync_every", value, ": steps between.")


def test_a_per_rank_setting_with_another_count_says_both_counts_and_the_fix():
    check_one_per_rank("`weights=[1.0, 0.4]`", 2, 2, "Give one weight per rank.")
    with pytest.raises(ValueError, match=r"^`weights=\[1.0\]` has 1 entries but the job has 2 ranks\. Give one"):
        check_one_per_rank("`weights=[1.0]`", 1, 2, "Give one weight per rank.")
