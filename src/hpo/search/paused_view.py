"""TPE shown a paused trial as the pruned trial it would be under stopping.

The rule. Under `study.pruner.pause` a trial that successive halving would have stopped
pauses instead and stays RUNNING (`hpo.search.pausing`). Optuna's TPE reads a RUNNING trial
as one still training: it leaves it out of the trials that end its random start-up and out
of the count that sizes its "good" group, and, with its constant liar, puts it among the
poor results whatever it reported. Stopping would have ended the same trial PRUNED, which
TPE ranks by how far it got and what it reported there. `PausedAsPruned` answers TPE's
questions about the study's history with each paused trial re-stated as PRUNED (its reports
unchanged), so TPE models under pausing what it would have modelled under stopping; a
resumed trial is a running one again until it ends. With no trial paused TPE sees the study
as it is and draws exactly what it draws unwrapped.

Where the study sets an agreement (`study.sampler.paused_as_pruned_agreement`), a paused
trial is re-stated only once the rung it paused at ranks trials as their ends do: Kendall's
tau between the value there and the final value, over at least `MIN_PAIRS` COMPLETE trials
that reported there (`pruning.agreement`), is at least the agreement. Until then it is the
running trial it is. An early epoch's ranking then steers TPE's model only on a task whose
early epochs predict the last (a few epochs of fine-tuning, where the first ranks as the
last); where they do not (a slow learning rate that ends best), its values stay out of the
model, as they do with no view at all.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from hpo.search.pausing import PAUSED_AT, is_paused, rung_reached
from hpo.search.pruning import agreement

_ASKED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
MIN_PAIRS = 5  # the finished trials an agreement is measured on, as the pruner's default


def trusted_rungs(trials: Sequence[FrozenTrial], min_agreement: float | None) -> set[int]:
    """The rungs of the paused trials whose ranking agrees with the end (all of them where
    `min_agreement` is None)."""
    rungs = {rung_reached(t) for t in trials if is_paused(t)}
    if min_agreement is None:
        return rungs
    trusted = set()
    for rung in rungs:
        tau, pairs = agreement(list(trials), rung)
        if pairs >= MIN_PAIRS and tau >= min_agreement:
            trusted.add(rung)
    return trusted


def as_stopped(trials: Sequence[FrozenTrial], states: Container[TrialState] | None,
               min_agreement: float | None = None, from_step: int = 0) -> list[FrozenTrial]:
    """`trials` with each paused one re-stated as PRUNED (only those paused at a rung that
    agrees with the end by `min_agreement`, where given, and at step `from_step` or later),
    those in `states` (None: all)."""
    trusted = trusted_rungs(trials, min_agreement)
    seen = []
    for trial in trials:
        if (is_paused(trial) and rung_reached(trial) in trusted
                and trial.user_attrs[PAUSED_AT] >= from_step):
            trial = copy.copy(trial)
            trial.state = TrialState.PRUNED
        if states is None or trial.state in states:
            seen.append(trial)
    return seen


class _StoppedView:
    """The study as TPE reads it, paused trials PRUNED; everything else is the study's.

    TPE reads the history through `Study._get_trials` (private: Optuna's samplers call it
    with `use_cache`); tests/search/test_paused_view.py fails if TPE stops reading it so."""

    def __init__(self, study: optuna.Study, min_agreement: float | None, from_step: int
                 ) -> None:
        self._study = study
        self._min_agreement = min_agreement
        self._from_step = from_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None,
                    use_cache: bool = False) -> list[FrozenTrial]:
        wanted = None if states is None else set(states)
        asked = None if wanted is None else tuple(set(_ASKED) | wanted)
        trials = self._study._get_trials(deepcopy=deepcopy, states=asked, use_cache=use_cache)
        # `asked` holds COMPLETE, so the agreement is measured on every finished trial.
        return as_stopped(trials, wanted, self._min_agreement, self._from_step)

    def get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None
                   ) -> list[FrozenTrial]:
        return self._get_trials(deepcopy=deepcopy, states=states)

    @property
    def trials(self) -> list[FrozenTrial]:
        return self._get_trials()


class PausedAsPruned(optuna.samplers.BaseSampler):
    """`inner` (Optuna's TPE) asked about a view of the study whose paused trials are PRUNED;
    the trial being sampled, and what the sampler writes, go to the study itself. Only the
    trials paused at a rung that agrees with the end by `min_agreement`, where given."""

    def __init__(self, inner: optuna.samplers.BaseSampler,
                 min_agreement: float | None = None, from_step: int = 0) -> None:
        self._inner = inner
        self._min_agreement = min_agreement
        self._from_step = from_step

    def _view(self, study: optuna.Study) -> _StoppedView:
        return _StoppedView(study, self._min_agreement, self._from_step)

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial,
    ) -> dict[str, BaseDistribution]:
        return self._inner.infer_relative_search_space(self._view(study), trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution],
    ) -> dict[str, Any]:
        return self._inner.sample_relative(self._view(study), trial, search_space)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        return self._inner.sample_independent(self._view(study), trial, param_name,
                                              param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._inner.before_trial(study, trial)

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self._inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._inner.reseed_rng()
