"""One trial from its claim to its state: planned (`planning`), trained (`drivers`), and told.

`outcome_of` is the one place where the end of a trial becomes its state, however it ended:
a result, a pruner's verdict, a pause (the trial stays RUNNING, `search.pausing`), an
out-of-memory error, a non-finite loss, a combination the check found unusable, an error,
Ctrl-C or SIGTERM, an isolated child that died, a claim given back, a reap while it ran.
`tell` writes that state with what the trial recorded. Only the reaper (`liveness.reap`) and
the end of a pausing study (`pausing.end_unpromoted`) set a state besides these two.
"""

from __future__ import annotations

import signal
import time
import traceback
from dataclasses import replace

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo import faults
from hpo.errors import Terminated, one_line, process_end
from hpo.outcome import INTERRUPTED, ChildDied, GivenBack, Outcome, Reaped
from hpo.search import pausing
from hpo.space import Params, suggest
from hpo.training import memory
from hpo.training.train import NonFiniteLoss
from hpo.trial import batch_limit, records, step_check
from hpo.trial.context import TrialContext
from hpo.trial.drivers import TrialPaused, train_folds, train_trial
from hpo.trial.planning import PlannedTrial, plan_trial
from hpo.trial.resources import Resources
from hpo.trial.run import Trained, TrialRun


def outcome_of(number: int, ended: BaseException | None, value: float | None = None
               ) -> Outcome:
    """How trial `number` ended, as its state: `ended` is what stopped it, None when it
    returned `value`."""
    if ended is None:
        return Outcome(TrialState.COMPLETE, value=value)
    if isinstance(ended, TrialPaused):
        return Outcome(TrialState.RUNNING, paused_at=ended.step)
    if isinstance(ended, optuna.TrialPruned):
        return Outcome(TrialState.PRUNED, prune_reason="pruner")
    if isinstance(ended, step_check.Unusable):
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
    how = process_end(exitcode)
    if exitcode != -signal.SIGKILL:
        return Outcome(TrialState.FAIL, error=f"trial process {how}")
    if died.tried is None:
        return Outcome(TrialState.PRUNED, prune_reason="oom",
                       error=f"trial process {how} (as the OOM killer does) before it tried "
                             f"a batch")
    return Outcome(TrialState.PRUNED, prune_reason="oom",
                   error=f"trial process {how} (as the OOM killer does) at micro-batch "
                         f"{died.tried[1]}")


def execute(context: TrialContext, resources: Resources, params: Params | None = None
            ) -> tuple[Outcome, FrozenTrial]:
    """Run one trial to its end, keep its model if it ranks in the study's best, and tell
    the study how it ended. Its parameters are sampled here, unless a parent that isolates
    the trial sampled them already (`params`)."""
    started = time.perf_counter()
    trial = context.trial
    planned: PlannedTrial | None = None
    ended: BaseException | None = None
    trained: Trained | None = None
    device_memory = memory.device_memory(resources.device)
    try:
        records.record_start(trial, resources)
        params = params if params is not None else suggest(trial, resources.pinned)
        planned = plan_trial(context, params, resources)
        memory.restart_peak(resources.device)
        records.record_plan(trial, planned)
        context.display.trial_started(trial.number, params, planned.plan, planned.probes)
        context.watch(planned.batch_key, planned.plan.physical_batch)
        run = TrialRun(context, planned, resources)
        trained = train_folds(run) if resources.config.data.cv_folds else train_trial(run)
        if resources.keeper is not None and trained.model is not None:
            records.keep(run, trained, resources.keeper)
    except Exception as exc:
        ended = exc
    value = trained.value if trained is not None else None
    outcome = outcome_of(trial.number, ended, value)
    failed_at = None
    if ended is not None and outcome.state == TrialState.FAIL and not outcome.dropped:
        failed_at = "".join(traceback.format_exception(ended))[-4000:]
    # Outside the except block, the exception and its traceback gone, and the trained model
    # let go: nothing holds the model's or a failed step's tensors.
    del ended, trained
    memory.release_memory()
    device_memory = memory.after_trial(resources.device, device_memory)
    if outcome.dropped or outcome.paused_at is not None:
        return outcome, _stored(context)
    tried = batch_limit.tried_alone(outcome, None if planned is None else planned.fitted,
                                    resources.device)
    told = tell(context, outcome, tried=tried, failed_at=failed_at, started=started,
                device_memory=device_memory)
    if told[1].state.is_finished():  # a resumed trial's checkpoint is needed no more
        pausing.remove(resources.checkpoints, pausing.checkpoint_of(told[1]))
    return told


def _stored(context: TrialContext) -> FrozenTrial:
    return context.trial.storage.get_trial(context.trial._trial_id)


def tell(context: TrialContext, outcome: Outcome, *, tried: tuple[str, int] | None = None,
         failed_at: str | None = None, started: float | None = None,
         device_memory: memory.DeviceMemory | None = None) -> tuple[Outcome, FrozenTrial]:
    """Tell the study the trial's outcome, with its reason and error recorded. An OOM lowers
    the study's batch limit for the micro-batch it `tried`. If the trial was reaped
    meanwhile, the outcome goes to its retry copy (`kept_from`), or nowhere (`dropped`)."""

    def finish(trial: optuna.Trial) -> FrozenTrial:
        lowered = None
        if outcome.prune_reason == "oom" and tried is not None:
            lowered = context.cache.lower(*tried)
        records.record_end(trial, outcome, lowered=lowered, failed_at=failed_at,
                           device_memory=device_memory, started=started)
        faults.kill_at("tell")
        return context.study.tell(trial, outcome.value, state=outcome.state)

    try:
        finished = context.write(finish)
    except Reaped as exc:
        return replace(outcome, dropped=str(exc)), _stored(context)
    if context.live.carried_over:
        outcome = replace(outcome, kept_from=context.live.claimed_as)
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
        records.record_stopped(trial, outcome.error, interrupted=True)
        study.tell(trial, state=outcome.state)
        # A trial holds its RDB storage through Optuna's cache wrapper, whose heartbeat base
        # class is private: ask for the callback by name.
        retry = getattr(storage, "get_heartbeat_stale_trial_callback", lambda: None)()
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
    records.record_stopped(trial, outcome.error, interrupted=False)
    study.tell(trial, state=outcome.state)
