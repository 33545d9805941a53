"""The demo study end to end: wall time, best score against the trivial baseline, per-trial
overhead (1 - train_seconds / trial_seconds) and the worker's resident memory over trials.

    python benchmarks/demo_study.py [--n-trials 20] [--set KEY=VALUE ...]

Runs `hpo run --study demo` from the repository root in a fresh SQLite storage, with an empty
tokenization cache (as on a machine's first run), and prints a markdown report for
benchmarks/README.md. `--set` passes overrides on, e.g. `--set training.isolate_trials=true`
or `--set "search_space.model_name=[data/demo/models/tiny-bert]"`.

Memory is read two ways: `worker_rss_mb`, which the process that ran a trial records after
releasing the trial's memory, and the resident memory of the `hpo run` process itself,
sampled from outside every 0.2 s and read just after each trial ended. With
`training.isolate_trials` the two differ: trials run in child processes, the worker waits.
"""

from __future__ import annotations

import argparse
import bisect
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import psutil
import torch
import transformers

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run_sampled(command: list[str], env: dict[str, str]) -> list[tuple[float, float]]:
    """Run `command`, sampling its resident memory (MiB, the process alone) until it exits."""
    samples = []
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, env=env)
    watched = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            samples.append((time.time(), watched.memory_info().rss / 2**20))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    if process.wait() != 0:
        raise SystemExit(f"{' '.join(command)} exited with {process.returncode}")
    return samples


def after(samples: list[tuple[float, float]], moment: float) -> float:
    """The first sample taken after `moment` (the last one if none is)."""
    index = bisect.bisect_right([t for t, _ in samples], moment)
    return samples[min(index, len(samples) - 1)][1]


# Where a trial's time goes, by the attributes each part records; training steps and
# evaluation make up train_seconds, the rest is the per-trial overhead.
PARTS = (("training steps", None), ("evaluation", "eval_seconds"),
         ("tokenization", "tokenization_seconds"), ("batch search", "batch_search_seconds"),
         ("model build", "model_seconds"), ("keeping a model", "keep_seconds"))


def parts_table(trials: list[optuna.trial.FrozenTrial]) -> str:
    totals = dict.fromkeys([name for name, _ in PARTS] + ["rest (sampling, storage, "
                                                           "bookkeeping)"], 0.0)
    for trial in trials:
        a = trial.user_attrs
        spent = {name: a.get(key, 0.0) for name, key in PARTS if key}
        spent["training steps"] = a.get("train_seconds", 0.0) - a.get("eval_seconds", 0.0)
        for name, seconds in spent.items():
            totals[name] += seconds
        totals["rest (sampling, storage, bookkeeping)"] += a.get("trial_seconds", 0.0) - sum(
            spent.values())
    whole = sum(totals.values())
    rows = ["| part of the trials' time | seconds | share |", "| --- | ---: | ---: |"]
    rows += [f"| {name} | {seconds:.1f} | {seconds / whole:.1%} |"
             for name, seconds in totals.items()]
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-trials", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = [part for item in args.overrides for part in ("--set", item)]
    with tempfile.TemporaryDirectory() as tmp:
        storage = f"sqlite:///{tmp}/demo.db"
        started, started_at = time.perf_counter(), time.time()
        samples = run_sampled(
            ["hpo", "run", "--study", "demo", "--n-trials", str(args.n_trials),
             "--storage", storage, *overrides],
            env={**os.environ, "HPO_CACHE_DIR": f"{tmp}/cache"},
        )
        wall = time.perf_counter() - started
        study = optuna.load_study(study_name="demo", storage=storage)
        trials = sorted(study.trials, key=lambda t: t.number)
        baseline = study.user_attrs["baseline"]["macro_f1"]

    worker = [after(samples, t.datetime_complete.timestamp()) for t in trials]
    recorded = [t.user_attrs["worker_rss_mb"] for t in trials]
    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, optuna {optuna.__version__}; "
          f"{time.strftime('%Y-%m-%d')}\n")
    shown = " ".join(f"`--set {item}`" for item in args.overrides) or "no overrides"
    print(f"- `hpo run --study demo --n-trials {args.n_trials}`, {shown}: wall time "
          f"(process start to exit) **{wall:.0f} s**")
    print(f"- best macro-F1 **{study.best_value:.4f}** (trial {study.best_trial.number}); "
          f"trivial baseline (every symptom for every post) {baseline:.4f}")
    total_trial = sum(t.user_attrs.get("trial_seconds", 0.0) for t in trials)
    total_train = sum(t.user_attrs.get("train_seconds", 0.0) for t in trials)
    complete = [t.user_attrs for t in trials if t.state.name == "COMPLETE"]
    median = statistics.median(1 - a["train_seconds"] / a["trial_seconds"] for a in complete)
    print(f"- per-trial overhead 1 - train_seconds / trial_seconds: median over COMPLETE "
          f"trials **{median:.1%}**, over all trials' time {1 - total_train / total_trial:.1%}")
    probes = [t.user_attrs.get("batch_probes", 0) for t in trials]
    searched = sum(t.user_attrs.get("batch_search_seconds", 0.0) for t in trials)
    print(f"- batch probes: {sum(probes)} over {len(trials)} trials, in "
          f"{sum(p > 0 for p in probes)} searches ({searched:.1f} s); per trial "
          f"{' '.join(map(str, probes))}")
    first = min(t.datetime_start.timestamp() for t in trials)
    print(f"- before the first trial (imports, data, models loaded, the check): "
          f"{first - started_at:.1f} s\n")
    print(parts_table(trials))
    print(f"- `hpo run` process, resident memory after trial 0: {worker[0]:.0f} MiB, after "
          f"the last: {worker[-1]:.0f} MiB (**{worker[-1] - worker[0]:+.0f} MiB**), highest "
          f"sampled: {max(rss for _, rss in samples):.0f} MiB")
    print(f"- `worker_rss_mb` (the process that ran the trial) after trial 0: "
          f"{recorded[0]:.0f} MiB, after the last: {recorded[-1]:.0f} MiB "
          f"(**{recorded[-1] - recorded[0]:+.0f} MiB**), highest: {max(recorded):.0f} MiB\n")
    if len(trials) > 30:
        shown = [*range(0, len(trials) - 1, len(trials) // 10), len(trials) - 1]
        print("| after trial | " + " | ".join(str(trials[i].number) for i in shown) + " |")
        print("|---" * (1 + len(shown)) + "|")
        print("| `hpo run` RSS MiB | " + " | ".join(f"{worker[i]:.0f}" for i in shown) + " |")
        print("| `worker_rss_mb` | " + " | ".join(f"{recorded[i]:.0f}" for i in shown) + " |")
        return
    print("| trial | model | fp | eff. batch | phys x accum | lr | state | macro-F1 | "
          "trial s | train s | samples/s | padding eff. | `hpo run` RSS MiB | "
          "`worker_rss_mb` |")
    print("|" + "|".join(" --- " if i in (1, 2, 6) else " ---: " for i in range(14)) + "|")
    for t, rss in zip(trials, worker, strict=True):
        a, p = t.user_attrs, t.params
        value = f"{t.value:.4f}" if t.value is not None else a.get("prune_reason", "")
        print(f"| {t.number} | {Path(p['model_name']).name} | {p['fp_precision']} | "
              f"{p['target_effective_batch_size']} | {a.get('physical_batch_size')} x "
              f"{a.get('grad_accum_steps')} | {p['learning_rate']:.2e} | {t.state.name} | "
              f"{value} | {a.get('trial_seconds', 0):.1f} | {a.get('train_seconds', 0):.1f} | "
              f"{a.get('samples_per_second', 0):.0f} | {a.get('padding_efficiency', 0):.3f} | "
              f"{rss:.0f} | {a.get('worker_rss_mb', 0):.0f} |")


if __name__ == "__main__":
    sys.exit(main())
