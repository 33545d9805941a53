"""Liveness: the heartbeat of a running trial, the reaper that fails trials whose worker went
silent and queues their retries, and the carry-over of a run reaped while it was alive onto
its retry copy. Real storages; a private PostgreSQL server stopped for the outages."""

import time
from collections import Counter

import optuna
import pytest
from optuna.trial import TrialState

from hpo.search.liveness import LiveTrial, carry_over, fail_dead_worker, heartbeat, reap
from hpo.search.resilience import single_attempt
from hpo.search.storage import open_storage

# ask() without Study.optimize is how hpo's own loop claims trials too (worker._ask).
pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")


# ask() without Study.optimize is how hpo's own loop claims trials too (worker._ask).
def test_a_trial_that_never_beat_is_reaped_by_its_start_time(any_storage):
    storage = open_storage(any_storage, heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(study_name="w", storage=storage)
    study_id = storage.get_study_id_from_name("w")
    silent = study.ask()  # its worker was killed before its first heartbeat
    silent.suggest_float("x", 0.0, 1.0)
    beating = study.ask()
    storage.record_heartbeat(beating._trial_id)
    reap(study, storage, study_id)
    assert [t.state for t in study.trials] == [TrialState.RUNNING] * 2  # within the grace
    time.sleep(2.5)
    storage.record_heartbeat(beating._trial_id)
    for _ in range(2):  # a second reaping finds nothing more to do
        reap(study, storage, study_id)
        states = [t.state for t in study.trials]
        assert states == [TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING]
    assert study.trials[2].params == study.trials[0].params

def test_reapers_take_turns_so_a_stale_trial_is_queued_once(any_storage):
    import threading

    from hpo.search import budget

    storage = open_storage(any_storage, heartbeat_interval=1, grace_period=1)
    study = optuna.create_study(study_name="w", storage=storage)
    study_id = storage.get_study_id_from_name("w")
    stale = study.ask()
    stale.suggest_float("x", 0.0, 1.0)
    storage.record_heartbeat(stale._trial_id)
    time.sleep(2)
    with budget.study_lock(storage.engine, "w"):  # a worker claiming a trial meanwhile
        reapers = [threading.Thread(target=reap, args=(study, storage, study_id))
                   for _ in range(2)]
        for reaper in reapers:
            reaper.start()
        time.sleep(1)
        assert storage.get_trial(stale._trial_id).state == TrialState.RUNNING
    for reaper in reapers:
        reaper.join()
    states = Counter(t.state for t in study.get_trials())
    assert states == {TrialState.FAIL: 1, TrialState.WAITING: 1}
    storage.engine.dispose()

def test_a_reaped_trial_is_carried_over_to_its_retry_copy_once(any_storage):
    storage = open_storage(any_storage, heartbeat_interval=30, grace_period=120)
    study = optuna.create_study(study_name="c", storage=storage, direction="maximize")
    trial = study.ask()
    live = LiveTrial(trial)
    x = trial.suggest_float("x", 0.0, 1.0)
    trial.report(0.1, 1)
    trial.set_user_attr("physical_batch_size", 4)
    assert carry_over(live) is None  # not reaped: nothing to carry over
    # The reaper's two steps (liveness._reap): fail it, queue its copy.
    storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
    storage.get_heartbeat_stale_trial_callback()(study, storage.get_trial(trial._trial_id))
    assert carry_over(live) == 0
    # `live` now stands for the copy (Trial's private `_trial_id`, which hpo reads, with it),
    # and the reaped trial's object is left as it was.
    assert trial.number == 0
    trial = live.trial
    assert (trial.number, trial._trial_id) == (1, storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name("c"), 1))
    assert trial.params == {"x": x}
    trial.report(0.2, 2)
    study.tell(trial, 0.3)
    reaped, kept = study.get_trials()
    assert (reaped.state, kept.state) == (TrialState.FAIL, TrialState.COMPLETE)
    assert kept.intermediate_values == {1: 0.1, 2: 0.2}
    assert kept.user_attrs == {"physical_batch_size": 4, "result_of": 0}
    assert carry_over(LiveTrial(optuna.trial.Trial(study, reaped._trial_id))) is None
    storage.engine.dispose()

@pytest.fixture
def outage_pair(tmp_path):
    """A private server that tests may stop, and two workers' storages on it (heartbeat 1 s,
    grace 3 s) sharing a study: one whose trial runs, one that watches and reaps."""
    from postgres import PrivateServer

    server = PrivateServer(tmp_path)
    server.start()
    opened = []
    try:
        live, reaper = (open_storage(server.url, heartbeat_interval=1, grace_period=3)
                        for _ in range(2))
        opened = [live, reaper]
        study = optuna.create_study(study_name="o", storage=live)
        watched = optuna.load_study(study_name="o", storage=reaper)
        yield server, live, study, reaper, watched, reaper.get_study_id_from_name("o")
    finally:
        for s in opened:
            s.engine.dispose()
        server.destroy()


def test_a_live_trial_outlives_an_outage_longer_than_the_grace_period(outage_pair):
    """Every heartbeat stops while the database is down; a reaper that was cut off too waits
    a grace period of unbroken contact, in which the live trial beats again, before judging."""
    server, live, study, reaper, watched, study_id = outage_pair
    trial = study.ask()
    assert not reaper.trusts_heartbeats()  # just started: it cannot know yet
    with heartbeat(live, LiveTrial(trial)):
        time.sleep(3.5)
        assert reaper.trusts_heartbeats()
        server.stop()
        with pytest.raises(optuna.exceptions.StorageInternalError), single_attempt():
            reaper.get_all_studies()
        assert not reaper.trusts_heartbeats()
        time.sleep(6)  # twice the grace period without a heartbeat
        server.start_again()
        reaped_at = None
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            watched.get_trials(deepcopy=False)  # the loop's polling, which regains contact
            if reaped_at is None and reaper.trusts_heartbeats():
                reaped_at = time.monotonic()
            if reaper.trusts_heartbeats():
                reap(watched, reaper, study_id)
            time.sleep(0.5)
        assert reaped_at is not None, "the reaper never trusted the heartbeats again"
        assert [t.state for t in watched.get_trials()] == [TrialState.RUNNING]


def test_an_idle_reaper_that_waited_out_an_outage_for_the_lock_does_not_judge(outage_pair):
    """A worker with no trial of its own meets the outage only in taking the study lock:
    the lock's wait tells its contact too, so it does not reap the moment it gets the lock."""
    import threading

    server, live, study, idle, watched, study_id = outage_pair
    trial = study.ask()
    live.record_heartbeat(trial._trial_id)  # its worker beats, then the outage stops it
    time.sleep(3.5)
    assert idle.trusts_heartbeats()
    server.stop()
    threading.Timer(6.0, server.start_again).start()
    reap(watched, idle, study_id)  # meets the outage in waiting for the lock
    assert [t.state for t in watched.get_trials()] == [TrialState.RUNNING]
    assert not idle.trusts_heartbeats()


def test_a_reaper_cut_off_while_it_reads_heartbeats_judges_nothing_it_read_after(
        outage_pair, monkeypatch):
    """The outage begins in the reaper's own read of the heartbeats: the read waits it out,
    and what it reads then, every heartbeat stopped by the outage, is not judged."""
    import threading

    from hpo.search import budget

    server, live, study, reaper, watched, study_id = outage_pair
    trial = study.ask()
    stale_ids, began = budget.stale_trial_ids, []

    def outage_begins(connection, *args):
        if not began:
            began.append(server.stop())
            threading.Timer(6.0, server.start_again).start()
        return stale_ids(connection, *args)

    with heartbeat(live, LiveTrial(trial)):
        time.sleep(3.5)
        assert reaper.trusts_heartbeats()
        monkeypatch.setattr(budget, "stale_trial_ids", outage_begins)
        reap(watched, reaper, study_id)
        assert not reaper.trusts_heartbeats()
        assert [t.state for t in watched.get_trials()] == [TrialState.RUNNING]


def test_a_dead_workers_running_trial_fails_at_once_with_one_retry_copy(storage):
    """What the launcher does for a worker it saw die (`hpo run --workers`): the trials the
    worker left RUNNING fail now, each with one waiting copy; other workers' trials and its
    finished ones are left alone, and a second call finds nothing more to do."""
    opened = open_storage(storage, heartbeat_interval=30, grace_period=120)
    study = optuna.create_study(study_name="d", storage=opened)
    dead = study.ask()
    x = dead.suggest_float("x", 0.0, 1.0)
    dead.set_user_attr("worker", "host:123")
    other = study.ask()
    other.set_user_attr("worker", "host:1234")
    done = study.ask()
    done.set_user_attr("worker", "host:123")
    study.tell(done, 0.5)
    why = "its worker host:123 killed by SIGKILL"
    assert fail_dead_worker(study, opened, "host:123", why) == [(0, True)]
    for _ in range(2):  # again: the trial is failed already, and queued once
        trials = study.get_trials()
        assert [t.state for t in trials] == [TrialState.FAIL, TrialState.RUNNING,
                                             TrialState.COMPLETE, TrialState.WAITING]
        assert trials[0].user_attrs["error"] == why
        copy = trials[3]
        assert copy.params == {"x": x} and copy.system_attrs["retry_history"] == [0]
        assert "error" not in copy.user_attrs  # the copy starts clean
        assert fail_dead_worker(study, opened, "host:123", why) == []
    opened.engine.dispose()


def test_a_dead_workers_trial_whose_retries_are_used_up_is_failed_alone(storage):
    opened = open_storage(storage, heartbeat_interval=30, grace_period=120, max_retry=0)
    study = optuna.create_study(study_name="d", storage=opened)
    study.ask().set_user_attr("worker", "host:7")
    assert fail_dead_worker(study, opened, "host:7", "its worker host:7 exited with code 1") \
        == [(0, False)]
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL]
    opened.engine.dispose()


def test_the_launcher_names_a_worker_as_its_trials_record_it(monkeypatch):
    import os

    from hpo.search.liveness import WORKER_PID, worker_on_this_host
    from hpo.trial import records

    monkeypatch.delenv(WORKER_PID, raising=False)
    assert worker_on_this_host(os.getpid()) == records.worker_name()
    # A trial run in a process of its own (isolate_trials) is its worker's.
    monkeypatch.setenv(WORKER_PID, "4188")
    assert records.worker_name() == worker_on_this_host(4188)


def _passed_rung_zero(study: optuna.Study) -> optuna.Trial:
    """A trial that passed successive halving's first rung (Optuna's pruner writes it)."""
    trial = study.ask()
    trial.suggest_float("x", 0.0, 1.0)
    trial.report(0.9, 1)
    assert not trial.should_prune()
    return trial


def test_a_retry_meets_every_rung_afresh_and_a_carried_run_keeps_its_own(storage):
    """Optuna's retry copies every system attribute, the pruner's passed rungs with them; a
    retry that starts over must be judged at every rung again. The key is Optuna's private
    name: this fails when it changes."""
    from hpo.search.liveness import RUNG_PREFIX

    opened = open_storage(storage, heartbeat_interval=30, grace_period=120)
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3,
                                                    bootstrap_count=0)
    study = optuna.create_study(study_name="r", storage=opened, direction="maximize",
                                pruner=pruner)
    dead = _passed_rung_zero(study)
    passed = opened.get_trial(dead._trial_id)
    assert f"{RUNG_PREFIX}0" in passed.system_attrs  # Optuna's name for a passed rung
    opened.set_trial_state_values(dead._trial_id, state=TrialState.FAIL)
    opened.get_heartbeat_stale_trial_callback()(study, passed)
    retry = study.get_trials(states=(TrialState.WAITING,))[0]
    assert retry.system_attrs["retry_history"] == [0]
    assert not any(k.startswith(RUNG_PREFIX) for k in retry.system_attrs)

    alive = _passed_rung_zero(study)  # reaped while it ran: it goes on as its retry
    live = LiveTrial(alive)
    opened.set_trial_state_values(alive._trial_id, state=TrialState.FAIL)
    opened.get_heartbeat_stale_trial_callback()(study, opened.get_trial(alive._trial_id))
    assert carry_over(live) == alive.number
    carried = opened.get_trial(live.trial._trial_id)
    assert carried.system_attrs[f"{RUNG_PREFIX}0"] == 0.9
    opened.engine.dispose()
