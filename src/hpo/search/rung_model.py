"""TPE fitted at the highest rung with enough results: BOHB's model in Optuna's TPE.

The rule. Successive halving records the value each trial reported at each rung it reached
(`completed_rung_<k>`, `hpo.search.pruning`). Optuna's TPE models every trial it has: the
COMPLETE ones ranked by their result, then the stopped ones ranked below them by how far
they got. BOHB instead fits its model on one fidelity only, the highest at which at least
`min_trials` trials have a result, each by the value it reported there (Falkner et al.,
2018; there `min_trials` is the number of parameters plus 3). `RungModel` answers TPE's
questions about the study's history so: with enough COMPLETE trials, those alone; else the
trials that reached the highest rung with `min_trials` of them, each as a COMPLETE trial
whose value is its value at that rung; the trials still training (not paused) stay, for
TPE's constant liar; every other trial is left out. While no fidelity has enough results
TPE reads the study as it is.

TPE's own random start-up is kept as TPE counts it (COMPLETE and PRUNED trials of the study
it is handed), so a study whose search has not begun draws what it drew without this.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Sequence
from typing import Any, cast

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from hpo.search.pausing import is_paused
from hpo.search.pruning import rung_key

_MAX_RUNGS = 64


def at_rung(trial: FrozenTrial, value: float) -> FrozenTrial:
    """`trial` restated as a COMPLETE trial whose value is `value` (its report at a rung)."""
    seen = copy.copy(trial)
    seen.state = TrialState.COMPLETE
    seen.values = [value]
    seen.datetime_complete = trial.datetime_complete or trial.datetime_start
    return seen


def modelled(trials: Sequence[FrozenTrial], min_trials: int) -> list[FrozenTrial] | None:
    """What TPE models of `trials`: the highest fidelity with `min_trials` results and the
    trials still training, or None when no fidelity has that many."""
    training = [t for t in trials if t.state == TrialState.RUNNING and not is_paused(t)]
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.values is not None]
    if len(complete) >= min_trials:
        return complete + training
    for rung in reversed(range(_highest_rung(trials) + 1)):
        key = rung_key(rung)
        reached = [at_rung(t, t.system_attrs[key]) for t in trials
                   if key in t.system_attrs and t.state != TrialState.FAIL]
        if len(reached) >= min_trials:
            numbers = {t.number for t in reached}
            return reached + [t for t in training if t.number not in numbers]
    return None


def _highest_rung(trials: Sequence[FrozenTrial]) -> int:
    highest = -1
    for trial in trials:
        while highest + 1 < _MAX_RUNGS and rung_key(highest + 1) in trial.system_attrs:
            highest += 1
    return highest


class _RungView:
    """The study as TPE reads it under the rule; everything else is the study's.

    TPE reads the history through `Study._get_trials` (private: Optuna's samplers call it with
    `use_cache`); tests/search/test_rung_model.py fails if TPE stops reading it so."""

    def __init__(self, study: optuna.Study, trials: list[FrozenTrial]) -> None:
        self._study = study
        self._trials = trials

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None,
                    use_cache: bool = False) -> list[FrozenTrial]:
        return [copy.deepcopy(t) if deepcopy else t for t in self._trials
                if states is None or t.state in states]

    def get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None
                   ) -> list[FrozenTrial]:
        return self._get_trials(deepcopy=deepcopy, states=states)

    @property
    def trials(self) -> list[FrozenTrial]:
        return self._get_trials()


class RungModel(optuna.samplers.BaseSampler):
    """`tpe` (made with `n_startup_trials=0`) asked about the study as the rule shows it, once
    `n_startup_trials` trials of the study it is handed have ended COMPLETE or PRUNED (TPE's
    own count); until then `random`, seeded as TPE seeds its own start-up sampler."""

    def __init__(self, tpe: optuna.samplers.BaseSampler, random: optuna.samplers.RandomSampler,
                 n_startup_trials: int, min_trials: int) -> None:
        if min_trials < 1:
            raise ValueError("min_trials >= 1 is required")
        self._tpe, self._random = tpe, random
        self._n, self.min_trials = n_startup_trials, min_trials

    def _view(self, study: optuna.Study) -> optuna.Study | None:
        """The study as TPE models it, or None during the start-up."""
        trials = study._get_trials(deepcopy=False, use_cache=True,  # noqa: SLF001 as TPE
                                   states=(TrialState.COMPLETE, TrialState.PRUNED,
                                           TrialState.RUNNING))
        if sum(t.state != TrialState.RUNNING for t in trials) < self._n:
            return None
        seen = modelled(trials, self.min_trials)
        # A stand-in for the study (it answers what TPE asks a study), typed as one.
        return study if seen is None else cast(optuna.Study, _RungView(study, seen))

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial,
    ) -> dict[str, BaseDistribution]:
        return self._tpe.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution],
    ) -> dict[str, Any]:
        view = self._view(study) if search_space else None
        return {} if view is None else self._tpe.sample_relative(view, trial, search_space)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        view = self._view(study)
        if view is None:
            return self._random.sample_independent(study, trial, param_name, param_distribution)
        return self._tpe.sample_independent(view, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._tpe.before_trial(study, trial)
        self._random.before_trial(study, trial)

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self._tpe.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._tpe.reseed_rng()
        self._random.reseed_rng()
