"""benchmarks/tpe_speed.py swaps a private function of Optuna's TPE for SciPy's: these tests
fail when Optuna renames it, stops looking it up at call time, or the two part ways."""

import math

import numpy as np
import optuna
import pytest
import tpe_speed
from optuna.samplers._tpe import _truncnorm


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
