"""The exported model: a directory that transformers' Auto classes and `pipeline` load offline,
with the symptom names as its labels, the decision thresholds in its config, the `hpo final`
report beside it (report.json) and a model card (README.md)."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from transformers import AutoTokenizer

from hpo.config import TrainingConfig
from hpo.errors import ConfigError
from hpo.study_files import local_path
from hpo.training import adapters
from hpo.training.final_results import FinalReport
from hpo.training.models import config_of, resolve

REPORT = "report.json"
CARD = "README.md"


def validate_output(directory: Path) -> None:
    """Fail before any training if the model cannot be written where asked: a directory that
    cannot be created or written, or one that holds something other than an earlier export
    (which `write` replaces). Creates nothing: an interrupted run must leave no directory
    that looks like a model."""
    if directory.exists() and any(directory.iterdir()) and not (directory / REPORT).is_file():
        raise ConfigError(f"--output {directory}: not empty and not an earlier hpo final "
                          f"export; choose another directory")
    existing = next(p for p in directory.absolute().parents if p.exists())
    probe = existing / f".{directory.name}.hpo-write-check"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--output {directory}: cannot write there "
                          f"({exc.strerror or exc})") from None


def write(directory: Path, model: torch.nn.Module, report: FinalReport) -> None:
    """The final model with its report and model card, written beside `directory` and then
    put in its place: an earlier export is replaced whole, never mixed with this one. A
    failure or an interrupt on the way leaves neither the partial copy nor a directory
    created for it."""
    created = [p for p in directory.absolute().parents if not p.exists()]
    partial = directory.with_name(f".{directory.name}.partial")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        save_model(partial, model, report.model_name, task=report.data.task,
                   max_length=report.data.max_length, thresholds=report.exported.thresholds)
        (partial / REPORT).write_text(json.dumps(report.to_json(), indent=2) + "\n")
        model_card(report).save(partial / CARD)
        modes_like(partial, partial / REPORT)
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        for parent in created:  # deepest first
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def modes_like(directory: Path, like: Path) -> None:
    """Every file in `directory` given the mode of `like`, a file written as the umask says:
    safetensors writes its weights 0600, so a model shared on a group's disk could be read
    by its config and tokenizer but not its weights."""
    mode = like.stat().st_mode & 0o777
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(mode)


def save_model(directory: Path, model: torch.nn.Module, model_name: str, *, task: str,
               max_length: int, thresholds: dict[str, float]) -> None:
    """Save the model (float32 weights, safetensors) with the symptom names (`thresholds`'
    keys, in label order) as its labels and its thresholds in its config, and its tokenizer
    cutting at the study's max_length (so a pipeline with truncation=True reads what the
    model was trained on). A model with adapters is saved merged, as a plain transformers
    model; it is consumed."""
    label_names = tuple(thresholds)
    model = adapters.merged(model)
    config = config_of(model)
    if task == "multilabel":
        config.id2label = dict(enumerate(label_names))
        config.label2id = {name: i for i, name in enumerate(label_names)}
    else:
        config.id2label, config.label2id = {0: "CRITERION_MET"}, {"CRITERION_MET": 0}
    config.problem_type = "multi_label_classification"  # a sigmoid per label in a pipeline
    config.decision_thresholds = thresholds
    # A transformers model's method, which torch types as a module attribute: tensor or module.
    model.to(torch.float32).save_pretrained(directory)  # type: ignore[operator]
    tokenizer = AutoTokenizer.from_pretrained(resolve(model_name), model_max_length=max_length)
    tokenizer.save_pretrained(directory)


def _adapters(training: dict[str, Any], precision: str) -> str:
    """The card's phrase for a model trained with adapters ("" for full fine-tuning)."""
    if training.get("peft", "none") == "none":
        return ""
    config = TrainingConfig.model_validate(training)
    targets = ", ".join(config.lora_target_modules or ["every linear layer of the body"])
    return (f"{config.peft.upper()} adapters (peft: r {config.lora_r}, alpha "
            f"{config.adapter_alpha():g}, dropout {config.lora_dropout:g}; on {targets}; body in "
            f"{adapters.body_dtype(config, precision)} during training) merged into the "
            f"weights, the head trained whole; ")


def model_card(report: FinalReport) -> ModelCard:
    """The exported model's README.md: what it is and how to use it, its data and training,
    its test scores and its limits, under the metadata the Hub reads (model-index included)."""
    body = _card_use(report) + _card_training(report) + _card_scores(report)
    # The way huggingface_hub's guide builds a card from a string: ModelCard parses the header
    # back, so a model-index it cannot read fails the export, not a later upload. The keys in
    # the order cards had before model-index (which huggingface_hub always puts last).
    header = _card_data(report).to_yaml(original_order=[
        "library_name", "pipeline_tag", "base_model", "tags", "model_name", "eval_results"])
    return ModelCard(f"---\n{header}\n---\n\n{body}")


def _card_data(report: FinalReport) -> ModelCardData:
    model_name = report.model_name
    return ModelCardData(
        library_name="transformers", pipeline_tag="text-classification",
        # The Hub links base_model to a model page: only a hub id has one.
        base_model=None if local_path(model_name).exists() else model_name,
        tags=["hpo", "multi-label-classification", "redsm5"],
        model_name=f"{report.study} trial {report.trial} seed {report.exported.seed}",
        eval_results=_eval_results(report))


def _eval_results(report: FinalReport) -> list[EvalResult]:
    """The exported model's test F1s for the Hub's model-index: the objective first, each
    followed by the bounds of its 95% interval.

    The model-index schema has no field for an interval: `metric_value` may be a string such
    as "0.52 ± 0.04", but the Hub's leaderboards and widgets read numbers, and `config`,
    `args` and `verified` mean a metric's load/compute settings and the Hub's own evaluation.
    So each bound is an F1 result of its own, told apart by its name."""
    data, exported = report.data, report.exported
    # No `datasets:` and no Hub dataset id: data.dir is a local directory in ReDSM5's format
    # (the demo's posts are synthetic), and only its name says which one was used.
    common: dict[str, Any] = dict(
        task_type="text-classification", task_name=_TASK_NAMES[data.task],
        dataset_type=local_path(data.dir).resolve().name or "local",
        # hpo's own split (by post, data.split_seed), not one load_dataset names: the body
        # says how it was made.
        dataset_name=f"ReDSM5-format posts in {data.dir}", dataset_split="test")
    objectives = sorted(("macro_f1", "micro_f1"), key=lambda name: name != report.objective)
    results: list[EvalResult] = []
    for objective in objectives:
        average = objective.removesuffix("_f1")
        label = f"Test {average}-F1"
        metric = dict(common, metric_type="f1", metric_args={"average": average})
        low, high = exported.test_interval_95[objective]
        results += [
            EvalResult(**metric, metric_value=float(exported.test.get(objective)),
                       metric_name=f"{label} (at config.decision_thresholds)"),
            *(EvalResult(**metric, metric_value=float(value),
                         metric_name=f"{label}, 95% interval {end} (bootstrap over posts)")
              for end, value in (("low", low), ("high", high)))]
    return results


_TASK_NAMES = {
    "multilabel": "Multi-label text classification",
    "nli_pairs": "Multi-label text classification, as (post, criterion) pairs",
}


def _card_use(report: FinalReport) -> str:
    pairs = ("" if report.data.task == "multilabel" else
             "\nInputs are (post, criterion description) pairs, one per symptom, with one "
             "yes/no output (`nli_pairs`): see hpo's `data/tasks.py` for the descriptions.\n")
    return f"""# {report.study}: trial {report.trial}, seed {report.exported.seed}

A multi-label classifier of DSM-5 depression symptoms in posts, found by an hpo search
(study `{report.study}`, trial {report.trial}) and trained again by `hpo final`. Each
label is a symptom; a post has a symptom when its sigmoid probability exceeds the symptom's
threshold in `config.decision_thresholds` ({report.thresholds}).
{pairs}
```python
from transformers import pipeline
classify = pipeline("text-classification", model="PATH", top_k=None, truncation=True)
thresholds = classify.model.config.decision_thresholds  # symptom -> threshold
for scores in classify(["a post", "another post"]):  # per post, every symptom's probability
    print([s["label"] for s in scores if s["score"] > thresholds[s["label"]]])
```

"""


def _card_training(report: FinalReport) -> str:
    data, plan = report.data, report.plan
    posts = data.posts
    settings = "\n".join(f"- `{k}`: {v}" for k, v in report.params.items())
    refit = ("training and validation splits (--refit), for the epochs of the trial's value"
             if report.refit else "training split; the epoch kept is the one the study's "
             "rule picks on the validation split")
    return f"""## Data

`{data.dir}`, task `{data.task}`, split by post with seed {data.split_seed}:
{posts['train']} training, {posts['validation']} validation and {posts['test']} test posts
(the test post ids are in {REPORT}). Texts are cut at {data.max_length} tokens.

## Training

Trained on the {refit}. Settings (the trial's):

{settings}

Precision `{report.precision}` (autocast during training; weights saved in float32),
{_adapters(report.training, report.precision)}effective batch {plan.effective_batch} =
{plan.physical_batch} x {plan.grad_accum_steps} accumulation, {plan.epochs} epoch(s),
on {report.device}.

"""


def _card_scores(report: FinalReport) -> str:
    exported, objective = report.exported, report.objective
    test_posts = report.data.posts["test"]
    spread, at_half = report.test_spread, report.test_spread_at_half.mean
    intervals = exported.test_interval_95
    rows = "\n".join(
        f"| {name} | {s.precision:.3f} | {s.recall:.3f} | {s.f1:.3f} | "
        f"{s.support} | {s.threshold:.2f} |"
        for name, s in exported.per_symptom.items())
    return f"""## Scores on the held-out test split

No trial of the search read the test split. The exported model was chosen among
{len(report.runs)} seed(s) by {exported.chosen_by}.

| | this model | 95% interval (bootstrap over posts) | at threshold 0.5 | trivial baseline |
|---|---|---|---|---|
| macro-F1 | {exported.test.macro_f1:.4f} | {intervals['macro_f1'][0]:.4f} to \
{intervals['macro_f1'][1]:.4f} | {exported.test_at_half.macro_f1:.4f} | \
{report.baseline.macro_f1:.4f} |
| micro-F1 | {exported.test.micro_f1:.4f} | {intervals['micro_f1'][0]:.4f} to \
{intervals['micro_f1'][1]:.4f} | {exported.test_at_half.micro_f1:.4f} | \
{report.baseline.micro_f1:.4f} |

Test {objective} over seeds: mean {spread.mean:.4f}, standard deviation {spread.std:.4f}.
The search's validation {objective} for this trial was {report.search_validation:.4f},
{report.optimism:+.4f} against the mean test {objective} at threshold 0.5 over seeds,
{at_half:.4f} (the threshold the search scored with): how optimistic the search
was.

| symptom | precision | recall | F1 | test posts with it | threshold |
|---|---|---|---|---|---|
{rows}

## Limits

Scores come from {test_posts} test posts; symptoms with few test posts have wide
uncertainty. The model flags language about symptoms in posts; it does not diagnose anyone
and must not be used as a clinical tool.
"""
