"""A trial's run as one object: its context (the study, the live trial, the batch cache,
the display), its plan and the worker's resources, made by the executor once the trial is
planned and handed to the driver that trains it and to the records that keep its model.
What a driver trained comes back as `Trained`."""

from __future__ import annotations

from dataclasses import dataclass

import optuna
import torch

from hpo.config import StudyConfig
from hpo.training.train import Plan
from hpo.trial.context import TrialContext
from hpo.trial.planning import PlannedTrial
from hpo.trial.resources import Resources


@dataclass(frozen=True)
class TrialRun:
    """One planned trial on its way through training."""

    context: TrialContext
    planned: PlannedTrial
    resources: Resources

    @property
    def trial(self) -> optuna.Trial:
        """The trial the run writes to now (`TrialContext.trial`)."""
        return self.context.trial

    @property
    def plan(self) -> Plan:
        return self.planned.plan

    @property
    def config(self) -> StudyConfig:
        return self.resources.config

    @property
    def model_name(self) -> str:
        return self.planned.params.model_name


@dataclass(frozen=True)
class Trained:
    """What a driver trained: the trial's value and, for a single model, the model holding
    the weights of `epoch` (1-based, `as_epochs`): the value's evaluation where `BestEpoch`
    kept it, else the last."""

    value: float
    model: torch.nn.Module | None = None
    epoch: float = 0  # in epochs: 1.5 is the middle of the second under evaluations_per_epoch
