"""Scores on a post x symptom grid: macro-F1 (the objective), micro-F1 and F1 per symptom.

Both tasks are scored on the same grid: for `nli_pairs` the yes/no answers of a post's pairs
are its row, so the two tasks' numbers are comparable.
"""

from __future__ import annotations

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
