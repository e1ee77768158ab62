"""Which copy of a step is the newer (``runid.newer``) and the identity the environment names."""

from __future__ import annotations

import pytest

from trainguard.checkpoint.runid import RunIdentity, from_env, newer

A = RunIdentity("aaaa", started=100.0)
B = RunIdentity("bbbb", started=200.0)  # a later run outside trainguard run


def test_one_run_orders_by_generation_other_runs_by_their_start() -> None:
    assert newer(A, 2, A, 1) and newer(A, 1, A, 1) and not newer(A, 0, A, 1)
    assert newer(B, 0, A, 5) and not newer(A, 5, B, 0)  # generations restart at 0 outside
    ga, gb = (RunIdentity(r, s, by_generation=True) for r, s in (("g1", 300.0), ("g2", 100.0)))
    assert newer(gb, 7, ga, 6) and not newer(ga, 6, gb, 7)  # trainguard run: one sequence


def test_a_copy_that_names_no_run_is_older_than_any_that_does() -> None:
    assert newer(A, 0, None, 9) and not newer(None, 9, A, 0)
    assert newer(None, 3, None, 2) and not newer(None, 2, None, 3)


def test_the_environment_names_a_run_or_is_refused_in_one_line() -> None:
    got = from_env({"TRAINGUARD_RUN_ID": "ab12", "TRAINGUARD_RUN_STARTED": "5.5",
                    "TRAINGUARD_GENERATION": "3"})  # fmt: skip
    assert got == RunIdentity("ab12", 5.5, by_generation=True)
    assert from_env({}) is None
    with pytest.raises(ValueError, match="TRAINGUARD_RUN_ID='a/b': a run id is 1-32 letters"):
        from_env({"TRAINGUARD_RUN_ID": "a/b"})
