"""A worker: its set-up (`prepare_worker`: device settings, the study joined, data and models
loaded; then the check, the precisions decided and the trivial baseline recorded) and its loop,
which claims trials under the exact study-wide budget, gives each its `TrialContext`, keeps its
heartbeat (`liveness`) and reaps trials whose worker went silent. How a trial ended is the
executor's to say; the loop only counts failures in a row. What it says is worded in
`console`."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import optuna
import sqlalchemy
from optuna.trial import FrozenTrial, TrialState

from hpo import faults, hardware
from hpo.app import console, isolation
from hpo.app.console import ConsoleDisplay
from hpo.app.preflight import Prepared
from hpo.config import StudyConfig
from hpo.errors import WorkerStopped
from hpo.outcome import GivenBack, Outcome
from hpo.search import artifacts, budget, pausing
from hpo.search.liveness import heartbeat, reap
from hpo.search.resilience import ResilientRDBStorage, is_connection_error
from hpo.search.study import (
    decide_precisions,
    finished_count,
    join,
)
from hpo.space import PinnedSpace
from hpo.training import memory
from hpo.trial import records, step_check
from hpo.trial.context import TrialContext, TrialDisplay, claimed
from hpo.trial.executor import execute, free, give_back
from hpo.trial.resources import Resources, load_resources

# How often a worker that waits for the study's last trials looks again.
POLL_SECONDS = 2.0


@dataclass(frozen=True)
class Orders:
    """What a worker is asked: run trials until the study holds `n_trials` finished ones
    (inf: no budget) or `timeout` seconds pass; run the study's check first (`run_check`)
    unless a worker on this kind of device did; say more (`verbose`); `next_command` names
    the study for the closing advice (`--study NAME` by default)."""

    n_trials: float
    timeout: float | None = None
    run_check: bool = True
    verbose: bool = False
    next_command: str | None = None


@dataclass(frozen=True)
class WorkerSetup:
    """A worker joined to its study, its data and models loaded, before any trial."""

    study: optuna.Study
    resources: Resources
    finished: int  # the study's finished trials when the worker joined
    left: bool  # whether its budget (`--n-trials`) had anything left to run then


def prepare_worker(site: Prepared, display: ConsoleDisplay, orders: Orders) -> WorkerSetup:
    """Join the study on this device, load the data and, unless trials run in their own
    processes, the models; say what the worker joined and where the best models go."""
    config, storage = site.config, site.storage
    hardware.configure_backends(site.device)
    study, pinned = join(config, storage, site.device, site.splits)
    finished = finished_count(study)
    for line in console.study_lines(site, pinned, finished, orders.n_trials):
        display.message(line)
    heartbeat_note = console.heartbeat_note(config, storage.heartbeat_interval,
                                           storage.grace_period)
    if heartbeat_note:
        display.message(heartbeat_note)
    pruning_note = config.pruning_note()
    for note in (pruning_note, *site.notes):
        if note:
            display.message(note)
    keeper = (artifacts.keeper_for(config, site.url)
              if config.study.keep_best and not config.data.cv_folds else None)
    resources = load_resources(config, pinned, site.device, site.splits, keeper,
                               artifacts.checkpoint_store(config, site.url))
    kept = console.kept_models_line(config, resources.keeper)
    if kept:
        display.message(kept)
    small = console.small_data_warning(site.splits)
    if small:
        display.warning(small)
    trainings = trainings_of(config, orders.n_trials)
    # Trials counted, the count above answers; trainings need the lock holder's tally.
    left = (finished < orders.n_trials if trainings is None
            else budget_left(study, storage, Limits(orders.n_trials, trainings=trainings)))
    if left and not config.training.isolate_trials:
        began = time.perf_counter()
        sources = resources.preload()
        if orders.verbose:
            display.message(console.preloaded_line(sources, time.perf_counter() - began))
    return WorkerSetup(study, resources, finished, left)


def budget_left(study: optuna.Study, storage: ResilientRDBStorage, limits: Limits) -> bool:
    study_id = storage.get_study_id_from_name(study.study_name)
    now = budget.under_lock(storage.engine, study.study_name,
                            lambda connection: standing(connection, study_id, limits))
    return not now.done(limits)


def work(site: Prepared, orders: Orders) -> None:
    """Set the worker up on its `site` (the study file, data, device and storage, checked)
    and run trials as `orders` say; raises WorkerStopped after too many failures in a
    row."""
    display = ConsoleDisplay()
    config = site.config
    setup = prepare_worker(site, display, orders)
    study, resources = setup.study, setup.resources
    next_command = orders.next_command or f"--study {config.study.name}"
    trainings = trainings_of(config, orders.n_trials)
    if not setup.left:
        asked = (f"{orders.n_trials:g}" if trainings is None
                 else f"{orders.n_trials:g} full trainings' worth")
        display.message(f"study '{config.study.name}' already has {setup.finished} finished "
                         f"trials (asked for {asked}); nothing to do")
        display.best(study)
        display.message(f"next: hpo final {next_command}")
        return
    with memory.long_lived_frozen():
        pinned = decide(study, site.storage, resources, display, orders)
        resources = dataclasses.replace(resources, pinned=pinned)
        objective = config.study.objective
        baseline = resources.baseline().get(objective)
        study.set_user_attr("baseline", {"name": console.BASELINE, objective: baseline})
        study.set_user_attr("objective", objective)
        run_trial = (isolation.in_child(site, pinned) if config.training.isolate_trials
                     else in_process(resources))
        promotion = (pausing.Promotion(config.study.pruner.reduction_factor,
                                       resources.checkpoints,
                                       config.study.pruner.max_checkpoints)
                     if config.study.pruner.pause else None)
        result = run_worker(study, site.storage, run_trial, display,
                            Limits(orders.n_trials, orders.timeout,
                                   config.study.max_consecutive_failures,
                                   promotion=promotion, trainings=trainings))
    display.best(study)
    display.message(console.baseline_line(objective, baseline))
    below = console.below_baseline_warning(study, objective, baseline)
    if below:
        display.warning(below)
    spent = budget.Trainings(orders.n_trials, config.max_steps()).spent(
        budget.trained_of(study.get_trials(deepcopy=False)))
    for line in console.closing_lines(study, site.url, (result.ran, result.finished),
                                     console.Spent(orders.n_trials, spent, trainings is not None),
                                     resources.keeper, next_command):
        display.message(line)


def decide(study: optuna.Study, storage: ResilientRDBStorage, resources: Resources,
           display: ConsoleDisplay, orders: Orders) -> PinnedSpace:
    """The study's check (unless skipped or done) and, from its step times, the precisions
    `auto` searches; says what was decided. Returns the space the trials search."""
    config, pinned = resources.config, resources.pinned
    assert pinned.fp_precision is not None  # resolved on this device when it joined
    verdicts = (step_check.ensure(study, resources, pinned.fp_precision, display)
                if orders.run_check else step_check.stored(study, resources.device))
    decided = decide_precisions(study, storage, pinned, step_check.step_costs(verdicts),
                                config.study.precision_tolerance)
    if decided.decided != pinned.decided:
        display.message(console.describe_decision(decided, orders.verbose))
    stored_tolerance = (decided.decided or {}).get("tolerance")
    if stored_tolerance is not None and stored_tolerance != config.study.precision_tolerance:
        display.warning(f"study.precision_tolerance {config.study.precision_tolerance:g} is "
                         f"not applied: the study decided its precisions with "
                         f"{stored_tolerance:g} (a new study decides again)")
    return decided


class LoopDisplay(TrialDisplay, Protocol):
    """What the loop says, besides what its trials say (the trial context's display)."""

    def trial_finished(self, trial: FrozenTrial, outcome: Outcome) -> None: ...
    def interrupted(self, text: str) -> None: ...


@dataclass(frozen=True)
class Limits:
    """When a worker's loop ends: the study holds `n_trials` finished (COMPLETE or PRUNED)
    trials, `timeout` seconds passed (no claim after it), or `max_consecutive_failures`
    trials in a row failed. `poll_seconds`: how often it looks again while the last trials
    run on other workers."""

    n_trials: float
    timeout: float | None = None
    max_consecutive_failures: int = 3
    poll_seconds: float = POLL_SECONDS
    # A study that pauses trials (`study.pruner.pause`): how the loop resumes them.
    promotion: pausing.Promotion | None = None
    # A budget of full trainings (`study.budget: trainings`), else `n_trials` counts trials.
    trainings: budget.Trainings | None = None


def trainings_of(config: StudyConfig, n_trials: float) -> budget.Trainings | None:
    """What `--n-trials N` counts under `study.budget`: full trainings, or trials (None)."""
    if config.study.budget != "trainings" or math.isinf(n_trials):
        return None
    return budget.Trainings(n_trials, config.max_steps())


@dataclass(frozen=True)
class Standing:
    """The study as the lock holder counts it: its trials by state and, under a budget of
    trainings, the steps left to start or resume (`room`) and the trainings trained."""

    counts: budget.Counts
    room: float = math.inf
    spent: float | None = None

    def done(self, limits: Limits) -> bool:
        """Whether the budget is spent: `n_trials` finished, or, counted in trainings,
        nothing runs and no whole training fits."""
        if limits.trainings is None:
            return self.counts.finished >= limits.n_trials
        return self.counts.running == 0 and self.room < limits.trainings.steps

    def tally(self, n_trials: float) -> str:
        if self.spent is None:
            return f"{self.counts.finished}/{n_trials:g} finished"
        return (f"{self.counts.finished} finished, {self.spent:.1f}/{n_trials:g} trainings "
                f"trained")

    def may_start(self, limits: Limits) -> bool:
        if limits.trainings is None:
            return budget.may_claim(self.counts, limits.n_trials)
        return self.room >= limits.trainings.steps


def standing(connection: sqlalchemy.Connection, study_id: int, limits: Limits) -> Standing:
    counts = budget.count_in_database(connection, study_id)
    if limits.trainings is None:
        return Standing(counts)
    trained = budget.trained_in_database(connection, study_id)
    return Standing(counts, limits.trainings.room(trained), limits.trainings.spent(trained))


def _standing_or_cut(connection: sqlalchemy.Connection, study_id: int,
                     limits: Limits) -> Standing | None:
    """The standing read on the study lock's `connection`; None where an outage took that
    connection, and the lock with it."""
    try:
        return standing(connection, study_id, limits)
    except sqlalchemy.exc.SQLAlchemyError as cut:
        if not is_connection_error(cut):
            raise
        return None


@dataclass(frozen=True)
class WorkerResult:
    ran: int  # trials this worker ran
    finished: int  # finished trials in the study when it stopped


@dataclass(frozen=True)
class Pace:
    """The study's finished trials per second since this worker first counted them, every
    worker's included, and from it the time left to the budget."""

    since: float  # time.monotonic() at the first count
    first: float  # finished trials then (trainings trained, where the budget counts those)

    def progress(self, finished: int, n_trials: float, spent: float | None = None) -> str:
        if math.isinf(n_trials):
            return f"  {console.plural(finished, 'trial')} finished"
        if spent is None:
            text, at = f"  {finished}/{n_trials:g} trials finished", float(finished)
        else:
            text, at = (f"  {console.plural(finished, 'trial')} finished, {spent:.1f}/"
                        f"{n_trials:g} trainings trained", spent)
        done = at - self.first
        left = n_trials - at
        if done <= 0 or left <= 0:
            return text
        return f"{text}, about {duration(left * (time.monotonic() - self.since) / done)} left"


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


TrialRunner = Callable[[TrialContext], tuple[Outcome, FrozenTrial]]


def in_process(resources: Resources) -> TrialRunner:
    return lambda context: execute(context, resources)


def _ask(study: optuna.Study) -> optuna.Trial:
    with warnings.catch_warnings():
        # The heartbeat thread below does for ask/tell what Study.optimize does for its loop.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        return study.ask()


def _run_claimed(
    context: TrialContext, storage: ResilientRDBStorage, run_trial: TrialRunner, waiting: int,
) -> tuple[Outcome, FrozenTrial]:
    trial = context.trial
    if waiting:
        # Optuna's retry callback marks the re-queued copy of a stale trial; only a waiting
        # trial can be one, and ask() takes waiting trials first.
        retried = storage.get_trial_system_attrs(trial._trial_id).get("failed_trial")
        if retried is not None:
            records.record_retry(trial, retried)
    faults.kill_at("heartbeat")
    with heartbeat(storage, context.live):
        return run_trial(context)


LOST_LOCK_CLAIM = ("claimed while the study lock was lost with its database connection; "
                   "given back to keep the budget exact")


def _settle_pause(study: optuna.Study, storage: ResilientRDBStorage, trial: FrozenTrial,
                  promotion: pausing.Promotion | None) -> str | None:
    """Mark a trial that paused paused, under the lock, once its heartbeat thread has stopped
    (which would write the row `repause` removes again), and say so on the dashboard; past
    `study.pruner.max_checkpoints`, the paused trials least likely to be promoted give theirs
    up: returns the words for those, if any."""
    with budget.study_lock(storage.engine, study.study_name):
        pausing.put_back(study, storage, storage.engine, trial._trial_id)
        if promotion is None or promotion.max_checkpoints is None:
            return None
        shed = pausing.shed(study, promotion.store, promotion.max_checkpoints)
    return (f"more paused trials than study.pruner.max_checkpoints "
            f"({promotion.max_checkpoints}): trial(s) {_numbers(shed)}, ranked lowest, gave "
            f"their checkpoints up (a promotion trains them again)") if shed else None


def _claim_stands(study: optuna.Study, storage: ResilientRDBStorage, trial: optuna.Trial,
                  resumed: str | None, limits: Limits, display: LoopDisplay) -> bool:
    """After a claim made while the study lock was lost, another worker may have claimed
    the same slot: recount under the lock and give the trial back if the budget overshoots.
    A paused trial resumed then (its claim `resumed`) stands if no other worker took it."""
    if resumed is not None:
        with budget.study_lock(storage.engine, study.study_name):
            return pausing.holds(storage, trial._trial_id, resumed)
    study_id = storage.get_study_id_from_name(study.study_name)

    def judge(connection: sqlalchemy.Connection) -> bool:
        now = standing(connection, study_id, limits)
        if (now.counts.started <= limits.n_trials if limits.trainings is None
                else now.room >= 0):
            return True
        give_back(study, trial, GivenBack(LOST_LOCK_CLAIM))
        return False

    if budget.under_lock(storage.engine, study.study_name, judge):
        return True
    display.message(f"trial {trial.number} given back: the study lock was lost while it was "
                     f"claimed and the budget would overshoot")
    return False


def _claim(study: optuna.Study, storage: ResilientRDBStorage, now: Standing,
           limits: Limits, display: LoopDisplay
           ) -> tuple[optuna.Trial | None, str | None, bool]:
    """Under the study lock: the trial this worker runs next, the claim it resumes it with
    if it is a paused one, and whether it ended the last paused trials instead. A study that
    pauses trials resumes the one its rung now promotes (`pausing.to_resume`) before it
    samples a new one; once the budget is all started and nothing but paused trials runs,
    nothing can promote them, and they end pruned. Under a budget of trainings a paused
    trial resumes only if the steps it has left fit."""
    promotion = limits.promotion
    may_claim = now.may_start(limits)
    if promotion is not None and now.counts.running:
        trials = study.get_trials(deepcopy=False)
        chosen = pausing.to_resume(trials, promotion.reduction_factor)
        if (chosen is not None and limits.trainings is not None
                and limits.trainings.steps - _kept_steps(chosen) > now.room):
            chosen = None
        token = (pausing.claim(storage, chosen._trial_id, records.worker_name())
                 if chosen is not None else None)
        if chosen is not None and token is not None:
            pausing.note(study, chosen._trial_id)
            display.message(
                f"trial {chosen.number} resumed from its checkpoint at step "
                f"{chosen.user_attrs[pausing.PAUSED_AT]}: later trials ranked below it"
                if pausing.holds_checkpoint(chosen) else
                f"trial {chosen.number} promoted from step {chosen.user_attrs[pausing.PAUSED_AT]}"
                f": later trials ranked below it; it kept no checkpoint "
                f"(study.pruner.max_checkpoints), so it trains again from its start")
            return optuna.trial.Trial(study, chosen._trial_id), token, False
        if not may_claim:
            ended = _end_paused(study, trials, promotion, display, "the budget is spent")
            return None, None, bool(ended)
    return (_ask(study) if may_claim else None), None, False


def _kept_steps(trial: FrozenTrial) -> int:
    """The steps a paused trial goes on from: its checkpoint's, none if it gave it up."""
    return trial.user_attrs[pausing.PAUSED_AT] if pausing.holds_checkpoint(trial) else 0


def _end_paused(study: optuna.Study, trials: list[FrozenTrial], promotion: pausing.Promotion,
                display: LoopDisplay, why: str) -> list[int]:
    """Under the study lock, where nothing but paused trials runs (no report can promote
    them any more): end them pruned, as stopping would have; returns their numbers."""
    running = [t for t in trials if t.state == TrialState.RUNNING]
    if not running or not all(pausing.is_paused(t) for t in running):
        return []
    ended = pausing.end_unpromoted(study, promotion.store)
    if ended:
        display.message(f"{why}: {len(ended)} paused trial(s) that no rung promoted end "
                         f"pruned ({_numbers(ended)})")
    return ended


def _numbers(numbers: list[int]) -> str:
    shown = ", ".join(str(n) for n in numbers[:8])
    return shown + (", ..." if len(numbers) > 8 else "")


def _interrupted(study: optuna.Study, storage: ResilientRDBStorage, trial: optuna.Trial,
                 stop: KeyboardInterrupt) -> str:
    """What becomes of the trial Ctrl-C or SIGTERM interrupted: a resumed one goes back to
    paused at its checkpoint (`pausing.repause`), any other is freed (`executor.free`)."""
    with budget.study_lock(storage.engine, study.study_name):
        repaused = pausing.put_back(study, storage, storage.engine, trial._trial_id)
    if repaused:
        return f"trial {trial.number} interrupted: paused again at its last checkpoint"
    return free(study, trial, stop)


def run_worker(study: optuna.Study, storage: ResilientRDBStorage, run_trial: TrialRunner,
               display: LoopDisplay, limits: Limits) -> WorkerResult:
    """Run trials until the `limits` end the loop.

    While the last trials run on other workers this worker waits, reaping stale trials, and
    takes over a slot that frees up (a failed trial, a re-queued retry).
    """
    n_trials, timeout, poll_seconds = limits.n_trials, limits.timeout, limits.poll_seconds
    started = time.monotonic()
    study_id = storage.get_study_id_from_name(study.study_name)
    reap_every = storage.get_heartbeat_interval() or poll_seconds
    ran = failures = 0
    waiting_said = told = False
    last_reap = -math.inf
    pace: Pace | None = None
    while True:
        # Reaping reads every running trial's heartbeat: once per interval is enough. Not
        # within a grace period of this worker's start or its last lost contact: the
        # heartbeats it would judge may have stopped in the same outage.
        if time.monotonic() - last_reap >= reap_every and storage.trusts_heartbeats():
            reap(study, storage, study_id)
            last_reap = time.monotonic()
        with budget.study_lock(storage.engine, study.study_name) as connection:
            now = _standing_or_cut(connection, study_id, limits)
            if now is None:
                continue  # taking the lock again waits the outage out
            counts = now.counts
            pace = pace or Pace(time.monotonic(),
                                counts.finished if now.spent is None else now.spent)
            if told:
                display.message(pace.progress(counts.finished, n_trials, now.spent))
                told = False
            if now.done(limits):
                break
            if timeout is not None and time.monotonic() - started >= timeout:
                display.message(f"timeout of {timeout:g}s reached")
                if limits.promotion is not None:  # the last worker out ends the paused
                    _end_paused(study, study.get_trials(deepcopy=False), limits.promotion,
                                display, "the search stops here")
                break
            trial, resumed, ended = _claim(study, storage, now, limits, display)
            if trial is not None:
                faults.kill_at("claim")
            lost = trial is not None and not budget.lock_held(connection)
        if (lost and trial is not None
                and not _claim_stands(study, storage, trial, resumed, limits, display)):
            continue
        if trial is None and ended:
            continue  # the last paused trials ended: the study is finished
        if trial is None:
            if not waiting_said:
                display.message(f"waiting for {counts.running} running trial(s) of other "
                                 f"workers ({now.tally(n_trials)})")
                waiting_said = True
            time.sleep(poll_seconds)
            continue
        waiting_said = False
        context = claimed(study, storage, trial, display)
        try:
            outcome, finished = _run_claimed(context, storage, run_trial,
                                             counts.waiting if resumed is None else 0)
        except KeyboardInterrupt as stop:
            # From the claim on: a trial left RUNNING would hold a budget slot until reaped.
            # `context.trial`: a run carried over to its retry copy frees the copy.
            display.interrupted(_interrupted(study, storage, context.trial, stop))
            raise
        shed = (_settle_pause(study, storage, finished, limits.promotion)
                if outcome.paused_at is not None else None)
        ran += outcome.paused_at is None
        display.trial_finished(finished, outcome)
        if shed:
            display.message(shed)
        told = True
        # A dropped result was lost for want of contact, not for anything of its own.
        if not outcome.dropped:
            failures = failures + 1 if outcome.state == TrialState.FAIL else 0
        if failures >= limits.max_consecutive_failures:
            raise WorkerStopped(f"{failures} trials in a row failed; last error: {outcome.error}")
    return WorkerResult(ran, finished_count(study))
