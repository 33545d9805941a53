"""The peers hpo is measured against: Optuna and transformers' Trainer glued as users write it.

    python benchmarks/peer_trainer.py --glue novice --storage sqlite:///p.db --seed 0 --n-trials 20
    python benchmarks/peer_trainer.py --glue expert --storage sqlite:///e.db --seed 0 --n-trials 20

Both read a study file (`--study demo`) only for what a user would copy from it: the data and
its split (the same training and validation posts as hpo's), the parameters and ranges
(`model_name`, `target_effective_batch_size`, `learning_rate`, `weight_decay`), the epochs,
warm-up, gradient clipping, training seed, the balanced positive weights of the loss, and the
study's TPE startup trials and median pruner. A trial's value is the same objective on the
same validation posts (macro-F1 at 0.5, hpo's `metrics.f1_scores`), taken after each epoch.

- **novice**: `Trainer.hyperparameter_search(backend="optuna")` with the Trainer's defaults
  for what hpo decides itself: the per-device batch is the sampled batch (no accumulation, no
  search for the largest batch that fits), fp32, dynamic padding of each batch in random
  order, an evaluation batch of 8, and the pruner judging at the Trainer's global step (which
  differs between batch sizes at the same epoch).
- **expert**: what a seasoned user sets on top, in an Optuna objective of their own: the
  fastest native autocast precision (bf16 where the device runs it natively, else fp16 where
  it does, else fp32; the precision `hpo hardware` measures fastest), length-grouped batches
  (`train_sampling_strategy="group_by_length"`), an evaluation batch of 64, and the pruner
  asked at each epoch's end with the epoch as its step; the trial's value is its best
  epoch's score, as hpo's.

Each model has its own tokenizer, so each trial trains on that model's tokenized posts. The
run continues an existing study of the same name in `--storage` (Optuna's `load_if_exists`),
so a second call extends a search to a longer wall-clock budget.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
import torch
import transformers
from search_quality import MEDIAN_STARTUP, MEDIAN_WARMUP
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from hpo.config import StudyConfig
from hpo.data.redsm5 import label_names, read_redsm5
from hpo.data.splits import split_posts
from hpo.data.tasks import build_examples
from hpo.hardware import detect, native_precisions
from hpo.study_files import load, study_path
from hpo.training import metrics
from hpo.training.models import resolve
from hpo.training.train import balanced_pos_weight

EXPERT_EVAL_BATCH = 64


def tokenized(tokenizer, examples, max_length: int) -> list[dict]:
    rows = tokenizer([e.text for e in examples], truncation=True, max_length=max_length)
    return [{**{key: values[i] for key, values in rows.items()}, "labels": list(e.labels)}
            for i, e in enumerate(examples)]


@dataclass
class Setup:
    """What any glue of Optuna and the Trainer needs for the study: the data tokenized per
    model, the loss, the metric and the study's settings."""

    config: StudyConfig
    names: tuple[str, ...]
    per_model: dict[str, tuple[Any, list[dict], list[dict]]]  # tokenizer, train, validation
    pos_weight: torch.Tensor

    def model(self, name: str) -> torch.nn.Module:
        return AutoModelForSequenceClassification.from_pretrained(
            resolve(name), num_labels=len(self.names),
            problem_type="multi_label_classification", ignore_mismatched_sizes=True)

    def loss(self, outputs, labels, num_items_in_batch=None) -> torch.Tensor:
        return torch.nn.functional.binary_cross_entropy_with_logits(
            outputs.logits, labels.float(), pos_weight=self.pos_weight)

    def compute_metrics(self, prediction) -> dict[str, float]:
        predicted = torch.sigmoid(torch.as_tensor(prediction.predictions)) > 0.5
        gold = torch.as_tensor(prediction.label_ids) > 0.5
        return {"macro_f1": metrics.f1_scores(predicted, gold, self.names).macro_f1}

    def arguments(self, output: str, **changes: Any) -> TrainingArguments:
        """The study's training settings, as a user copies them into the Trainer."""
        training = self.config.training
        settings = dict(
            output_dir=output, num_train_epochs=training.epochs,
            warmup_steps=training.warmup_ratio, max_grad_norm=training.max_grad_norm,
            weight_decay=training.weight_decay, eval_strategy="epoch", save_strategy="no",
            logging_strategy="no", report_to="none", disable_tqdm=True, seed=training.seed)
        return TrainingArguments(**{**settings, **changes})

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """The Trainer's settings a trial samples from the study's space: its batch (the
        per-device batch, no accumulation), learning rate and weight decay."""
        space = self.config.search_space
        params: dict[str, Any] = {
            "per_device_train_batch_size": trial.suggest_categorical(
                "target_effective_batch_size", space.target_effective_batch_size),
            "learning_rate": trial.suggest_float(
                "learning_rate", space.learning_rate.low, space.learning_rate.high,
                log=space.learning_rate.log),
        }
        if space.weight_decay is not None:
            params["weight_decay"] = trial.suggest_float(
                "weight_decay", space.weight_decay.low, space.weight_decay.high)
        return params

    def sampler(self, seed: int) -> optuna.samplers.TPESampler:
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=self.config.study.sampler.n_startup_trials)

    def pruner(self) -> optuna.pruners.MedianPruner:
        return optuna.pruners.MedianPruner(n_startup_trials=MEDIAN_STARTUP,
                                           n_warmup_steps=MEDIAN_WARMUP)



def quiet_libraries() -> None:
    transformers.logging.set_verbosity_error()
    logging.getLogger("optuna").setLevel(logging.WARNING)


def setup(study: str) -> Setup:
    config = load(study_path(study))
    data = config.data
    posts = read_redsm5(data.dir, special_case=data.special_case)
    splits = split_posts(posts, validation=data.validation_fraction, test=data.test_fraction,
                         seed=data.split_seed)
    train_examples = build_examples(splits.train, data.task, special_case=data.special_case)
    validation_examples = build_examples(splits.validation, data.task,
                                         special_case=data.special_case)
    per_model = {}
    for name in config.search_space.model_name:
        tokenizer = AutoTokenizer.from_pretrained(resolve(name))
        per_model[name] = (tokenizer, tokenized(tokenizer, train_examples, data.max_length),
                           tokenized(tokenizer, validation_examples, data.max_length))
    return Setup(config, label_names(data.special_case), per_model,
                 balanced_pos_weight(torch.tensor([e.labels for e in train_examples])))


def expert_switches() -> dict[str, Any]:
    """What a seasoned user sets: the fastest native autocast precision, length-grouped
    batches and a large evaluation batch."""
    device = detect("auto")
    native = native_precisions(device)
    precision = "bf16" if "bf16" in native else "fp16" if "fp16" in native else "none"
    return {"bf16": precision == "bf16", "fp16": precision == "fp16",
            "use_cpu": device.type == "cpu",
            "train_sampling_strategy": "group_by_length",
            "per_device_eval_batch_size": EXPERT_EVAL_BATCH}


def novice(peer: Setup, args: argparse.Namespace) -> None:
    space = peer.config.search_space

    def hp_space(trial: optuna.Trial) -> dict:
        trial.suggest_categorical("model_name", space.model_name)
        return peer.suggest(trial)

    def model_init(trial: optuna.Trial | None):
        # The Trainer builds the model before it calls hp_space: the model is sampled here
        # (Optuna returns the same value when hp_space asks again).
        name = (trial.suggest_categorical("model_name", space.model_name) if trial is not None
                else space.model_name[0])
        tokenizer, train_rows, validation_rows = peer.per_model[name]
        if trial is not None:
            trainer.train_dataset, trainer.eval_dataset = train_rows, validation_rows
            trainer.data_collator = DataCollatorWithPadding(tokenizer)
        return peer.model(name)

    first_tokenizer, first_train, first_validation = peer.per_model[space.model_name[0]]
    with tempfile.TemporaryDirectory() as output:
        trainer = Trainer(
            model_init=model_init, args=peer.arguments(output), train_dataset=first_train,
            eval_dataset=first_validation, data_collator=DataCollatorWithPadding(first_tokenizer),
            compute_metrics=peer.compute_metrics, compute_loss_func=peer.loss,
        )
        best = trainer.hyperparameter_search(
            hp_space=hp_space, compute_objective=lambda scores: scores["eval_macro_f1"],
            direction="maximize", backend="optuna", n_trials=args.n_trials,
            timeout=args.timeout, storage=args.storage, study_name=args.study_name,
            load_if_exists=True, sampler=peer.sampler(args.seed), pruner=peer.pruner(),
        )
    print(f"best trial {best.run_id}: {best.objective:.4f} {best.hyperparameters}")


class EpochPruning(TrainerCallback):
    """Reports each epoch's score to the trial with the epoch as its step, and stops a trial
    the pruner prunes; the score of every epoch is kept for the trial's value."""

    def __init__(self, trial: optuna.Trial, epochs: int) -> None:
        self.trial, self.epochs, self.scores = trial, epochs, []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs) -> None:
        epoch = round(state.epoch)
        self.scores.append(metrics["eval_macro_f1"])
        self.trial.report(self.scores[-1], epoch)
        if epoch < self.epochs and self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at epoch {epoch}")


def expert(peer: Setup, args: argparse.Namespace) -> None:
    space = peer.config.search_space
    switches = expert_switches()

    def objective(trial: optuna.Trial) -> float:
        name = trial.suggest_categorical("model_name", space.model_name)
        changes = peer.suggest(trial)
        tokenizer, train_rows, validation_rows = peer.per_model[name]
        pruning = EpochPruning(trial, peer.config.training.epochs)
        with tempfile.TemporaryDirectory() as output:
            Trainer(
                model=peer.model(name), args=peer.arguments(output, **switches, **changes),
                train_dataset=train_rows, eval_dataset=validation_rows,
                data_collator=DataCollatorWithPadding(tokenizer),
                compute_metrics=peer.compute_metrics, compute_loss_func=peer.loss,
                callbacks=[pruning],
            ).train()
        return max(pruning.scores)

    study = optuna.create_study(
        study_name=args.study_name, storage=args.storage, direction="maximize",
        load_if_exists=True, sampler=peer.sampler(args.seed), pruner=peer.pruner())
    study.optimize(objective, n_trials=args.n_trials, timeout=args.timeout)
    print(f"best trial {study.best_trial.number}: {study.best_value:.4f} "
          f"{study.best_params}")


GLUES: dict[str, Callable[[Setup, argparse.Namespace], None]] = {
    "novice": novice, "expert": expert}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--glue", choices=sorted(GLUES), default="novice")
    parser.add_argument("--study", default="demo")
    parser.add_argument("--storage", required=True)
    parser.add_argument("--study-name", default="peer")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--n-trials", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args()
    quiet_libraries()
    GLUES[args.glue](setup(args.study), args)


if __name__ == "__main__":
    main()
