"""The yardstick of a search replay: anytime normalized regret over paired worlds, with
bootstrap intervals, as Syne Tune's benchmarking, HPOBench and mf-prior-bench measure search.

A world is one table (or one task of a table) with one draw of its training noise; every
policy searches every world, so the worlds pair the policies. In a world, a policy's
normalized regret at time t is

    r(t) = (best - incumbent(t)) / (best - baseline), clipped to [0, 1]

where `best` is the best value any policy found in that world, `incumbent(t)` the best value
the policy's finished trials told by t (r = 1 before its first), and `baseline` the median
value of a random configuration at full fidelity. A policy's regret area in a world is the
mean of r at log-spaced times from the first finished trial of any policy to the horizon.

Of policy a against policy b, over the paired worlds:
- `auc_ratio`: mean area of a over mean area of b (below 1: a is ahead), with a paired
  bootstrap 95% interval (worlds resampled with replacement);
- `final_regret_diff`: the mean of a's r minus b's r at the horizon, with its interval;
- `g1_strict`: the share of worlds where a's incumbent at the horizon beats b's, a tie
  counting half, with Wilson's interval;
- `g2_median`: the median over worlds of (when a first reached b's final best) over (when b
  did), infinite where a never did: below 1, a got there sooner.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

POINTS = 64  # log-spaced times per world
RESAMPLES = 2000


def incumbent(steps: Sequence[Sequence[float]], moment: float) -> float | None:
    """The best value told by `moment`, from a best-so-far curve [[time, best], ...]."""
    found = None
    for time, best in steps:
        if time > moment:
            break
        found = best
    return found


def regret(value: float | None, best: float, baseline: float) -> float:
    if value is None:
        return 1.0
    span = best - baseline
    if span <= 0:
        return 0.0 if value >= best else 1.0
    return min(max((best - value) / span, 0.0), 1.0)


def times(rep: dict) -> np.ndarray:
    """The log-spaced times of a world's figures: from the first finished trial of any
    policy to its horizon."""
    world = rep["world"]
    firsts = [rep[n]["steps"][0][0] for n in policies(rep) if rep[n]["steps"]]
    horizon = world["horizon"]
    start = min(firsts, default=horizon)
    start = min(max(start, 1e-6), horizon)
    return np.geomspace(start, horizon, POINTS) if horizon > start else np.array([horizon])


def policies(rep: dict) -> list[str]:
    return [n for n in rep if n != "world"]


def curve(rep: dict, name: str, at: np.ndarray) -> np.ndarray:
    world = rep["world"]
    return np.array([regret(incumbent(rep[name]["steps"], t), world["best"],
                            world["baseline"]) for t in at])


def figures(rep: dict, name: str) -> tuple[float, float, float | None]:
    """A policy's regret area and final regret in a world, and its final incumbent."""
    at = times(rep)
    r = curve(rep, name, at)
    return float(r.mean()), float(r[-1]), incumbent(rep[name]["steps"], rep["world"]["horizon"])


def reached(steps: Sequence[Sequence[float]], target: float) -> float:
    return next((time for time, best in steps if best >= target), math.inf)


def compare(reps: list[dict], a: str, b: str, seed: int = 0) -> dict[str, Any]:
    """Policy `a` against policy `b` over paired worlds (the module's doc says what each
    figure is)."""
    areas, finals, points, shares = [], [], [], []
    for rep in reps:
        area_a, final_a, best_a = figures(rep, a)
        area_b, final_b, best_b = figures(rep, b)
        areas.append((area_a, area_b))
        finals.append(final_a - final_b)
        if best_a is None and best_b is None or best_a == best_b:
            points.append(0.5)
        else:
            points.append(1.0 if best_b is None or (best_a is not None and best_a > best_b)
                          else 0.0)
        if best_b is not None:
            theirs = reached(rep[b]["steps"], best_b)
            mine = reached(rep[a]["steps"], best_b)
            mine = mine if mine <= rep["world"]["horizon"] else math.inf
            shares.append(mine / theirs if theirs > 0 else math.inf)
    pairs, diffs = np.array(areas), np.array(finals)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(reps), (RESAMPLES, len(reps)))
    sums = pairs[picks].sum(axis=1)
    ratios = sums[:, 0] / np.maximum(sums[:, 1], 1e-12)
    means = diffs[picks].mean(axis=1)
    wins = sum(points)
    return {
        "worlds": len(reps),
        "area": round(float(pairs[:, 0].mean()), 4),
        "peer_area": round(float(pairs[:, 1].mean()), 4),
        "auc_ratio": round(float(pairs[:, 0].sum() / max(pairs[:, 1].sum(), 1e-12)), 4),
        "auc_ratio_interval": interval(ratios),
        "final_regret_diff": round(float(diffs.mean()), 4),
        "final_regret_diff_interval": interval(means),
        "g1_strict": round(wins / len(reps), 3),
        "ties": round(sum(p == 0.5 for p in points) / len(reps), 3),
        "g1_interval": wilson(wins, len(reps)),
        "g2_median": statistics.median(shares) if shares else None,
        "g2_interval": median_interval(shares),
        "g2_never": sum(math.isinf(s) for s in shares),
    }


def blocks(reps: list[dict], a: str, b: str, size: int) -> list[dict[str, Any]]:
    """`compare` over each run of `size` consecutive worlds, then over them all: whether a
    null check that fails on one set of worlds fails by the draw of those worlds (the other
    blocks and the whole level) or by a difference the whole shows too. Each entry adds
    `first` and `last`, the worlds' indices, and `level`."""
    spans = [(k, min(k + size, len(reps))) for k in range(0, len(reps), size)]
    if len(spans) > 1:
        spans.append((0, len(reps)))
    return [{"first": first, "last": end - 1, **(found := compare(reps[first:end], a, b)),
             "level": level(found)} for first, end in spans]


def interval(samples: np.ndarray) -> list[float]:
    return [round(float(np.percentile(samples, 2.5)), 4),
            round(float(np.percentile(samples, 97.5)), 4)]


def wilson(hits: float, n: int, z: float = 1.959964) -> list[float]:
    """Wilson's 95% interval for a share (`hits` may hold halves: ties)."""
    if n == 0:
        return [0.0, 1.0]
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(centre - half, 0.0), 3), round(min(centre + half, 1.0), 3)]


def median_interval(values: list[float], confidence: float = 0.95) -> list[float] | None:
    """A distribution-free interval for the median of `values` (infinities included): the
    order statistics that binomial(n, 1/2) puts the median between; None where even the
    smallest and largest value hold it with less than `confidence` (5 values or fewer)."""
    import scipy.stats

    ordered, n = sorted(values), len(values)
    if n == 0:
        return None
    low = int(scipy.stats.binom.ppf((1 - confidence) / 2, n, 0.5))
    return None if low < 1 else [ordered[low - 1], ordered[n - low]]


def level(figures: dict[str, Any]) -> bool:
    """A null check passes: both intervals hold "no difference"."""
    low, high = figures["auc_ratio_interval"]
    d_low, d_high = figures["final_regret_diff_interval"]
    return low <= 1.0 <= high and d_low <= 0.0 <= d_high


def over_time(reps: list[dict], names: Sequence[str], points: int = 50,
              seed: int = 0) -> dict[str, Any]:
    """Per policy, normalized regret and average rank (1 best; ties share their ranks) at
    `points` shares of each world's horizon, log-spaced from 1%: the interquartile mean of
    the regret with a bootstrap 95% band, and the mean rank."""
    import scipy.stats

    shares = np.geomspace(0.01, 1.0, points)
    regrets = np.array([[curve(rep, n, shares * rep["world"]["horizon"]) for n in names]
                        for rep in reps])  # worlds x policies x times
    ranks = scipy.stats.rankdata(regrets, axis=1)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"shares": shares.tolist()}
    for k, name in enumerate(names):
        boot = np.array([iqm(regrets[rng.integers(0, len(reps), len(reps)), k])
                         for _ in range(200)])
        out[name] = {"iqm": iqm(regrets[:, k]).tolist(),
                     "low": np.percentile(boot, 2.5, axis=0).tolist(),
                     "high": np.percentile(boot, 97.5, axis=0).tolist(),
                     "rank": ranks[:, k].mean(axis=0).tolist()}
    return out


def iqm(values: Any) -> Any:
    """The interquartile mean over the first axis (rliable's aggregate): the mean of the
    middle half, a quarter cut from each end."""
    ordered = np.sort(values, axis=0)
    cut = int(0.25 * len(ordered))
    return ordered[cut:len(ordered) - cut].mean(axis=0)
