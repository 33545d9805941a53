"""Scores on a post x symptom grid: macro-F1 (the objective), micro-F1 and F1 per symptom.

Both tasks are scored on the same grid: for `nli_pairs` the yes/no answers of a post's pairs
are its row, so the two tasks' numbers are comparable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Scores:
    macro_f1: float
    micro_f1: float
    per_label: dict[str, float]

    def get(self, objective: str) -> float:
        return {"macro_f1": self.macro_f1, "micro_f1": self.micro_f1}[objective]


def chosen_epoch(values: list[float], rule: str) -> int:
    """The index of the epoch whose score is the trial's value under `study.objective_epoch`:
    the last one, or the best one (the earliest of equal bests)."""
    if rule == "last":
        return len(values) - 1
    return max(range(len(values)), key=values.__getitem__)


def f1_scores(predicted: torch.Tensor, gold: torch.Tensor, names: tuple[str, ...]) -> Scores:
    """F1 per column of two boolean grids; a label with no positives predicted or present
    scores 0, as scikit-learn's zero_division=0 does."""
    predicted, gold = predicted.bool(), gold.bool()
    tp = (predicted & gold).sum(0).double()
    fp = (predicted & ~gold).sum(0).double()
    fn = (~predicted & gold).sum(0).double()
    per_label = _f1(tp, fp, fn)
    micro = _f1(tp.sum(), fp.sum(), fn.sum())
    return Scores(
        macro_f1=float(per_label.mean()),
        micro_f1=float(micro),
        per_label={name: round(float(v), 4) for name, v in zip(names, per_label, strict=True)},
    )


def _f1(tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    denominator = 2 * tp + fp + fn
    return torch.where(denominator > 0, 2 * tp / denominator.clamp(min=1), torch.zeros_like(tp))


def as_grid(values: torch.Tensor, num_label_names: int) -> torch.Tensor:
    """A post x label grid from model outputs: multilabel rows already are one; nli_pairs
    outputs come one pair per row, a post's pairs consecutive in label order."""
    if values.shape[1] == num_label_names:
        return values
    return values.reshape(-1, num_label_names)


def all_positive_baseline(gold: torch.Tensor, names: tuple[str, ...]) -> Scores:
    """The trivial baseline for macro-F1: every post has every symptom (predicting none
    scores 0 on every label)."""
    return f1_scores(torch.ones_like(gold, dtype=torch.bool), gold, names)


@dataclass(frozen=True)
class LabelScores:
    precision: float
    recall: float
    f1: float
    support: int  # posts with the label


def per_label_scores(predicted: torch.Tensor, gold: torch.Tensor,
                     names: tuple[str, ...]) -> dict[str, LabelScores]:
    """Precision, recall and F1 per column; 0 where undefined (zero_division=0)."""
    predicted, gold = predicted.bool(), gold.bool()
    tp = (predicted & gold).sum(0).double()
    fp = (predicted & ~gold).sum(0).double()
    fn = (~predicted & gold).sum(0).double()
    precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(tp + fn > 0, tp / (tp + fn).clamp(min=1), torch.zeros_like(tp))
    f1 = _f1(tp, fp, fn)
    return {
        name: LabelScores(round(float(p), 4), round(float(r), 4), round(float(f), 4),
                          int(s))
        for name, p, r, f, s in zip(names, precision, recall, f1, gold.sum(0), strict=True)
    }


THRESHOLD_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))


def tune_thresholds(probabilities: torch.Tensor, gold: torch.Tensor,
                    grid: tuple[float, ...] = THRESHOLD_GRID) -> tuple[float, ...]:
    """Per column, the threshold of `grid` whose predictions score the highest F1 against
    `gold`; of equal ones the nearest to 0.5, so a label the split says nothing about (no
    positives: F1 0 at every threshold) keeps 0.5."""
    gold = gold.bool()
    candidates = torch.tensor(grid, dtype=probabilities.dtype)
    predicted = probabilities.unsqueeze(0) > candidates.view(-1, 1, 1)  # grid x posts x labels
    tp = (predicted & gold).sum(1).double()
    fp = (predicted & ~gold).sum(1).double()
    fn = (~predicted & gold).sum(1).double()
    f1 = _f1(tp, fp, fn)  # grid x labels
    tied = f1 >= f1.max(0).values - 1e-12
    closeness = -(candidates.double() - 0.5).abs().view(-1, 1).expand_as(f1)
    best = torch.where(tied, closeness, torch.full_like(closeness, -math.inf)).argmax(0)
    return tuple(grid[int(i)] for i in best)


def apply_thresholds(probabilities: torch.Tensor, thresholds: tuple[float, ...]) -> torch.Tensor:
    return probabilities > torch.tensor(thresholds, dtype=probabilities.dtype)


@dataclass(frozen=True)
class Interval:
    low: float
    high: float


def bootstrap_intervals(predicted: torch.Tensor, gold: torch.Tensor, *, resamples: int = 2000,
                        confidence: float = 0.95, seed: int = 0) -> dict[str, Interval]:
    """Percentile bootstrap intervals of macro- and micro-F1 over posts (rows): each resample
    draws as many posts as there are, with replacement."""
    predicted, gold = predicted.bool(), gold.bool()
    n = gold.shape[0]
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, n, (resamples, n), generator=generator)
    # How often each post was drawn in each resample: the counts weight the post's tp/fp/fn.
    weights = torch.zeros((resamples, n), dtype=torch.float64)
    weights.scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    tp = weights @ (predicted & gold).double()
    fp = weights @ (predicted & ~gold).double()
    fn = weights @ (~predicted & gold).double()
    macro = _f1(tp, fp, fn).mean(1)
    micro = _f1(tp.sum(1), fp.sum(1), fn.sum(1))
    tail = (1 - confidence) / 2
    quantiles = torch.tensor([tail, 1 - tail], dtype=torch.float64)
    return {name: Interval(*(round(float(v), 4) for v in torch.quantile(values, quantiles)))
            for name, values in (("macro_f1", macro), ("micro_f1", micro))}
