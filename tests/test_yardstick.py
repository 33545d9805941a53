"""benchmarks/yardstick.py: anytime normalized regret over paired worlds, worked out by hand
on made-up worlds."""

from __future__ import annotations

import math

import pytest
import yardstick


def world(horizon: float = 100.0, best: float = 0.9, baseline: float = 0.5, **steps) -> dict:
    return {"world": {"horizon": horizon, "best": best, "baseline": baseline},
            **{name: {"steps": s} for name, s in steps.items()}}


def test_regret_is_normalized_by_the_worlds_best_and_a_random_configurations_median():
    assert yardstick.regret(0.9, 0.9, 0.5) == 0.0
    assert yardstick.regret(0.7, 0.9, 0.5) == pytest.approx(0.5)
    assert yardstick.regret(0.3, 0.9, 0.5) == 1.0  # worse than random: clipped
    assert yardstick.regret(None, 0.9, 0.5) == 1.0  # nothing told yet
    assert yardstick.regret(0.5, 0.5, 0.5) == 0.0 and yardstick.regret(0.4, 0.5, 0.5) == 1.0


def test_the_incumbent_is_the_best_told_by_then():
    steps = [[10.0, 0.6], [30.0, 0.8]]
    assert yardstick.incumbent(steps, 5.0) is None
    assert yardstick.incumbent(steps, 10.0) == 0.6 and yardstick.incumbent(steps, 29.9) == 0.6
    assert yardstick.incumbent(steps, 100.0) == 0.8


def test_the_area_is_the_mean_regret_at_log_spaced_times_from_the_first_finished_trial():
    rep = world(a=[[1.0, 0.7]], b=[[10.0, 0.9]])
    area, final, best = yardstick.figures(rep, "a")
    assert (area, final, best) == (pytest.approx(0.5), pytest.approx(0.5), 0.7)
    # b: regret 1 from t=1 (the first finish of any policy) until 10, then 0: the log-spaced
    # times put half their points before 10 (log10 from 0 to 2).
    area, final, _ = yardstick.figures(rep, "b")
    assert final == 0.0 and area == pytest.approx(0.5, abs=1 / yardstick.POINTS)


def test_a_copy_of_a_policy_comes_out_exactly_level():
    reps = [world(a=[[5.0 + k, 0.6 + 0.01 * k]], b=[[5.0 + k, 0.6 + 0.01 * k]])
            for k in range(20)]
    found = yardstick.compare(reps, "a", "b")
    assert found["auc_ratio"] == 1.0 and found["auc_ratio_interval"] == [1.0, 1.0]
    assert found["final_regret_diff"] == 0.0 and found["g1_strict"] == 0.5
    assert found["ties"] == 1.0 and found["g2_median"] == 1.0 and yardstick.level(found)


def test_a_policy_better_by_construction_comes_out_ahead_with_intervals_that_say_so():
    # a finds what b finds, sooner, and in half the worlds a better value.
    reps = [world(a=[[2.0, 0.7], [8.0, 0.85 if k % 2 else 0.8]], b=[[4.0, 0.7], [16.0, 0.8]])
            for k in range(30)]
    found = yardstick.compare(reps, "a", "b")
    assert found["auc_ratio_interval"][1] < 1.0
    assert found["final_regret_diff_interval"][1] < 0.0
    assert found["g1_strict"] == 0.75 and found["ties"] == 0.5  # ties count half
    assert found["g2_median"] == 0.5  # 8 s against b's 16 s to b's final best
    assert not yardstick.level(found)


def test_g2_is_infinite_where_a_never_reaches_bs_final_best_within_the_horizon():
    reps = [world(a=[[2.0, 0.6]], b=[[4.0, 0.8]]), world(a=[[200.0, 0.9]], b=[[4.0, 0.8]]),
            world(a=[[1.0, 0.9]], b=[[4.0, 0.8]])]
    found = yardstick.compare(reps, "a", "b")
    assert found["g2_never"] == 2 and found["g2_median"] == math.inf
    assert found["g1_strict"] == pytest.approx(1 / 3, abs=1e-3)


def test_the_intervals_are_wilsons_for_g1_and_order_statistics_for_the_median_g2():
    assert yardstick.wilson(67, 100) == [0.573, 0.754]
    assert yardstick.wilson(100, 100)[1] == 1.0
    values = [float(v) for v in range(1, 101)]
    assert yardstick.median_interval(values) == [40.0, 61.0]
    assert yardstick.median_interval([*values[:55], *[math.inf] * 45]) == [40.0, math.inf]
    assert yardstick.median_interval([0.1, 0.2, 0.3, 0.4, 0.5]) is None


def test_over_time_ranks_the_policies_and_the_band_holds_the_iqm():
    reps = [world(a=[[2.0, 0.9]], b=[[50.0, 0.8]]) for _ in range(8)]
    found = yardstick.over_time(reps, ["a", "b"], points=10)
    assert found["a"]["rank"][-1] == 1.0 and found["b"]["rank"][-1] == 2.0
    assert found["a"]["iqm"][-1] == 0.0 and found["b"]["iqm"][-1] == pytest.approx(0.25)
    for name in ("a", "b"):
        assert all(lo - 1e-9 <= m <= hi + 1e-9 for lo, m, hi in zip(
            found[name]["low"], found[name]["iqm"], found[name]["high"], strict=True))


def test_iqm_is_the_mean_of_the_middle_half():
    import numpy as np

    assert yardstick.iqm(np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0])) == 3.5


def test_blocks_say_which_run_of_worlds_a_null_check_fails_on_and_what_the_whole_says():
    # a equals b but in worlds 10-19, where it finds b's value four times later.
    reps = [world(a=[[(20.0 if 10 <= k < 20 else 5.0) + k % 3, 0.8]], b=[[5.0 + k % 3, 0.8]])
            for k in range(40)]
    found = yardstick.blocks(reps, "a", "b", 10)
    assert [(f["first"], f["last"], f["worlds"]) for f in found] == [
        (0, 9, 10), (10, 19, 10), (20, 29, 10), (30, 39, 10), (0, 39, 40)]
    assert [f["level"] for f in found[:4]] == [True, False, True, True]
    assert found[1]["auc_ratio_interval"][0] > 1.0
    assert found[4] == {"first": 0, "last": 39, **yardstick.compare(reps, "a", "b"),
                        "level": found[4]["level"]}
    # One block holds every world: no second entry for the whole.
    assert [(f["first"], f["last"]) for f in yardstick.blocks(reps, "a", "b", 40)] == [(0, 39)]
    assert [(f["first"], f["last"]) for f in yardstick.blocks(reps, "a", "b", 30)] == [
        (0, 29), (30, 39), (0, 39)]
