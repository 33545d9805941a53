"""Full fine-tuning against LoRA and DoRA at the same settings on the demo study: training
samples per second, peak host memory of the worker, trainable parameters and the score.

    python benchmarks/adapters.py [--model sentence-transformers/all-MiniLM-L6-v2]
        [--precision bf16] [--batch 16] [--learning-rate 5e-4] [--repeats 1]

Each method runs as one `hpo run --study demo` trial in a fresh process and storage, its
parameters enqueued (`study.enqueue`), with the check skipped so the process holds only the
trial; the process's resident memory is sampled from outside every 0.2 s (its peak is the
figure), and the trial's own attributes give the rest.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

import optuna
import torch
import transformers
from demo_study import cpu_model, run_sampled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for method in ("none", "lora", "dora"):
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                storage = f"sqlite:///{tmp}/adapters.db"
                point = (f"{{model_name: {args.model}, fp_precision: {args.precision}, "
                         f"target_effective_batch_size: {args.batch}, "
                         f"learning_rate: {args.learning_rate}, peft: {method}}}")
                samples = run_sampled(
                    ["hpo", "run", "--study", "demo", "--n-trials", "1", "--storage", storage,
                     "--skip-check", "--set", f"search_space.fp_precision=[{args.precision}]",
                     "--set", "search_space.peft=[none, lora, dora]",
                     "--set", f"study.enqueue=[{point}]"],
                    env={**os.environ, "HPO_CACHE_DIR": f"{tmp}/cache"},
                )
                (trial,) = optuna.load_study(study_name="demo", storage=storage).trials
                rows.append((method, trial, max(rss for _, rss in samples)))
    print(f"Result ({cpu_model()}, {os.cpu_count()} cores, {platform.python_version()}; torch "
          f"{torch.__version__}, transformers {transformers.__version__}); "
          f"{Path(args.model).name}, {args.precision}, effective batch {args.batch}, "
          f"lr {args.learning_rate:g}, {rows[0][1].user_attrs['training']['epochs']} epochs:\n")
    print("| peft | trainable parameters | share | physical batch | samples/s | "
          "peak RSS of the worker | train s | macro-F1 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for method, trial, peak in rows:
        attrs = trial.user_attrs
        print(f"| {method} | {attrs['trainable_parameters']:,} | "
              f"{attrs['trainable_share']:.2%} | {attrs['physical_batch_size']} | "
              f"{attrs['samples_per_second']:.1f} | {peak:.0f} MiB | "
              f"{attrs['train_seconds']:.1f} | {trial.value:.4f} |")


if __name__ == "__main__":
    main()
