"""The worker loop against real storages: budget, heartbeats, reaping, retries, the shared
batch cache, and the read-only commands. Real PostgreSQL, real processes."""

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import optuna
import pytest
import yaml
from conftest import REPO, study_dict
from optuna.trial import TrialState

from hpo.cli import main

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def worker(study_file, storage, n, *extra, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hpo.cli", "run", "--config", str(study_file),
         "--storage", storage, "--n-trials", str(n), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def states(storage, name="tiny") -> Counter:
    study = optuna.load_study(study_name=name, storage=storage)
    return Counter(t.state for t in study.trials)


@pytest.fixture
def one_model_study(tmp_path, tiny_model, small_data):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(study_dict([tiny_model], small_data)))
    return path


def test_run_on_each_backend(tiny_study, any_storage):
    assert main(["run", "--config", str(tiny_study), "--storage", any_storage,
                 "--n-trials", "2"]) == 0
    assert states(any_storage)[TrialState.COMPLETE] == 2


def test_create_is_idempotent_and_pins(tiny_study, any_storage, capsys):
    for _ in range(2):
        assert main(["create", "--config", str(tiny_study), "--storage", any_storage]) == 0
    study = optuna.load_study(study_name="tiny", storage=any_storage)
    assert study.user_attrs["search_space"]["fp_precision"] == ["none"]
    assert len(study.trials) == 0
    assert "ready" in capsys.readouterr().out


def test_many_workers_create_one_study_on_an_empty_database(tiny_study, pg_url):
    procs = [
        subprocess.Popen([sys.executable, "-m", "hpo.cli", "create", "--config", str(tiny_study),
                          "--storage", pg_url], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, [err for _, err in results]
    summaries = optuna.get_all_study_summaries(pg_url)
    assert [s.study_name for s in summaries] == ["tiny"]


def test_batch_cache_is_shared_between_workers(one_model_study, pg_url):
    env = {"HPO_FAULT_OOM_ABOVE_BATCH": "5"}
    first = worker(one_model_study, pg_url, 1, env=env)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    second = worker(one_model_study, pg_url, 3, env=env)
    assert second.wait(timeout=300) == 0, second.stderr.read()
    trials = sorted(optuna.load_study(study_name="tiny", storage=pg_url).trials,
                    key=lambda t: t.number)
    assert 1 <= trials[0].user_attrs["batch_probes"] <= 9
    assert trials[0].user_attrs["worker"] != trials[1].user_attrs["worker"]
    assert [t.user_attrs["batch_probes"] for t in trials[1:]] == [0, 0]
    assert all(t.user_attrs["physical_batch_size"] == 4 for t in trials)


def test_a_lowered_batch_is_seen_by_the_next_worker(one_model_study, pg_url):
    lowering = worker(one_model_study, pg_url, 1, env={"HPO_FAULT_OOM_AT_STEP": "2"})
    assert lowering.wait(timeout=300) == 0, lowering.stderr.read()
    study = optuna.load_study(study_name="tiny", storage=pg_url)
    (oom,) = study.trials
    assert oom.user_attrs["prune_reason"] == "oom"
    lowered_to = oom.user_attrs["batch_limit_after_oom"]["largest_ok"]
    assert main(["run", "--config", str(one_model_study), "--storage", pg_url,
                 "--n-trials", "2"]) == 0
    second = optuna.load_study(study_name="tiny", storage=pg_url).trials[1]
    assert second.user_attrs["batch_probes"] == 0
    assert second.user_attrs["physical_batch_size"] <= int(0.9 * lowered_to) or (
        second.user_attrs["physical_batch_size"] == 1)


@pytest.mark.slow
def test_eight_workers_end_exactly_on_budget(tiny_study, pg_url):
    procs = [worker(tiny_study, pg_url, 40) for _ in range(8)]
    for p in procs:
        assert p.wait(timeout=900) == 0, p.stderr.read()[-2000:]
    counts = states(pg_url)
    assert counts[TrialState.COMPLETE] + counts[TrialState.PRUNED] == 40
    assert sum(counts.values()) == 40, counts


def running_trials(storage: str) -> list:
    try:
        study = optuna.load_study(study_name="tiny", storage=storage)
    except KeyError:
        return []
    return study.get_trials(states=(TrialState.RUNNING,))


def wait_for(condition, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)


@pytest.mark.slow
def test_killed_worker_trial_is_failed_and_retried_by_a_waiting_worker(tiny_study, pg_url):
    env = {"HPO_HEARTBEAT_INTERVAL": "1", "HPO_GRACE_PERIOD": "4"}
    # Training settings are the worker's own (only the search space is pinned): the victim's
    # trial outlasts the survivor's start-up, the survivor's trials are quick.
    victim = worker(tiny_study, pg_url, 2, "--set", "training.epochs=1000", env=env)
    wait_for(lambda: len(running_trials(pg_url)) == 1 or victim.poll() is not None)
    survivor = worker(tiny_study, pg_url, 2, "--set", "training.epochs=5", env=env)
    wait_for(lambda: len(running_trials(pg_url)) == 2 or survivor.poll() is not None)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    # The survivor finishes its own trial, then has nothing to claim (1 finished + 1 running
    # = 2): only its reaping while it waits can fail the dead worker's trial and re-run it.
    assert survivor.wait(timeout=600) == 0, survivor.stderr.read()[-2000:]
    study = optuna.load_study(study_name="tiny", storage=pg_url)
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert len(failed) == 1
    killed = failed[0]
    retries = [t for t in study.trials if t.user_attrs.get("retry_of") == killed.number]
    assert len(retries) == 1 and retries[0].state in FINISHED
    assert retries[0].params == killed.params
    counts = Counter(t.state for t in study.trials)
    assert counts[TrialState.COMPLETE] + counts[TrialState.PRUNED] == 2
    assert counts[TrialState.RUNNING] == counts[TrialState.WAITING] == 0


def test_status_best_and_studies(tiny_study, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "2"]) == 0
    capsys.readouterr()
    assert main(["status", "--config", str(tiny_study), "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert "COMPLETE 2" in out and "best trial" in out
    assert main(["best", "--config", str(tiny_study), "--storage", storage,
                 "--format", "json"]) == 0
    import json

    best = json.loads(capsys.readouterr().out)
    assert set(best["params"]) >= {"model_name", "fp_precision", "target_effective_batch_size",
                                   "learning_rate"}
    runtime = best["runtime"]
    assert runtime["effective_batch_size"] == best["params"]["target_effective_batch_size"]
    assert runtime["physical_batch_size"] * runtime["grad_accum_steps"] >= (
        runtime["effective_batch_size"])
    assert best["training"]["max_grad_norm"] == 1.0
    assert main(["best", "--config", str(tiny_study), "--storage", storage]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trial"] == best["trial"]
    assert main(["studies", "--storage", storage]) == 0
    assert capsys.readouterr().out.startswith("tiny\t2 trials")


def test_password_never_printed(tiny_study, capsys):
    url = "postgresql+psycopg2://postgres:Sup3rS3cret@127.0.0.1:5432/postgres"
    main(["status", "--config", str(tiny_study), "--storage", url])
    captured = capsys.readouterr()
    assert "Sup3rS3cret" not in captured.out + captured.err


@pytest.mark.slow
def test_workers_survive_a_database_outage(tiny_study, tmp_path):
    from postgres import PrivateServer

    server = PrivateServer(tmp_path)
    server.start()
    try:
        url = server.url
        slow = ["--set", "training.epochs=6"]
        procs = [worker(tiny_study, url, 12, *slow) for _ in range(2)]
        deadline = time.monotonic() + 300
        finished = 0
        while finished < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                finished = sum(states(url)[s] for s in FINISHED)
            except (KeyError, Exception):
                finished = 0
        assert finished >= 3, "the study did not get going"
        server.stop()
        time.sleep(20)
        server.start_again()
        outputs = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
            outputs.append(out)
        study = optuna.load_study(study_name="tiny", storage=url)
        counts = Counter(t.state for t in study.trials)
        assert counts[TrialState.COMPLETE] + counts[TrialState.PRUNED] == 12
        assert counts[TrialState.RUNNING] == counts[TrialState.WAITING] == 0
        # Every result a worker reported is in the storage, with the same value.
        import re

        stored = {t.number: t.value for t in study.trials}
        reported = [(int(n), float(v)) for out in outputs
                    for n, v in re.findall(r"^trial (\d+) value ([\d.]+)", out, re.MULTILINE)]
        assert len(reported) == counts[TrialState.COMPLETE]
        for number, value in reported:
            assert stored[number] == pytest.approx(value, abs=1e-4)
    finally:
        server.destroy()
