"""TPE shown a trial paused late in its training as the pruned trial it would be under
stopping.

The rule. Under `study.pruner.pause` a trial that successive halving would have stopped
pauses instead and stays RUNNING (`hpo.search.pausing`). Optuna's TPE reads a RUNNING trial
as one still training: it leaves it out of the trials that end its random start-up and out
of the count that sizes its "good" group, and, with its constant liar, puts it among the
poor results whatever it reported. Stopping would have ended the same trial PRUNED, which
TPE ranks by how far it got and what it reported there. `PausedAsPruned` answers TPE's
questions about the study's history with each trial paused at step `from_step` or later
re-stated as PRUNED (its reports unchanged), so TPE models those as it would under stopping;
a trial paused earlier, and a resumed one, is the running trial it is. With no such trial TPE
sees the study as it is and draws exactly what it draws unwrapped.

Why only late pauses (`study.sampler.paused_as_pruned_from`, half the training by default):
a value reported late in a training ranks trials as their ends do, an early one may not (a
slow learning rate that ends best). In the replay, every pause shown as pruned gained on a
table of 4-epoch fine-tuning curves and lost at scale on LCBench's 52-epoch curves, whose
rungs sit at 12% and 35% of the training; pauses past half the training kept the gain on the
first and left the second as it was (benchmarks/README.md, "Paused trials shown to TPE as
pruned").
"""

from __future__ import annotations

import copy
from collections.abc import Container, Sequence
from typing import Any, cast

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from hpo.search.pausing import PAUSED_AT, is_paused

_ASKED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)


def as_stopped(trials: Sequence[FrozenTrial], states: Container[TrialState] | None,
               from_step: int = 0) -> list[FrozenTrial]:
    """`trials` with each trial paused at `from_step` or later re-stated as PRUNED, those in
    `states` (None: all)."""
    seen = []
    for trial in trials:
        if is_paused(trial) and trial.user_attrs[PAUSED_AT] >= from_step:
            trial = copy.copy(trial)
            trial.state = TrialState.PRUNED
        if states is None or trial.state in states:
            seen.append(trial)
    return seen


class _StoppedView:
    """The study as TPE reads it, late-paused trials PRUNED; everything else is the study's.

    TPE reads the history through `Study._get_trials` (private: Optuna's samplers call it
    with `use_cache`); tests/search/test_paused_view.py fails if TPE stops reading it so."""

    def __init__(self, study: optuna.Study, from_step: int) -> None:
        self._study = study
        self._from_step = from_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None,
                    use_cache: bool = False) -> list[FrozenTrial]:
        wanted = None if states is None else {s for s in TrialState if s in states}
        asked = None if wanted is None else tuple(set(_ASKED) | wanted)
        trials = self._study._get_trials(deepcopy=deepcopy, states=asked, use_cache=use_cache)
        return as_stopped(trials, wanted, self._from_step)

    def get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None
                   ) -> list[FrozenTrial]:
        return self._get_trials(deepcopy=deepcopy, states=states)

    @property
    def trials(self) -> list[FrozenTrial]:
        return self._get_trials()


class PausedAsPruned(optuna.samplers.BaseSampler):
    """`inner` (Optuna's TPE) asked about a view of the study whose trials paused at
    `from_step` or later are PRUNED; the trial being sampled, and what the sampler writes, go
    to the study itself."""

    def __init__(self, inner: optuna.samplers.BaseSampler, from_step: int = 0) -> None:
        self._inner = inner
        self.from_step = from_step

    def _view(self, study: optuna.Study) -> optuna.Study:
        # A stand-in for the study (it answers what TPE asks a study), typed as one.
        return cast(optuna.Study, _StoppedView(study, self.from_step))

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
