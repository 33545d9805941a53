"""TPE shown paused trials as pruned (`hpo.search.paused_view`), on in-memory studies."""

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

from hpo.config import SamplerConfig
from hpo.search.paused_view import PausedAsPruned, as_stopped
from hpo.search.pausing import PAUSED_AT
from hpo.search.startup import PausedCountStartup
from hpo.search.study import PerTrialSeeded, make_sampler
from hpo.study_files import load

SPACE = {"x": FloatDistribution(-3, 3), "y": FloatDistribution(1e-4, 1, log=True),
         "c": CategoricalDistribution(["a", "b"])}


def tpe(seed: int = 7, startup: int = 4) -> optuna.samplers.TPESampler:
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True,
                                      constant_liar=True)


def loss(params: dict) -> float:
    return (params["x"] - 1) ** 2 + params["y"] + {"a": 0.0, "b": 0.5}[params["c"]]


def history(stopped: str, complete: int = 3, cut: int = 4, running: int = 1) -> optuna.Study:
    """`complete` trials ended, `cut` trials cut at epoch 1 (`stopped`: "paused" or "pruned")
    and `running` trials still training, each with its report at epoch 1."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    for k in range(complete + cut + running):
        trial = study.ask(SPACE)
        trial.report(loss(trial.params) + 1, 1)
        if k < complete:
            study.tell(trial, loss(trial.params))
        elif k < complete + cut:
            if stopped == "pruned":
                study.tell(trial, state=TrialState.PRUNED)
            else:
                trial.set_user_attr(PAUSED_AT, 1)
    return study


def draws(study: optuna.Study, sampler: optuna.samplers.BaseSampler, n: int = 3) -> list[dict]:
    study.sampler = sampler
    return [study.ask(SPACE).params for _ in range(n)]


def test_paused_trials_are_modelled_exactly_as_the_pruned_trials_stopping_makes():
    as_pruned = draws(history("paused"), PausedAsPruned(tpe()))
    assert as_pruned == draws(history("pruned"), tpe())
    # Guards the private name the view stands on: were TPE to stop reading the history
    # through `Study._get_trials`, the view would change nothing and this would fail.
    assert as_pruned != draws(history("paused"), tpe())


def test_with_no_trial_paused_it_draws_exactly_what_tpe_draws():
    study = optuna.create_study(sampler=PausedAsPruned(tpe()))
    study.optimize(lambda t: loss({k: t._suggest(k, d) for k, d in SPACE.items()}), 12)
    plain = optuna.create_study(sampler=tpe())
    plain.optimize(lambda t: loss({k: t._suggest(k, d) for k, d in SPACE.items()}), 12)
    assert [t.params for t in study.trials] == [t.params for t in plain.trials]


def test_the_view_restates_only_paused_trials_and_filters_by_state():
    study = history("paused", complete=2, cut=2, running=1)
    trials = study.get_trials(deepcopy=False)
    seen = as_stopped(trials, None)
    assert [t.state for t in seen] == [TrialState.COMPLETE] * 2 + [TrialState.PRUNED] * 2 + [
        TrialState.RUNNING]
    assert [t.state for t in trials][2:4] == [TrialState.RUNNING] * 2  # the study's untouched
    assert [t.number for t in as_stopped(trials, (TrialState.PRUNED,))] == [2, 3]
    assert seen[2].intermediate_values == trials[2].intermediate_values


def test_a_resumed_trial_is_running_again():
    study = history("paused", complete=0, cut=1, running=0)
    study._storage.set_trial_user_attr(study.trials[0]._trial_id, PAUSED_AT, None)
    assert as_stopped(study.get_trials(deepcopy=False), None)[0].state == TrialState.RUNNING


def test_the_sample_goes_to_the_study_itself():
    study = history("paused")
    study.sampler = PausedAsPruned(tpe())
    trial = study.ask(SPACE)
    assert study.trials[trial.number].params == trial.params
    assert study.trials[trial.number].state == TrialState.RUNNING


def paused_at(steps: tuple[int, ...]) -> list:
    """Finished trials, and one trial paused at each of `steps`."""
    study = optuna.create_study(direction="maximize")
    for k in range(2 + len(steps)):
        trial = study.ask({"x": FloatDistribution(0, 1)})
        trial.report(float(k), 1)
        if k < 2:
            study.tell(trial, float(k))
        else:
            trial.set_user_attr(PAUSED_AT, steps[k - 2])
    return study.get_trials(deepcopy=False)


def test_only_trials_paused_from_a_step_on_are_restated():
    trials = paused_at((1, 2, 3))
    assert [t.state for t in as_stopped(trials, None, from_step=2)] == [
        TrialState.COMPLETE] * 2 + [TrialState.RUNNING, TrialState.PRUNED, TrialState.PRUNED]
    assert [t.state for t in as_stopped(trials, None)][2:] == [TrialState.PRUNED] * 3
    assert [t.number for t in as_stopped(trials, (TrialState.RUNNING,), from_step=3)] == [2, 3]


def test_tpe_reads_trials_paused_before_the_step_as_running():
    # history's trials pause at step 1: from step 2 on, TPE sees the study as it is
    assert draws(history("paused"), PausedAsPruned(tpe(), 2)) == draws(history("paused"),
                                                                        tpe())


def test_by_default_trials_paused_from_half_their_training_on_are_restated(tiny_study):
    sets = ["study.sampler.name=tpe", "study.sampler.seed=3"]
    config = load(tiny_study, sets)
    made = make_sampler(config)
    assert isinstance(made, PerTrialSeeded)
    assert isinstance(made.sampler_for(0), PausedAsPruned)
    assert made.sampler_for(0).from_step == -(-config.max_steps() // 2)  # rounded up
    made = make_sampler(load(tiny_study, [*sets, "study.sampler.paused_as_pruned_from=0"]))
    assert made.sampler_for(0).from_step == 0
    made = make_sampler(load(tiny_study, [*sets, "study.sampler.paused_as_pruned_from=null"]))
    assert isinstance(made.sampler_for(0), optuna.samplers.TPESampler)
    # With the counted start-up, the start-up counts the paused trials, TPE the view
    made = make_sampler(load(tiny_study, [*sets, "study.sampler.startup_counts_paused=true"]))
    assert isinstance(made.sampler_for(0), PausedCountStartup)
    assert isinstance(made.sampler_for(0)._tpe, PausedAsPruned)
    with pytest.raises(ValueError, match="paused_as_pruned_from"):
        SamplerConfig(paused_as_pruned_from=1.5)
