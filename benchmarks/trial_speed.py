"""One demo trial at fixed parameters: hpo against the expert's Trainer (issue 27 item 3).

    python benchmarks/trial_speed.py [--repeats 3] [--batch 8] [--learning-rate 4e-4]

Each repeat runs one trial of each tool at the same parameters (model, effective batch,
learning rate, weight decay; the precision each picks itself: hpo's `fp_precision: auto`
check, the expert's fastest native precision), each in a fresh process and a fresh SQLite
study where that trial is enqueued, the tools' order alternating between repeats. A trial's
seconds run from its start to its end as the study records them (`datetime_start` to
`datetime_complete`), the same clock for both; hpo's parts come from its trial's attributes.
Prints a markdown table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import optuna
import torch
import transformers
from demo_study import cpu_model

REPO = Path(__file__).resolve().parents[1]
MODEL = "sentence-transformers/all-MiniLM-L6-v2"

# hpo's parts of a trial, by the attribute each records.
PARTS = (("train + eval", "train_seconds"), ("eval", "eval_seconds"),
         ("batch search", "batch_search_seconds"), ("model", "model_seconds"),
         ("keep", "keep_seconds"))


def seconds(trial: optuna.trial.FrozenTrial) -> float:
    return (trial.datetime_complete - trial.datetime_start).total_seconds()


def enqueued(storage: str, name: str, params: dict, create: list[str] | None) -> None:
    if create:
        subprocess.run(create, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize",
                                load_if_exists=True)
    study.enqueue_trial(params)


def run_hpo(folder: Path, params: dict) -> optuna.trial.FrozenTrial:
    storage = f"sqlite:///{folder / 'hpo.db'}"
    hpo = [sys.executable, "-m", "hpo.cli", "--study", "demo", "--storage", storage]
    enqueued(storage, "demo", params, [*hpo[:3], "create", *hpo[3:]])
    subprocess.run([*hpo[:3], "run", *hpo[3:], "--n-trials", "1"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    return optuna.load_study(study_name="demo", storage=storage).trials[0]


def run_expert(folder: Path, params: dict) -> optuna.trial.FrozenTrial:
    storage = f"sqlite:///{folder / 'expert.db'}"
    enqueued(storage, "peer", params, None)
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "peer_trainer.py"),
                    "--glue", "expert", "--storage", storage, "--n-trials", "1"],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return optuna.load_study(study_name="peer", storage=storage).trials[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=4e-4)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    args = parser.parse_args()
    params = {"model_name": args.model, "target_effective_batch_size": args.batch,
              "learning_rate": args.learning_rate, "weight_decay": args.weight_decay}
    rows = []
    for repeat in range(args.repeats):
        order = [("expert", run_expert), ("hpo", run_hpo)]
        if repeat % 2:
            order.reverse()
        with tempfile.TemporaryDirectory() as folder:
            ran = {tool: run(Path(folder), params) for tool, run in order}
        hpo = ran["hpo"]
        rows.append((repeat + 1, seconds(ran["expert"]), seconds(hpo),
                     hpo.params.get("fp_precision"),
                     [hpo.user_attrs.get(key, 0.0) for _, key in PARTS]))
        print(f"repeat {repeat + 1}: expert {rows[-1][1]:.1f} s, hpo {rows[-1][2]:.1f} s",
              file=sys.stderr)
    print(f"{cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, optuna {optuna.__version__}; {args.model}, effective "
          f"batch {args.batch}, lr {args.learning_rate}, weight decay {args.weight_decay}\n")
    print("| repeat | expert's Trainer | hpo | hpo's precision | "
          + " | ".join(f"hpo: {name}" for name, _ in PARTS) + " |")
    print("| --- | ---: | ---: | --- |" + " ---: |" * len(PARTS))
    for repeat, expert, hpo, precision, parts in rows:
        print(f"| {repeat} | {expert:.1f} s | {hpo:.1f} s | {precision} | "
              + " | ".join(f"{p:.1f} s" for p in parts) + " |")
    expert_median = statistics.median(r[1] for r in rows)
    hpo_median = statistics.median(r[2] for r in rows)
    verdict = "met" if hpo_median <= expert_median else "NOT met"
    print(f"\nmedian: expert {expert_median:.1f} s, hpo {hpo_median:.1f} s "
          f"({hpo_median / expert_median:.2f}x): goal hpo no slower **{verdict}**")


if __name__ == "__main__":
    main()
