"""Does hpo's batch order cost model quality? hpo's training loop on benchmarks/throughput.py's
posts and settings, its epochs sorted by noisy length or blurred length rank (the default)
against the same loop with batches in random order (`--length-noise 1e12 --rank-blur 1e12`:
both sort keys all noise, as the Trainer's default sampler), both dynamically padded, at
training seeds 0 .. repeats-1, each run in a fresh process, the order alternating.

    PYTHONPATH=src python benchmarks/batch_order.py [--repeats 6] [throughput.py's options]

Prints a markdown table per seed, the means, the macro-F1 difference with a 95% bootstrap
over validation posts (runs paired by seed) and the speed-up of the sorted order.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import transformers
from throughput import (
    OURS,
    SEED,
    cpu_model,
    load_bench,
    measure_in_child,
    paired_bootstrap,
    parser_for,
)

from hpo.hardware import detect
from hpo.training.models import quiet_transformers

SHUFFLED = ("--length-noise", "1e12", "--rank-blur", "1e12")


def main() -> None:
    device = detect("cpu")
    args = parser_for(device).parse_args()
    quiet_transformers()
    argv = sys.argv[1:]
    load_start = os.getloadavg()[0]
    runs: dict[str, list] = {"sorted": [], "random": []}
    for repeat in range(args.repeats):
        order = ("sorted", "random") if repeat % 2 == 0 else ("random", "sorted")
        for name in order:
            seed = ["--training-seed", str(SEED + repeat)]
            runs[name].append(measure_in_child(
                [*argv, *seed, *(SHUFFLED if name == "random" else ())], OURS))
    gold = load_bench(args, device).val.labels
    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; {time.strftime('%Y-%m-%d')}; precision "
          f"{args.precision}; load average (1 min) {load_start:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end\n")
    print("| training seed | sorted: macro-F1 | random: macro-F1 | sorted: micro-F1 | "
          "random: micro-F1 | sorted: samples/s | random: samples/s | padding, sorted / random |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    pairs = list(zip(runs["sorted"], runs["random"], strict=True))  # by training seed
    for k, (s, r) in enumerate(pairs):
        print(f"| {SEED + k} | {s.macro_f1:.4f} | {r.macro_f1:.4f} | {s.micro_f1:.4f} | "
              f"{r.micro_f1:.4f} | {s.samples_per_second:.2f} | {r.samples_per_second:.2f} | "
              f"{s.padding_efficiency:.3f} / {r.padding_efficiency:.3f} |")
    mean = {name: {f: statistics.mean(getattr(x, f) for x in rs)
                   for f in ("macro_f1", "micro_f1")} for name, rs in runs.items()}
    low, high = paired_bootstrap([p for x in runs["sorted"] for p in x.probabilities],
                                 [p for x in runs["random"] for p in x.probabilities], gold)
    wins = sum(s.macro_f1 > r.macro_f1 for s, r in pairs)
    speed = statistics.median(s.samples_per_second / r.samples_per_second for s, r in pairs)
    print(f"\n- mean macro-F1 sorted **{mean['sorted']['macro_f1']:.4f}**, random "
          f"**{mean['random']['macro_f1']:.4f}** (micro-F1 {mean['sorted']['micro_f1']:.4f} "
          f"/ {mean['random']['micro_f1']:.4f}); sorted higher on {wins} of {args.repeats} "
          f"seeds; difference {mean['sorted']['macro_f1'] - mean['random']['macro_f1']:+.4f}, "
          f"95% paired bootstrap over validation posts {low:+.4f} .. {high:+.4f}")
    print(f"- samples/s, sorted over random: median **{speed:.2f}x** per seed")


if __name__ == "__main__":
    main()
