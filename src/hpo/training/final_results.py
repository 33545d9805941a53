"""The report of `hpo final`, as typed records: what was trained again, how each seed's run
scored on the held-out test split, and the exported model's scores. The terminal's text and
the model card read it by attribute; `FinalReport.to_json` is the layout of report.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class F1:
    macro_f1: float
    micro_f1: float

    def get(self, objective: str) -> float:
        return {"macro_f1": self.macro_f1, "micro_f1": self.micro_f1}[objective]


@dataclass(frozen=True)
class Spread:
    """One score over the seeds' runs."""

    mean: float
    std: float
    min: float
    max: float


@dataclass(frozen=True)
class SeedRun:
    seed: int
    epoch: float  # the epoch kept (1-based; 1.5: an evaluation inside the second)
    epochs: float  # the epochs trained
    validation: float | None  # the objective at the kept epoch; None with --refit
    test: F1
    test_at_half: F1

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "epochs": self.epochs,
                "validation": self.validation, "test": asdict(self.test),
                "test_at_0.5": asdict(self.test_at_half)}


@dataclass(frozen=True)
class SymptomScore:
    precision: float
    recall: float
    f1: float
    support: int
    threshold: float


@dataclass(frozen=True)
class Exported:
    """The exported run's scores on the test split, at its thresholds and at 0.5."""

    seed: int
    chosen_by: str
    test: F1
    test_interval_95: dict[str, tuple[float, float]]  # per objective: low, high
    test_at_half: F1
    per_symptom: dict[str, SymptomScore]
    thresholds: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "chosen_by": self.chosen_by, "test": asdict(self.test),
                "test_interval_95": {k: list(v) for k, v in self.test_interval_95.items()},
                "test_at_0.5": asdict(self.test_at_half),
                "per_symptom": {k: asdict(v) for k, v in self.per_symptom.items()},
                "thresholds": self.thresholds}


@dataclass(frozen=True)
class BatchPlan:
    physical_batch: int
    grad_accum_steps: int
    effective_batch: int
    epochs: int
    batch_probes: int


@dataclass(frozen=True)
class DataUsed:
    dir: str
    task: str
    split_seed: int
    max_length: int
    posts: dict[str, int]  # train, validation, test
    test_post_ids: list[str]


@dataclass(frozen=True)
class FinalReport:
    study: str
    trial: int
    objective: str
    search_validation: float  # the trial's value in the search
    params: dict[str, Any]
    training: dict[str, Any]  # the trial's resolved training settings
    plan: BatchPlan
    device: str
    refit: bool
    thresholds: str  # how they were chosen
    data: DataUsed
    runs: tuple[SeedRun, ...]
    test_spread: Spread  # the objective over seeds, at the runs' thresholds
    test_spread_at_half: Spread  # and at 0.5, the threshold the search scored with
    exported: Exported
    baseline: F1  # every symptom predicted for every post
    optimism: float  # search_validation less test_spread_at_half's mean

    @property
    def model_name(self) -> str:
        return self.params["model_name"]

    @property
    def precision(self) -> str:
        return self.params["fp_precision"]

    def to_json(self) -> dict[str, Any]:
        objective = self.objective
        return {
            "study": self.study, "trial": self.trial, "objective": objective,
            "search_validation": self.search_validation, "params": self.params,
            "training": self.training, "plan": asdict(self.plan), "device": self.device,
            "refit": self.refit, "thresholds": self.thresholds, "data": asdict(self.data),
            "runs": [run.to_json() for run in self.runs],
            "seed_spread": {"test_" + objective: asdict(self.test_spread),
                            "test_at_0.5_" + objective: asdict(self.test_spread_at_half)},
            "exported": self.exported.to_json(),
            "baseline": {"name": "all_positive", **asdict(self.baseline)},
            "optimism": self.optimism,
        }
