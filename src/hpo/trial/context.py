"""The context one trial runs in: the study, the live trial, the study's batch cache and
lock, the watch and the display, as one object. A worker makes it where it claims the trial
(an isolated child makes its own for the same trial) and passes it down: the executor, the
planning, the drivers and the records take it, and nothing below them needs more."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import optuna

from hpo.outcome import Reaped
from hpo.search.liveness import LiveTrial, Lock, carry_over
from hpo.search.resilience import ResilientRDBStorage
from hpo.space import Params
from hpo.training.train import Plan, Progress
from hpo.trial.batch_limit import StudyBatchCache, Watch, shared_batch_cache, unwatched

T = TypeVar("T")

class TrialDisplay(Protocol):
    """What a trial says while it runs."""

    def trial_started(self, number: int, params: Params, plan: Plan, probes: int) -> None: ...
    def step(self, number: int, progress: Progress, epochs: int) -> None: ...
    def epoch(self, number: int, epoch: float, epochs: int, score: float) -> None: ...
    def warning(self, text: str) -> None: ...
    def message(self, text: str) -> None: ...


@dataclass(frozen=True)
class TrialContext:
    study: optuna.Study
    live: LiveTrial
    cache: StudyBatchCache
    display: TrialDisplay
    watch: Watch = unwatched

    @property
    def trial(self) -> optuna.Trial:
        """The trial the run writes to now: its retry copy once it was carried over."""
        return self.live.trial

    @property
    def lock(self) -> Lock:
        """The study lock every worker of the study shares (the cache's updates and a carry
        over take it)."""
        return self.cache.lock

    def write(self, write: Callable[[optuna.Trial], T]) -> T:
        """Run `write` on the live trial; if the trial was reaped while it ran, carry it over
        to its waiting copy (`liveness.carry_over`, under the study lock) and write there,
        else raise Reaped. The copy can be reaped in turn (a long outage again): a few times
        over."""
        live = self.live
        number = live.trial.number  # the trial that was reaped, if this one is
        for _ in range(3):
            trial = live.trial
            try:
                return write(trial)
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
                # ValueError: study.tell's "Cannot tell a FAIL trial"; the state says which.
                if not trial.storage.get_trial(trial._trial_id).state.is_finished():
                    raise
            if carry_over(live, self.lock) is None:
                break
        raise Reaped(f"trial {number} was reaped while it ran (its heartbeats were lost) and "
                     f"its retry was already claimed by another worker: this run's result is "
                     f"dropped")


def claimed(study: optuna.Study, storage: ResilientRDBStorage, trial: optuna.Trial,
            display: TrialDisplay, watch: Watch = unwatched) -> TrialContext:
    """The context of a trial just claimed from `study`, whose workers share `storage`."""
    return TrialContext(study, LiveTrial(trial), shared_batch_cache(study, storage), display,
                        watch)
