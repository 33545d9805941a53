"""Creating or joining a study with its pinned space, and the worker loop: an exact
study-wide budget, heartbeats for running trials, reaping of trials whose worker went silent."""

from __future__ import annotations

import contextlib
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo import budget
from hpo.config import StudyConfig
from hpo.executor import Outcome, Worker, execute
from hpo.hardware import Device
from hpo.space import PinnedSpace, pin
from hpo.storage import ResilientRDBStorage

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
# The heartbeat thread below does for ask/tell what Study.optimize does for its own loop.
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
# How often a worker that waits for the study's last trials looks again.
POLL_SECONDS = 2.0


class WorkerStopped(RuntimeError):
    """The worker gave up: too many trials in a row failed."""


def _sampler(config: StudyConfig) -> optuna.samplers.BaseSampler:
    sampler = config.study.sampler
    if sampler.name == "random":
        return optuna.samplers.RandomSampler(seed=sampler.seed)
    return optuna.samplers.TPESampler(
        seed=sampler.seed, n_startup_trials=sampler.n_startup_trials, multivariate=True
    )


def make_pruner(config: StudyConfig) -> optuna.pruners.BasePruner:
    pruner = config.study.pruner
    if pruner.name == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=pruner.n_startup_trials, n_warmup_steps=pruner.n_warmup_steps
        )
    if pruner.name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto")
    return optuna.pruners.NopPruner()


def join(
    config: StudyConfig, storage: ResilientRDBStorage, device: Device
) -> tuple[optuna.Study, PinnedSpace]:
    """Create the study or load it, and the space this worker may search in it. Under the
    study lock, so that of many workers starting at once exactly one pins the space."""
    with budget.study_lock(storage.engine, config.study.name):
        study = optuna.create_study(
            storage=storage,
            study_name=config.study.name,
            direction="maximize",
            sampler=_sampler(config),
            pruner=make_pruner(config),
            load_if_exists=True,
        )
        return study, pin(study, config.search_space, device)


def finished_count(study: optuna.Study) -> int:
    return budget.count(study).finished


@contextlib.contextmanager
def heartbeat(storage: ResilientRDBStorage, trial_id: int) -> Iterator[None]:
    """Record the trial's heartbeat every interval while it runs, from a background thread,
    so a long training step cannot make a live trial look dead."""
    interval = storage.get_heartbeat_interval()
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            # A beat lost to an outage is not fatal: the next one, or the grace period, copes.
            with contextlib.suppress(Exception):
                storage.record_heartbeat(trial_id)

    storage.record_heartbeat(trial_id)
    thread = threading.Thread(target=beat, name=f"heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def reap(study: optuna.Study) -> None:
    """Fail trials whose worker stopped beating; the retry callback re-queues them."""
    optuna.storages.fail_stale_trials(study)


@dataclass(frozen=True)
class WorkerResult:
    ran: int
    finished_before: int
    finished_after: int


TrialRunner = Callable[[optuna.Study, optuna.Trial], tuple[Outcome, FrozenTrial]]


def in_process(worker: Worker, reporter) -> TrialRunner:
    return lambda study, trial: execute(study, trial, worker, reporter)


def run_worker(
    study: optuna.Study,
    storage: ResilientRDBStorage,
    run_trial: TrialRunner,
    reporter,
    *,
    n_trials: float,
    timeout: float | None = None,
    max_consecutive_failures: int = 3,
    poll_seconds: float = POLL_SECONDS,
) -> WorkerResult:
    """Run trials until the study holds `n_trials` finished (COMPLETE or PRUNED) trials.

    While the last trials run on other workers this worker waits, reaping stale trials, and
    takes over a slot that frees up (a failed trial, a re-queued retry). `timeout` stops it
    from claiming new trials; `max_consecutive_failures` FAILed trials in a row stop it.
    """
    started = time.monotonic()
    before = finished_count(study)
    study_id = storage.get_study_id_from_name(study.study_name)
    reap_every = storage.get_heartbeat_interval() or poll_seconds
    ran = failures = 0
    waiting_said = False
    last_reap = -math.inf
    while True:
        # Reaping reads every running trial's heartbeat: once per heartbeat interval is
        # enough, since nothing can turn stale faster than that.
        if time.monotonic() - last_reap >= reap_every:
            reap(study)
            last_reap = time.monotonic()
        with budget.study_lock(storage.engine, study.study_name) as connection:
            counts = budget.count_in_database(connection, study_id)
            if counts.finished >= n_trials:
                break
            if timeout is not None and time.monotonic() - started >= timeout:
                reporter.message(f"timeout of {timeout:g}s reached")
                break
            trial = study.ask() if budget.may_claim(counts, n_trials) else None
        if trial is None:
            if not waiting_said:
                reporter.message(f"waiting for {counts.running} running trial(s) of other "
                                 f"workers ({counts.finished}/{n_trials:g} finished)")
                waiting_said = True
            time.sleep(poll_seconds)
            continue
        waiting_said = False
        if counts.waiting:
            # Optuna's retry callback marks the re-queued copy of a stale trial; only a
            # waiting trial can be one, and ask() takes waiting trials first.
            retried = storage.get_trial_system_attrs(trial._trial_id).get("failed_trial")
            if retried is not None:
                trial.set_user_attr("retry_of", retried)
        with heartbeat(storage, trial._trial_id):
            try:
                outcome, finished = run_trial(study, trial)
            except KeyboardInterrupt:
                # Leave no trial RUNNING behind an interrupted worker.
                with contextlib.suppress(Exception):
                    study.tell(trial, state=TrialState.FAIL)
                raise
        ran += 1
        reporter.trial_finished(finished, outcome)
        failures = failures + 1 if outcome.state == TrialState.FAIL else 0
        if failures >= max_consecutive_failures:
            raise WorkerStopped(f"{failures} trials in a row failed; last error: {outcome.error}")
    return WorkerResult(ran, before, finished_count(study))
