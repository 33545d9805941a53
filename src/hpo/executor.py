"""One trial from its claim to its state: planned (`planning`), trained (`drivers`), and told.

`outcome_of` is the one place where the end of a trial becomes its state, however it ended:
a result, a pruner's verdict, an out-of-memory error, a non-finite loss, a combination the
check found unusable, an error, Ctrl-C or SIGTERM, an isolated child that died, a claim given
back, a reap while it ran. `tell` writes that state with what the trial recorded. Only the
reaper (`liveness.reap`) sets a state besides these two, for workers that went silent.
"""

from __future__ import annotations

import signal
import time
import traceback
from dataclasses import replace
from typing import Protocol

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from hpo import check, faults, memory, records
from hpo.drivers import Reporter as DriverReporter
from hpo.drivers import train_folds, train_trial
from hpo.errors import Terminated, one_line
from hpo.liveness import LiveTrial, write_kept
from hpo.outcome import INTERRUPTED, ChildDied, GivenBack, Outcome, Reaped
from hpo.planning import TrialPlan, Watch, plan_trial, unwatched
from hpo.resources import Resources
from hpo.space import Params
from hpo.study import StudyBatchCache
from hpo.train import NonFiniteLoss, Plan


class Reporter(DriverReporter, Protocol):
    def trial_started(self, number: int, params: Params, plan: Plan, probes: int) -> None: ...


def outcome_of(number: int, ended: BaseException | None, value: float | None = None
               ) -> Outcome:
    """How trial `number` ended, as its state: `ended` is what stopped it, None when it
    returned `value`."""
    if ended is None:
        return Outcome(TrialState.COMPLETE, value=value)
    if isinstance(ended, optuna.TrialPruned):
        return Outcome(TrialState.PRUNED, prune_reason="pruner")
    if isinstance(ended, check.Unusable):
        return Outcome(TrialState.PRUNED, prune_reason="unusable", error=str(ended))
    if isinstance(ended, NonFiniteLoss):
        return Outcome(TrialState.PRUNED, prune_reason="nan_loss", error=str(ended))
    if isinstance(ended, Reaped):
        return Outcome(TrialState.FAIL, dropped=str(ended))
    if isinstance(ended, optuna.exceptions.UpdateFinishedTrialError):
        # Reaped before it had a result: its waiting copy is the next worker's to run.
        return Outcome(TrialState.FAIL, dropped=f"trial {number} was reaped while it was "
                                                f"being set up; its retry is left to the next "
                                                f"worker")
    if isinstance(ended, KeyboardInterrupt):
        why = "SIGTERM" if isinstance(ended, Terminated) else "Ctrl-C"
        return Outcome(TrialState.FAIL, error=f"{INTERRUPTED}{why}")
    if isinstance(ended, GivenBack):
        return Outcome(TrialState.FAIL, error=str(ended))
    if isinstance(ended, ChildDied):
        return _death(ended)
    if memory.is_oom(ended):
        return Outcome(TrialState.PRUNED, prune_reason="oom", error=one_line(ended))
    return Outcome(TrialState.FAIL, error=one_line(ended))


def _death(died: ChildDied) -> Outcome:
    """A trial whose isolated child died before telling the study: SIGKILL is what the
    kernel's OOM killer sends, so it prunes as out of memory; any other death fails it."""
    exitcode = died.exitcode
    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:  # a real-time signal has no name
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    if exitcode != -signal.SIGKILL:
        return Outcome(TrialState.FAIL, error=f"trial process {how}")
    if died.tried is None:
        return Outcome(TrialState.PRUNED, prune_reason="oom",
                       error=f"trial process {how} (as the OOM killer does) before it tried "
                             f"a batch")
    return Outcome(TrialState.PRUNED, prune_reason="oom",
                   error=f"trial process {how} (as the OOM killer does) at micro-batch "
                         f"{died.tried[1]}")


def execute(
    study: optuna.Study, live: LiveTrial, resources: Resources, reporter: Reporter,
    cache: StudyBatchCache, watch: Watch = unwatched,
) -> tuple[Outcome, FrozenTrial]:
    """Run one trial to its end and tell the study how it ended; `cache` is the study's
    batch cache, `watch` hears what the trial is about to try."""
    started = time.perf_counter()
    trial = live.trial
    planned: TrialPlan | None = None
    ended: BaseException | None = None
    value: float | None = None
    device_memory = memory.device_memory(resources.device)
    try:
        records.record_start(trial, resources)
        planned = plan_trial(trial, resources, cache, watch)
        memory.restart_peak(resources.device)
        records.record_plan(trial, planned)
        reporter.trial_started(trial.number, planned.params, planned.plan, planned.probes)
        watch(planned.batch_key, planned.plan.physical_batch)
        run = train_folds if resources.config.data.cv_folds else train_trial
        value = run(live, planned, resources, reporter, cache.lock)
    except Exception as exc:
        ended = exc
    outcome = outcome_of(trial.number, ended, value)
    failed_at = None
    if ended is not None and outcome.state == TrialState.FAIL and not outcome.dropped:
        failed_at = "".join(traceback.format_exception(ended))[-4000:]
    # Outside the except block, the exception and its traceback gone: nothing holds the
    # failed step's tensors.
    del ended
    memory.release_memory()
    device_memory = memory.after_trial(resources.device, device_memory)
    if outcome.dropped:
        return outcome, _stored(live)
    tried = (planned.batch_key, planned.plan.physical_batch) if planned is not None else None
    return tell(study, live, outcome, cache, tried=tried, failed_at=failed_at,
                started=started, device_memory=device_memory)


def _stored(live: LiveTrial) -> FrozenTrial:
    return live.trial.storage.get_trial(live.trial._trial_id)


def tell(study: optuna.Study, live: LiveTrial, outcome: Outcome, cache: StudyBatchCache, *,
         tried: tuple[str, int] | None = None, failed_at: str | None = None,
         started: float | None = None, device_memory: memory.DeviceMemory | None = None,
         ) -> tuple[Outcome, FrozenTrial]:
    """Tell the study the trial's outcome, with its reason and error recorded. An OOM lowers
    the study's batch limit for the micro-batch it `tried`. If the trial was reaped
    meanwhile, the outcome goes to its retry copy (`kept_from`), or nowhere (`dropped`)."""

    def finish(trial: optuna.Trial) -> FrozenTrial:
        if outcome.prune_reason == "oom" and tried is not None:
            lowered = cache.lower(*tried)
            trial.set_user_attr("batch_limit_after_oom", lowered.to_json())
        if outcome.prune_reason:
            trial.set_user_attr("prune_reason", outcome.prune_reason)
        if outcome.error:
            trial.set_user_attr("error", outcome.error)
        if failed_at:
            trial.set_user_attr("traceback", failed_at)
        for name, mib in (device_memory.to_attrs() if device_memory else {}).items():
            trial.set_user_attr(name, round(mib, 1))
        if started is not None:
            trial.set_user_attr("worker_rss_mb",
                                round(psutil.Process().memory_info().rss / 2**20, 1))
            trial.set_user_attr("trial_seconds", round(time.perf_counter() - started, 3))
        faults.kill_at("tell")
        return study.tell(trial, outcome.value, state=outcome.state)

    try:
        finished = write_kept(live, finish, cache.lock)
    except Reaped as exc:
        return replace(outcome, dropped=str(exc)), _stored(live)
    if live.carried_over:
        outcome = replace(outcome, kept_from=live.claimed_as)
    return outcome, finished


def free(study: optuna.Study, trial: optuna.Trial, stop: KeyboardInterrupt) -> str:
    """End an interrupted trial at once, as `outcome_of` says (FAIL with the reason), and
    re-queue it as a waiting trial for the next worker, as the reaper would a dead worker's
    (the same `max_retry` bounds both), instead of leaving it RUNNING for a grace period.
    Returns what became of it."""
    outcome = outcome_of(trial.number, stop)
    storage = trial.storage
    number = trial.number
    try:
        # Read before the reason is set: the copy must not inherit it.
        before = storage.get_trial(trial._trial_id)
        if before.state.is_finished():
            return f"trial {number} had finished ({before.state.name}) before the interrupt"
        trial.set_user_attr("error", outcome.error)
        # `hpo status` counts a deliberate stop apart from failures (summary.interrupted).
        trial.set_user_attr("interrupted", True)
        study.tell(trial, state=outcome.state)
        retry = storage.get_heartbeat_stale_trial_callback()
        if retry is not None:
            retry(study, before)
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    except Exception as exc:
        return (f"trial {number} could not be freed ({one_line(exc)}); another worker fails "
                f"and re-queues it after the grace period")
    if any(number in t.system_attrs.get("retry_history", ()) for t in waiting):
        return f"trial {number} failed ({outcome.error}) and re-queued for the next worker"
    return f"trial {number} failed ({outcome.error}); its retries are used up"


def give_back(study: optuna.Study, trial: optuna.Trial, why: GivenBack) -> None:
    """A claim that would overshoot the budget, ended as `outcome_of` says."""
    outcome = outcome_of(trial.number, why)
    trial.set_user_attr("error", outcome.error)
    study.tell(trial, state=outcome.state)
