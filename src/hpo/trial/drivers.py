"""The training drivers of a planned trial: one model (`train_trial`), or one per fold of
`data.cv_folds` (`train_folds`), reporting to the pruner as they go. A driver returns what it
trained (`Trained`); whether the model is kept is the executor's to decide.

`fit` is the one wiring of a model's training, for a trial and for `hpo final`'s runs alike:
built, prepared for the device, trained, scored on the validation split after each epoch
(`scorer`) and, where asked, put back to the weights of the epoch the study's rule chooses
(`BestEpoch`).

A driver takes the trial's run (`TrialRun`) and writes to the trial through its context
(`TrialContext.write`): a trial reaped while it ran goes on as its retry copy.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import optuna
import torch

from hpo import faults
from hpo.config import TrainingConfig
from hpo.data.batching import Encoded
from hpo.outcome import Reaped
from hpo.search import artifacts, pausing
from hpo.training import adapters, memory, metrics
from hpo.training.models import ModelStore
from hpo.training.train import (
    Hooks,
    Paused,
    PauseHere,
    Plan,
    Progress,
    TrainState,
    as_epochs,
    predict,
    prepare,
    train,
)
from hpo.trial import records
from hpo.trial.resources import Resources
from hpo.trial.run import Trained, TrialRun


def scorer(resources: Resources, plan: Plan, data: Encoded, gold: torch.Tensor, pad_id: int,
           into: list[metrics.Scores]) -> Callable[[torch.nn.Module], float]:
    """Scores a model on `data` as the search scores its trials (in the plan's precision,
    threshold 0.5), appends the scores to `into` and returns the study's objective."""
    names = resources.label_names
    objective = resources.config.study.objective

    def evaluate(model: torch.nn.Module) -> float:
        probabilities = predict(model, data, plan.eval_batch, resources.device, plan.precision,
                                pad_id)
        grid = metrics.as_grid(probabilities > 0.5, len(names))
        into.append(metrics.f1_scores(grid, gold, names))
        return into[-1].get(objective)

    return evaluate


class BestEpoch:
    """The weights of the evaluation a run's value comes from (`study.objective_epoch`),
    copied to the host after each evaluation that is the chosen one so far, unless it is the
    last (the last one's weights are the model's own when training ends) or its score does
    not beat `floor`: a trial of that value could not rank among the models the study keeps,
    and a base model's copy costs a fifth of a second on a host."""

    def __init__(self, model: torch.nn.Module, rule: str, evaluations: int,
                 floor: float = -math.inf) -> None:
        self._model, self._rule, self._evaluations = model, rule, evaluations
        self._floor = floor
        self._state: dict[str, torch.Tensor] = {}
        self._held: int | None = None  # the evaluation (1-based) whose weights _state holds

    def after_evaluation(self, index: int, values: list[float]) -> None:
        if (self._rule == "best" and index < self._evaluations
                and metrics.chosen_epoch(values, self._rule) == index - 1
                and values[index - 1] > self._floor):
            self._state = {k: v.detach().to("cpu", copy=True)
                           for k, v in self._model.state_dict().items()}
            self._held = index

    def held(self) -> tuple[dict[str, torch.Tensor], int | None]:
        """The weights copied so far and the evaluation they are from: a paused run's
        checkpoint carries them, so a resumed run can still end on them."""
        return self._state, self._held

    def hold(self, state: dict[str, torch.Tensor], held: int | None) -> None:
        self._state, self._held = state, held

    def restore(self, values: list[float]) -> int | None:
        """Put the chosen evaluation's weights back into the model; returns its index, or
        None where they were not copied (its score did not beat the floor)."""
        chosen = metrics.chosen_epoch(values, self._rule)
        if chosen == len(values) - 1:
            return chosen
        if self._held != chosen + 1:
            return None
        self._model.load_state_dict(self._state)
        return chosen


@dataclass(frozen=True)
class FitJob:
    """What `fit` trains: a fresh `model_name` from `models`, with its settings and plan, on
    `data`; `evaluate` scores a model at each evaluation and appends its scores to `scores`.
    With a `snapshot` floor the model ends on the weights of the evaluation the study's rule
    chooses (`BestEpoch`), else on the last."""

    models: ModelStore
    model_name: str
    training: TrainingConfig
    plan: Plan
    data: Encoded
    pad_id: int
    evaluate: Callable[[torch.nn.Module], float]
    scores: list[metrics.Scores]
    snapshot: float | None = None
    resume: Checkpoint | None = None  # the paused fit it goes on from, if any


@dataclass(frozen=True)
class Checkpoint:
    """A paused fit, as the artifact store keeps it: where its training stood, its scores so
    far, and the chosen evaluation's weights copied so far (`BestEpoch`)."""

    train: TrainState
    scores: list[metrics.Scores]
    best: dict[str, torch.Tensor]
    best_held: int | None


class FitPaused(Exception):
    """A fit that a hook paused (`PauseHere`): `checkpoint` is where it stands."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(f"paused after evaluation {checkpoint.train.evaluations}")
        self.checkpoint = checkpoint


class Listener(Protocol):
    """What hears a fit as it goes: the model built (and the one prepared for the device, and
    the seconds both took), each evaluation's score, each step's progress."""

    def built(self, base: torch.nn.Module, model: torch.nn.Module, seconds: float) -> None: ...
    def evaluated(self, index: int, score: float) -> None: ...
    def stepped(self, progress: Progress) -> None: ...


def fit(job: FitJob, resources: Resources, listener: Listener
        ) -> tuple[torch.nn.Module | None, int]:
    """Train `job`, telling `listener`. Returns the built model and the evaluation (1-based)
    whose weights it holds: with a `snapshot` floor, the one the study's rule (`study.
    objective_epoch`) chooses by the scores (the model None where that one's score did not
    beat the floor: `BestEpoch`), else (None) the last."""
    plan, study = job.plan, resources.config.study
    began = time.perf_counter()
    base = adapters.build(job.models, job.model_name, job.data.labels.shape[1], job.training,
                          plan.precision)
    model = prepare(base, plan, resources.device)
    listener.built(base, model, time.perf_counter() - began)
    best = (BestEpoch(base, study.objective_epoch, plan.evaluations, job.snapshot)
            if job.snapshot is not None else None)

    def evaluated(index: int, score: float) -> None:
        if best is not None:
            best.after_evaluation(index, [s.get(study.objective) for s in job.scores])
        listener.evaluated(index, score)

    if job.resume is not None and best is not None:
        best.hold(job.resume.best, job.resume.best_held)
    try:
        train(model, job.data, plan, resources.device, pad_id=job.pad_id,
              hooks=Hooks(job.evaluate, evaluated, listener.stepped,
                          job.resume.train if job.resume is not None else None))
    except Paused as paused:
        state, held = best.held() if best is not None else ({}, None)
        raise FitPaused(Checkpoint(paused.state, list(job.scores), state, held)) from None
    del model
    if best is None:
        return base, plan.evaluations
    values = [s.get(study.objective) for s in job.scores]
    held = best.restore(values)
    if held is None:
        return None, metrics.chosen_epoch(values, study.objective_epoch) + 1
    return base, held + 1


@dataclass
class _TrialListener:
    """A single-model trial's fit heard: each epoch reported to the pruner (the study's rule
    applied to the epochs so far, so it compares what the trial's value would be) and shown,
    the model's records written once it is built, the last progress kept for the records."""

    run: TrialRun
    scores: list[metrics.Scores] = field(default_factory=list)
    prepared: torch.nn.Module | None = None  # for the compiler's failure, once built
    progress: Progress | None = None
    warned: str | None = None
    claim: str | None = None  # a resumed run's claim on its trial (`pausing.holds`)
    again: int = 0  # steps it reported before and trains again: not reported twice

    def value(self) -> float:
        study = self.run.config.study
        values = [s.get(study.objective) for s in self.scores]
        return values[metrics.chosen_epoch(values, study.objective_epoch)]

    def built(self, base: torch.nn.Module, model: torch.nn.Module, seconds: float) -> None:
        # Recorded first: a trial reaped while it was built fails here, before any record of
        # its progress would carry it over to a retry copy it then leaves unfinished.
        run = self.run
        records.record_model(run.trial, base, run.resources.device.type, seconds)
        self.prepared = model
        self.warned = records.warn_eager(run.trial.number, model, run.context.display, None)

    def evaluated(self, index: int, score: float) -> None:
        context, plan = self.run.context, self.run.plan
        epoch = as_epochs(index, plan.evaluations_per_epoch)
        context.display.epoch(context.trial.number, epoch, plan.epochs, score)
        value = self.value()
        self.still_held()
        if index <= self.again:  # reported, and ranked at its rung, before its checkpoint went
            return
        context.write(lambda trial: trial.report(value, index))
        # After the last evaluation the compute is spent: the result is kept, not pruned.
        if index < plan.evaluations and context.trial.should_prune():
            if self.run.config.study.pruner.pause:
                raise PauseHere
            raise optuna.TrialPruned(f"pruned at epoch {epoch}")

    def stepped(self, progress: Progress) -> None:
        if self.again and progress.step == 1:  # trained again from its start: resumed too
            faults.kill_at("resume")
        self.progress = progress
        self.run.context.display.step(self.run.trial.number, progress, self.run.plan.epochs)

    def still_held(self) -> None:
        """Raise Reaped where this run resumed its trial and no longer holds it."""
        trial = self.run.trial
        if self.claim is not None and not pausing.holds(trial.storage, trial._trial_id,
                                                         self.claim):
            raise Reaped(f"trial {trial.number} was put back to paused while this run "
                         f"resumed it (its heartbeats were lost): what it trained since its "
                         f"checkpoint is dropped")

    def finished(self) -> None:
        """The records of the training's end, once the model was built: also after a
        pruning or a failure."""
        if self.prepared is None:
            return
        run, prepared, progress, scores = self.run, self.prepared, self.progress, self.scores
        records.warn_eager(run.trial.number, prepared, run.context.display, self.warned)
        run.context.write(lambda trial: records.record_progress(
            trial, progress, scores, run.config.study, prepared,
            per_epoch=run.plan.evaluations_per_epoch))


def train_trial(run: TrialRun) -> Trained:
    """Train the planned trial, reporting each epoch's value for pruning; its value is the
    best or the last epoch's score (`study.objective_epoch`). Where the study keeps its best
    models, the model returned holds the value epoch's weights."""
    planned, resources = run.planned, run.resources
    heard = _TrialListener(run)
    # Read once: the bar only rises as other trials finish, so a stale one copies more
    # weights than needed, never fewer.
    floor = (artifacts.floor(run.context.study, resources.keeper.best)
             if resources.keeper is not None else None)
    resume, heard.claim, heard.again = resumed(run)
    if resume is not None:
        heard.scores.extend(resume.scores)
    job = FitJob(resources.models, run.model_name, planned.training, run.plan,
                 planned.train_data, planned.pad_id,
                 scorer(resources, run.plan, planned.validation_data, resources.gold(),
                        planned.pad_id, heard.scores), heard.scores, snapshot=floor,
                 resume=resume)
    try:
        model, epoch = fit(job, resources, heard)
    except FitPaused as paused:
        heard.still_held()
        raise pause(run, paused.checkpoint) from None
    finally:
        heard.finished()
    return Trained(heard.value(), model, as_epochs(epoch, run.plan.evaluations_per_epoch))


class TrialPaused(Exception):
    """The trial paused at `step` (`study.pruner.pause`), its checkpoint in the store."""

    def __init__(self, number: int, step: int, epoch: float) -> None:
        super().__init__(f"trial {number} paused at epoch {epoch}")
        self.step = step


def resumed(run: TrialRun) -> tuple[Checkpoint | None, str | None, int]:
    """The checkpoint the trial goes on from, the claim of the worker that resumed it, and
    the steps it reported before that it trains again (its checkpoint given up under
    `study.pruner.max_checkpoints`): a trial holds one only from its first pause on, and runs
    again only when a worker resumes it. Read to the host: the run loads it onto the device
    itself, weights into the model's own tensors, and a second copy on the device would not
    fit its batch."""
    if not run.config.study.pruner.pause:
        return None, None, 0
    trial = run.trial
    attrs = trial.storage.get_trial(trial._trial_id).user_attrs
    checkpoint, store = attrs.get(pausing.CHECKPOINT), run.resources.checkpoints
    if checkpoint is None:
        return None, None, 0
    if checkpoint["id"] is None:
        return None, attrs.get(pausing.CLAIM), checkpoint["step"]
    if store is None:
        raise RuntimeError(f"trial {trial.number} resumes from a checkpoint, but this worker "
                           f"has no artifact store to read it from")
    payload = pausing.load(store, checkpoint["id"], torch.device("cpu"))
    if not isinstance(payload, Checkpoint):
        raise RuntimeError(f"trial {trial.number}'s checkpoint {checkpoint['id']} is not one")
    return payload, attrs.get(pausing.CLAIM), 0


def pause(run: TrialRun, checkpoint: Checkpoint) -> TrialPaused:
    """Keep a paused fit's checkpoint in the store and record it on the trial (the one it
    replaces removed after); the worker marks the trial paused once its heartbeat stops. A
    study that keeps no checkpoints (`study.pruner.max_checkpoints: 0`, no store) records
    only the step: promoted, the trial trains again from its start."""
    store, trial = run.resources.checkpoints, run.trial
    step = checkpoint.train.evaluations
    key = pausing.save(store, trial.number, checkpoint) if store is not None else None
    try:
        old = run.context.write(lambda live: pausing.record_checkpoint(live, step, key))
    except BaseException:
        pausing.remove(store, key)  # recorded nowhere: no run could resume from it
        raise
    pausing.remove(store, old)
    return TrialPaused(trial.number, step, as_epochs(step, run.plan.evaluations_per_epoch))


def _report(trial: optuna.Trial, value: float, step: int) -> None:
    trial.report(value, step)


@dataclass
class _FoldsListener:
    """A cross-validated trial's folds heard: each fold's epochs and steps shown, the first
    fold's model recorded (every fold builds the same), each fold's prepared model held until
    the fold ends; what the folds so far scored, for the pruner and the records."""

    run: TrialRun
    folds: records.FoldsSoFar = field(default_factory=records.FoldsSoFar)
    fold: int = 0
    prepared: torch.nn.Module | None = None

    def built(self, base: torch.nn.Module, model: torch.nn.Module, seconds: float) -> None:
        if self.fold == 1:
            records.record_model(self.run.trial, base, self.run.resources.device.type, seconds)
        self.prepared = model

    def evaluated(self, index: int, score: float) -> None:
        self.run.context.display.epoch(self.run.trial.number, index, self.run.plan.epochs,
                                        score)

    def stepped(self, progress: Progress) -> None:
        self.folds.progress = progress
        self.run.context.display.step(self.run.trial.number, progress, self.run.plan.epochs)

    def fold_ended(self, scores: list[metrics.Scores]) -> float:
        """The fold's model let go and its score and speed kept; returns the mean so far."""
        folds, study = self.folds, self.run.config.study
        assert self.prepared is not None  # fit tells the listener what it built
        folds.compile_failure = folds.compile_failure or records.warn_eager(
            self.run.trial.number, self.prepared, self.run.context.display,
            folds.compile_failure)
        folds.seconds += folds.progress.train_seconds if folds.progress is not None else 0.0
        self.prepared = None  # the fold's model, let go before the next is built
        memory.release_memory()
        values = [s.get(study.objective) for s in scores]
        folds.value_epochs.append(metrics.chosen_epoch(values, study.objective_epoch) + 1)
        folds.scores.append(values[folds.value_epochs[-1] - 1])
        return folds.mean


def train_folds(run: TrialRun) -> Trained:
    """Train the planned trial once per fold of `data.cv_folds` (one batch search for all,
    done in planning); its value is the mean of the folds' scores, each its best or last
    epoch's (`study.objective_epoch`). The mean so far is reported after each fold, so the
    pruner can stop a poor configuration after its first folds. No model is returned: none
    of the folds' is the trial's."""
    planned, resources, context = run.planned, run.resources, run.context
    k = run.config.data.cv_folds
    assert k is not None  # the executor runs this driver only with folds
    heard = _FoldsListener(run)
    try:
        for index, fold in enumerate(resources.folds(run.model_name), 1):
            scores: list[metrics.Scores] = []
            heard.fold = index
            fit(FitJob(resources.models, run.model_name, planned.training, run.plan,
                       fold.train, planned.pad_id,
                       scorer(resources, run.plan, fold.validation, fold.gold, planned.pad_id,
                              scores), scores), resources, heard)
            mean = heard.fold_ended(scores)
            context.display.message(f"  trial {run.trial.number} fold {index}/{k}: score "
                                     f"{heard.folds.scores[-1]:.4f} (mean so far {mean:.4f})")
            context.write(functools.partial(_report, value=mean, step=index))
            # After the last fold the compute is spent: the result is kept, not pruned.
            if index < k and context.trial.should_prune():
                raise optuna.TrialPruned(f"pruned after fold {index}")
    finally:
        folds = heard.folds
        context.write(lambda trial: records.record_folds(trial, folds, run.plan.compile))
    return Trained(heard.folds.mean)
