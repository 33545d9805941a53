"""A worker: its set-up (device settings, the study joined, data and models loaded, the
trivial baseline recorded) and its loop, which claims trials under the exact study-wide budget,
keeps each running trial's heartbeat (`liveness`) and reaps trials whose worker went silent.
How a trial ended is the executor's to say; the loop only counts failures in a row."""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo import artifacts, budget, check, faults, hardware, isolation, memory
from hpo.config import StudyConfig
from hpo.data.splits import Splits
from hpo.errors import WorkerStopped
from hpo.executor import execute, free, give_back
from hpo.hardware import Device, precision_name, precision_names
from hpo.liveness import LiveTrial, heartbeat, reap
from hpo.outcome import GivenBack, Outcome
from hpo.report import ConsoleReporter
from hpo.resources import Resources, load_resources
from hpo.space import PinnedSpace
from hpo.storage import ResilientRDBStorage, redact
from hpo.study import (
    decide_precisions,
    finished_count,
    join,
    make_sampler,
    shared_batch_cache,
)

BASELINE = "every symptom predicted for every post"
# With fewer validation posts a symptom has a handful of positives, and one post more or less
# right moves its F1 by tens of points: trials would be ranked by noise.
MIN_VALIDATION_POSTS = 50
# How often a worker that waits for the study's last trials looks again.
POLL_SECONDS = 2.0


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


def describe_decision(pinned: PinnedSpace, verbose: bool = False) -> str:
    """The precisions `fp_precision: auto` searches, and why the others are not."""
    decided = pinned.decided or {}
    text = f"precisions searched: {precision_names(pinned.fp_precision or ())}"
    if decided.get("by") == "native":
        return f"{text}: every native one ({decided['why']})"
    dropped = decided.get("dropped", {})
    text += "".join(f"; {precision_name(p)} left out ({why})" for p, why in dropped.items())
    text += "".join(f"; unsettled: {precision_name(p)} {why}"
                    for p, why in decided.get("unsettled", {}).items())
    if not verbose:
        return text
    return (f"{text} (kept: within study.precision_tolerance {decided.get('tolerance', 0):g} "
            f"of the fastest precision's step time per sequence, summed over the models; "
            f"fp_precision: native searches every native one)")


class LoopReporter(Protocol):
    def message(self, text: str) -> None: ...
    def trial_finished(self, trial: FrozenTrial, outcome: Outcome) -> None: ...
    def interrupted(self, text: str) -> None: ...


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def study_lines(config: StudyConfig, url: str, device: Device, splits: Splits,
                pinned: PinnedSpace, finished: int, n_trials: float) -> list[str]:
    """What a worker says first: the study, its budget and device; then data and precisions."""
    goal = ("no trial budget" if math.isinf(n_trials)
            else f"{finished}/{n_trials:g} trials finished")
    data = config.data
    return [
        f"study '{config.study.name}' on {redact(url)}: {goal}; device {device.describe()}",
        f"  data: {len(splits.train)} training / {len(splits.validation)} validation posts "
        f"(task {data.task}, up to {data.max_length} tokens); precisions: "
        f"{pinned.describe_precisions()}",
    ]


def keep_models(config: StudyConfig, url: str, resources: Resources,
                reporter: ConsoleReporter) -> None:
    """Set the keeper of the best trials' models up, saying where they go or why none does."""
    if config.data.cv_folds and config.study.keep_best:
        reporter.message(f"  no trial's model is kept: a cross-validated trial trains "
                         f"{config.data.cv_folds} models (data.cv_folds), none of them the "
                         f"trial's; hpo final trains the chosen configuration again")
    elif config.study.keep_best:
        resources.keeper = artifacts.keeper_for(config, url)
        if resources.keeper is None:
            reporter.message("  no trial's model is kept: a server storage has no artifact "
                             "store unless study.artifacts (or HPO_ARTIFACTS) names one, a "
                             "directory every worker shares or s3://BUCKET")
        else:
            best = resources.keeper.best
            whose = "the best trial's model" if best == 1 else f"the best {best} trials' models"
            reporter.message(f"  models kept: {whose}, in {resources.keeper.where}")


def closing_lines(study: optuna.Study, url: str, result: WorkerResult, n_trials: float,
                  resources: Resources, next_command: str) -> list[str]:
    """Where the results are and what to run next, after the best trial."""
    budget_text = "" if math.isinf(n_trials) else f" of {n_trials:g}"
    where = f"the study is in {redact(url)}"
    keeper = resources.keeper
    if keeper is not None and artifacts.kept(study):
        where += f"; the best trials' models in {keeper.where}"
    return [
        f"this worker ran {plural(result.ran, 'trial')}; the study has "
        f"{result.finished}{budget_text} finished",
        where,
        f"next: hpo final {next_command}  (train the best trial again, score it on the "
        f"test split, export a model)",
    ]


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
    verbose: bool = False,
    next_command: str | None = None,
) -> None:
    """Set the worker up and run trials until the study holds `n_trials` finished ones (or
    `timeout` passes); raises WorkerStopped after too many failures in a row. Unless told
    not to, the study's model x precision check runs first if no worker on this kind of
    device has run it. `next_command` names the study for the closing advice (`--study
    NAME` by default)."""
    hardware.configure_backends(device)
    study, pinned = join(config, storage, device, splits)
    reporter = ConsoleReporter()
    finished = finished_count(study)
    for line in study_lines(config, url, device, splits, pinned, finished, n_trials):
        reporter.message(line)
    own = (config.study.heartbeat_interval, config.study.grace_period)
    if own != (storage.heartbeat_interval, storage.grace_period):
        reporter.message(f"  heartbeat every {storage.heartbeat_interval} s, grace period "
                         f"{storage.grace_period} s: the study's, fixed when it was created "
                         f"(this worker asked for {own[0]} s and {own[1]} s)")
    resources = load_resources(config, pinned, device, splits)
    keep_models(config, url, resources, reporter)
    small = small_data_warning(splits)
    if small:
        reporter.warning(small)
    next_command = next_command or f"--study {config.study.name}"
    if finished >= n_trials:
        reporter.message(f"study '{config.study.name}' already has {finished} finished trials "
                         f"(asked for {n_trials:g}); nothing to do")
        reporter.best(study)
        reporter.message(f"next: hpo final {next_command}")
        return
    if not config.training.isolate_trials:
        began = time.perf_counter()
        sources = resources.preload()
        if verbose:
            reporter.message(
                f"  loaded {plural(len(sources), 'model')} in "
                f"{time.perf_counter() - began:.1f} s; tokens from: "
                f"{'; '.join(f'{Path(m).name} {s}' for m, s in sources.items())}")
    with memory.long_lived_frozen():
        pinned = decide(study, storage, resources, pinned, reporter, run_check, verbose)
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
    reporter.best(study)
    reporter.message(f"trivial baseline ({BASELINE}): {objective} {baseline:.4f} "
                     f"on the validation split")
    below = below_baseline_warning(study, objective, baseline)
    if below:
        reporter.warning(below)
    for line in closing_lines(study, url, result, n_trials, resources, next_command):
        reporter.message(line)


def decide(study: optuna.Study, storage: ResilientRDBStorage, resources: Resources,
           pinned: PinnedSpace, reporter: ConsoleReporter, run_check: bool,
           verbose: bool) -> PinnedSpace:
    """The study's check (unless skipped or done) and, from its step times, the precisions
    `auto` searches; says what was decided. Returns the space the trials search."""
    config = resources.config
    verdicts = (check.ensure(study, resources, pinned.fp_precision, reporter) if run_check
                else check.stored(study, resources.device))
    decided = decide_precisions(study, storage, pinned, check.step_seconds(verdicts),
                                config.study.precision_tolerance, check.step_spreads(verdicts))
    if decided.decided != pinned.decided:
        reporter.message(describe_decision(decided, verbose))
    stored_tolerance = (decided.decided or {}).get("tolerance")
    if stored_tolerance is not None and stored_tolerance != config.study.precision_tolerance:
        reporter.warning(f"study.precision_tolerance {config.study.precision_tolerance:g} is "
                         f"not applied: the study decided its precisions with "
                         f"{stored_tolerance:g} (a new study decides again)")
    resources.pinned = decided
    return decided


@dataclass(frozen=True)
class WorkerResult:
    ran: int  # trials this worker ran
    finished: int  # finished trials in the study when it stopped


@dataclass(frozen=True)
class Pace:
    """The study's finished trials per second since this worker first counted them, every
    worker's included, and from it the time left to the budget."""

    since: float  # time.monotonic() at the first count
    first: int  # finished trials then

    def progress(self, finished: int, n_trials: float) -> str:
        if math.isinf(n_trials):
            return f"  {finished} trials finished"
        text = f"  {finished}/{n_trials:g} trials finished"
        done = finished - self.first
        left = n_trials - finished
        if done <= 0 or left <= 0:
            return text
        return f"{text}, about {duration(left * (time.monotonic() - self.since) / done)} left"


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


TrialRunner = Callable[[optuna.Study, LiveTrial], tuple[Outcome, FrozenTrial]]


def in_process(resources: Resources, reporter: ConsoleReporter,
               storage: ResilientRDBStorage) -> TrialRunner:
    return lambda study, live: execute(study, live, resources, reporter,
                                       shared_batch_cache(study, storage))


def _ask(study: optuna.Study) -> optuna.Trial:
    with warnings.catch_warnings():
        # The heartbeat thread below does for ask/tell what Study.optimize does for its loop.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        return study.ask()


def _run_claimed(
    study: optuna.Study, storage: ResilientRDBStorage, live: LiveTrial,
    run_trial: TrialRunner, waiting: int,
    sampler_for: Callable[[int], optuna.samplers.BaseSampler] | None,
) -> tuple[Outcome, FrozenTrial]:
    trial = live.trial
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
    with heartbeat(storage, live):
        return run_trial(study, live)


def _claim_stands(study: optuna.Study, storage: ResilientRDBStorage, study_id: int,
                  trial: optuna.Trial, n_trials: float, reporter: LoopReporter) -> bool:
    """After a claim made while the study lock was lost, another worker may have claimed
    the same slot: recount under the lock and give the trial back if the budget overshoots."""
    with budget.study_lock(storage.engine, study.study_name) as connection:
        counts = budget.count_in_database(connection, study_id)
        if counts.started <= n_trials:
            return True
        give_back(study, trial, GivenBack("claimed while the study lock was lost with its "
                                          "database connection; given back to keep the "
                                          "budget exact"))
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
    waiting_said = told = False
    last_reap = -math.inf
    pace: Pace | None = None
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
            pace = pace or Pace(time.monotonic(), counts.finished)
            if told:
                reporter.message(pace.progress(counts.finished, n_trials))
                told = False
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
        live = LiveTrial(trial)
        try:
            outcome, finished = _run_claimed(study, storage, live, run_trial, counts.waiting,
                                             sampler_for)
        except KeyboardInterrupt as stop:
            # From the claim on: a trial left RUNNING would hold a budget slot until reaped.
            # `live.trial`: a run carried over to its retry copy frees the copy.
            reporter.interrupted(free(study, live.trial, stop))
            raise
        ran += 1
        reporter.trial_finished(finished, outcome)
        told = True
        # A dropped result was lost for want of contact, not for anything of its own.
        if not outcome.dropped:
            failures = failures + 1 if outcome.state == TrialState.FAIL else 0
        if failures >= max_consecutive_failures:
            raise WorkerStopped(f"{failures} trials in a row failed; last error: {outcome.error}")
    return WorkerResult(ran, finished_count(study))
