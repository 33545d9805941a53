"""benchmarks/tpe_speed.py swaps a private function of Optuna's TPE for SciPy's: these tests
fail when Optuna renames it, stops looking it up at call time, or the two part ways."""

import math

import numpy as np
import optuna
import pytest
import tpe_speed
from optuna.samplers._tpe import _truncnorm
from optuna.search_space import IntersectionSearchSpace

from hpo.search.study import PerTrialSeeded, trial_seed


@pytest.fixture
def installed():
    tpe_speed.install()
    yield
    tpe_speed.uninstall()


def test_optunas_log_ndtr_is_still_the_private_name_swapped():
    assert tpe_speed.OPTUNAS is _truncnorm._log_ndtr
    assert _truncnorm._log_ndtr.__name__ == "_log_ndtr"


def test_the_vectorised_log_ndtr_agrees_with_optunas_over_its_whole_range():
    # Both branches of Optuna's: erf/erfc in (-20, 6], the asymptotic series below -20.
    # Near 6 Optuna's log(1 - tiny) is the less exact of the two, by under 1e-16 absolute.
    a = np.concatenate([np.linspace(-40, 10, 5001), [-1e3, -20.0, 6.0, 38.0]])
    ours, optunas = tpe_speed.vectorised(a), tpe_speed.OPTUNAS(a)
    assert ours.dtype == optunas.dtype == np.float64 and ours.shape == optunas.shape
    np.testing.assert_allclose(ours, optunas, rtol=1e-12, atol=1e-15)


def test_installed_it_is_what_optunas_gauss_mass_calls(installed, monkeypatch):
    calls = []
    monkeypatch.setattr(tpe_speed, "log_ndtr",
                        lambda a: calls.append(len(a)) or np.log(0.5 * np.ones(len(a))))
    _truncnorm._log_gauss_mass(np.array([-3.0, 1.0]), np.array([-2.0, 2.0]))
    assert calls  # the left and right tails went through the swapped function


def test_a_tpe_search_suggests_the_same_with_either(installed):
    def suggestions() -> list[tuple]:
        sampler = optuna.samplers.TPESampler(seed=3, n_startup_trials=5)
        study = optuna.create_study(sampler=sampler)
        out = []
        for _ in range(60):
            trial = study.ask()
            x = trial.suggest_float("x", 1e-5, 1e-2, log=True)
            n = trial.suggest_int("n", 1, 64)
            study.tell(trial, (math.log10(x) + 3) ** 2 + (n - 20) ** 2 / 100)
            out.append((x, n))
        return out

    fast = suggestions()
    tpe_speed.uninstall()
    exact = suggestions()
    # The same search: the integers chosen alike, the floats to rounding (last bits differ).
    assert [n for _, n in fast] == [n for _, n in exact]
    assert [x for x, _ in fast] == pytest.approx([x for x, _ in exact], rel=1e-12)


def test_a_tpe_still_keeps_its_intersection_search_space_under_the_private_name():
    sampler = optuna.samplers.TPESampler(seed=0)
    assert isinstance(sampler._search_space, IntersectionSearchSpace)
    shared = tpe_speed.one_search_space(lambda n: optuna.samplers.TPESampler(seed=n))
    first, second = shared(0), shared(1)
    assert first._search_space is second._search_space
    study = optuna.create_study()
    for _ in range(3):
        trial = study.ask()
        trial.suggest_float("x", 0.0, 1.0)
        study.tell(trial, 0.5)
    calls = []
    real = first._search_space.calculate
    first._search_space.calculate = lambda *a: calls.append(a) or real(*a)
    trial = study.ask()
    assert second.infer_relative_search_space(study, study.trials[-1]) == {
        "x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    assert calls  # the TPE asked the shared space, not one of its own
    study.tell(trial, state=optuna.trial.TrialState.FAIL)


def test_per_trial_samplers_sharing_one_search_space_draw_as_those_that_do_not():
    """Several trials running at once, some pruned, a parameter only some trials have: the
    cases Optuna's incremental cache must get right for the draws to be the same."""
    def suggestions(make) -> list[tuple]:
        study = optuna.create_study(sampler=PerTrialSeeded(make))
        out, running = [], []
        for k in range(90):
            trial = study.ask()
            x = trial.suggest_float("x", 1e-5, 1e-2, log=True)
            n = trial.suggest_int("n", 1, 64)
            c = trial.suggest_categorical("c", ["a", "b"])
            y = trial.suggest_float("y", 0.0, 1.0) if c == "a" else 0.0
            running.append((trial, (math.log10(x) + 3) ** 2 + (n - 20) ** 2 / 100 + y))
            out.append((x, n, c, y))
            if k % 3 == 2:  # three at a time, told oldest first, every fifth pruned
                for j, (t, value) in enumerate(running):
                    if (k + j) % 5 == 0:
                        study.tell(t, state=optuna.trial.TrialState.PRUNED)
                    else:
                        study.tell(t, value)
                running = []
        return out

    def fresh(n: int) -> optuna.samplers.TPESampler:
        return optuna.samplers.TPESampler(seed=trial_seed(7, n), n_startup_trials=10)

    assert suggestions(tpe_speed.one_search_space(fresh)) == suggestions(fresh)
