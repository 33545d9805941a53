"""The demo study end to end: wall time, best score against the trivial baseline, per-trial
overhead (1 - train_seconds / trial_seconds) and the worker's resident memory over trials.

    python benchmarks/demo_study.py [--n-trials 20]

Runs `hpo run --study demo` from the repository root in a fresh SQLite storage, with an empty
tokenization cache (as on a machine's first run), and prints a markdown report for
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import torch
import transformers

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-trials", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        storage = f"sqlite:///{tmp}/demo.db"
        started = time.perf_counter()
        subprocess.run(
            ["hpo", "run", "--study", "demo", "--n-trials", str(args.n_trials),
             "--storage", storage],
            cwd=REPO, check=True, stdout=subprocess.DEVNULL,
            env={**os.environ, "HPO_CACHE_DIR": f"{tmp}/cache"},
        )
        wall = time.perf_counter() - started
        study = optuna.load_study(study_name="demo", storage=storage)
        trials = sorted(study.trials, key=lambda t: t.number)
        baseline = study.user_attrs["baseline"]["macro_f1"]

    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, optuna {optuna.__version__}; "
          f"{time.strftime('%Y-%m-%d')}\n")
    print(f"- wall time of `hpo run --study demo --n-trials {args.n_trials}` "
          f"(process start to exit): **{wall:.0f} s**")
    print(f"- best macro-F1 **{study.best_value:.4f}** (trial {study.best_trial.number}); "
          f"trivial baseline (every symptom for every post) {baseline:.4f}")
    total_trial = sum(t.user_attrs.get("trial_seconds", 0.0) for t in trials)
    total_train = sum(t.user_attrs.get("train_seconds", 0.0) for t in trials)
    print(f"- per-trial overhead 1 - train_seconds / trial_seconds over all trials: "
          f"**{1 - total_train / total_trial:.1%}**")
    rss = [t.user_attrs["worker_rss_mb"] for t in trials]
    print(f"- worker resident memory after trial 0: {rss[0]:.0f} MiB, after the last: "
          f"{rss[-1]:.0f} MiB, highest: {max(rss):.0f} MiB\n")
    print("| trial | model | fp | eff. batch | phys x accum | lr | state | macro-F1 | "
          "trial s | train s | tokens from | samples/s | padding eff. | RSS MiB |")
    print("|" + "|".join(" --- " if i in (1, 2, 6, 10) else " ---: " for i in range(14)) + "|")
    for t in trials:
        a, p = t.user_attrs, t.params
        value = f"{t.value:.4f}" if t.value is not None else a.get("prune_reason", "")
        print(f"| {t.number} | {Path(p['model_name']).name} | {p['fp_precision']} | "
              f"{p['target_effective_batch_size']} | {a.get('physical_batch_size')} x "
              f"{a.get('grad_accum_steps')} | {p['learning_rate']:.2e} | {t.state.name} | "
              f"{value} | {a.get('trial_seconds', 0):.1f} | {a.get('train_seconds', 0):.1f} | "
              f"{a.get('tokenization', '')} | "
              f"{a.get('samples_per_second', 0):.0f} | {a.get('padding_efficiency', 0):.3f} | "
              f"{a.get('worker_rss_mb', 0):.0f} |")


if __name__ == "__main__":
    sys.exit(main())
