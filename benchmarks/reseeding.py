"""Whether hpo's per-trial seeding (`hpo.search.study.PerTrialSeeded`: a TPE sampler made for
each trial from the study's seed and the trial's number) searches worse than one TPE sampler
seeded once, as the expert's glue builds it. Both run Optuna's TPE (10 random start-up trials)
on a 7-dimensional bowl, half its dimensions log-scaled, for `--trials` trials, once per seed;
the table gives the mean best value and its standard error.

    python benchmarks/reseeding.py --seeds 600 --trials 30    # about 2 minutes per sampler
"""

from __future__ import annotations

import argparse
import math
import statistics
import warnings

import optuna

from hpo.search.study import PerTrialSeeded, trial_seed

STARTUP = 10


def objective(trial: optuna.Trial) -> float:
    xs = [trial.suggest_float(f"x{i}", 1e-4, 1.0, log=i % 2 == 0) for i in range(7)]
    return -sum((math.log10(x) + 2) ** 2 if i % 2 == 0 else 4 * (x - 0.3) ** 2
                for i, x in enumerate(xs))


def sampler(kind: str, seed: int) -> optuna.samplers.BaseSampler:
    if kind == "once":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=STARTUP)
    return PerTrialSeeded(lambda n: optuna.samplers.TPESampler(seed=trial_seed(seed, n),
                                                               n_startup_trials=STARTUP))


def best(kind: str, seed: int, trials: int) -> float:
    study = optuna.create_study(direction="maximize", sampler=sampler(kind, seed))
    study.optimize(objective, n_trials=trials)
    return study.best_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=600)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--kind", choices=("once", "per-trial", "both"), default="both")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    kinds = ("once", "per-trial") if args.kind == "both" else (args.kind,)
    print("| sampler | seeds | trials | mean best | standard error | median best |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in kinds:
        values = [best(kind, seed, args.trials) for seed in range(args.seeds)]
        error = statistics.stdev(values) / math.sqrt(len(values))
        print(f"| {kind} | {args.seeds} | {args.trials} | {statistics.mean(values):.3f} | "
              f"{error:.3f} | {statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
