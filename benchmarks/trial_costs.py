"""What a base-model trial costs outside its training steps, and what share of a ReDSM5-sized
trial on an H200 that is (issue 62 item 1).

    python benchmarks/trial_costs.py [--repeats 3] [--keep-all] [--storage URL]
        [--set KEY=VALUE ...]

Runs `hpo run` (alone on this machine, a fresh SQLite storage unless `--storage`) on full-size
replicas of the redsm5 study's four models (benchmarks/gpu/replicas.py: the hub's config.json
and tokenizer formats, random weights), each enqueued `--repeats` times in a row, fp32, 5
epochs of a few ReDSM5-format posts: the steps are few, so the run is quick, while everything
around them is a base model's, as on a GPU. The study keeps its best model (`keep_best: 1`, the
default): a trial that becomes the best pays for writing it; `--keep-all` keeps every trial's,
the worst case.

A trial's **fixed seconds** are its `trial_seconds` less its `train_seconds` (the steps and the
evaluations), plus the **gap** before it: the seconds from the worker's previous trial's end
(or, for the first, nothing) to its start, as the storage records them (the tell, reaping,
the budget, the claim, sampling). The recorded parts (`model_seconds`, `keep_seconds`,
`tokenization_seconds`, `batch_search_seconds`) split them; the rest is storage writes,
records and the pruner. These are host-side seconds, which a GPU pays alike, except moving
the model to the device (nothing here; about 0.05 s for 440 MB at H2D rates) and what the
model build costs there.

The projection of a ReDSM5-sized trial on the H200 (a documented model, not a measurement):
1,500 posts split 70/15/15, 5 epochs at an effective batch of 32 (1,050 training posts: 32
steps an epoch, 160 in all) and 225 validation posts scored after each epoch. A training
sample costs the H200's bf16 step of 32 x 512 tokens for bert-base (0.039 s, the study's
check, benchmarks/README.md "On a GPU" (g)) divided by 32, scaled for the other models by
the ratio of bert-base's in-trial samples/s to theirs in the H200 study (run 2); a validation
sample a third of a training one (a forward pass of the three). So

    gpu_trial = fixed + 160 x 32 x per_sample + 5 x 225 x per_sample / 3

and the fixed share is fixed / gpu_trial. Prints a markdown report for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import torch
import transformers
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

import replicas  # noqa: E402
from demo_study import cpu_model  # noqa: E402

# Seconds per training sample on the H200 in bf16 (see the module's docstring): bert-base's
# check step of 32 x 512 tokens, 0.039 s, over 32; the others by the H200 study's in-trial
# samples/s against bert-base's (bf16 374.55; roberta 353.9 and electra 355.89 bf16;
# deberta-v3 at 16 x 1 in fp16 165.03 against bert-base's fp16 361.39-374.19, 0.44x).
BERT_PER_SAMPLE = 0.039 / 32
GPU_PER_SAMPLE = {
    "bert-base-uncased": BERT_PER_SAMPLE,
    "roberta-base": BERT_PER_SAMPLE * 374.55 / 353.9,
    "electra-base-discriminator": BERT_PER_SAMPLE * 374.55 / 355.89,
    "deberta-v3-base": BERT_PER_SAMPLE / 0.44,
}
REDSM5 = {"posts": 1500, "train": 1050, "validation": 225, "epochs": 5, "batch": 32}
# The demo's posts a run trains on: 60, split 70/15/15 as the study says (one step of 32 an
# epoch: the steps are not what is measured).
POSTS = 60


def subset(out: Path, posts: int) -> Path:
    """The first `posts` of the demo's posts and their annotations, in ReDSM5's format."""
    demo = REPO / "data" / "demo"
    out.mkdir(parents=True)
    with (demo / "redsm5_posts.csv").open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))[:posts]
    kept = {row["post_id"] for row in rows}
    for name, keep in (("redsm5_posts.csv", rows), ("redsm5_annotations.csv", None)):
        with (demo / name).open(encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            fields = reader.fieldnames
            chosen = keep if keep is not None else [r for r in reader if r["post_id"] in kept]
        with (out / name).open("w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            writer.writerows(chosen)
    return out


def study_file(path: Path, data: Path, models: dict[str, Path], repeats: int,
               keep_all: bool) -> Path:
    # Rates a hair apart: the study runs each enqueued set once (skip_if_exists).
    enqueued = [{"model_name": str(directory), "fp_precision": "none",
                 "target_effective_batch_size": 32, "learning_rate": 3e-5 * (1 + k / 100)}
                for directory in models.values() for k in range(repeats)]
    path.write_text(yaml.safe_dump({
        "study": {"name": "costs", "sampler": {"name": "random", "seed": 0},
                  "pruner": {"name": "none"}, "keep_best": len(enqueued) if keep_all else 1,
                  "enqueue": enqueued},
        "data": {"dir": str(data), "task": "multilabel", "validation_fraction": 0.15,
                 "test_fraction": 0.15, "split_seed": 13, "max_length": 64},
        "search_space": {"model_name": [str(d) for d in models.values()],
                         "fp_precision": ["none"], "target_effective_batch_size": [32],
                         "learning_rate": {"low": 2e-5, "high": 1e-4, "log": True}},
        "training": {"epochs": REDSM5["epochs"], "max_physical_batch_size": 32},
    }))
    return path


def gaps(trials: list[optuna.trial.FrozenTrial]) -> dict[int, float]:
    """Per trial, the seconds from the previous trial's end to its start (one worker)."""
    ordered = sorted(trials, key=lambda t: t.datetime_start)
    found = {ordered[0].number: 0.0}
    for before, trial in zip(ordered, ordered[1:], strict=False):
        found[trial.number] = (trial.datetime_start - before.datetime_complete).total_seconds()
    return found


PARTS = (("model build", "model_seconds"), ("keep", "keep_seconds"),
         ("tokenization", "tokenization_seconds"), ("batch search", "batch_search_seconds"))


def row(trial: optuna.trial.FrozenTrial, name: str, gap: float, repeat: int) -> dict:
    a = trial.user_attrs
    outside = a["trial_seconds"] - a["train_seconds"]
    parts = {label: a.get(key, 0.0) for label, key in PARTS}
    fixed = outside + gap
    per_sample = GPU_PER_SAMPLE[name]
    compute = (REDSM5["train"] // REDSM5["batch"] * REDSM5["batch"] * REDSM5["epochs"]
               * per_sample + REDSM5["epochs"] * REDSM5["validation"] * per_sample / 3)
    return {"trial": trial.number, "model": name, "repeat": repeat, "gap": gap, **parts,
            "rest": outside - sum(parts.values()), "fixed": fixed,
            "train": a["train_seconds"], "gpu_trial": fixed + compute,
            "share": fixed / (fixed + compute)}


def report(rows: list[dict], wall: float, storage: str) -> str:
    lines = [f"Machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, "
             f"transformers {transformers.__version__}, optuna {optuna.__version__}; "
             f"{time.strftime('%Y-%m-%d')}; storage {storage.split(':', 1)[0]}; "
             f"wall {wall:.0f} s\n",
             "| trial | model | run of it | gap | model build | keep | tokenization | "
             "batch search | rest | **fixed** | steps + evaluations here | projected H200 "
             "trial | fixed share |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['trial']} | {r['model']} | {r['repeat']} | {r['gap']:.2f} | "
            f"{r['model build']:.2f} | {r['keep']:.2f} | {r['tokenization']:.2f} | "
            f"{r['batch search']:.2f} | {r['rest']:.2f} | **{r['fixed']:.2f}** | "
            f"{r['train']:.1f} | {r['gpu_trial']:.1f} | {r['share']:.1%} |")
    later = [r for r in rows if r["repeat"] > 1] or rows
    median_fixed = statistics.median(r["fixed"] for r in later)
    median_share = statistics.median(r["share"] for r in later)
    lines.append(f"\n- median fixed seconds of a base-model trial after the first of its "
                 f"model (the batch cached, the model loaded): **{median_fixed:.2f} s** "
                 f"(goal at most 1.0 s: **{'met' if median_fixed <= 1.0 else 'NOT met'}**); "
                 f"share of a projected ReDSM5-sized H200 trial **{median_share:.1%}** (goal "
                 f"at most 5%: **{'met' if median_share <= 0.05 else 'NOT met'}**)")
    first = [r for r in rows if r["repeat"] == 1]
    lines.append(f"- first trial of each model: median fixed "
                 f"{statistics.median(r['fixed'] for r in first):.2f} s, share "
                 f"{statistics.median(r['share'] for r in first):.1%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep-all", action="store_true")
    parser.add_argument("--storage", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = {name: replicas.build(name, work / "models" / name)
                  for name in replicas.FAMILIES}
        config = study_file(work / "costs.yaml", subset(work / "data", POSTS), models,
                            args.repeats, args.keep_all)
        storage = args.storage or f"sqlite:///{work}/costs.db"
        n = len(models) * args.repeats
        began = time.perf_counter()
        subprocess.run(
            ["hpo", "run", "--config", str(config), "--storage", storage, "--n-trials",
             str(n), "--skip-check", *(p for o in args.overrides for p in ("--set", o))],
            cwd=work, check=True, stdout=subprocess.DEVNULL,
            env={**os.environ, "HPO_CACHE_DIR": f"{work}/cache",
                 "HPO_ARTIFACTS": f"{work}/artifacts"})
        wall = time.perf_counter() - began
        study = optuna.load_study(study_name="costs", storage=storage)
        trials = sorted(study.trials, key=lambda t: t.number)
        names = {str(directory): name for name, directory in models.items()}
        gap = gaps(trials)
        seen: dict[str, int] = {}
        rows = []
        for trial in trials:
            name = names[trial.params["model_name"]]
            seen[name] = seen.get(name, 0) + 1
            rows.append(row(trial, name, gap[trial.number], seen[name]))
    print(report(rows, wall, storage))


if __name__ == "__main__":
    main()
