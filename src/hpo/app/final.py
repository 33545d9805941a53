"""From a search to a model: a finished trial trained again from its recorded settings, once
per seed, each run scored on the held-out test split, and the run that did best on the
validation split exported.

The search never reads the test split (a worker holds only the training and validation
examples); this is the one place that does, after training, once per run. Decision
thresholds are tuned on the validation split, never on the test split.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import optuna
import pydantic
import torch
from optuna.trial import FrozenTrial, TrialState

from hpo.app.console import ConsoleDisplay
from hpo.config import ADAPTER_RATE, TrainingConfig
from hpo.data.batching import Encoded
from hpo.data.redsm5 import Post
from hpo.data.splits import Splits
from hpo.data.tasks import build_examples
from hpo.errors import ConfigError, SpaceError
from hpo.hardware import native_precisions, precision_name
from hpo.space import Params
from hpo.training import adapters, memory, metrics
from hpo.training.final_results import (
    F1,
    BatchPlan,
    DataUsed,
    Exported,
    FinalReport,
    SeedRun,
    Spread,
    SymptomScore,
)
from hpo.training.models import ModelStore
from hpo.training.train import Plan, Progress, as_epochs, predict
from hpo.trial.batch_limit import StudyBatchCache, fit_batch
from hpo.trial.drivers import FitJob, fit, scorer
from hpo.trial.resources import Resources

SEARCHED = ("model_name", "fp_precision", "target_effective_batch_size", "learning_rate",
            ADAPTER_RATE)


@dataclass(frozen=True)
class Recipe:
    """A COMPLETE trial's settings, enough to train it again."""

    number: int
    value: float
    params: Params
    training: TrainingConfig
    # The epoch the trial's value came from (1-based; a fraction such as 1.5 where it came
    # from an evaluation inside an epoch, under training.evaluations_per_epoch).
    value_epoch: float


def recipe(study: optuna.Study, number: int | None, defaults: TrainingConfig) -> Recipe:
    """The settings of trial `number`, or of the best trial; `defaults` stand in for the
    resolved training settings of a trial that did not record them."""
    trial = _chosen_trial(study, number)
    params = trial.params
    extras = {k: v for k, v in params.items() if k not in SEARCHED}
    recorded = trial.user_attrs.get("training")
    try:
        training = (TrainingConfig.model_validate(recorded) if recorded is not None
                    else defaults.model_copy(update=extras))
    except pydantic.ValidationError as exc:
        raise ConfigError(f"trial {trial.number}: its recorded training settings no longer "
                          f"validate ({exc.error_count()} error(s), first: "
                          f"{exc.errors()[0]['msg']})") from None
    assert trial.value is not None  # a COMPLETE trial's
    rate = params[ADAPTER_RATE] if ADAPTER_RATE in params else params["learning_rate"]
    return Recipe(
        number=trial.number,
        value=float(trial.value),
        params=Params(params["model_name"], params["fp_precision"],
                      int(params["target_effective_batch_size"]), float(rate), extras),
        training=training,
        value_epoch=float(trial.user_attrs.get("value_epoch", training.epochs)),
    )


def _chosen_trial(study: optuna.Study, number: int | None) -> FrozenTrial:
    trials = study.get_trials(deepcopy=False)
    if not any(t.state == TrialState.COMPLETE for t in trials):
        raise ConfigError(f"study '{study.study_name}' has no COMPLETE trial yet: nothing to "
                          f"train (hpo run first)")
    if number is None:
        return study.best_trial
    found = [t for t in trials if t.number == number]
    if not found:
        raise ConfigError(f"--trial {number}: study '{study.study_name}' has no trial "
                          f"{number} (its trials are numbered 0 to {len(trials) - 1})")
    if found[0].state != TrialState.COMPLETE:
        raise ConfigError(f"--trial {number}: trial {number} of study '{study.study_name}' "
                          f"is {found[0].state.name}, not COMPLETE: it has no result to repeat")
    return found[0]


@dataclass(frozen=True)
class Run:
    """One seed's training run, scored with its own weights in float32, as exported."""

    seed: int
    epochs_trained: float
    kept_epoch: float  # in epochs (`train.as_epochs`)
    # The objective on the validation split at the kept epoch, scored as the search scored
    # its trials (in the trial's precision, threshold 0.5); None with --refit.
    validation: float | None
    validation_probabilities: torch.Tensor | None
    test_probabilities: torch.Tensor


@dataclass(frozen=True)
class Data:
    """The encoded splits a final run trains on and is scored on."""

    train: Encoded
    validation: Encoded
    test: Encoded
    pad_id: int


def encode_splits(resources: Resources, splits: Splits, model_name: str,
                  refit: bool) -> Data:
    """The splits tokenized as the search's trials were (`Resources.encode`); with --refit,
    training and validation posts train together."""
    config = resources.config.data

    def encoded(posts: Sequence[Post]) -> Encoded:
        examples = build_examples(posts, config.task, special_case=config.special_case)
        return resources.encode(examples, model_name)[0]

    train_posts = splits.train + splits.validation if refit else splits.train
    return Data(encoded(train_posts), encoded(splits.validation), encoded(splits.test),
                resources.pad_id(model_name))


def validate_precision(found: Recipe, resources: Resources) -> None:
    precision = found.params.fp_precision
    native = native_precisions(resources.device)
    if precision not in native:
        raise SpaceError(f"trial {found.number} trained in {precision}, which "
                         f"{resources.device.describe()} runs only by emulation (native: "
                         f"{', '.join(native)}): run hpo final on a device like the search's")


def fitted_plan(found: Recipe, resources: Resources, cache: StudyBatchCache, refit: bool,
                display: ConsoleDisplay) -> tuple[Plan, int]:
    """The trial's plan with the batches that fit this device (the study's cached limit; a
    batch search where this kind of device has none). With --refit and the best epoch as the
    trial's value, training stops at that epoch: there is no validation split left to choose
    an epoch on. On a device other processes hold memory of, the batch is searched for what
    is left, as a worker's is (`batch_limit.fit_batch`), and the user is told."""
    training = found.training
    stop_after = None
    if refit and resources.config.study.objective_epoch == "best":
        training = training.model_copy(update={"epochs": math.ceil(found.value_epoch)})
        stop_after = round(found.value_epoch * training.evaluations_per_epoch)
    shared = memory.foreign_bytes(resources.device)
    if shared:
        display.warning(f"{shared / 2**30:.1f} GiB of {resources.device.describe()} is held "
                         f"outside hpo final (other processes use it): its batch is searched "
                         f"for what is left now and kept out of the study's cache, and a "
                         f"neighbour that grows can still run it out of memory; give it a GPU "
                         f"of its own (CUDA_VISIBLE_DEVICES)")
    plan, _, probes = fit_batch(found.params, training, resources, cache, shared=shared)
    return replace(plan, stop_after=stop_after), probes


@dataclass(frozen=True)
class _RunListener:
    """A retraining run heard: said when built, each evaluation and step shown."""

    display: ConsoleDisplay
    label: str
    plan: Plan

    def built(self, _base: torch.nn.Module, _model: torch.nn.Module, _seconds: float) -> None:
        self.display.run_started(self.label, self.plan)

    def evaluated(self, index: int, score: float) -> None:
        plan = self.plan
        self.display.epoch(self.label, as_epochs(index, plan.evaluations_per_epoch),
                            plan.epochs, score)

    def stepped(self, progress: Progress) -> None:
        self.display.step(self.label, progress, self.plan.epochs)


def train_run(job: Retraining, seed: int, label: str) -> tuple[Run, torch.nn.Module]:
    """Train the trial's configuration with `seed` (its data order and dropout; the head is
    initialised from it too) and score the weights of the epoch the study's rule keeps, as
    the search's trials are trained and scored (`drivers.fit`). Returns the run and the
    model with those weights, on the device."""
    plan = replace(job.plan, seed=seed)
    resources, data, refit = job.resources, job.data, job.options.refit
    scores: list[metrics.Scores] = []
    # With --refit no validation split is left to score: the last epoch is kept unscored.
    evaluate = ((lambda _model: math.nan) if refit
                else scorer(resources, plan, data.validation, job.gold_validation,
                            data.pad_id, scores))
    # A store of its own: each seed's initial weights are needed once.
    # Every chosen evaluation's weights are copied (a floor of -inf): the run's model is
    # exported whatever it scores.
    found = job.found
    fit_job = FitJob(ModelStore(), found.params.model_name,
                     found.training.model_copy(update={"seed": seed}), plan, data.train,
                     data.pad_id, evaluate, scores, snapshot=None if refit else -math.inf)
    model, kept = fit(fit_job, resources, _RunListener(job.display, label, plan))
    assert model is not None  # under a floor of -inf every chosen evaluation is copied
    kept_score = None if refit else scores[kept - 1].get(resources.config.study.objective)
    # Adapters folded into the body, all in float32: the model as it is exported.
    model = adapters.merged(model)
    model.eval()
    # Scored as exported: float32 weights, no autocast, as a plain pipeline runs them.
    device = resources.device
    validation = (None if refit else predict(model, data.validation, plan.eval_batch, device,
                                             "none", data.pad_id))
    test = predict(model, data.test, plan.eval_batch, device, "none", data.pad_id)
    per_epoch = plan.evaluations_per_epoch
    return Run(seed, as_epochs(plan.evaluations, per_epoch), as_epochs(kept, per_epoch),
               kept_score, validation, test), model


@dataclass(frozen=True)
class Scored:
    """A run's test predictions at its thresholds and at 0.5."""

    thresholds: tuple[float, ...]
    test: metrics.Scores
    test_at_half: metrics.Scores


def score(run: Run, gold_validation: torch.Tensor, gold_test: torch.Tensor,
          names: tuple[str, ...], tuned: bool) -> Scored:
    n = len(names)
    validation = (None if run.validation_probabilities is None
                  else metrics.as_grid(run.validation_probabilities, n))
    thresholds = (metrics.tune_thresholds(validation, gold_validation)
                  if tuned and validation is not None else (0.5,) * n)
    test = metrics.as_grid(run.test_probabilities, n)
    return Scored(
        thresholds,
        metrics.f1_scores(metrics.apply_thresholds(test, thresholds), gold_test, names),
        metrics.f1_scores(test > 0.5, gold_test, names),
    )


def spread(values: list[float]) -> Spread:
    return Spread(
        mean=round(statistics.fmean(values), 4),
        std=round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
        min=round(min(values), 4),
        max=round(max(values), 4),
    )


@dataclass(frozen=True)
class Options:
    number: int | None  # None: the best trial
    seeds: int
    refit: bool
    tuned: bool  # thresholds tuned on the validation split, else 0.5


@dataclass(frozen=True)
class Retraining:
    """What every seed's run of `hpo final` shares: the chosen trial's recipe and the plan
    fitted to this device (found in `probes` probes), the study's resources and splits, the
    splits encoded for the trial's model, the gold labels they are scored against, the
    command's options and where it reports."""

    found: Recipe
    plan: Plan
    probes: int
    resources: Resources
    splits: Splits
    data: Data
    gold_validation: torch.Tensor
    gold_test: torch.Tensor
    options: Options
    display: ConsoleDisplay


def retraining(study: optuna.Study, resources: Resources, splits: Splits, options: Options,
               display: ConsoleDisplay, cache: StudyBatchCache) -> Retraining:
    """The chosen trial's retraining, its data encoded and its batch fitted (`cache` is the
    study's batch cache, shared with its workers)."""
    found = recipe(study, options.number, resources.config.training)
    validate_precision(found, resources)
    data = encode_splits(resources, splits, found.params.model_name, options.refit)
    config = resources.config.data
    gold_test = resources.gold(build_examples(splits.test, config.task,
                                              special_case=config.special_case))
    plan, probes = fitted_plan(found, resources, cache, options.refit, display)
    return Retraining(found, plan, probes, resources, splits, data, resources.gold(),
                      gold_test, options, display)


def final(study: optuna.Study, resources: Resources, splits: Splits, options: Options,
          display: ConsoleDisplay, cache: StudyBatchCache,
          ) -> tuple[FinalReport, torch.nn.Module]:
    """Train the chosen trial again once per seed and score every run on the test split;
    `cache` is the study's batch cache, shared with its workers.
    Returns the report and the model to export: the run best on validation (the earliest of
    equal ones), or the first seed's with --refit (no validation split is left to choose)."""
    job = retraining(study, resources, splits, options, display, cache)
    found = job.found
    runs: list[tuple[Run, Scored]] = []
    chosen: tuple[Run, Scored, torch.nn.Module] | None = None
    for index in range(options.seeds):
        seed = found.training.seed + index
        split = "training + validation" if options.refit else "training"
        display.message(f"seed {index + 1} of {options.seeds} (training seed {seed}): trial "
                         f"{found.number}'s configuration trained on the {split} split "
                         f"({len(job.data.train)} examples)")
        run, model = train_run(job, seed, f"seed {index + 1}/{options.seeds}")
        display.run_finished()
        scored = score(run, job.gold_validation, job.gold_test, resources.label_names,
                       options.tuned)
        runs.append((run, scored))
        display.message(_run_line(run, scored, resources.config.study.objective))
        best = None if chosen is None else chosen[0].validation
        if chosen is None or (run.validation is not None
                              and (best is None or run.validation > best)):
            chosen = (run, scored, model.to("cpu"))
        del model
        memory.release_memory()
    assert chosen is not None
    return _report(study, job, runs, chosen[:2]), chosen[2]


def _run_line(run: Run, scored: Scored, objective: str) -> str:
    validation = ("" if run.validation is None
                  else f", validation {objective} {run.validation:.4f}")
    return (f"  seed {run.seed}: epoch {run.kept_epoch} of {run.epochs_trained} kept"
            f"{validation}, test macro-F1 {scored.test.macro_f1:.4f} "
            f"({scored.test_at_half.macro_f1:.4f} at threshold 0.5)")


def _f1(scores: metrics.Scores) -> F1:
    return F1(round(scores.macro_f1, 4), round(scores.micro_f1, 4))


def _report(study: optuna.Study, job: Retraining, runs: list[tuple[Run, Scored]],
            chosen: tuple[Run, Scored]) -> FinalReport:
    resources, splits, options, found = job.resources, job.splits, job.options, job.found
    plan, gold_test = job.plan, job.gold_test
    config, names = resources.config, resources.label_names
    objective = config.study.objective
    run, scored = chosen
    predicted = metrics.apply_thresholds(metrics.as_grid(run.test_probabilities, len(names)),
                                         scored.thresholds)
    intervals = metrics.bootstrap_intervals(predicted, gold_test)
    per_label = metrics.per_label_scores(predicted, gold_test, names)
    # The search scored its trials at threshold 0.5: its optimism is measured at 0.5 too.
    at_half = spread([s.test_at_half.get(objective) for _, s in runs])
    data = config.data
    return FinalReport(
        study=study.study_name, trial=found.number, objective=objective,
        search_validation=round(found.value, 4),
        params={"model_name": found.params.model_name,
                "fp_precision": found.params.fp_precision,
                "target_effective_batch_size": found.params.target_effective_batch_size,
                "learning_rate": found.params.learning_rate, **found.params.extras},
        training=found.training.model_dump(mode="json"),
        plan=BatchPlan(plan.physical_batch, plan.grad_accum_steps, plan.effective_batch,
                       plan.epochs, job.probes),
        device=resources.device.describe(),
        refit=options.refit,
        thresholds="tuned on validation" if options.tuned and not options.refit else "0.5",
        data=DataUsed(data.dir, data.task, data.split_seed, data.max_length,
                      {"train": len(splits.train), "validation": len(splits.validation),
                       "test": len(splits.test)},
                      [post.post_id for post in splits.test]),
        runs=tuple(SeedRun(r.seed, r.kept_epoch, r.epochs_trained,
                           None if r.validation is None else round(r.validation, 4),
                           _f1(s.test), _f1(s.test_at_half)) for r, s in runs),
        test_spread=spread([s.test.get(objective) for _, s in runs]),
        test_spread_at_half=at_half,
        exported=Exported(
            seed=run.seed,
            chosen_by="first seed (--refit)" if options.refit else "validation score",
            test=_f1(scored.test),
            test_interval_95={k: (v.low, v.high) for k, v in intervals.items()},
            test_at_half=_f1(scored.test_at_half),
            per_symptom={name: SymptomScore(s.precision, s.recall, s.f1, s.support, t)
                         for (name, s), t in zip(per_label.items(), scored.thresholds,
                                                 strict=True)},
            thresholds=dict(zip(names, scored.thresholds, strict=True)),
        ),
        baseline=_f1(metrics.all_positive_baseline(gold_test, names)),
        # From the rounded figures the report shows, so that they subtract exactly.
        optimism=round(round(found.value, 4) - at_half.mean, 4),
    )


def render(report: FinalReport) -> str:
    """The report as the terminal shows it."""
    objective, exported, spread_ = report.objective, report.exported, report.test_spread
    runs = len(report.runs)
    trained = ("refit on training + validation" if report.refit
               else "trained on the training split")
    lines = [
        f"final model of study '{report.study}', trial {report.trial} "
        f"({report.model_name}, {precision_name(report.precision)}): {runs} "
        f"seed{'s' if runs != 1 else ''}, {trained}; test split {report.data.posts['test']} "
        f"posts; thresholds {report.thresholds}",
        f"search's validation {objective}: {report.search_validation:.4f}; test {objective} "
        f"over seeds: mean {spread_.mean:.4f}, std {spread_.std:.4f}, "
        f"min {spread_.min:.4f}, max {spread_.max:.4f}",
        f"how optimistic the search was: {report.optimism:+.4f} (its validation "
        f"{objective} minus the mean test {objective} at threshold 0.5, the threshold the "
        f"search scored with: {report.test_spread_at_half.mean:.4f})",
        f"exported model: seed {exported.seed}, chosen by {exported.chosen_by}",
    ]
    for name in ("macro_f1", "micro_f1"):
        low, high = exported.test_interval_95[name]
        lines.append(f"  test {name} {exported.test.get(name):.4f} [{low:.4f}, {high:.4f}] "
                     f"(95% bootstrap over posts); {exported.test_at_half.get(name):.4f} at "
                     f"threshold 0.5; trivial baseline {report.baseline.get(name):.4f}")
    rows = [["symptom", "precision", "recall", "F1", "support", "threshold"]]
    for name, s in exported.per_symptom.items():
        rows.append([name, f"{s.precision:.3f}", f"{s.recall:.3f}", f"{s.f1:.3f}",
                     str(s.support), f"{s.threshold:.2f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip() for row in rows]
    return "\n".join(lines)
