import math
import random

import optuna
import pytest
from optuna.trial import TrialState

from hpo.search.pruning import EvidenceHalvingPruner, agreement, in_top, kendall_tau, rung_key

optuna.logging.set_verbosity(optuna.logging.WARNING)


def run(pruner: optuna.pruners.BasePruner, curves: list[list[float]]) -> list[int]:
    """Each curve a trial, one after the other: the epoch each stopped at (its length when
    it finished), the trial told its best report."""
    study = optuna.create_study(direction="maximize", pruner=pruner)
    ends = []
    for curve in curves:
        trial = study.ask()
        for step, value in enumerate(curve, 1):
            trial.report(value, step)
            if step < len(curve) and trial.should_prune():
                study.tell(trial, state=TrialState.PRUNED)
                ends.append(step)
                break
        else:
            study.tell(trial, max(curve))
            ends.append(len(curve))
    return ends


def test_without_evidence_rules_it_stops_what_optunas_successive_halving_stops():
    rng = random.Random(0)
    for _ in range(20):
        curves = [[rng.random() for _ in range(9)] for _ in range(30)]
        optunas = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
        ours = EvidenceHalvingPruner(min_resource=1, reduction_factor=3, max_resource=9)
        assert run(ours, curves) == run(optunas, curves)


def test_a_rung_stops_nothing_until_enough_trials_reached_it():
    # Each trial worse at epoch 1 than all before it: Optuna's rule stops each from the
    # second on; waiting for 3 trials lets the second pass.
    curves = [[0.9 - 0.1 * k] * 4 for k in range(5)]
    assert run(EvidenceHalvingPruner(1, 3, 4), curves) == [4, 1, 1, 1, 1]
    assert run(EvidenceHalvingPruner(1, 3, 4, min_trials=3), curves) == [4, 4, 1, 1, 1]


def test_a_rung_whose_ranking_the_end_reverses_stops_nothing():
    # Slow starters end best: epoch 1 ranks the trials the other way round from epoch 4.
    reversed_ = [[0.1 * k, 0.1 * k, 0.1 * k, 1.0 - 0.1 * k] for k in range(1, 9)]
    agreeing = [[0.1 * k, 0.1 * k, 0.1 * k, 0.1 * k + 0.05] for k in range(8, 0, -1)]
    checked = dict(min_agreement=0.5, min_pairs=5)
    # Reversed: no trial is ever stopped, the rung never earns trust.
    assert run(EvidenceHalvingPruner(1, 3, 4, **checked), reversed_) == [4] * 8
    # Agreeing: the first 5 pass unchecked (the sample), then the rung stops the worse.
    assert run(EvidenceHalvingPruner(1, 3, 4, **checked), agreeing) == [4] * 5 + [1] * 3
    assert run(EvidenceHalvingPruner(1, 3, 4), agreeing) == [4] + [1] * 7


def test_kendall_tau():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert math.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))


def test_in_top_keeps_a_third_and_the_best_of_few():
    assert in_top(0.9, [0.9, 0.5], 3, maximize=True)
    assert not in_top(0.5, [0.9, 0.5], 3, maximize=True)
    assert in_top(0.8, [0.9, 0.8, 0.1, 0.2, 0.3, 0.4], 3, maximize=True)
    assert not in_top(0.4, [0.9, 0.8, 0.1, 0.2, 0.3, 0.4], 3, maximize=True)
    assert in_top(0.1, [0.9, 0.1, 0.5], 3, maximize=False)


def test_rungs_are_recorded_as_optunas_and_measured_on_finished_trials():
    """The pruner writes `completed_rung_<k>` through the study's storage, as Optuna's own
    pruners do (`study._storage`, `trial._trial_id`: private names of Optuna this test
    pins)."""
    study = optuna.create_study(direction="maximize",
                                pruner=EvidenceHalvingPruner(1, 2, 8, min_trials=99))
    for k in range(3):
        trial = study.ask()
        for step in range(1, 9):
            trial.report(0.1 * k * step, step)
            assert not trial.should_prune()
        study.tell(trial, 0.8 * k)
    first = study.trials[1]
    assert [key for key in first.system_attrs if key.startswith("completed_rung")] == [
        rung_key(0), rung_key(1), rung_key(2)]  # steps 1, 2, 4; none at the last step, 8
    assert first.system_attrs[rung_key(1)] == pytest.approx(0.2)
    tau, pairs = agreement(study.trials, 1)
    assert (tau, pairs) == (1.0, 3)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        EvidenceHalvingPruner(0, 3, 4)
    with pytest.raises(ValueError):
        EvidenceHalvingPruner(1, 3, 4, min_pairs=1)
