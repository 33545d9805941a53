"""TPE fitted at the highest rung with enough results (`hpo.search.rung_model`), on in-memory
studies."""

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

from hpo.config import SamplerConfig
from hpo.search.paused_view import PausedAsPruned
from hpo.search.pausing import PAUSED_AT
from hpo.search.pruning import rung_key
from hpo.search.rung_model import RungModel, modelled
from hpo.search.startup import PausedCountStartup
from hpo.search.study import PerTrialSeeded, make_sampler
from hpo.study_files import load

SPACE = {"x": FloatDistribution(-3, 3), "y": FloatDistribution(1e-4, 1, log=True),
         "c": CategoricalDistribution(["a", "b"])}


def loss(params: dict) -> float:
    return (params["x"] - 1) ** 2 + params["y"] + {"a": 0.0, "b": 0.5}[params["c"]]


def tpe(startup: int = 0) -> optuna.samplers.TPESampler:
    return optuna.samplers.TPESampler(seed=7, n_startup_trials=startup, multivariate=True,
                                      constant_liar=True)


def rung_model(min_trials: int, startup: int = 4) -> RungModel:
    return RungModel(tpe(), optuna.samplers.RandomSampler(seed=7), startup, min_trials)


def history(complete: int = 2, cut: int = 5, paused: int = 1, running: int = 1
            ) -> optuna.Study:
    """Trials that each reported at epoch 1, rung 0: `complete` ended, `cut` stopped there,
    `paused` paused there, `running` still training past it."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    for k in range(complete + cut + paused + running):
        trial = study.ask(SPACE)
        trial.report(loss(trial.params) + 1, 1)
        study._storage.set_trial_system_attr(  # noqa: SLF001 as the pruner records it
            trial._trial_id, rung_key(0), loss(trial.params) + 1)  # noqa: SLF001
        if k < complete:
            study.tell(trial, loss(trial.params))
        elif k < complete + cut:
            study.tell(trial, state=TrialState.PRUNED)
        elif k < complete + cut + paused:
            trial.set_user_attr(PAUSED_AT, 1)
    return study


def draws(study: optuna.Study, sampler: optuna.samplers.BaseSampler, n: int = 3) -> list[dict]:
    study.sampler = sampler
    return [study.ask(SPACE).params for _ in range(n)]


def test_it_models_the_highest_fidelity_with_enough_results():
    trials = history().get_trials(deepcopy=False)
    training = [t.number for t in trials if t.state == TrialState.RUNNING
                and PAUSED_AT not in t.user_attrs]
    at_end = modelled(trials, min_trials=2)
    assert at_end is not None
    assert [t.number for t in at_end] == [0, 1, *training]
    assert [t.value for t in at_end[:2]] == [trials[0].value, trials[1].value]
    at_rung = modelled(trials, min_trials=3)
    assert at_rung is not None
    # Every trial that reported at the rung (the paused one and the one still training
    # included), each by its value there; nothing else.
    assert sorted(t.number for t in at_rung) == list(range(9))
    assert all(t.state == TrialState.COMPLETE for t in at_rung)
    assert [t.value for t in at_rung] == [t.system_attrs[rung_key(0)] for t in at_rung]
    assert modelled(trials, min_trials=10) is None


def test_tpe_models_the_rung_as_if_its_results_were_complete_trials():
    study = history()
    seen = modelled(study.get_trials(deepcopy=False), min_trials=3)
    assert seen is not None
    restated = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    for trial in seen:
        restated.add_trial(trial)
    assert draws(history(), rung_model(3)) == draws(restated, tpe())
    # Guards the private name the view stands on: were TPE to stop reading the history
    # through `Study._get_trials`, the view would change nothing and this would fail.
    assert draws(history(), rung_model(3)) != draws(history(), tpe())


def test_until_some_fidelity_has_enough_results_it_draws_exactly_what_tpe_draws():
    def objective(trial: optuna.Trial) -> float:
        return loss({k: trial._suggest(k, d) for k, d in SPACE.items()})

    ours = optuna.create_study(sampler=rung_model(min_trials=100))
    ours.optimize(objective, 12)
    theirs = optuna.create_study(sampler=tpe(startup=4))
    theirs.optimize(objective, 12)
    assert [t.params for t in ours.trials] == [t.params for t in theirs.trials]


def test_the_start_up_is_counted_as_tpe_counts_it():
    # Two ended trials, five stopped: seven of eight; the paused and the running one not.
    study = history()
    assert draws(study, rung_model(3, startup=8), 1) == draws(
        history(), optuna.samplers.RandomSampler(seed=7), 1)
    assert draws(history(), rung_model(3, startup=7), 1) != draws(
        history(), optuna.samplers.RandomSampler(seed=7), 1)


def test_the_study_file_turns_it_on_under_the_paused_view(tiny_study):
    sets = ["study.sampler.name=tpe", "study.sampler.seed=3"]
    assert not isinstance(make_sampler(load(tiny_study, sets)).sampler_for(0)._inner,
                          RungModel)  # noqa: SLF001
    made = make_sampler(load(tiny_study, [*sets, "study.sampler.rung_model_min_trials=8"]))
    assert isinstance(made, PerTrialSeeded)
    inner = made.sampler_for(0)
    assert isinstance(inner, PausedAsPruned)
    assert isinstance(inner._inner, RungModel)  # noqa: SLF001
    assert inner._inner.min_trials == 8  # noqa: SLF001
    # With the counted start-up, the start-up is its: the rung model starts at once
    made = make_sampler(load(tiny_study, [*sets, "study.sampler.rung_model_min_trials=8",
                                          "study.sampler.startup_counts_paused=true"]))
    assert isinstance(made.sampler_for(0), PausedCountStartup)
    assert made.sampler_for(0)._tpe._inner._n == 0  # noqa: SLF001
    with pytest.raises(ValueError, match="rung_model_min_trials"):
        SamplerConfig(rung_model_min_trials=0)
