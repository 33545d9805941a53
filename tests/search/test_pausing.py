"""Paused trials (`study.pruner.pause`): which one a free worker resumes (in milliseconds, on
made trials), and their marks, claims and ends on real storages: a paused trial holds its
slot without a heartbeat and no reaper takes it; a resumed one whose worker goes silent goes
back to paused at its checkpoint, never to a retry from scratch."""

import io
import time

import optuna
import pytest
import sqlalchemy
from optuna.storages._rdb.models import TrialHeartbeatModel
from optuna.trial import TrialState, create_trial
from optuna_dashboard import get_note

from hpo.search import pausing
from hpo.search.liveness import fail_dead_worker, reap
from hpo.search.pruning import rung_key
from hpo.search.storage import open_storage

pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")


def made(number: int, rungs: list[float], paused: bool = False,
         state: TrialState = TrialState.RUNNING) -> optuna.trial.FrozenTrial:
    """A trial that reported `rungs` at successive rungs; `paused` at the last of them."""
    trial = create_trial(
        state=state, value=None if state == TrialState.RUNNING else rungs[-1],
        system_attrs={rung_key(k): v for k, v in enumerate(rungs)},
        user_attrs={pausing.PAUSED_AT: len(rungs),
                    pausing.CHECKPOINT: {"id": f"k{number}", "step": len(rungs)}}
        if paused else {},
        intermediate_values={k + 1: v for k, v in enumerate(rungs)})
    trial.number = number
    return trial


def test_a_paused_trial_resumes_once_later_trials_put_it_in_its_rungs_top():
    done = made(0, [0.9], state=TrialState.COMPLETE)
    waiting = made(1, [0.5], paused=True)
    # Of two values at rung 0 the top half is the best one: 0.5 waits.
    assert pausing.to_resume([done, waiting], reduction_factor=2) is None
    poorer = [made(2, [0.1], state=TrialState.PRUNED), made(3, [0.2], paused=True)]
    # Of four, the top half holds 0.9 and 0.5: it resumes; 0.2 still waits.
    assert pausing.to_resume([done, waiting, *poorer], 2).number == 1
    # A factor of 3 keeps one of four: nothing resumes yet.
    assert pausing.to_resume([done, waiting, *poorer], 3) is None


def test_the_highest_rung_resumes_first_then_the_best_then_the_earliest():
    trials = [made(0, [0.9, 0.8], state=TrialState.COMPLETE),
              made(1, [0.1], state=TrialState.PRUNED), made(2, [0.2], state=TrialState.PRUNED),
              made(3, [0.6], paused=True), made(4, [0.7], paused=True),
              made(5, [0.5, 0.85], paused=True), made(6, [0.4, 0.1], state=TrialState.PRUNED)]
    # Rung 1 holds 0.8, 0.85, 0.1: its top (one of three) is 0.85, trial 5's.
    assert pausing.to_resume(trials, 2).number == 5
    trials[5] = made(5, [0.5, 0.85])  # resumed: the best paused at rung 0 is next
    assert pausing.to_resume(trials, 2).number == 4
    trials[4] = made(4, [0.7])
    trials.append(made(7, [0.6], paused=True))  # as good as trial 3: the earlier goes first
    assert pausing.to_resume(trials, 2).number == 3


def test_past_max_checkpoints_those_of_the_trials_least_likely_to_be_promoted_go():
    trials = [made(0, [0.9, 0.8], state=TrialState.COMPLETE), made(1, [0.7], paused=True),
              made(2, [0.3], paused=True), made(3, [0.5, 0.2], paused=True),
              made(4, [0.6], paused=True)]
    assert pausing.over_limit(trials, 4) == []
    # Rung 0 holds 0.9, 0.7, 0.3, 0.5, 0.6: 0.3 has 4 of 5 above it. Rung 1 holds 0.8, 0.2:
    # 0.2 has 1 of 2 above it, as does 0.5 at rung 0 (2 of 5 is less).
    assert [t.number for t in pausing.over_limit(trials, 3)] == [2]
    assert [t.number for t in pausing.over_limit(trials, 1)] == [2, 3, 4]
    # Of equal shares (a half: 0.4 at rung 1, 0.3 at rung 0), the lower rung goes first,
    # then the later trial.
    equal = [made(0, [0.9, 0.8], state=TrialState.COMPLETE), made(1, [0.5, 0.4], paused=True),
             made(3, [0.3], paused=True), made(4, [0.3], paused=True)]
    assert [t.number for t in pausing.over_limit(equal, 1)] == [4, 3]
    assert [t.number for t in pausing.over_limit(equal, 0)] == [4, 3, 1]
    # A trial whose checkpoint went already counts no more.
    equal[3].user_attrs[pausing.CHECKPOINT] = {"id": None, "step": 1}
    assert [t.number for t in pausing.over_limit(equal, 1)] == [3]


@pytest.fixture
def beating(any_storage):
    storage = open_storage(any_storage, heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(study_name="p", storage=storage, direction="maximize")
    yield study, storage
    storage.engine.dispose()


def heartbeats(storage, trial_id: int) -> int:
    beats = TrialHeartbeatModel.__table__
    with storage.engine.connect() as connection:
        return connection.execute(sqlalchemy.select(sqlalchemy.func.count()).select_from(
            beats).where(beats.c.trial_id == trial_id)).scalar_one()


def paused_trial(study, storage, step: int = 1) -> optuna.Trial:
    """A trial that ran, reported `step`, kept a checkpoint there and was marked paused."""
    trial = study.ask()
    trial.suggest_float("x", 0.0, 1.0)
    storage.record_heartbeat(trial._trial_id)
    trial.report(0.5, step)
    storage.set_trial_system_attr(trial._trial_id, rung_key(0), 0.5)  # as the pruner does
    assert pausing.record_checkpoint(trial, step, "key-1") is None
    assert pausing.repause(storage, storage.engine, trial._trial_id)
    return trial


def test_a_paused_trial_holds_no_heartbeat_and_no_reaper_takes_it(beating):
    study, storage = beating
    trial = paused_trial(study, storage)
    frozen = storage.get_trial(trial._trial_id)
    assert pausing.is_paused(frozen) and frozen.user_attrs[pausing.PAUSES] == [1]
    assert heartbeats(storage, trial._trial_id) == 0
    time.sleep(2.5)  # past the grace period
    reap(study, storage, storage.get_study_id_from_name("p"))
    assert [t.state for t in study.trials] == [TrialState.RUNNING]
    assert fail_dead_worker(study, storage, frozen.user_attrs.get("worker", "?"), "gone") == []


def test_a_claim_unmarks_and_beats_once_and_a_silent_resume_goes_back_to_paused(beating):
    study, storage = beating
    trial = paused_trial(study, storage)
    token = pausing.claim(storage, trial._trial_id, "host:2")
    assert token and pausing.claim(storage, trial._trial_id, "host:3") is None  # taken
    frozen = storage.get_trial(trial._trial_id)
    assert not pausing.is_paused(frozen) and frozen.user_attrs[pausing.RESUMES] == [1]
    assert frozen.user_attrs["worker"] == "host:2"
    assert heartbeats(storage, trial._trial_id) == 1
    assert pausing.holds(storage, trial._trial_id, token)
    # The resumed run reports on past its checkpoint and passes a rung, then its worker dies.
    for step in (2, 3):
        storage.set_trial_intermediate_value(trial._trial_id, step, 0.7)
    storage.set_trial_system_attr(trial._trial_id, rung_key(1), 0.7)
    time.sleep(3.2)  # past the grace period (SQLite keeps whole seconds)
    reap(study, storage, storage.get_study_id_from_name("p"))
    (again,) = study.trials  # no failure, no retry copy: paused at its checkpoint again
    assert pausing.is_paused(again) and again.user_attrs[pausing.PAUSED_AT] == 1
    assert heartbeats(storage, trial._trial_id) == 0
    # What the dead run reported past the checkpoint is gone: the next run reports it anew.
    assert again.intermediate_values == {1: 0.5}
    assert rung_key(0) in again.system_attrs and rung_key(1) not in again.system_attrs
    assert not pausing.holds(storage, trial._trial_id, token)  # the dead run's claim lapsed
    assert get_note(trial).startswith("**Paused** at step 1, where its rung would have")
    assert get_note(trial).endswith("Paused at steps: 1. Resumed from: 1.")


def test_a_dead_workers_resumed_trial_goes_back_to_paused(beating):
    study, storage = beating
    trial = paused_trial(study, storage)
    trial.set_user_attr("worker", "host:0")  # the worker that paused it
    assert pausing.claim(storage, trial._trial_id, "host:1")
    assert fail_dead_worker(study, storage, "host:0", "killed") == []  # it is not host:0's
    assert not pausing.is_paused(storage.get_trial(trial._trial_id))
    assert fail_dead_worker(study, storage, "host:1", "killed") == []
    (again,) = study.trials
    assert pausing.is_paused(again) and "error" not in again.user_attrs


def test_the_last_paused_trials_end_pruned_and_their_checkpoints_go(beating, tmp_path):
    study, storage = beating
    store = optuna.artifacts.FileSystemArtifactStore(str(tmp_path))
    trial = paused_trial(study, storage)
    key = pausing.save(store, trial.number, {"weights": [1, 2]})
    storage.set_trial_user_attr(trial._trial_id, pausing.CHECKPOINT, {"id": key, "step": 1})
    running = study.ask()
    assert pausing.end_unpromoted(study, store) == [trial.number]
    ended = storage.get_trial(trial._trial_id)
    assert ended.state == TrialState.PRUNED
    assert ended.user_attrs["prune_reason"] == pausing.NOT_PROMOTED
    assert storage.get_trial(running._trial_id).state == TrialState.RUNNING  # not paused
    with pytest.raises(optuna.artifacts.exceptions.ArtifactNotFound):
        store.open_reader(key)


def test_a_paused_trial_past_max_checkpoints_stays_paused_without_one(beating, tmp_path):
    from hpo.search import budget

    study, storage = beating
    store = optuna.artifacts.FileSystemArtifactStore(str(tmp_path))
    trials = [paused_trial(study, storage) for _ in range(2)]
    keys = []
    for trial, value in zip(trials, (0.7, 0.4), strict=True):
        storage.set_trial_system_attr(trial._trial_id, rung_key(0), value)
        keys.append(pausing.save(store, trial.number, {"weights": [value]}))
        storage.set_trial_user_attr(trial._trial_id, pausing.CHECKPOINT,
                                    {"id": keys[-1], "step": 1, "rung": 0})
    assert pausing.shed(study, store, 2) == []
    assert pausing.shed(study, store, 1) == [trials[1].number]
    shed = storage.get_trial(trials[1]._trial_id)
    assert pausing.is_paused(shed) and not pausing.holds_checkpoint(shed)
    assert shed.user_attrs[pausing.CHECKPOINT] == {"id": None, "step": 1, "rung": 0}
    assert get_note(trials[1]).startswith("**Paused** at step 1, where its rung would have "
                                          "stopped it, without a checkpoint")
    with pytest.raises(optuna.artifacts.exceptions.ArtifactNotFound):
        store.open_reader(keys[1])
    assert store.open_reader(keys[0]) and pausing.shed(study, store, 1) == []
    # Resumed, it trains its step again: counted twice in a budget of trainings.
    assert pausing.claim(storage, trials[1]._trial_id, "host:1")
    assert storage.get_trial(trials[1]._trial_id).user_attrs[pausing.RETRAINED] == 1
    study_id = storage.get_study_id_from_name("p")
    with storage.engine.connect() as connection:
        counted = budget.trained_in_database(connection, study_id)
    assert sorted(counted, key=lambda t: t.retrained) == [
        budget.Trained(1, False, 0), budget.Trained(1, True, 1)]
    assert budget.trained_of(study.trials) == counted
    # Put back before it reported anything new, it is paused again, still without one.
    assert pausing.repause(storage, storage.engine, trials[1]._trial_id)
    assert not pausing.holds_checkpoint(storage.get_trial(trials[1]._trial_id))
    assert pausing.end_unpromoted(study, store) == [t.number for t in trials]


def test_a_checkpoint_round_trips_through_the_store(tmp_path):
    store = optuna.artifacts.FileSystemArtifactStore(str(tmp_path))
    key = pausing.save(store, 3, {"step": 2, "buffer": io.BytesIO(b"x").getvalue()})
    assert key.startswith("checkpoint-trial-3-")
    assert pausing.load(store, key, "cpu") == {"step": 2, "buffer": b"x"}
    pausing.remove(store, {"id": key, "step": 2})
    pausing.remove(store, key)  # gone already: nothing to say
    assert list(tmp_path.iterdir()) == []
