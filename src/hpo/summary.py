"""What a study holds, for `hpo status`, `hpo best` and `hpo studies`: plain data that the CLI
prints as a table, YAML or JSON."""

from __future__ import annotations

import datetime
from typing import Any

import optuna
from optuna.trial import TrialState

from hpo.artifacts import kept
from hpo.budget import count

# What a final training run needs besides the sampled parameters.
RUNTIME_ATTRS = (
    "physical_batch_size", "grad_accum_steps", "effective_batch_size", "eval_batch_size",
    "device",
)


def best(study: optuna.Study) -> dict[str, Any] | None:
    try:
        trial = study.best_trial
    except ValueError:
        return None
    attrs = trial.user_attrs
    return {
        "study": study.study_name,
        "trial": trial.number,
        "value": trial.value,
        "objective": study.user_attrs.get("objective", "macro_f1"),
        "params": dict(trial.params),
        "runtime": {
            "fp_precision": trial.params.get("fp_precision"),
            **{name: attrs[name] for name in RUNTIME_ATTRS if name in attrs},
        },
        "training": attrs.get("training", {}),
        "scores": {k: attrs[k] for k in ("macro_f1", "micro_f1", "f1_per_symptom") if k in attrs},
        "kept_model": kept(study).get(trial.number),
    }


def status(study: optuna.Study, now: datetime.datetime | None = None) -> dict[str, Any]:
    now = now or datetime.datetime.now()
    counts = count(study)
    running = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        started = trial.datetime_start or now
        running.append({
            "trial": trial.number,
            "worker": trial.user_attrs.get("worker", "?"),
            "age_seconds": round((now - started).total_seconds()),
            "params": dict(trial.params),
        })
    return {
        "study": study.study_name,
        "counts": {"COMPLETE": counts.complete, "PRUNED": counts.pruned,
                   "RUNNING": counts.running, "WAITING": counts.waiting, "FAIL": counts.failed},
        "best": best(study),
        "running": running,
        "compute": compute(study),
    }


def trial_seconds(trial: optuna.trial.FrozenTrial) -> float:
    """The device time a finished trial took: its recorded `trial_seconds` (one device per
    worker), else the time between its start and its end (a trial whose worker died)."""
    recorded = trial.user_attrs.get("trial_seconds")
    if recorded is not None:
        return float(recorded)
    if trial.datetime_start and trial.datetime_complete:
        return (trial.datetime_complete - trial.datetime_start).total_seconds()
    return 0.0


def compute(study: optuna.Study) -> dict[str, Any]:
    """Device-seconds spent by finished trials, per model and precision, and the share of
    them spent on trials that were pruned or failed: what the search's results cost."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    totals = {"COMPLETE": 0.0, "PRUNED": 0.0, "FAIL": 0.0}
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    for trial in study.get_trials(deepcopy=False, states=states):
        seconds = trial_seconds(trial)
        key = (str(trial.params.get("model_name", "?")),
               str(trial.params.get("fp_precision", "?")))
        row = rows.setdefault(key, {"model_name": key[0], "fp_precision": key[1],
                                    "trials": 0, "device_seconds": 0.0,
                                    "pruned_seconds": 0.0, "failed_seconds": 0.0})
        row["trials"] += 1
        row["device_seconds"] += seconds
        if trial.state == TrialState.PRUNED:
            row["pruned_seconds"] += seconds
        elif trial.state == TrialState.FAIL:
            row["failed_seconds"] += seconds
        totals[trial.state.name] += seconds
    total = sum(totals.values())
    for row in rows.values():
        for name in ("device_seconds", "pruned_seconds", "failed_seconds"):
            row[name] = round(row[name], 1)
    return {
        "device_seconds": round(total, 1),
        "pruned_share": round(totals["PRUNED"] / total, 4) if total else 0.0,
        "failed_share": round(totals["FAIL"] / total, 4) if total else 0.0,
        "by_model_precision": sorted(rows.values(), key=lambda r: -r["device_seconds"]),
    }


def studies(storage: optuna.storages.BaseStorage) -> list[dict[str, Any]]:
    rows = []
    for frozen in optuna.get_all_study_summaries(storage, include_best_trial=True):
        best_value = frozen.best_trial.value if frozen.best_trial else None
        rows.append({
            "study": frozen.study_name,
            "direction": frozen.direction.name,
            "trials": frozen.n_trials,
            "best_value": best_value,
            "started": frozen.datetime_start.isoformat(" ", "seconds")
            if frozen.datetime_start else None,
        })
    return rows
