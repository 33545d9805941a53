"""What a worker shows: what it joined and loaded, a live progress line per trial on a
terminal, one summary line per finished trial, the best trial and where the results are at the
end. Logs (no terminal) get plain lines per epoch. The worker's lines are built here, its
decisions in `worker`."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from hpo.app.preflight import Prepared
from hpo.config import StudyConfig
from hpo.data.splits import Splits
from hpo.hardware import precision_name, precision_names
from hpo.outcome import Outcome
from hpo.search import artifacts
from hpo.search.storage import redact
from hpo.space import Params, PinnedSpace
from hpo.training.train import Plan
from hpo.training.train import Progress as TrainProgress

BASELINE = "every symptom predicted for every post"
# With fewer validation posts a symptom has a handful of positives, and one post more or less
# right moves its F1 by tens of points: trials would be ranked by noise.
MIN_VALIDATION_POSTS = 50


def describe_params(params: dict) -> str:
    """Parameters as a user reads them: short floats, the precision as `precision=fp32` rather
    than the parameter's `fp_precision=none`."""
    parts = []
    for name, value in params.items():
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        if name == "fp_precision":
            name, shown = "precision", precision_name(str(value))
        parts.append(f"{name}={shown}")
    return " ".join(parts)


class ConsoleDisplay:
    """What a worker and `hpo final` show on the terminal: each trial's start, a progress bar
    over its steps, its epochs and its end, messages and warnings."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def trial_started(self, number: int, params: Params, plan: Plan, probes: int) -> None:
        searched = (f"batch search {probes} probe{'s' if probes != 1 else ''}" if probes
                    else "batch from cache")
        peft = params.extras.get("peft", "none")
        adapter = "" if peft == "none" else f" peft={peft}"
        self.console.print(
            f"trial {number} start: model={params.model_name} "
            f"precision={precision_name(params.fp_precision)}"
            f"{adapter} lr={params.learning_rate:.3g} effective {plan.effective_batch} = "
            f"{plan.physical_batch} x {plan.grad_accum_steps} accumulation "
            f"(eval batch {plan.eval_batch}, {searched})"
        )
        self._start_progress(f"trial {number}", plan)

    def run_started(self, label: str, plan: Plan) -> None:
        """A training run outside a trial (hpo final's seeds), called `label` in its lines."""
        self._start_progress(label, plan)

    def _start_progress(self, label: str, plan: Plan) -> None:
        if self.live:
            self._progress = Progress(
                TextColumn("  {task.fields[label]} epoch {task.fields[epoch]}"),
                BarColumn(),
                TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
                TextColumn("{task.fields[speed]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=1, label=label, epoch=f"1/{plan.epochs}", speed=""
            )

    def step(self, number: int | str, progress: TrainProgress, epochs: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                completed=progress.step,
                total=progress.steps_per_epoch,
                epoch=f"{progress.epoch}/{epochs}",
                speed=f"{progress.samples_per_second:.0f} samples/s",
            )

    def epoch(self, number: int | str, epoch: float, epochs: int, score: float) -> None:
        """`number`: a trial's, or the label of a run outside a trial."""
        label = f"trial {number}" if isinstance(number, int) else number
        self.console.print(f"  {label} epoch {epoch}/{epochs}: score {score:.4f}")

    def run_finished(self) -> None:
        """A training run outside a trial (hpo final) ended: its progress bar goes."""
        self._stop_progress()

    def _stop_progress(self) -> None:
        # Stopping clears the bar and shows the cursor again: nothing is drawn after it.
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def interrupted(self, text: str) -> None:
        self._stop_progress()
        # An isolated trial's child draws its own bar and may be killed before it can.
        self.console.show_cursor(True)
        self.console.print(text)

    def trial_finished(self, trial: FrozenTrial, outcome: Outcome) -> None:
        self._stop_progress()
        if outcome.dropped:
            self.warning(outcome.dropped)
            return
        attrs = trial.user_attrs
        if outcome.paused_at is not None:
            result = (f"paused at step {outcome.paused_at} (it resumes "
                      f"if later trials rank below it)")
        elif outcome.state == TrialState.COMPLETE:
            result = f"value {outcome.value:.4f}"
        elif outcome.state == TrialState.PRUNED:
            result = f"pruned ({outcome.prune_reason})"
        else:
            result = f"failed ({outcome.error})"
        batch = ""
        if "physical_batch_size" in attrs:
            batch = f" batch {attrs['physical_batch_size']}x{attrs['grad_accum_steps']}"
        seconds = attrs.get("trial_seconds", 0.0)
        if outcome.paused_at is not None:  # not ended, so no `trial_seconds`: its epochs'
            seconds = sum(attrs.get("epoch_seconds", ()))
        kept = (f" (the run of trial {outcome.kept_from}, reaped while it ran)"
                if outcome.kept_from is not None else "")
        self.console.print(
            f"trial {trial.number} {result}  {describe_params(trial.params)}{batch} "
            f"{seconds:.1f}s{kept}"
        )

    def message(self, text: str) -> None:
        self.console.print(text)

    def warning(self, text: str) -> None:
        self._stop_progress()
        print(f"hpo: warning: {text}", file=sys.stderr, flush=True)

    def best(self, study: optuna.Study) -> None:
        try:
            best = study.best_trial
        except ValueError:
            self.console.print("no completed trial yet")
            return
        attrs = best.user_attrs
        self.console.print(
            f"best trial {best.number}: value {best.value:.4f}  {describe_params(best.params)} "
            f"batch {attrs.get('physical_batch_size')}x{attrs.get('grad_accum_steps')}"
        )


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def study_lines(site: Prepared, pinned: PinnedSpace, finished: int, n_trials: float
                ) -> list[str]:
    """What a worker says first: the study, its budget and device; then data and precisions."""
    config, splits = site.config, site.splits
    goal = ("no trial budget" if math.isinf(n_trials)
            else f"{finished}/{n_trials:g} trials finished"
            if config.study.budget == "trials"
            else f"{finished} trials finished, a budget of {n_trials:g} full trainings")
    data = config.data
    return [
        f"study '{config.study.name}' on {redact(site.url)}: {goal}; device "
        f"{site.device.describe()}",
        f"  data: {len(splits.train)} training / {len(splits.validation)} validation posts "
        f"(task {data.task}, up to {data.max_length} tokens); precisions: "
        f"{pinned.describe_precisions()}",
    ]


def heartbeat_note(config: StudyConfig, interval: int | None, grace: int | None) -> str | None:
    """Said when the study's heartbeat settings, fixed when it was created, are not the ones
    this worker's study file asks for."""
    own = (config.study.heartbeat_interval, config.study.grace_period)
    if own == (interval, grace):
        return None
    return (f"  heartbeat every {interval} s, grace period {grace} s: the study's, fixed when "
            f"it was created (this worker asked for {own[0]} s and {own[1]} s)")


def kept_models_line(config: StudyConfig, keeper: artifacts.Keeper | None) -> str | None:
    """Where the best trials' models go, or why none does; None where none was asked for."""
    if not config.study.keep_best:
        return None
    if config.data.cv_folds:
        return (f"  no trial's model is kept: a cross-validated trial trains "
                f"{config.data.cv_folds} models (data.cv_folds), none of them the trial's; "
                f"hpo final trains the chosen configuration again")
    if keeper is None:
        return ("  no trial's model is kept: a server storage has no artifact store unless "
                "study.artifacts (or HPO_ARTIFACTS) names one, a directory every worker "
                "shares or s3://BUCKET")
    whose = ("the best trial's model" if keeper.best == 1
             else f"the best {keeper.best} trials' models")
    return f"  models kept: {whose}, in {keeper.where}"


def preloaded_line(sources: dict[str, str], seconds: float) -> str:
    return (f"  loaded {plural(len(sources), 'model')} in {seconds:.1f} s; tokens from: "
            f"{'; '.join(f'{Path(m).name} {s}' for m, s in sources.items())}")


def small_data_warning(splits: Splits) -> str | None:
    n = len(splits.validation)
    if n >= MIN_VALIDATION_POSTS:
        return None
    return (f"the validation split has only {n} posts: its scores rank trials mostly by noise "
            f"(aim for {MIN_VALIDATION_POSTS} or more: more posts, or a larger "
            f"data.validation_fraction)")


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


def baseline_line(objective: str, baseline: float) -> str:
    return f"trivial baseline ({BASELINE}): {objective} {baseline:.4f} on the validation split"


def below_baseline_warning(study: optuna.Study, objective: str, baseline: float) -> str | None:
    try:
        best = study.best_trial
    except ValueError:
        return None
    if best.value is None or best.value >= baseline:
        return None
    return (f"the best trial ({objective} {best.value:.4f}) is below the trivial baseline "
            f"({baseline:.4f}, {BASELINE}): no model has learned the task yet; try more "
            f"epochs, more trials or another learning-rate range")


@dataclass(frozen=True)
class Spent:
    """What the study's `--n-trials` bought: its trials' steps came to `trainings` full
    trainings; `counted`: the budget counts those (`study.budget: trainings`)."""

    n_trials: float
    trainings: float
    counted: bool

    def words(self, finished: int) -> str:
        worth = f"{self.trainings:.1f} full trainings' worth of epochs"
        if math.isinf(self.n_trials):
            return f"the study has {finished} finished: {worth}"
        if self.counted:
            return (f"the study has {finished} finished: {self.trainings:.1f} of "
                    f"{self.n_trials:g} full trainings' worth of epochs (study.budget: "
                    f"trainings)")
        said = f"the study has {finished} of {self.n_trials:g} finished: {worth}"
        if self.trainings >= finished - 0.05:
            return said
        # A plain Optuna loop of N unpruned trials trains N full trainings: say that these
        # N trained less, so that nobody compares N trials with N trials unawares.
        return f"{said}; study.budget: trainings makes --n-trials count full trainings"


def closing_lines(study: optuna.Study, url: str, counts: tuple[int, int], spent: Spent,
                  keeper: artifacts.Keeper | None, next_command: str) -> list[str]:
    """Where the results are and what to run next, after the best trial: `counts` are the
    trials this worker ran and the study's finished trials, `spent` what its budget bought."""
    ran, finished = counts
    where = f"the study is in {redact(url)}"
    if keeper is not None and artifacts.kept(study):
        where += f"; the best trials' models in {keeper.where}"
    return [
        f"this worker ran {plural(ran, 'trial')}; {spent.words(finished)}",
        where,
        f"next: hpo final {next_command}  (train the best trial again, score it on the "
        f"test split, export a model)",
    ]
