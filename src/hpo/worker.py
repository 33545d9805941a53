"""A worker: its set-up (device settings, the study joined, data and models loaded, the
trivial baseline recorded) and its loop, which claims trials under the exact study-wide budget,
keeps each running trial's heartbeat and reaps trials whose worker went silent."""

from __future__ import annotations

import contextlib
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo import budget, hardware, isolation
from hpo.config import StudyConfig
from hpo.data.splits import Splits
from hpo.executor import Outcome, execute
from hpo.hardware import Device
from hpo.report import ConsoleReporter
from hpo.resources import Resources, load_resources
from hpo.storage import ResilientRDBStorage, redact
from hpo.study import finished_count, join

BASELINE = "every symptom predicted for every post"
# How often a worker that waits for the study's last trials looks again.
POLL_SECONDS = 2.0


class WorkerStopped(RuntimeError):
    """The worker gave up: too many trials in a row failed."""


class LoopReporter(Protocol):
    def message(self, text: str) -> None: ...
    def trial_finished(self, trial: FrozenTrial, outcome: Outcome) -> None: ...


def work(
    config: StudyConfig,
    splits: Splits,
    device: Device,
    url: str,
    storage: ResilientRDBStorage,
    *,
    n_trials: float,
    timeout: float | None = None,
) -> None:
    """Set the worker up and run trials until the study holds `n_trials` finished ones (or
    `timeout` passes); raises WorkerStopped after too many failures in a row."""
    hardware.configure_backends(device)
    study, pinned = join(config, storage, device)
    reporter = ConsoleReporter()
    resources = load_resources(config, pinned, device, splits)
    data = config.data
    finished = finished_count(study)
    goal = "no trial budget" if math.isinf(n_trials) else f"{finished}/{n_trials} finished"
    reporter.message(
        f"study '{config.study.name}' on {redact(url)}: {goal}; "
        f"device {device.describe()}; fp_precision searched: {', '.join(pinned.fp_precision)}; "
        f"data {len(splits.train)} train / {len(splits.validation)} validation posts, "
        f"task {data.task}, max_length {data.max_length}"
    )
    if finished >= n_trials:
        reporter.message(f"study '{config.study.name}' already has {finished} finished trials "
                         f"(asked for {n_trials}); nothing to do")
        reporter.best(study)
        return
    if not config.training.isolate_trials:
        began = time.perf_counter()
        sources = resources.preload()
        reporter.message(
            f"loaded {len(sources)} model(s) in {time.perf_counter() - began:.1f} s; tokens "
            f"from: {'; '.join(f'{Path(m).name} {s}' for m, s in sources.items())}"
        )
    objective = config.study.objective
    baseline = resources.baseline().get(objective)
    study.set_user_attr("baseline", {"name": BASELINE, objective: baseline})
    study.set_user_attr("objective", objective)
    run_trial = (
        isolation.in_child(config, pinned, device, url, storage)
        if config.training.isolate_trials else in_process(resources, reporter)
    )
    result = run_worker(
        study, storage, run_trial, reporter, n_trials=n_trials, timeout=timeout,
        max_consecutive_failures=config.study.max_consecutive_failures,
    )
    reporter.message(f"this worker ran {result.ran} trials; the study has "
                     f"{result.finished} finished")
    reporter.best(study)
    reporter.message(f"trivial baseline ({BASELINE}): {objective} {baseline:.4f} "
                     f"on the validation split")


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
    with warnings.catch_warnings():
        # Optuna 5 marks heartbeats experimental; they are its documented way to reap.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


@dataclass(frozen=True)
class WorkerResult:
    ran: int  # trials this worker ran
    finished: int  # finished trials in the study when it stopped


TrialRunner = Callable[[optuna.Study, optuna.Trial], tuple[Outcome, FrozenTrial]]


def in_process(resources: Resources, reporter: ConsoleReporter) -> TrialRunner:
    return lambda study, trial: execute(study, trial, resources, reporter)


def _ask(study: optuna.Study) -> optuna.Trial:
    with warnings.catch_warnings():
        # The heartbeat thread below does for ask/tell what Study.optimize does for its loop.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        return study.ask()


def run_worker(
    study: optuna.Study,
    storage: ResilientRDBStorage,
    run_trial: TrialRunner,
    reporter: LoopReporter,
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
            trial = _ask(study) if budget.may_claim(counts, n_trials) else None
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
    return WorkerResult(ran, finished_count(study))
