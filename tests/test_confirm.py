"""benchmarks/confirm.py: the replay's predicted difference against the paired interval of
real runs, on made-up runs and a made-up replay."""

from __future__ import annotations

import confirm
import pytest
from test_search_quality import run


def peer(seed: int, trials: list[tuple[str, float, float]], machine: str = "m") -> dict:
    return {**run("default", seed, 100, trials), "tool": "expert", "machine": machine}


def test_hpo_is_read_at_its_budgets_wall_and_the_peer_at_its_n_trials():
    results = {"n_trials": 2, "runs": [
        # hpo's run went on past its budget (to 200 s): its 0.9 then does not count.
        {**run("v", 1, 100, [("COMPLETE", 0.6, 50), ("COMPLETE", 0.9, 200)])},
        # The peer's third trial is past its 2.
        peer(1, [("COMPLETE", 0.5, 40), ("PRUNED", 0.0, 80), ("COMPLETE", 0.8, 120)]),
        {**run("v", 2, 100, [("COMPLETE", 0.4, 50)])},
        peer(2, [("COMPLETE", 0.5, 40), ("COMPLETE", 0.7, 80)]),
        {**run("v", 3, 100, [("COMPLETE", 0.4, 50)])},
        peer(3, [("COMPLETE", 0.5, 40)], machine="other"),  # another machine: unpaired
    ]}
    assert confirm.real_differences(results, "v", "expert") == pytest.approx(
        {1: 0.1, 2: -0.3})


def test_the_prediction_is_the_replays_mean_final_difference_and_the_interval_students():
    replay = {"repetitions_data": [
        {"v": {"steps": [[1, 0.3], [5, 0.6]]}, "expert": {"steps": [[2, 0.5]]}},
        {"v": {"steps": []}, "expert": {"steps": [[2, 0.2]]}},
    ]}
    assert confirm.predicted(replay, "v", "expert") == pytest.approx((0.1 - 0.2) / 2)
    low, high = confirm.interval([0.1, 0.2, 0.3])
    # mean 0.2, standard error 0.1 / sqrt(3), t(2) at 97.5% = 4.303
    assert (low, high) == pytest.approx((0.2 - 4.303 * 0.0577, 0.2 + 4.303 * 0.0577), abs=1e-3)
