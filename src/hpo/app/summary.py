"""What a study holds, for `hpo status`, `hpo best` and `hpo studies`: plain data, and its
rendering as a table, YAML or JSON."""

from __future__ import annotations

import collections
import datetime
import json
from dataclasses import dataclass
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState

from hpo.outcome import INTERRUPTED
from hpo.search import pausing
from hpo.search.artifacts import kept
from hpo.search.budget import count
from hpo.search.storage import redact

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


def interrupted(trial: optuna.trial.FrozenTrial) -> bool:
    """A trial that Ctrl-C or SIGTERM ended (`executor.free`): FAIL in Optuna's terms, but a
    deliberate stop, not a fault. Told by the user attribute `interrupted` where it is set,
    else by the recorded error, which is all that studies written before the marker have."""
    if trial.state != TrialState.FAIL:
        return False
    attrs = trial.user_attrs
    if "interrupted" in attrs:
        return bool(attrs["interrupted"])
    return str(attrs.get("error", "")).startswith(INTERRUPTED)


def _interrupted(trials: list[optuna.trial.FrozenTrial]) -> list[dict[str, Any]]:
    """The interrupted trials, each with the number of its re-queued copy (None when its
    retries were used up): the retry callback records the failed trial's number last in the
    copy's `retry_history`."""
    copies = {t.system_attrs["retry_history"][-1]: t.number for t in trials
              if t.system_attrs.get("retry_history")}
    return [{"trial": t.number, "error": t.user_attrs.get("error"),
             "requeued_as": copies.get(t.number)} for t in trials if interrupted(t)]


def status(study: optuna.Study, now: datetime.datetime | None = None) -> dict[str, Any]:
    now = now or datetime.datetime.now()
    counts = count(study)
    running = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        started = trial.datetime_start or now
        running.append({
            "trial": trial.number,
            "worker": trial.user_attrs.get("worker", "?"),
            "gpu_share": trial.user_attrs.get("gpu_share"),  # None: a GPU of its own
            "age_seconds": round((now - started).total_seconds()),
            "params": dict(trial.params),
            # study.pruner.pause: the step it is paused at (None: training), and the steps
            # it paused at before (a resumed trial's).
            "paused_at": trial.user_attrs.get(pausing.PAUSED_AT),
            "pauses": trial.user_attrs.get(pausing.PAUSES, []),
            "resumes": trial.user_attrs.get(pausing.RESUMES, []),
        })
    stopped = _interrupted(study.get_trials(deepcopy=False))
    # Optuna's state for a paused trial is RUNNING: counted apart, as interrupted ones are.
    paused = sum(t["paused_at"] is not None for t in running)
    return {
        "study": study.study_name,
        # FAIL counts the failures; an interrupted trial is counted apart, though Optuna's
        # state for it is FAIL too.
        "counts": {"COMPLETE": counts.complete, "PRUNED": counts.pruned,
                   "RUNNING": counts.running - paused, "PAUSED": paused,
                   "WAITING": counts.waiting,
                   "FAIL": counts.failed - len(stopped), "INTERRUPTED": len(stopped)},
        "best": best(study),
        "running": running,
        "interrupted": stopped,
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


def _kind(trial: optuna.trial.FrozenTrial) -> str:
    """Which share of compute a finished trial's seconds go to."""
    if trial.state == TrialState.COMPLETE:
        return "complete"
    if trial.state == TrialState.PRUNED:
        return "pruned"
    return "interrupted" if interrupted(trial) else "failed"


@dataclass
class _Rates:
    """One row's training FLOPs and step seconds, and its MFU weighted by those seconds
    (workers on different GPUs have different peaks)."""

    flops: float = 0.0
    seconds: float = 0.0
    mfu_seconds: float = 0.0
    weighted_mfu: float = 0.0

    def add(self, attrs: dict[str, Any]) -> None:
        flops, rate = attrs.get("train_flops"), attrs.get("flops_per_second")
        if not flops or not rate:
            return
        seconds = flops / rate  # the trial's training-step seconds
        self.flops += flops
        self.seconds += seconds
        if attrs.get("mfu") is not None:
            self.mfu_seconds += seconds
            self.weighted_mfu += attrs["mfu"] * seconds

    def figures(self) -> dict[str, float | None]:
        return {"tflops_per_second": float(f"{self.flops / self.seconds / 1e12:.4g}")
                if self.seconds else None,
                "mfu": round(self.weighted_mfu / self.mfu_seconds, 4)
                if self.mfu_seconds else None}


def compute(study: optuna.Study) -> dict[str, Any]:
    """Device-seconds spent by finished trials, per model and precision, and the share of
    them spent on trials that were pruned, failed or interrupted: what the search's results
    cost."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    rates: dict[tuple[str, str], _Rates] = collections.defaultdict(_Rates)
    totals = {"complete": 0.0, "pruned": 0.0, "failed": 0.0, "interrupted": 0.0}
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    for trial in study.get_trials(deepcopy=False, states=states):
        seconds, kind = trial_seconds(trial), _kind(trial)
        key = (str(trial.params.get("model_name", "?")),
               str(trial.params.get("fp_precision", "?")))
        row = rows.setdefault(key, {"model_name": key[0], "fp_precision": key[1],
                                    "trials": 0, "device_seconds": 0.0,
                                    "pruned_seconds": 0.0, "failed_seconds": 0.0,
                                    "interrupted_seconds": 0.0})
        row["trials"] += 1
        row["device_seconds"] += seconds
        rates[key].add(trial.user_attrs)
        if kind != "complete":
            row[f"{kind}_seconds"] += seconds
        totals[kind] += seconds
    total = sum(totals.values())
    for key, row in rows.items():
        for name in ("device_seconds", "pruned_seconds", "failed_seconds",
                     "interrupted_seconds"):
            row[name] = round(row[name], 1)
        row.update(rates[key].figures())
    return {
        "device_seconds": round(total, 1),
        **{f"{kind}_share": round(totals[kind] / total, 4) if total else 0.0
           for kind in ("pruned", "failed", "interrupted")},
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


def dump(data: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2, default=str)
    return yaml.safe_dump(data, sort_keys=False).rstrip()


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _columns(rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def _counts_line(info: dict[str, Any]) -> str:
    counts = dict(info["counts"])
    stopped = counts.pop("INTERRUPTED", 0)
    # Said only where the study pauses trials (study.pruner.pause) and some are paused.
    if not counts.get("PAUSED"):
        counts.pop("PAUSED", None)
    line = ", ".join(f"{n} {state}" for state, n in counts.items())
    if stopped:
        requeued = sum(t["requeued_as"] is not None for t in info.get("interrupted", ()))
        again = ("re-queued" if requeued == stopped else
                 "not re-queued" if not requeued else f"{requeued} re-queued")
        line += f", {stopped} interrupted ({again})"
    return f"study '{info['study']}': {line}"


def _rate(value: float | None, name: str) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if name == "mfu" else f"{value:.3g}"


def _compute_lines(spent: dict[str, Any]) -> list[str]:
    # The interrupted share and column appear only where a trial was interrupted, so that a
    # study without one reads as it always has.
    stopped = spent.get("interrupted_share", 0.0) > 0
    shares = (f"{100 * spent['pruned_share']:.0f}% on pruned, "
              f"{100 * spent['failed_share']:.0f}% on failed and "
              f"{100 * spent['interrupted_share']:.0f}% on interrupted trials" if stopped else
              f"{100 * spent['pruned_share']:.0f}% on pruned and "
              f"{100 * spent['failed_share']:.0f}% on failed trials")
    names = ["device", "pruned", "failed", *(["interrupted"] if stopped else [])]
    by_row = spent["by_model_precision"]
    # The FLOP/s and MFU columns appear where some trial recorded them.
    rates = [name for name in ("tflops_per_second", "mfu")
             if any(r.get(name) is not None for r in by_row)]
    rows = [["model", "precision", "trials", *(f"{name}-s" for name in names),
             *({"tflops_per_second": "TFLOP/s", "mfu": "MFU"}[name] for name in rates)]]
    rows += [[r["model_name"], r["fp_precision"], str(r["trials"]),
              *(f"{r[f'{name}_seconds']:.0f}" for name in names),
              *(_rate(r.get(name), name) for name in rates)]
             for r in by_row]
    return [f"compute: {spent['device_seconds']:.0f} device-seconds, {shares}",
            *("  " + line for line in _columns(rows))]


def render_status(info: dict[str, Any], fmt: str) -> str:
    """`hpo status`: counts, the best trial, compute spent, the running trials."""
    if fmt != "text":
        return dump(info, fmt)
    lines = [_counts_line(info)]
    best = info["best"]
    if best:
        lines.append(f"best: trial {best['trial']}, {best['objective']} {best['value']:.4f}")
        lines += ["  " + line for line in _columns(
            [[name, _number(value)] for name, value in best["params"].items()])]
    if info["compute"]["by_model_precision"]:
        lines += _compute_lines(info["compute"])
    if info["running"]:
        names = sorted({name for trial in info["running"] for name in trial["params"]})
        shared = any(t.get("gpu_share") for t in info["running"])
        paused = any(t.get("pauses") for t in info["running"])
        rows = [["running", "worker", *(["GPU share"] if shared else []), "for",
                 *(["paused"] if paused else []), *names]]
        rows += [[f"trial {t['trial']}", t["worker"],
                  *([t.get("gpu_share") or "whole"] if shared else []), f"{t['age_seconds']} s",
                  *([_pause_state(t)] if paused else []),
                  *(_number(t["params"].get(name, "-")) for name in names)]
                 for t in info["running"]]
        lines += _columns(rows)
    return "\n".join(lines)


def _pause_state(trial: dict[str, Any]) -> str:
    """A running trial's pauses (`study.pruner.pause`), as `hpo status` shows them."""
    if trial.get("paused_at") is not None:
        return f"at step {trial['paused_at']}"
    resumes = trial.get("resumes") or []
    if resumes:
        return f"resumed from step {resumes[-1]}"
    return "-"


def render_studies(rows: list[dict[str, Any]], url: str, fmt: str) -> str:
    """`hpo studies`: one line per study in the storage at `url`."""
    if fmt != "text":
        return dump(rows, fmt)
    if not rows:
        return f"no studies in {redact(url)}"
    lines = []
    for row in rows:
        best = f"{row['best_value']:.4f}" if row["best_value"] is not None else "-"
        # A study with no trial has no start time: "-", as for its best value.
        started = row["started"] or "-"
        lines.append(f"{row['study']}\t{row['trials']} trials\tbest {best}\tstarted {started}")
    return "\n".join(lines)
