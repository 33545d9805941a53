"""The fleet under faults: real `hpo run` workers with the median pruner on, on a private
PostgreSQL, restarted when they fail as docker-compose's `restart: on-failure` restarts them,
through database outages shorter and longer than the grace period, SIGKILLs at the dangerous
moments (HPO_FAULT_KILL_AT, HPO_FAULT_KILL_ABOVE_BATCH) and a trial process killed from outside.

After each: every worker ends with exit code 0 within a bound, exactly the budget finished,
nothing RUNNING or WAITING, every value a worker printed is in storage, and the only FAILed
trials are those whose own worker was killed, each retried."""

import os
import re
import signal
import threading
import time
from collections import Counter

import optuna
import psutil
import pytest
from conftest import start_worker
from optuna.trial import TrialState
from postgres import study_trials

from hpo.app.worker import LOST_LOCK_CLAIM

pytestmark = pytest.mark.slow

# Scaled down from 30 s and 120 s, as the README says a test may.
LIVENESS = {"HPO_HEARTBEAT_INTERVAL": "1", "HPO_GRACE_PERIOD": "4"}
# Three epochs, so the median pruner has steps to judge; it judges from the second trial on.
# Trials counted (`study.budget: trials`), so that a study ends with exactly its budget of
# trials; the soak (benchmarks/soak.py) keeps the default budget of trainings under faults.
SETTINGS = ("--set", "training.epochs=3", "--set", "study.pruner.name=median",
            "--set", "study.pruner.n_startup_trials=1", "--set", "study.pruner.n_warmup_steps=0",
            "--set", "study.budget=trials")
BOUND_SECONDS = 420
MAX_RESTARTS = 3


class Supervised:
    """One worker, restarted while it exits non-zero (at most MAX_RESTARTS times); its first
    run has the fault variables, as a worker that is killed once."""

    def __init__(self, study_file, url: str, budget: int, *extra: str, fault: dict | None = None
                 ) -> None:
        self.runs: list[tuple[int, int, str, str]] = []  # pid, exit code, stdout, stderr
        self.current = None
        self._start = lambda env: start_worker(study_file, url, budget, *SETTINGS, *extra,
                                               env={**LIVENESS, **env})
        self._fault = fault or {}
        self._thread = threading.Thread(target=self._supervise, daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        env = self._fault
        for _ in range(MAX_RESTARTS + 1):
            self.current = self._start(env)
            out, err = self.current.communicate()
            self.runs.append((self.current.pid, self.current.returncode, out, err))
            if self.current.returncode == 0:
                return
            env = {}

    def wait(self, deadline: float) -> None:
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        if self.current is not None and self.current.poll() is None:
            self.current.kill()
        self._thread.join(30)


@pytest.fixture
def server(tmp_path):
    from postgres import PrivateServer

    server = PrivateServer(tmp_path)
    server.start()
    yield server
    server.destroy()


@pytest.fixture
def fleet():
    workers: list[Supervised] = []
    yield workers
    for worker in workers:
        worker.stop()


def finished(url: str) -> int:
    """Finished trials; -1 while the database is down or the study not created yet, which
    no wait below takes for progress."""
    try:
        trials = study_trials(url, "tiny")
    except Exception:
        return -1
    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def assert_sound(url: str, workers: list[Supervised], budget: int, started: float) -> Counter:
    """The study ended as a fleet must end it, whatever happened on the way. The states'
    count leaves out of FAIL the claims given back (under "given back")."""
    deadline = started + BOUND_SECONDS
    for worker in workers:
        worker.wait(deadline)
    runs = [run for worker in workers for run in worker.runs]
    for worker in workers:
        assert worker.runs and worker.runs[-1][1] == 0, (
            f"a worker did not end well within {BOUND_SECONDS} s: "
            f"{[(code, err[-2000:]) for _, code, _, err in worker.runs]}")
    assert all(code in (0, -signal.SIGKILL) for _, code, _, _ in runs), (
        [(code, err[-2000:]) for _, code, _, err in runs if code not in (0, -signal.SIGKILL)])
    study = optuna.load_study(study_name="tiny", storage=url)
    trials = {t.number: t for t in study.trials}
    states = Counter(t.state for t in trials.values())
    assert states[TrialState.COMPLETE] + states[TrialState.PRUNED] == budget, states
    assert states[TrialState.RUNNING] == states[TrialState.WAITING] == 0, states
    printed = [(int(n), float(v)) for _, _, out, _ in runs
               for n, v in re.findall(r"^trial (\d+) value ([\d.]+)", out, re.MULTILINE)]
    assert len(printed) == states[TrialState.COMPLETE]
    for number, value in printed:
        assert trials[number].state == TrialState.COMPLETE
        assert trials[number].value == pytest.approx(value, abs=1e-4)
    killed = {pid for pid, code, _, _ in runs if code == -signal.SIGKILL}
    retried = {n for t in trials.values() for n in t.system_attrs.get("retry_history", ())}
    # A claim made while an outage cut the study lock, given back because the budget would
    # overshoot (worker._claim_stands): it never trained, so it holds no result to lose.
    given_back = {t.number for t in trials.values() if t.state == TrialState.FAIL
                  and t.user_attrs.get("error") == LOST_LOCK_CLAIM}
    assert all(not trials[n].intermediate_values for n in given_back)
    for trial in trials.values():
        if trial.state != TrialState.FAIL or trial.number in given_back:
            continue
        worker = trial.user_attrs.get("worker")
        # Killed before it wrote anything, or while its own worker ran it: nothing else.
        assert worker is None or int(worker.rsplit(":", 1)[1]) in killed, (
            f"trial {trial.number} failed with its worker {worker} alive (killed: {killed}); "
            f"started {trial.datetime_start}, ended {trial.datetime_complete}, user attrs "
            f"{trial.user_attrs}, system attrs {trial.system_attrs}")
        assert "error" not in trial.user_attrs, trial.user_attrs["error"]
        assert trial.number in retried, f"trial {trial.number} failed and was not retried"
    assert states[TrialState.FAIL] - len(given_back) <= len(killed)
    states[TrialState.FAIL] -= len(given_back)
    states["given back"] = len(given_back)
    return states


def test_outages_shorter_and_longer_than_the_grace_period_lose_nothing(
        one_model_study, server, fleet):
    url, budget = server.url, 10
    started = time.monotonic()
    fleet.extend(Supervised(one_model_study, url, budget) for _ in range(2))
    wait_until(lambda: finished(url) >= 2, 180, "the first trials")
    server.stop()
    time.sleep(2)  # shorter than the grace period (4 s)
    server.start_again()
    wait_until(lambda: finished(url) >= 0, 60, "the database back")
    done = finished(url)
    wait_until(lambda: finished(url) > done, 120, "a trial after the short outage")
    server.stop()
    time.sleep(12)  # three grace periods without a heartbeat
    server.start_again()
    states = assert_sound(url, fleet, budget, started)
    assert states[TrialState.FAIL] == 0  # no live trial was taken for dead


def test_workers_killed_while_claiming_before_the_first_heartbeat_and_while_telling(
        one_model_study, server, fleet):
    url, budget = server.url, 6
    started = time.monotonic()
    fleet.extend(Supervised(one_model_study, url, budget, fault={"HPO_FAULT_KILL_AT": point})
                 for point in ("claim", "heartbeat", "tell"))
    states = assert_sound(url, fleet, budget, started)
    assert sum(code == -signal.SIGKILL for w in fleet for _, code, _, _ in w.runs) == 3
    assert states[TrialState.FAIL] == 3  # the three killed workers' trials, each retried


def test_workers_killed_during_the_batch_probe_and_during_training(
        one_model_study, server, fleet):
    url, budget = server.url, 6
    started = time.monotonic()
    fleet.extend([
        # The probe tries the whole target batch (8 or 16) first: killed there.
        Supervised(one_model_study, url, budget, fault={"HPO_FAULT_KILL_ABOVE_BATCH": "4"}),
        Supervised(one_model_study, url, budget, fault={"HPO_FAULT_KILL_AT": "train"}),
    ])
    states = assert_sound(url, fleet, budget, started)
    assert sum(code == -signal.SIGKILL for w in fleet for _, code, _, _ in w.runs) == 2
    assert states[TrialState.FAIL] == 2


def test_a_trial_process_killed_in_isolate_mode_is_pruned_not_failed(
        one_model_study, server, fleet):
    url, budget = server.url, 3
    started = time.monotonic()
    worker = Supervised(one_model_study, url, budget, "--set", "training.isolate_trials=true")
    fleet.append(worker)
    children: list[psutil.Process] = []

    def a_child() -> bool:
        if worker.current is None or worker.current.poll() is not None:
            return False
        children[:] = [c for c in psutil.Process(worker.current.pid).children(recursive=True)
                       if "spawn" in " ".join(c.cmdline())]
        return bool(children)

    wait_until(a_child, 120, "a trial process")
    os.kill(children[0].pid, signal.SIGKILL)  # as the OOM killer would
    states = assert_sound(url, fleet, budget, started)
    assert states[TrialState.FAIL] == 0
    study = optuna.load_study(study_name="tiny", storage=url)
    killed = [t for t in study.trials if "killed by SIGKILL" in t.user_attrs.get("error", "")]
    assert len(killed) == 1 and killed[0].state == TrialState.PRUNED
    assert killed[0].user_attrs["prune_reason"] == "oom"
