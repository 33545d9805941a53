"""The replay's prediction against real runs (issue 63, item 4): does the difference the
replay predicts between an hpo setting and a peer, in trials mode, lie inside the paired 95%
interval of the same difference measured by real runs of `search_quality.py`?

    python benchmarks/confirm.py --real benchmarks/results/search_quality.json \
        --replay benchmarks/results/replay_demo_trials_20x1_budget.json \
        --variant pause-tr --peer expert

The difference is in the final model's validation macro-F1: a tool's best COMPLETE trial once
its budget is spent. A peer's budget is its first `n_trials` trials; hpo's run is read at the
wall its `--n-trials` took (`trial_budget_wall`; a budget of trainings may start more
trials). Real runs pair by seed on one machine; the replay's worlds pair by world. The
interval is Student's t over the seeds (few seeds, one number each).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import stored
from scipy import stats
from search_quality import best_by, first_n


def final_real(run: dict, n_trials: int) -> float:
    if run["tool"] == "hpo":
        return best_by(run["trials"], run["trial_budget_wall"]) or 0.0
    return best_by(first_n(run["trials"], n_trials), math.inf) or 0.0


def real_differences(results: dict, label: str, peer: str) -> dict[int, float]:
    """Per seed where both ran on one machine: hpo's `label` run's final best minus the
    peer's."""
    runs = results["runs"]
    n = results["n_trials"]
    ours = {(r["seed"], r["machine"]): r for r in runs
            if r["tool"] == "hpo" and r["label"] == label}
    theirs = {(r["seed"], r["machine"]): r for r in runs
              if r["tool"] == peer and r["label"] == "default"}
    return {seed: final_real(ours[seed, machine], n) - final_real(theirs[seed, machine], n)
            for seed, machine in sorted(ours) if (seed, machine) in theirs}


def final_replayed(steps: list[list[float]]) -> float:
    return max((value for _, value in steps), default=0.0)


def predicted(replay: dict, policy: str, peer: str) -> float:
    """The replay's mean difference of the final best over its worlds."""
    return statistics.fmean(final_replayed(world[policy]["steps"])
                            - final_replayed(world[peer]["steps"])
                            for world in replay["repetitions_data"])


def interval(differences: list[float], level: float = 0.95) -> tuple[float, float]:
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return -math.inf, math.inf
    half = stats.t.ppf(0.5 + level / 2, len(differences) - 1) * statistics.stdev(
        differences) / math.sqrt(len(differences))
    return mean - half, mean + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", type=Path, required=True)
    parser.add_argument("--replay", type=Path, required=True)
    parser.add_argument("--variant", required=True, help="hpo's label in both files")
    parser.add_argument("--peer", default="expert")
    parser.add_argument("--replay-policy", default=None,
                        help="hpo's name in --replay when it differs from --variant (a "
                             "replay run at hpo's default names it `hpo`)")
    args = parser.parse_args()
    real = real_differences(stored.read(args.real), args.variant, args.peer)
    if not real:
        raise SystemExit(f"no seed has both hpo's {args.variant} and the {args.peer} on one "
                         f"machine in {args.real}")
    guess = predicted(stored.read(args.replay), args.replay_policy or args.variant,
                      args.peer)
    low, high = interval(list(real.values()))
    print(f"{args.variant} - {args.peer}, final validation macro-F1, per seed: "
          + ", ".join(f"{seed}: {d:+.4f}" for seed, d in real.items()))
    print(f"real: mean {statistics.fmean(real.values()):+.4f}, 95% interval {low:+.4f} to "
          f"{high:+.4f} ({len(real)} seeds); replay predicts {guess:+.4f}: "
          + ("inside" if low <= guess <= high else "OUTSIDE"))


if __name__ == "__main__":
    main()
