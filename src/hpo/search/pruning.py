"""Successive halving whose rungs stop trials only on evidence.

The rule. Rung k sits at `min_resource * reduction_factor**k` steps (below the last step). A
trial reaching it goes on while its value ranks in the top 1/reduction_factor of the values
reported there (Optuna's `SuccessiveHalvingPruner`, stopping form). But a rung stops a trial
only once it has evidence that its ranking means something:

- **enough trials**: at least `min_trials` trials (the one deciding included) reported at it;
  Optuna's rule instead stops the second trial to arrive unless it beats the first;
- **agreement with the end**: over the finished trials that reported at the rung, Kendall's
  tau between their value there and their final value is at least `min_agreement`, measured
  on at least `min_pairs` of them. An early epoch that ranks trials unlike the last (a slow
  learning rate that ends best) keeps its rung from stopping anything.

Until both hold a trial passes the rung unchecked, and those trials, run to the end, are the
unselected sample the agreement is measured on; once a rung stops trials, the ones it lets
through are its top, so a rung whose ranking stops agreeing at the end turns itself off again.

Rungs are recorded as Optuna's are (the system attribute `completed_rung_<k>`), so what
reads or clears them (`liveness.RetryFromScratch`) treats both pruners alike.
"""

from __future__ import annotations

import math

import numpy as np
import optuna
from optuna.pruners import BasePruner
from optuna.trial import FrozenTrial, TrialState


def rung_key(rung: int) -> str:
    return f"completed_rung_{rung}"


def kendall_tau(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b of two paired samples: 1 when they rank alike, -1 when reversed, nan
    when either is constant."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    dx = np.sign(a[:, None] - a[None, :])
    dy = np.sign(b[:, None] - b[None, :])
    ties = math.sqrt(float(np.count_nonzero(dx)) * float(np.count_nonzero(dy)))
    return float((dx * dy).sum() / ties) if ties else math.nan


def in_top(value: float, competing: list[float], reduction_factor: int, maximize: bool
           ) -> bool:
    """Whether `value` ranks in the top 1/reduction_factor of `competing` (which holds it);
    with fewer than reduction_factor values, whether it is the best of them (Optuna's)."""
    ranked = sorted(competing, reverse=maximize)
    keep = max(1, len(ranked) // reduction_factor)
    threshold = ranked[keep - 1]
    return value >= threshold if maximize else value <= threshold


def agreement(trials: list[FrozenTrial], rung: int) -> tuple[float, int]:
    """Kendall's tau between the value at `rung` and the final value over the COMPLETE trials
    that reported at it, and how many they are."""
    pairs = [(t.system_attrs[rung_key(rung)], t.value) for t in trials
             if t.state == TrialState.COMPLETE and t.value is not None
             and rung_key(rung) in t.system_attrs]
    if len(pairs) < 2:
        return math.nan, len(pairs)
    at_rung, final = zip(*pairs, strict=True)
    return kendall_tau(list(at_rung), list(final)), len(pairs)


class EvidenceHalvingPruner(BasePruner):
    """Successive halving in stopping form whose rungs stop trials only on evidence (the
    module's rule). `max_resource`: the last step, where no rung sits."""

    def __init__(self, min_resource: int, reduction_factor: int, max_resource: int,
                 min_trials: int = 1, min_agreement: float | None = None,
                 min_pairs: int = 5) -> None:
        if min_resource < 1 or reduction_factor < 2 or min_trials < 1 or min_pairs < 2:
            raise ValueError("min_resource >= 1, reduction_factor >= 2, min_trials >= 1 and "
                             "min_pairs >= 2 are required")
        self.min_resource = min_resource
        self.reduction_factor = reduction_factor
        self.max_resource = max_resource
        self.min_trials = min_trials
        self.min_agreement = min_agreement
        self.min_pairs = min_pairs

    def rung_step(self, rung: int) -> int:
        return self.min_resource * self.reduction_factor**rung

    def trusts(self, trials: list[FrozenTrial], rung: int) -> bool:
        """Whether rung `rung`'s ranking may stop trials: it agrees with the end."""
        if self.min_agreement is None:
            return True
        tau, pairs = agreement(trials, rung)
        return pairs >= self.min_pairs and tau >= self.min_agreement

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        value = trial.intermediate_values[step]
        rung = 0
        while rung_key(rung) in trial.system_attrs:
            rung += 1
        trials: list[FrozenTrial] | None = None
        maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
        while step >= self.rung_step(rung) and self.rung_step(rung) < self.max_resource:
            if math.isnan(value):
                return True
            if trials is None:
                trials = study.get_trials(deepcopy=False)
            study._storage.set_trial_system_attr(  # noqa: SLF001 as Optuna's own pruners
                trial._trial_id, rung_key(rung), value)  # noqa: SLF001
            competing = [t.system_attrs[rung_key(rung)] for t in trials
                         if t.number != trial.number and rung_key(rung) in t.system_attrs]
            competing.append(value)
            # The agreement (quadratic in the finished trials) only for a trial it would stop.
            if (len(competing) >= self.min_trials
                    and not in_top(value, competing, self.reduction_factor, maximize)
                    and self.trusts(trials, rung)):
                return True
            rung += 1
        return False
