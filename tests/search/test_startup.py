"""TPE's start-up counted with paused trials (`hpo.search.startup`), on in-memory studies."""

import optuna
import pytest

from hpo.search.pausing import PAUSED_AT
from hpo.search.startup import WORKERS, PausedCountStartup
from hpo.search.study import PerTrialSeeded, make_sampler
from hpo.study_files import load

N = 4


def wrapped(seed: int = 7, min_complete: int | str = 0) -> PausedCountStartup:
    return PausedCountStartup(optuna.samplers.TPESampler(seed=seed, n_startup_trials=0),
                              optuna.samplers.RandomSampler(seed=seed), N, min_complete)


def search(sampler: optuna.samplers.BaseSampler, trials: int = 12) -> list[dict]:
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda t: (t.suggest_float("x", -3, 3) - 1) ** 2
                   + t.suggest_float("y", 1e-4, 1, log=True)
                   + {"a": 0.0, "b": 0.5}[t.suggest_categorical("c", ["a", "b"])], trials)
    return [t.params for t in study.trials]


def test_with_no_trial_paused_it_draws_exactly_what_plain_tpe_draws():
    assert search(wrapped()) == search(optuna.samplers.TPESampler(seed=7, n_startup_trials=N))


def paused_study(paused: int, running: int, ended: int) -> optuna.Study:
    study = optuna.create_study()
    for _ in range(ended):
        trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
        study.tell(trial, trial.params["x"])
    for k in range(paused + running):
        trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
        trial.report(0.5, 1)
        if k < paused:
            trial.set_user_attr(PAUSED_AT, 1)
    return study


@pytest.mark.parametrize(("paused", "running", "ended", "started"), [
    (0, 0, N - 1, False), (0, 0, N, True),  # as plain TPE: trials ended
    (N - 1, 0, 1, True), (N, 0, 0, True),  # a paused trial counts as the stop it replaces
    (0, 5, N - 1, False),  # a trial still training does not
    (N - 1, 0, 0, False),
])
def test_paused_trials_count_toward_the_start_up_and_running_ones_do_not(paused, running,
                                                                         ended, started):
    study = paused_study(paused, running, ended)
    trial = study.ask()
    assert wrapped().started(study, study.trials[trial.number]) is started


@pytest.mark.parametrize(("paused", "ended", "min_complete", "started"), [
    (N - 1, 1, 1, True), (N - 1, 1, 2, False),  # enough trials decided, too few complete
    (N - 2, 2, 2, True), (0, N, N, True), (N, 0, 1, False),
])
def test_the_start_up_also_waits_for_min_complete_trials(paused, ended, min_complete, started):
    study = paused_study(paused, 0, ended)
    trial = study.ask()
    assert wrapped(min_complete=min_complete).started(study, study.trials[trial.number]) is started


@pytest.mark.parametrize(("running", "ended", "started"), [
    (2, 2, False), (2, 3, True),  # 3 workers: 2 training, 1 sampling
    (0, 1, True), (0, 0, False),  # 1 worker
])
def test_workers_waits_for_as_many_complete_trials_as_trials_training(running, ended, started):
    study = paused_study(N, running, ended)
    trial = study.ask()
    assert wrapped(min_complete=WORKERS).started(study, study.trials[trial.number]) is started


def test_a_resumed_trial_no_longer_counts():
    study = paused_study(N, 0, 0)
    study._storage.set_trial_user_attr(study.trials[0]._trial_id, PAUSED_AT, None)
    trial = study.ask()
    assert not wrapped().started(study, study.trials[trial.number])


def test_once_started_it_models_the_results_and_leaves_the_random_draws():
    study = paused_study(N, 0, 0)
    trial = study.ask()
    frozen = study.trials[trial.number]
    space = {"x": optuna.distributions.FloatDistribution(0, 1)}
    sampler = wrapped()
    # TPE with constant liar over paused (running) trials: it samples, where the start-up
    # would have returned nothing relative.
    assert set(sampler.sample_relative(study, frozen, space)) == {"x"}


def test_the_study_file_chooses_it_and_the_default_keeps_plain_tpe(tiny_study):
    def made(*sets: str) -> optuna.samplers.BaseSampler:
        sampler = make_sampler(load(tiny_study, ["study.sampler.name=tpe",
                                                 "study.sampler.seed=3", *sets]))
        assert isinstance(sampler, PerTrialSeeded)
        return sampler.sampler_for(0)

    plain = "study.sampler.paused_as_pruned_from=null"  # the paused view's default, left out
    assert isinstance(made(plain), optuna.samplers.TPESampler)
    assert isinstance(made(plain, "study.sampler.startup_counts_paused=true"),
                      PausedCountStartup)
    assert isinstance(made(plain, "study.sampler.startup_counts_paused=true",
                           "study.sampler.n_startup_trials=0"), optuna.samplers.TPESampler)
    sampler = made(plain, "study.sampler.startup_counts_paused=true",
                   "study.sampler.startup_min_complete=3")
    assert isinstance(sampler, PausedCountStartup) and sampler._min_complete == 3
    sampler = made(plain, "study.sampler.startup_counts_paused=true",
                   "study.sampler.startup_min_complete=workers")
    assert sampler._min_complete == WORKERS
