"""The soak's budget check (benchmarks/soak.py): the budget as the study's workers keep it."""

import optuna
import soak
from optuna.trial import TrialState, create_trial

from hpo.search.pausing import PAUSED_AT


def trial(state: TrialState, steps: int, **attrs) -> optuna.trial.FrozenTrial:
    return create_trial(state=state, user_attrs=attrs,
                        intermediate_values={k: 0.5 for k in range(1, steps + 1)},
                        value=0.5 if state == TrialState.COMPLETE else None)


def test_the_default_budget_is_kept_in_trainings_short_by_less_than_one():
    budget = soak.Budget.of_study(3, list(soak.SETTINGS[1::2]))
    assert (budget.n, budget.steps) == (3, 2)  # the demo's 2 epochs, each one report
    trials = [trial(TrialState.COMPLETE, 2), trial(TrialState.PRUNED, 1),
              trial(TrialState.RUNNING, 1, **{PAUSED_AT: 1}), trial(TrialState.FAIL, 2)]
    assert budget.used(trials) == 2.0  # 4 steps of COMPLETE, PRUNED and paused: not the FAIL
    assert not budget.kept(2.0) and budget.kept(2.5) and budget.kept(3.0)
    assert not budget.kept(3.5)


def test_a_budget_of_trials_is_kept_to_the_trial():
    budget = soak.Budget.of_study(2, [*soak.SETTINGS[1::2], "study.budget=trials"])
    assert budget.steps is None and budget.unit() == "trials finished"
    trials = [trial(TrialState.COMPLETE, 2), trial(TrialState.PRUNED, 1),
              trial(TrialState.RUNNING, 1)]
    assert budget.used(trials) == 2 and budget.kept(2) and not budget.kept(1)
