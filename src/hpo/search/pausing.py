"""Trials paused instead of stopped (`study.pruner.pause`): asynchronous successive halving in
its promotion form (Li et al. 2020; Syne Tune's `type="promotion"`), kept by many workers
through the study's storage.

The rule. A trial that successive halving would stop at a rung (it ranks below the top
1/reduction_factor of the values reported there) pauses instead: its run's checkpoint goes to
the artifact store, and the trial stays RUNNING, marked `paused_at` (the step) and without a
heartbeat, so it holds its slot of the budget, the sampler counts it as running, and no
reaper takes it for dead. A free worker, before it samples a new trial, resumes the paused
trial that now ranks in its rung's top 1/reduction_factor (later, poorer trials made room),
the highest rung first and the best value first, and trains it on from its checkpoint: no
epoch is trained twice. Once the budget is all started (or the last worker's `--timeout` is
up) and nothing else runs, nothing can promote what is still paused: those trials end
PRUNED, as stopping would have ended them. Where the study bounds the checkpoints
(`study.pruner.max_checkpoints`), a pause past the bound takes the checkpoint of the paused
trial least likely to be promoted (`over_limit`, the pausing one included): it stays paused,
ranked by what it reported, and a worker that resumes it trains it again from its start
(those steps counted again, `RETRAINED`).

A resumed trial whose run ends without a result (its worker killed, interrupted or reaped)
goes back to paused at its checkpoint (`repause`) instead of failing: what it trained since
is lost (its reports past the checkpoint are removed), what it trained before is not. A
resume is a claim (`claim`, a token on the trial): a run cut off while its trial was put
back to paused finds its claim lapsed (`holds`) and writes nothing more. The checkpoint
leaves the store when its trial ends.

Marks and claims are written under the study lock (`budget.study_lock`), as every claim is.
"""

from __future__ import annotations

import contextlib
import io
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna
import sqlalchemy

# Optuna's RDB schema (private, versioned by its migrations), as in budget.py: a paused trial
# holds no heartbeat row, so Optuna's reaper, which judges trials by theirs, passes it by.
# tests/search/test_pausing.py fails if these tables or columns change.
# Likewise a resumed run's reports past its checkpoint, once that run is gone.
from optuna.storages._rdb.models import (
    TrialHeartbeatModel,
    TrialIntermediateValueModel,
    TrialSystemAttributeModel,
)
from optuna.trial import FrozenTrial, TrialState
from optuna_dashboard import save_note

from hpo.search.pruning import rung_key
from hpo.search.resilience import retrying_on

if TYPE_CHECKING:
    import torch
    from optuna.artifacts._protocol import ArtifactStore

PAUSED_AT = "paused_at"  # user attribute: the step a trial is paused at; None once resumed
CHECKPOINT = "checkpoint"  # user attribute: {"id": the store's key, "step": its step}
PAUSES = "pauses"  # user attribute: the steps it paused at, in order
RESUMES = "resumes"  # user attribute: the steps it was resumed from, in order
CLAIM = "resume_claim"  # user attribute: the claim of the run that resumed it last
RETRAINED = "retrained_steps"  # user attribute: steps trained again, its checkpoint given up
ATTRIBUTES = (PAUSED_AT, CHECKPOINT, PAUSES, RESUMES, CLAIM, RETRAINED)
NOT_PROMOTED = "not_promoted"  # the prune reason of a trial still paused at the end
MAX_RUNGS = 64  # more rungs than any training has: reduction factor 2 over 2**64 steps


@dataclass(frozen=True)
class Promotion:
    """How a study that pauses trials promotes them: by its rungs' `reduction_factor`, their
    checkpoints in `store`."""

    reduction_factor: int
    store: ArtifactStore | None
    max_checkpoints: int | None = None  # `study.pruner.max_checkpoints`: None, no bound


def is_paused(trial: FrozenTrial) -> bool:
    return trial.state == TrialState.RUNNING and trial.user_attrs.get(PAUSED_AT) is not None


def checkpoint_of(trial: FrozenTrial) -> dict[str, Any] | None:
    """Its checkpoint's record ({"id", "step", "rung"}; id None: given up, `shed`)."""
    return trial.user_attrs.get(CHECKPOINT)


def holds_checkpoint(trial: FrozenTrial) -> bool:
    checkpoint = checkpoint_of(trial)
    return checkpoint is not None and checkpoint.get("id") is not None


def rung_reached(trial: FrozenTrial) -> int:
    """The last rung the trial reported at (-1: none)."""
    rung = 0
    while rung_key(rung) in trial.system_attrs:
        rung += 1
    return rung - 1


def in_top(value: float, competing: list[float], reduction_factor: int) -> bool:
    """Whether `value` ranks in the top 1/reduction_factor of `competing` (which holds it),
    the best of fewer: the rule successive halving stops by (a study that maximizes)."""
    ranked = sorted(competing, reverse=True)
    return value >= ranked[max(1, len(ranked) // reduction_factor) - 1]


def to_resume(trials: list[FrozenTrial], reduction_factor: int) -> FrozenTrial | None:
    """The paused trial a free worker resumes (the module's rule): of the paused trials that
    rank in the top of the rung they paused at, one of the highest rung, the best there (the
    earlier of equals); None when no paused trial ranks."""
    paused = [t for t in trials if is_paused(t) and rung_reached(t) >= 0]
    for rung in sorted({rung_reached(t) for t in paused}, reverse=True):
        key = rung_key(rung)
        values = [t.system_attrs[key] for t in trials if key in t.system_attrs]
        ready = [t for t in paused if rung_reached(t) == rung
                 and in_top(t.system_attrs[key], values, reduction_factor)]
        if ready:
            return min(ready, key=lambda t: (-t.system_attrs[key], t.number))
    return None


def over_limit(trials: list[FrozenTrial], max_checkpoints: int) -> list[FrozenTrial]:
    """The paused trials to give their checkpoints up so that at most `max_checkpoints` keep
    one: those least likely to be promoted, by the share of their rung's values above their
    own (the larger, the more trials must still rank below them), of equals the lower rung
    (less to train again), then the later trial (as `to_resume` prefers the earlier)."""
    paused = [t for t in trials if is_paused(t) and holds_checkpoint(t)]
    excess = len(paused) - max_checkpoints
    if excess <= 0:
        return []

    def behind(trial: FrozenTrial) -> tuple[float, int, int]:
        rung = rung_reached(trial)
        key = rung_key(rung)
        if rung < 0:
            return (1.0, 1, trial.number)  # reached no rung: nothing ranks it yet
        values = [t.system_attrs[key] for t in trials if key in t.system_attrs]
        above = sum(v > trial.system_attrs[key] for v in values)
        return (above / len(values), -rung, trial.number)

    return sorted(paused, key=behind, reverse=True)[:excess]


# ------------------------------------------------------------------- the trial's marks


def record_checkpoint(trial: optuna.Trial, step: int, checkpoint: str | None) -> str | None:
    """Record the new `checkpoint` of the running `trial`, taken at `step` (the rung it
    paused at with it; None: none kept); returns the key of the one it replaces (for the
    caller to remove), if any. The trial is marked paused once its heartbeat has stopped
    (`repause`)."""
    frozen = trial.storage.get_trial(trial._trial_id)
    attrs = frozen.user_attrs
    old = attrs.get(CHECKPOINT)
    trial.set_user_attr(CHECKPOINT, {"id": checkpoint, "step": step,
                                     "rung": rung_reached(frozen)})
    trial.set_user_attr(PAUSES, [*attrs.get(PAUSES, []), step])
    return old["id"] if old and old["id"] != checkpoint else None


def _forget(engine: sqlalchemy.Engine, trial_id: int, checkpoint: dict[str, Any]) -> None:
    """Remove the heartbeat of a trial put back to paused, and what a run resumed from its
    checkpoint reported past it (its reports and the rungs it passed): the next run reports
    those steps again, and the pruner and the promotion rule must see its values, not a dead
    run's."""
    beats, values = TrialHeartbeatModel.__table__, TrialIntermediateValueModel.__table__
    attrs = TrialSystemAttributeModel.__table__
    later = [rung_key(k) for k in range(checkpoint.get("rung", -1) + 1, MAX_RUNGS)]

    def delete() -> None:
        with engine.begin() as connection:
            connection.execute(sqlalchemy.delete(beats).where(beats.c.trial_id == trial_id))
            connection.execute(sqlalchemy.delete(values).where(
                values.c.trial_id == trial_id, values.c.step > checkpoint["step"]))
            connection.execute(sqlalchemy.delete(attrs).where(
                attrs.c.trial_id == trial_id, attrs.c.key.in_(later)))

    # One transaction, so made again whole through an outage, as a storage call is.
    retrying_on(engine, delete, what="put back")


def claim(storage: optuna.storages.BaseStorage, trial_id: int, worker: str) -> str | None:
    """Take a paused trial for `worker`: unmarked and beating at once, so that it is seen
    alive from its claim on, and named this worker's (a launcher that sees the worker that
    paused it die then leaves it alone). Under the study lock. Returns the claim, which the
    run checks it still holds (`holds`), or None if the trial is no longer paused."""
    frozen = storage.get_trial(trial_id)
    if not is_paused(frozen):
        return None
    token = uuid.uuid4().hex
    resumes = [*frozen.user_attrs.get(RESUMES, []), frozen.user_attrs[PAUSED_AT]]
    if not holds_checkpoint(frozen):  # trained again from its start: counted at the claim
        storage.set_trial_user_attr(trial_id, RETRAINED, frozen.user_attrs.get(RETRAINED, 0)
                                    + frozen.user_attrs[PAUSED_AT])
    storage.set_trial_user_attr(trial_id, CLAIM, token)
    storage.set_trial_user_attr(trial_id, "worker", worker)
    storage.set_trial_user_attr(trial_id, RESUMES, resumes)
    storage.set_trial_user_attr(trial_id, PAUSED_AT, None)
    storage.record_heartbeat(trial_id)  # type: ignore[attr-defined]  # RDB storages beat
    return token


def holds(storage: optuna.storages.BaseStorage, trial_id: int, token: str) -> bool:
    """Whether the run that resumed a trial with claim `token` still holds it: a run whose
    worker a reaper took for dead (an outage longer than the grace period) finds the trial
    paused again, or resumed by another worker, and must write nothing more to it."""
    trial = storage.get_trial(trial_id)
    return (trial.state == TrialState.RUNNING and trial.user_attrs.get(CLAIM) == token
            and trial.user_attrs.get(PAUSED_AT) is None)


def repause(storage: optuna.storages.BaseStorage, engine: sqlalchemy.Engine,
            trial_id: int) -> bool:
    """Mark a running trial paused at its checkpoint and remove its heartbeat: a run that
    paused, once its heartbeat thread stopped (which would write the row again), or a resumed
    run that ended without a result, whose reports past the checkpoint go too. Under the
    study lock, so no worker claims it meanwhile. False (nothing done) for a trial without
    a checkpoint, or no longer running."""
    trial = storage.get_trial(trial_id)
    checkpoint = checkpoint_of(trial)
    if checkpoint is None or trial.state != TrialState.RUNNING:
        return False
    try:
        storage.set_trial_user_attr(trial_id, PAUSED_AT, checkpoint["step"])
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    _forget(engine, trial_id, checkpoint)
    return True


def put_back(study: optuna.Study, storage: optuna.storages.BaseStorage,
             engine: sqlalchemy.Engine, trial_id: int) -> bool:
    """`repause`, and the trial's dashboard note saying so (`note`)."""
    if not repause(storage, engine, trial_id):
        return False
    note(study, trial_id)
    return True


def end_unpromoted(study: optuna.Study, store: ArtifactStore | None) -> list[int]:
    """End every paused trial PRUNED (nothing can promote them any more) and remove their
    checkpoints; returns their numbers. Under the study lock."""
    ended = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not is_paused(trial):
            continue
        try:
            study._storage.set_trial_user_attr(trial._trial_id, "prune_reason", NOT_PROMOTED)
            study.tell(trial.number, state=TrialState.PRUNED)
        except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
            continue  # another worker ended it first
        remove(store, checkpoint_of(trial))
        note(study, trial._trial_id)
        ended.append(trial.number)
    return ended


def shed(study: optuna.Study, store: ArtifactStore | None, max_checkpoints: int) -> list[int]:
    """Take the checkpoints of the paused trials past `max_checkpoints` (`over_limit`) out of
    the store; they stay paused. Returns their numbers. Under the study lock."""
    numbers = []
    for trial in over_limit(study.get_trials(deepcopy=False), max_checkpoints):
        checkpoint = checkpoint_of(trial)
        assert checkpoint is not None
        study._storage.set_trial_user_attr(trial._trial_id, CHECKPOINT,
                                           {**checkpoint, "id": None})
        remove(store, checkpoint)
        note(study, trial._trial_id)
        numbers.append(trial.number)
    return numbers


def note(study: optuna.Study, trial_id: int) -> None:
    """Say on the trial's page in optuna-dashboard (its note) where the trial stands: Optuna
    shows a paused trial as running, and its attributes only on request."""
    trial = study._storage.get_trial(trial_id)
    attrs = trial.user_attrs
    pauses = ", ".join(str(step) for step in attrs.get(PAUSES, []))
    resumes = ", ".join(str(step) for step in attrs.get(RESUMES, [])) or "none yet"
    if trial.state == TrialState.PRUNED:
        now = (f"**Pruned, not promoted**: paused at step {attrs[PAUSES][-1]}, and no rung "
               f"promoted it before the study's budget was spent.")
    elif is_paused(trial) and not holds_checkpoint(trial):
        now = (f"**Paused** at step {attrs[PAUSED_AT]}, where its rung would have stopped it, "
               f"without a checkpoint (study.pruner.max_checkpoints): once later trials rank "
               f"below it, a worker trains it again from its start.")
    elif is_paused(trial):
        now = (f"**Paused** at step {attrs[PAUSED_AT]}, where its rung would have stopped it: "
               f"its checkpoint is kept, and any worker resumes it from there once later "
               f"trials rank below it.")
    else:
        now = f"**Resumed** from step {attrs[RESUMES][-1]}: training on from its checkpoint."
    body = f"{now}\n\nPaused at steps: {pauses}. Resumed from: {resumes}."
    # optuna-dashboard's own API for a trial's note (a study system attribute it reads).
    save_note(optuna.trial.Trial(study, trial_id), body)


# -------------------------------------------------------------------- the checkpoints


def save(store: ArtifactStore, number: int, payload: object) -> str:
    """Write a paused run's checkpoint (`payload`, saved by torch) to the store; returns its
    key. A key of its own each time: a new pause never overwrites the checkpoint a crash
    could still need."""
    import torch  # here: the commands that check a study file answer before torch loads

    key = f"checkpoint-trial-{number}-{uuid.uuid4().hex}"
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    buffer.seek(0)
    store.write(key, buffer)
    return key


def load(store: ArtifactStore, key: str, device: torch.device | str) -> Any:
    import torch

    with store.open_reader(key) as reader:
        data = io.BytesIO(reader.read())
    # Our own checkpoint (weights, optimizer and scheduler state, counters, dataclasses):
    # not a foreign file, so unpickled in full.
    return torch.load(data, map_location=device, weights_only=False)


def remove(store: ArtifactStore | None, checkpoint: dict[str, Any] | str | None) -> None:
    if store is None or checkpoint is None:
        return
    key = checkpoint["id"] if isinstance(checkpoint, dict) else checkpoint
    if key is None:  # given up already
        return
    with contextlib.suppress(Exception):  # gone already, or the store is away: only space
        store.remove(key)
