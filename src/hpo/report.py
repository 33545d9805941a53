"""What a worker shows: a live progress line per trial on a terminal, one summary line per
finished trial, the best trial at the end. Logs (no terminal) get plain lines per epoch."""

from __future__ import annotations

import sys

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from hpo.hardware import precision_name
from hpo.outcome import Outcome
from hpo.space import Params
from hpo.train import Plan
from hpo.train import Progress as TrainProgress


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


class ConsoleReporter:
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

    def epoch(self, number: int | str, epoch: int, epochs: int, score: float) -> None:
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
        if outcome.state == TrialState.COMPLETE:
            result = f"value {outcome.value:.4f}"
        elif outcome.state == TrialState.PRUNED:
            result = f"pruned ({outcome.prune_reason})"
        else:
            result = f"failed ({outcome.error})"
        batch = ""
        if "physical_batch_size" in attrs:
            batch = f" batch {attrs['physical_batch_size']}x{attrs['grad_accum_steps']}"
        seconds = attrs.get("trial_seconds", 0.0)
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
