"""How a trial ended, and the ends that no library exception names. A leaf: the executor maps
every end to an `Outcome` (`executor.outcome_of`), and the worker, its isolated children and
the console read it, without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

# How the error of a trial that Ctrl-C or SIGTERM ended begins ("interrupted by SIGTERM"):
# `hpo status` tells such trials from failures by it where they lack the `interrupted` mark.
INTERRUPTED = "interrupted by "


@dataclass(frozen=True)
class Outcome:
    state: TrialState
    value: float | None = None
    prune_reason: str | None = None
    error: str | None = None
    # The trial was reaped while it ran: its result went to its retry copy, which was told
    # in its place (`kept_from` is the reaped trial's number), or, with no copy left to
    # claim, nowhere (`dropped` says why).
    kept_from: int | None = None
    dropped: str | None = None
    # The trial paused at this step (`study.pruner.pause`): it stays RUNNING, its checkpoint
    # in the store, until a worker resumes it.
    paused_at: int | None = None


def as_told(trial: FrozenTrial) -> Outcome:
    """The outcome of a trial already told, read back from the storage."""
    attrs = trial.user_attrs
    return Outcome(trial.state, value=trial.value, prune_reason=attrs.get("prune_reason"),
                   error=attrs.get("error"))


class Reaped(Exception):
    """The trial was reaped while it ran and no waiting copy was left to carry its result."""


class ChildDied(Exception):
    """An isolated trial's process died before it told the study: `exitcode` is its exit
    code (negative: the signal that killed it), `tried` the batch cache key and micro-batch
    it was trying, if it had got that far."""

    def __init__(self, exitcode: int | None, tried: tuple[str, int] | None) -> None:
        super().__init__(exitcode, tried)
        self.exitcode = exitcode
        self.tried = tried


class GivenBack(Exception):
    """A trial claimed while the study lock was lost, given back to keep the budget exact."""
