"""A worker: its set-up (device settings, the study joined, data and models loaded, the
trivial baseline recorded) and its loop, which claims trials under the exact study-wide budget,
keeps each running trial's heartbeat and reaps trials whose worker went silent."""

from __future__ import annotations

import contextlib
import datetime
import functools
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

from hpo import artifacts, budget, check, faults, hardware, isolation
from hpo.config import StudyConfig
from hpo.data.splits import Splits
from hpo.errors import Terminated, one_line
from hpo.executor import Outcome, execute
from hpo.hardware import Device
from hpo.report import ConsoleReporter
from hpo.resources import Resources, load_resources
from hpo.storage import ResilientRDBStorage, redact, single_attempt
from hpo.study import finished_count, join, make_sampler, shared_batch_cache

BASELINE = "every symptom predicted for every post"
# With fewer validation posts a symptom has a handful of positives, and one post more or less
# right moves its F1 by tens of points: trials would be ranked by noise.
MIN_VALIDATION_POSTS = 50
# How often a worker that waits for the study's last trials looks again.
POLL_SECONDS = 2.0


class WorkerStopped(RuntimeError):
    """The worker gave up: too many trials in a row failed."""


def small_data_warning(splits: Splits) -> str | None:
    n = len(splits.validation)
    if n >= MIN_VALIDATION_POSTS:
        return None
    return (f"the validation split has only {n} posts: its scores rank trials mostly by noise "
            f"(aim for {MIN_VALIDATION_POSTS} or more: more posts, or a larger "
            f"data.validation_fraction)")


def below_baseline_warning(study: optuna.Study, objective: str, baseline: float) -> str | None:
    try:
        best = study.best_trial
    except ValueError:
        return None
    if best.value >= baseline:
        return None
    return (f"the best trial ({objective} {best.value:.4f}) is below the trivial baseline "
            f"({baseline:.4f}, {BASELINE}): no model has learned the task yet; try more "
            f"epochs, more trials or another learning-rate range")


class LoopReporter(Protocol):
    def message(self, text: str) -> None: ...
    def trial_finished(self, trial: FrozenTrial, outcome: Outcome) -> None: ...
    def interrupted(self, text: str) -> None: ...


def work(
    config: StudyConfig,
    splits: Splits,
    device: Device,
    url: str,
    storage: ResilientRDBStorage,
    *,
    n_trials: float,
    timeout: float | None = None,
    run_check: bool = True,
) -> None:
    """Set the worker up and run trials until the study holds `n_trials` finished ones (or
    `timeout` passes); raises WorkerStopped after too many failures in a row. Unless told
    not to, the study's model x precision check runs first if no worker on this kind of
    device has run it."""
    hardware.configure_backends(device)
    study, pinned = join(config, storage, device, splits)
    reporter = ConsoleReporter()
    own = (config.study.heartbeat_interval, config.study.grace_period)
    if own != (storage.heartbeat_interval, storage.grace_period):
        reporter.message(f"heartbeat every {storage.heartbeat_interval} s, grace period "
                         f"{storage.grace_period} s: the study's, fixed when it was created "
                         f"(this worker asked for {own[0]} s and {own[1]} s)")
    resources = load_resources(config, pinned, device, splits)
    if config.data.cv_folds and config.study.keep_best:
        reporter.message(f"no trial's model is kept: a cross-validated trial trains "
                         f"{config.data.cv_folds} models (data.cv_folds), none of them the "
                         f"trial's; hpo final trains the chosen configuration again")
    elif config.study.keep_best:
        resources.keeper = artifacts.keeper_for(config, url)
        if resources.keeper is None:
            reporter.message("no trial's model is kept: a server storage has no artifact "
                             "store unless study.artifacts (or HPO_ARTIFACTS) names one, a "
                             "directory every worker shares or s3://BUCKET")
        else:
            reporter.message(f"the models of the best {resources.keeper.best} trial(s) are "
                             f"kept in the artifact store {resources.keeper.where}")
    data = config.data
    finished = finished_count(study)
    goal = "no trial budget" if math.isinf(n_trials) else f"{finished}/{n_trials} finished"
    reporter.message(
        f"study '{config.study.name}' on {redact(url)}: {goal}; "
        f"device {device.describe()}; fp_precision searched: {pinned.describe_precisions()}; "
        f"data {len(splits.train)} train / {len(splits.validation)} validation posts, "
        f"task {data.task}, max_length {data.max_length}"
    )
    small = small_data_warning(splits)
    if small:
        reporter.warning(small)
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
    if run_check:
        check.ensure(study, resources, pinned.fp_precision, reporter)
    objective = config.study.objective
    baseline = resources.baseline().get(objective)
    study.set_user_attr("baseline", {"name": BASELINE, objective: baseline})
    study.set_user_attr("objective", objective)
    run_trial = (
        isolation.in_child(config, pinned, device, url, storage)
        if config.training.isolate_trials else in_process(resources, reporter, storage)
    )
    seeded = config.study.sampler.seed is not None
    result = run_worker(
        study, storage, run_trial, reporter, n_trials=n_trials, timeout=timeout,
        max_consecutive_failures=config.study.max_consecutive_failures,
        sampler_for=functools.partial(make_sampler, config) if seeded else None,
    )
    reporter.message(f"this worker ran {result.ran} trials; the study has "
                     f"{result.finished} finished")
    reporter.best(study)
    reporter.message(f"trivial baseline ({BASELINE}): {objective} {baseline:.4f} "
                     f"on the validation split")
    below = below_baseline_warning(study, objective, baseline)
    if below:
        reporter.warning(below)


@contextlib.contextmanager
def heartbeat(storage: ResilientRDBStorage, trial: optuna.Trial) -> Iterator[None]:
    """Record the trial's heartbeat every interval while it runs, from a background thread,
    so a long training step cannot make a live trial look dead. It beats for whatever trial
    the object stands for: a trial carried over to its retry copy (`study.carry_over`) moves
    its heartbeat along."""
    interval = storage.get_heartbeat_interval()
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            # One try per interval, no backoff: once an outage ends the trial beats again
            # within an interval, well inside the grace period reapers then wait.
            with contextlib.suppress(Exception), single_attempt():
                storage.record_heartbeat(trial._trial_id)

    storage.record_heartbeat(trial._trial_id)
    thread = threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def reap(study: optuna.Study, storage: ResilientRDBStorage, study_id: int) -> None:
    """Fail trials whose worker stopped beating, or never beat; the retry callback re-queues
    them. Under the study lock: two reapers that both saw a stale trial would otherwise each
    queue a copy of it (SQLite has no row lock; a retried write cannot tell whose it was),
    and a second waiting copy overshoots the budget."""
    with budget.study_lock(storage.engine, study.study_name):
        # Taking the lock may have waited out an outage: judge only with contact unbroken.
        if storage.trusts_heartbeats():
            _reap(study, storage, study_id)


def _reap(study: optuna.Study, storage: ResilientRDBStorage, study_id: int) -> None:
    with warnings.catch_warnings():
        # Optuna 5 marks heartbeats experimental; they are its documented way to reap.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    if not storage.get_heartbeat_interval():
        return
    # A worker killed between claiming a trial and its first heartbeat (OOM killer, eviction)
    # leaves a RUNNING trial that Optuna's reaper never sees: reap it by its start time.
    started_before = datetime.datetime.now() - datetime.timedelta(seconds=storage.grace_period)
    with storage.engine.connect() as connection:
        unbeaten = budget.unbeaten_trial_ids(connection, study_id, started_before)
    retry = storage.get_heartbeat_stale_trial_callback()
    for trial_id in unbeaten:
        try:
            if not storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # it finished, or another worker reaped it first
        if retry is not None:
            retry(study, storage.get_trial(trial_id))


@dataclass(frozen=True)
class WorkerResult:
    ran: int  # trials this worker ran
    finished: int  # finished trials in the study when it stopped


TrialRunner = Callable[[optuna.Study, optuna.Trial], tuple[Outcome, FrozenTrial]]


def in_process(resources: Resources, reporter: ConsoleReporter,
               storage: ResilientRDBStorage) -> TrialRunner:
    return lambda study, trial: execute(study, trial, resources, reporter,
                                        shared_batch_cache(study, storage))


def _ask(study: optuna.Study) -> optuna.Trial:
    with warnings.catch_warnings():
        # The heartbeat thread below does for ask/tell what Study.optimize does for its loop.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        return study.ask()


def free(study: optuna.Study, storage: ResilientRDBStorage, trial: optuna.Trial,
         stop: KeyboardInterrupt) -> str:
    """End an interrupted trial at once, as FAIL with the reason, and re-queue it as a
    waiting trial for the next worker, as the reaper would a dead worker's (the same
    `max_retry` bounds both), instead of leaving it RUNNING for a grace period."""
    why = "SIGTERM" if isinstance(stop, Terminated) else "Ctrl-C"
    number = trial.number
    try:
        # Read before the reason is set: the copy must not inherit it.
        before = storage.get_trial(trial._trial_id)
        if before.state.is_finished():
            return f"trial {number} had finished ({before.state.name}) before the interrupt"
        trial.set_user_attr("error", f"interrupted by {why}")
        study.tell(trial, state=TrialState.FAIL)
        retry = storage.get_heartbeat_stale_trial_callback()
        if retry is not None:
            retry(study, before)
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    except Exception as exc:
        return (f"trial {number} could not be freed ({one_line(exc)}); another worker fails "
                f"and re-queues it after the grace period")
    if any(number in t.system_attrs.get("retry_history", ()) for t in waiting):
        return f"trial {number} failed (interrupted by {why}) and re-queued for the next worker"
    return f"trial {number} failed (interrupted by {why}); its retries are used up"


def _run_claimed(
    study: optuna.Study, storage: ResilientRDBStorage, trial: optuna.Trial,
    run_trial: TrialRunner, waiting: int,
    sampler_for: Callable[[int], optuna.samplers.BaseSampler] | None,
) -> tuple[Outcome, FrozenTrial]:
    if sampler_for is not None:
        # Optuna samples when a parameter is first suggested, after ask().
        study.sampler = sampler_for(trial.number)
    if waiting:
        # Optuna's retry callback marks the re-queued copy of a stale trial; only a waiting
        # trial can be one, and ask() takes waiting trials first.
        retried = storage.get_trial_system_attrs(trial._trial_id).get("failed_trial")
        if retried is not None:
            trial.set_user_attr("retry_of", retried)
    faults.kill_at("heartbeat")
    with heartbeat(storage, trial):
        return run_trial(study, trial)


def _claim_stands(study: optuna.Study, storage: ResilientRDBStorage, study_id: int,
                  trial: optuna.Trial, n_trials: float, reporter: LoopReporter) -> bool:
    """After a claim made while the study lock was lost, another worker may have claimed
    the same slot: recount under the lock and give the trial back if the budget overshoots."""
    with budget.study_lock(storage.engine, study.study_name) as connection:
        counts = budget.count_in_database(connection, study_id)
        if counts.claimed <= n_trials:
            return True
        trial.set_user_attr("error", "claimed while the study lock was lost with its database "
                                     "connection; given back to keep the budget exact")
        study.tell(trial, state=TrialState.FAIL)
    reporter.message(f"trial {trial.number} given back: the study lock was lost while it was "
                     f"claimed and the budget would overshoot")
    return False


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
    sampler_for: Callable[[int], optuna.samplers.BaseSampler] | None = None,
) -> WorkerResult:
    """Run trials until the study holds `n_trials` finished (COMPLETE or PRUNED) trials.

    While the last trials run on other workers this worker waits, reaping stale trials, and
    takes over a slot that frees up (a failed trial, a re-queued retry). `timeout` stops it
    from claiming new trials; `max_consecutive_failures` FAILed trials in a row stop it.
    `sampler_for` gives the sampler that draws a claimed trial's parameters from its number.
    """
    started = time.monotonic()
    study_id = storage.get_study_id_from_name(study.study_name)
    reap_every = storage.get_heartbeat_interval() or poll_seconds
    ran = failures = 0
    waiting_said = False
    last_reap = -math.inf
    while True:
        # Reaping reads every running trial's heartbeat: once per heartbeat interval is
        # enough, since nothing can turn stale faster than that. Not within a grace period
        # of this worker's start or its last lost contact: the heartbeats it would judge may
        # have stopped in the same outage.
        if time.monotonic() - last_reap >= reap_every and storage.trusts_heartbeats():
            reap(study, storage, study_id)
            last_reap = time.monotonic()
        with budget.study_lock(storage.engine, study.study_name) as connection:
            counts = budget.count_in_database(connection, study_id)
            if counts.finished >= n_trials:
                break
            if timeout is not None and time.monotonic() - started >= timeout:
                reporter.message(f"timeout of {timeout:g}s reached")
                break
            trial = _ask(study) if budget.may_claim(counts, n_trials) else None
            if trial is not None:
                faults.kill_at("claim")
            lost = trial is not None and not budget.lock_held(connection)
        if lost and not _claim_stands(study, storage, study_id, trial, n_trials, reporter):
            continue
        if trial is None:
            if not waiting_said:
                reporter.message(f"waiting for {counts.running} running trial(s) of other "
                                 f"workers ({counts.finished}/{n_trials:g} finished)")
                waiting_said = True
            time.sleep(poll_seconds)
            continue
        waiting_said = False
        try:
            outcome, finished = _run_claimed(study, storage, trial, run_trial, counts.waiting,
                                             sampler_for)
        except KeyboardInterrupt as stop:
            # From the claim on: a trial left RUNNING would hold a budget slot until reaped.
            reporter.interrupted(free(study, storage, trial, stop))
            raise
        ran += 1
        reporter.trial_finished(finished, outcome)
        # A dropped result was lost for want of contact, not for anything of its own.
        if not outcome.dropped:
            failures = failures + 1 if outcome.state == TrialState.FAIL else 0
        if failures >= max_consecutive_failures:
            raise WorkerStopped(f"{failures} trials in a row failed; last error: {outcome.error}")
    return WorkerResult(ran, finished_count(study))
