"""The peer hpo is measured against: Optuna driven by transformers' own
`Trainer.hyperparameter_search(backend="optuna")`, written as a user would glue them.

    python benchmarks/peer_trainer.py --storage sqlite:///peer.db --seed 0 --n-trials 20
    python benchmarks/peer_trainer.py --storage sqlite:///peer.db --seed 0 --timeout 300

It reads a study file (`--study demo`) only for what a user would copy from it: the data and
its split (the same training and validation posts as hpo's), the parameters and ranges
(`model_name`, `target_effective_batch_size`, `learning_rate`, `weight_decay`), the epochs,
warm-up, gradient clipping, training seed, the balanced positive weights of the loss, and the
study's TPE startup trials and median pruner. A trial's value is the same objective on the
same validation posts (macro-F1 at 0.5, hpo's `metrics.f1_scores`), taken after each epoch.

What hpo decides for itself is left to the Trainer's defaults: the per-device batch is the
sampled batch (no gradient accumulation, no search for the largest batch that fits), fp32
(hpo's `fp_precision: auto` is hpo's own choice of the device's native precisions), dynamic
padding of each batch in dataset order (`DataCollatorWithPadding`), the Trainer's evaluation
batch of 8, and the pruner judging at the Trainer's global step. Each model has its own
tokenizer, so `model_init` also points the Trainer at that model's tokenized posts.

The run continues an existing study of the same name in `--storage` (Optuna's
`load_if_exists`), so a second call extends a search to a longer wall-clock budget.
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import optuna
import torch
import transformers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

from hpo import metrics
from hpo.config import load, study_path
from hpo.data.redsm5 import label_names, read_redsm5
from hpo.data.splits import split_posts
from hpo.data.tasks import build_examples
from hpo.models import resolve
from hpo.train import balanced_pos_weight


def tokenized(tokenizer, examples, max_length: int) -> list[dict]:
    rows = tokenizer([e.text for e in examples], truncation=True, max_length=max_length)
    return [{**{key: values[i] for key, values in rows.items()}, "labels": list(e.labels)}
            for i, e in enumerate(examples)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--study", default="demo")
    parser.add_argument("--storage", required=True)
    parser.add_argument("--study-name", default="peer")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--n-trials", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    logging.getLogger("optuna").setLevel(logging.WARNING)

    config = load(study_path(args.study))
    data, space, training = config.data, config.search_space, config.training
    posts = read_redsm5(data.dir, special_case=data.special_case)
    splits = split_posts(posts, validation=data.validation_fraction, test=data.test_fraction,
                         seed=data.split_seed)
    train_examples = build_examples(splits.train, data.task, special_case=data.special_case)
    validation_examples = build_examples(splits.validation, data.task,
                                         special_case=data.special_case)
    names = label_names(data.special_case)
    pos_weight = balanced_pos_weight(torch.tensor([e.labels for e in train_examples]))

    per_model = {}
    for name in space.model_name:
        tokenizer = AutoTokenizer.from_pretrained(resolve(name))
        per_model[name] = (tokenizer, tokenized(tokenizer, train_examples, data.max_length),
                           tokenized(tokenizer, validation_examples, data.max_length))

    def hp_space(trial: optuna.Trial) -> dict:
        trial.suggest_categorical("model_name", space.model_name)
        params = {
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

    def model_init(trial: optuna.Trial | None):
        # The Trainer builds the model before it calls hp_space: the model is sampled here
        # (Optuna returns the same value when hp_space asks again).
        name = (trial.suggest_categorical("model_name", space.model_name) if trial is not None
                else space.model_name[0])
        tokenizer, train_rows, validation_rows = per_model[name]
        if trial is not None:
            trainer.train_dataset, trainer.eval_dataset = train_rows, validation_rows
            trainer.data_collator = DataCollatorWithPadding(tokenizer)
        return AutoModelForSequenceClassification.from_pretrained(
            resolve(name), num_labels=len(names), problem_type="multi_label_classification",
            ignore_mismatched_sizes=True)

    def loss(outputs, labels, num_items_in_batch=None):
        return torch.nn.functional.binary_cross_entropy_with_logits(
            outputs.logits, labels.float(), pos_weight=pos_weight)

    def compute_metrics(prediction) -> dict[str, float]:
        predicted = torch.sigmoid(torch.as_tensor(prediction.predictions)) > 0.5
        gold = torch.as_tensor(prediction.label_ids) > 0.5
        return {"macro_f1": metrics.f1_scores(predicted, gold, names).macro_f1}

    first_tokenizer, first_train, first_validation = per_model[space.model_name[0]]
    with tempfile.TemporaryDirectory() as output:
        arguments = TrainingArguments(
            output_dir=output, num_train_epochs=training.epochs,
            warmup_steps=training.warmup_ratio, max_grad_norm=training.max_grad_norm,
            weight_decay=training.weight_decay, eval_strategy="epoch", save_strategy="no",
            logging_strategy="no", report_to="none", disable_tqdm=True, seed=training.seed,
        )
        trainer = Trainer(
            model_init=model_init, args=arguments, train_dataset=first_train,
            eval_dataset=first_validation, data_collator=DataCollatorWithPadding(first_tokenizer),
            compute_metrics=compute_metrics, compute_loss_func=loss,
        )
        pruner = config.study.pruner
        best = trainer.hyperparameter_search(
            hp_space=hp_space, compute_objective=lambda scores: scores["eval_macro_f1"],
            direction="maximize", backend="optuna", n_trials=args.n_trials,
            timeout=args.timeout, storage=args.storage, study_name=args.study_name,
            load_if_exists=True,
            sampler=optuna.samplers.TPESampler(
                seed=args.seed, n_startup_trials=config.study.sampler.n_startup_trials),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=pruner.n_startup_trials,
                                               n_warmup_steps=pruner.n_warmup_steps),
        )
    print(f"best trial {best.run_id}: {best.objective:.4f} {best.hyperparameters}")


if __name__ == "__main__":
    main()
