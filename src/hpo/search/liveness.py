"""Whether a running trial's worker is alive, beside the storage that records it (as optuna
keeps reaping beside its storages): the heartbeat a running trial records, the reaper that
fails trials whose worker went silent and queues their retries, the same for the trials of a
worker its launcher saw die, and the carry-over of a run that was reaped while it was in fact
alive onto its retry copy.

The reapers are the one place besides `executor.outcome_of` that sets a trial's state: they
judge workers, not outcomes. A paused trial (`pausing`) holds no heartbeat and is never
reaped; a resumed one whose worker went silent goes back to paused, not to a retry.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import socket
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import optuna
from optuna.trial import TrialState

from hpo.search import budget, pausing
from hpo.search.resilience import ResilientRDBStorage, single_attempt

Lock = Callable[[], AbstractContextManager[object]]

# Optuna's successive halving pruner (Hyperband's brackets too) records each rung a trial
# passed as the system attribute `completed_rung_<k>` (optuna.pruners._successive_halving's
# private `_completed_rung_key`; tests/search/test_liveness.py fails when it changes).
RUNG_PREFIX = "completed_rung_"


class RetryFromScratch(optuna.storages.RetryHeartbeatStaleTrialCallback):
    """Optuna's re-queueing of a dead worker's trial, less the rungs the dead run passed.
    Optuna's callback copies every system attribute onto the retry, so the retry, which
    trains from its first epoch again, would skip the rungs its predecessor passed and be
    judged first at a later rung. A run that was in fact alive and goes on as the retry
    (`carry_over`) takes its rungs along itself."""

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        fresh = copy.copy(trial)
        fresh.system_attrs = {k: v for k, v in trial.system_attrs.items()
                              if not k.startswith(RUNG_PREFIX)}
        # Nor does it go on from a checkpoint of its predecessor's (`pausing`).
        fresh.user_attrs = {k: v for k, v in trial.user_attrs.items()
                            if k not in pausing.ATTRIBUTES}
        super().__call__(study, fresh)


class LiveTrial:
    """The trial a run writes to. A trial reaped while it ran goes on as its retry copy:
    `carry_over` points `trial` at the copy, and the training loop, its callbacks and the
    heartbeat, which all hold this object rather than the trial, follow it there."""

    def __init__(self, trial: optuna.Trial) -> None:
        self.trial = trial
        self.claimed_as = trial.number  # the trial the run began as

    @property
    def carried_over(self) -> bool:
        return self.trial.number != self.claimed_as


@contextlib.contextmanager
def heartbeat(storage: ResilientRDBStorage, live: LiveTrial) -> Iterator[None]:
    """Record the trial's heartbeat every interval while it runs, from a background thread,
    so a long training step cannot make a live trial look dead. It beats for whatever trial
    `live` stands for at each beat: a run carried over to its retry copy moves its heartbeat
    along."""
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
                storage.record_heartbeat(live.trial._trial_id)

    storage.record_heartbeat(live.trial._trial_id)
    thread = threading.Thread(target=beat, name=f"heartbeat-{live.trial.number}", daemon=True)
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
    interval = storage.get_heartbeat_interval()
    if not interval:
        return
    grace = storage.grace_period or 2 * interval
    # A resumed trial whose worker went silent goes back to paused at its checkpoint
    # (`pausing`), before Optuna's reaper would fail it and queue a copy from scratch: judged
    # an interval early, so that none turns stale between the two.
    # Each read below waits out an outage, which stops every heartbeat: what it reads then
    # is judged only with contact unbroken since, that is at a later reap.
    stale = budget.read(storage.engine, lambda connection: budget.stale_trial_ids(
        connection, study_id, grace - interval))
    if not storage.trusts_heartbeats():
        return
    for trial_id in stale:
        pausing.put_back(study, storage, storage.engine, trial_id)
    if not storage.trusts_heartbeats():
        return
    with warnings.catch_warnings():
        # Optuna 5 marks heartbeats experimental; they are its documented way to reap.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    # A worker killed between claiming a trial and its first heartbeat (OOM killer, eviction)
    # leaves a RUNNING trial that Optuna's reaper never sees: reap it by its start time, after
    # the grace period (Optuna's default where none was set: two intervals). A paused trial
    # has no heartbeat by design.
    started_before = datetime.datetime.now() - datetime.timedelta(seconds=grace)
    unbeaten = budget.read(storage.engine, lambda connection: budget.unbeaten_trial_ids(
        connection, study_id, started_before))
    if not storage.trusts_heartbeats():
        return
    retry = storage.get_heartbeat_stale_trial_callback()
    for trial_id in unbeaten:
        if pausing.is_paused(storage.get_trial(trial_id)) or pausing.repause(
                storage, storage.engine, trial_id):
            continue
        try:
            if not storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # it finished, or another worker reaped it first
        if retry is not None:
            retry(study, storage.get_trial(trial_id))


# Set in a trial's own process (`training.isolate_trials`): the pid of the worker it runs for.
WORKER_PID = "HPO_WORKER_PID"


def worker_on_this_host(pid: int) -> str:
    """The name the trials of the process `pid` of this host record as their "worker"
    (records.worker_name, in that process)."""
    return f"{socket.gethostname()}:{pid}"


def fail_dead_worker(study: optuna.Study, storage: ResilientRDBStorage, worker: str,
                     why: str) -> list[tuple[int, bool]]:
    """Fail at once the RUNNING trials of `worker` (its "host:pid"), which whoever started
    it saw die, and queue their retries as the reaper does, rather than leave them to the
    reaper for a grace period. Each is failed with `why` as its error. Returns the number of
    each trial failed and whether a retry copy was queued (none once its retries are used up).
    Under the study lock, for the reaper's reason: a second copy would overshoot the budget.
    A trial that finished or was reaped meanwhile is left alone."""
    study_id = storage.get_study_id_from_name(study.study_name)
    with budget.study_lock(storage.engine, study.study_name):
        running = storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
        failed = []
        for trial in running:
            if trial.user_attrs.get("worker") != worker or pausing.is_paused(trial):
                continue
            if pausing.put_back(study, storage, storage.engine, trial._trial_id):
                continue  # a resumed trial: back to paused at its checkpoint
            try:
                # The reason before the state: a finished trial takes no attribute. Its copy
                # is made from `trial`, read before, so it does not inherit the reason.
                storage.set_trial_user_attr(trial._trial_id, "error", why)
                if not storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # it finished, or a reaper failed it first
            retry = storage.get_heartbeat_stale_trial_callback()
            if retry is not None:
                retry(study, trial)
            failed.append((trial.number, _requeued(storage, study_id, trial.number)))
    return failed


def _requeued(storage: ResilientRDBStorage, study_id: int, number: int) -> bool:
    waiting = storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.WAITING,))
    return any(_copy_of(t) == number for t in waiting)


def _copy_of(trial: optuna.trial.FrozenTrial) -> int | None:
    """The trial a retry copy re-runs: Optuna's retry callback appends the failed trial's
    number to the copy's `retry_history`."""
    return trial.system_attrs.get("retry_history", [None])[-1]


def carry_over(live: LiveTrial, lock: Lock = contextlib.nullcontext) -> int | None:
    """For a trial that was reaped while it ran (its heartbeats lost, another worker took it
    for dead): claim the waiting copy the reaper queued, if no worker has claimed it yet,
    carry over what the trial recorded and point `live` at the copy, so the run goes on and
    its result is kept. Returns the reaped trial's number, or None when there is no copy to
    claim: the result then has nowhere to go. Under the study `lock`, which reapers hold from
    failing a trial to queueing its copy and claimers hold while they claim."""
    trial = live.trial
    study, storage, number = trial.study, trial.storage, trial.number
    with lock():
        copies = [t for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                  if _copy_of(t) == number]
        claimed = None
        for copy in copies:
            try:
                if storage.set_trial_state_values(copy._trial_id, state=TrialState.RUNNING):
                    claimed = copy
                    break
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # claimed and finished by another worker meanwhile
    if claimed is None:
        return None
    reaped = storage.get_trial(trial._trial_id)
    for step, value in reaped.intermediate_values.items():
        storage.set_trial_intermediate_value(claimed._trial_id, step, value)
    for key, value in {**reaped.user_attrs, "result_of": number}.items():
        storage.set_trial_user_attr(claimed._trial_id, key, value)
    for key, value in reaped.system_attrs.items():
        if key.startswith(RUNG_PREFIX):  # the run goes on past the rungs it passed
            storage.set_trial_system_attr(claimed._trial_id, key, value)
    live.trial = optuna.trial.Trial(study, claimed._trial_id)
    return number
