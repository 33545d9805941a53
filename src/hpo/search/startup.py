"""TPE's random start-up, counted as stopping would count it when trials pause.

The rule. Optuna's TPE draws at random until `n_startup_trials` trials have ended COMPLETE
or PRUNED. Under `study.pruner.pause` a trial that successive halving would have stopped
pauses instead and stays RUNNING (`hpo.search.pausing`), so it does not count, and a search
whose trials mostly pause stays random far longer than the same search stopping them: on a
table of 52-epoch curves, hpo at 20 trials' compute on one worker finished about 15 of the
55 trials it started in the horizon (benchmarks/README.md). `PausedCountStartup` counts a
paused trial among the trials that end the start-up, as the stop it replaces would have
counted; what TPE models once it starts is unchanged (a paused trial is a running one to
it, its constant liar's). While no trial is paused it draws exactly what the TPE it wraps draws.
`min_complete` also waits for that many COMPLETE trials: a start-up ended by paused trials
alone leaves TPE one or two results to model, all of its "good" group, while the trials of
the other workers count among its poor ones (the constant liar). `WORKERS` waits for as
many as there are workers, read off the study: the trials training now, paused ones not
counted (one per worker, the trial being sampled included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from hpo.search.pausing import is_paused

WORKERS = "workers"


class PausedCountStartup(optuna.samplers.BaseSampler):
    """`tpe` (made with `n_startup_trials=0`) once `n_startup_trials` trials have ended or
    paused, `min_complete` of them COMPLETE; until then `random`, seeded as TPE seeds its own
    start-up sampler."""

    def __init__(self, tpe: optuna.samplers.BaseSampler, random: optuna.samplers.RandomSampler,
                 n_startup_trials: int, min_complete: int | str = 0) -> None:
        self._tpe, self._random, self._n = tpe, random, n_startup_trials
        self._min_complete = min_complete
        self._warm: tuple[int, bool] | None = None  # (trial number, counted for it)

    def started(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        """Whether TPE models trial `trial`: enough trials ended or paused before it."""
        if self._warm is None or self._warm[0] != trial.number:
            trials = study.get_trials(deepcopy=False, states=(
                TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
            decided = sum(t.state != TrialState.RUNNING or is_paused(t) for t in trials)
            complete = sum(t.state == TrialState.COMPLETE for t in trials)
            wanted = (len(trials) - decided if isinstance(self._min_complete, str)
                      else self._min_complete)  # str: WORKERS, the config's only one
            self._warm = (trial.number, decided >= self._n and complete >= wanted)
        return self._warm[1]

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial,
    ) -> dict[str, BaseDistribution]:
        return self._tpe.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution],
    ) -> dict[str, Any]:
        if not search_space or not self.started(study, trial):
            return {}
        return self._tpe.sample_relative(study, trial, search_space)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        sampler = self._tpe if self.started(study, trial) else self._random
        return sampler.sample_independent(study, trial, param_name, param_distribution)

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
