"""The context one trial runs in: the study, the live trial, the study's batch cache and
lock, the watch and the reporter, as one object. A worker makes it where it claims the trial
(an isolated child makes its own for the same trial) and passes it down: the executor, the
planning, the drivers and the records take it, and nothing below them needs more."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import optuna

from hpo.search.liveness import LiveTrial, Lock, write_carried
from hpo.search.resilience import ResilientRDBStorage
from hpo.space import Params
from hpo.training.train import Plan, Progress
from hpo.trial.batch_limit import StudyBatchCache, Watch, shared_batch_cache, unwatched

T = TypeVar("T")

class TrialReporter(Protocol):
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
    reporter: TrialReporter
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
        """`write` on the live trial, followed to its retry copy if it was reaped meanwhile
        (`liveness.write_carried`)."""
        return write_carried(self.live, write, self.lock)


def claimed(study: optuna.Study, storage: ResilientRDBStorage, trial: optuna.Trial,
            reporter: TrialReporter, watch: Watch = unwatched) -> TrialContext:
    """The context of a trial just claimed from `study`, whose workers share `storage`."""
    return TrialContext(study, LiveTrial(trial), shared_batch_cache(study, storage), reporter,
                        watch)
