"""Trials in child processes: the same results as in-process, and no orphans."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import optuna
import psutil
import pytest
from conftest import REPO
from conftest import run_in_process as run
from optuna.trial import TrialState

from hpo.app import isolation
from hpo.outcome import ChildDied
from hpo.trial.executor import outcome_of


def test_child_process_trials_match_in_process_ones(tiny_study, tmp_path):
    same = f"sqlite:///{tmp_path / 'same.db'}"
    child = f"sqlite:///{tmp_path / 'child.db'}"
    assert run(tiny_study, same, 2) == 0
    assert run(tiny_study, child, 2, "--set", "training.isolate_trials=true") == 0
    a = sorted(optuna.load_study(study_name="tiny", storage=same).trials, key=lambda t: t.number)
    b = sorted(optuna.load_study(study_name="tiny", storage=child).trials,
               key=lambda t: t.number)
    assert [t.params for t in a] == [t.params for t in b]
    assert [t.state for t in b] == [TrialState.COMPLETE] * 2
    for x, y in zip(a, b, strict=True):
        assert x.value == pytest.approx(y.value, abs=1e-6)
        assert set(x.user_attrs) == set(y.user_attrs)
        assert x.user_attrs["physical_batch_size"] == y.user_attrs["physical_batch_size"]
        # y ran in a process of its own, for the same worker, which its launcher watches.
        assert x.user_attrs["worker"] == y.user_attrs["worker"]


# Loaded by every Python process started with the test's PYTHONPATH, so by the spawned child
# alone: it logs the child's freezes, unfreezes and full collections, each with how many
# objects were frozen at that moment.
GC_LOGGER = """
import gc, json, os
_log = os.environ["HPO_TEST_GC_LOG"]
_freeze, _unfreeze, _collect = gc.freeze, gc.unfreeze, gc.collect

def _record(event):
    with open(_log, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "event": event,
                            "frozen": gc.get_freeze_count()}) + "\\n")

def freeze():
    _freeze()
    _record("freeze")

def unfreeze():
    _record("unfreeze")
    _unfreeze()

def collect(*args, **kwargs):
    _record("collect")
    return _collect(*args, **kwargs)

gc.freeze, gc.unfreeze, gc.collect = freeze, unfreeze, collect
"""


def test_a_child_runs_its_trial_with_what_it_loaded_frozen(tiny_study, tmp_path, monkeypatch):
    """As a worker does in-process (test_worker), the child freezes what it loaded before its
    trial, so the trial's collections walk only what the trial made, and unfreezes after."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(GC_LOGGER)
    log = tmp_path / "gc.jsonl"
    monkeypatch.setenv("HPO_TEST_GC_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    storage = f"sqlite:///{tmp_path / 'frozen.db'}"
    assert run(tiny_study, storage, 1, "--set", "training.isolate_trials=true") == 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert {e["pid"] for e in events} - {os.getpid()}, "the child logged nothing"
    (child,) = {e["pid"] for e in events} - {os.getpid()}
    kinds = [e["event"] for e in events if e["pid"] == child]
    frozen = [e["frozen"] for e in events if e["pid"] == child]
    assert kinds.count("freeze") == kinds.count("unfreeze") == 1
    start, end = kinds.index("freeze"), kinds.index("unfreeze")
    assert start < end and frozen[start] > 0
    during = list(zip(kinds[start + 1:end], frozen[start + 1:end], strict=True))
    # The trial releases its memory (a full collection) before it is told, with what the
    # child loaded still frozen (fewer as some of it is freed).
    assert "collect" in [kind for kind, _ in during]
    assert all(n > 0 for _, n in during)


def test_a_child_killed_as_by_the_oom_killer_prunes_its_trial_and_lowers_the_batch(
        one_model_study, tmp_path, monkeypatch):
    # The kernel's OOM killer sends SIGKILL; the injected fault does so above 6 samples.
    monkeypatch.setenv("HPO_FAULT_KILL_ABOVE_BATCH", "6")
    storage = f"sqlite:///{tmp_path / 'killed.db'}"
    began = time.perf_counter()
    assert run(one_model_study, storage, 3, "--set", "training.isolate_trials=true",
               "--set", "search_space.target_effective_batch_size=[8]") == 0
    wall = time.perf_counter() - began
    study = optuna.load_study(study_name="tiny", storage=storage)
    trials = sorted(study.trials, key=lambda t: t.number)
    assert [t.state for t in trials] == [TrialState.PRUNED, TrialState.PRUNED,
                                         TrialState.COMPLETE]
    for killed, batch in zip(trials[:2], (8, 7), strict=True):
        assert killed.user_attrs["prune_reason"] == "oom"
        assert f"killed by SIGKILL (as the OOM killer does) at micro-batch {batch}" in \
            killed.user_attrs["error"]
        assert killed.user_attrs["batch_limit_after_oom"]["smallest_fail"] == batch
        # Told by the parent, with the time its child spent, as a trial told in-process.
        assert 0 < killed.user_attrs["trial_seconds"] < wall
    assert trials[2].user_attrs["physical_batch_size"] <= 6
    (limit,) = [v for k, v in study.user_attrs.items() if k.startswith("batch_limit:")]
    assert limit == {"largest_ok": 6, "smallest_fail": 7}


def test_a_child_that_crashes_fails_its_trial_and_lowers_nothing():
    attempt = isolation._Attempt(multiprocessing.get_context("spawn"))
    attempt("tiny|none|32|cpu", 8)
    for exitcode, error in ((-signal.SIGSEGV, "trial process killed by SIGSEGV"),
                            (1, "trial process exited with code 1")):
        outcome = outcome_of(0, ChildDied(exitcode, attempt.read()))
        # Not an out-of-memory kill: `executor.tell` lowers the batch limit only for "oom".
        assert (outcome.state, outcome.prune_reason, outcome.error) == (
            TrialState.FAIL, None, error)


@pytest.mark.slow
def test_killing_the_worker_kills_its_child(tiny_study, tmp_path):
    storage = f"sqlite:///{tmp_path / 'k.db'}"
    worker = subprocess.Popen(
        [sys.executable, "-m", "hpo.cli", "run", "--config", str(tiny_study), "--storage",
         storage, "--n-trials", "3", "--set", "training.isolate_trials=true",
         "--set", "training.epochs=1000"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.monotonic() + 120
    children = []
    while not children and time.monotonic() < deadline and worker.poll() is None:
        time.sleep(0.5)
        children = [c for c in psutil.Process(worker.pid).children(recursive=True)
                    if "spawn" in " ".join(c.cmdline())]
    assert children, worker.stderr.read() if worker.poll() is not None else "no child"
    # Killed once the child has opened its storage, after it asked to die with its parent: a
    # child still importing when its parent dies leaves only when its imports are done (it
    # then sees it was orphaned), which takes longer than the wait below on a loaded machine.
    database = os.path.realpath(tmp_path / "k.db")

    def opened() -> bool:
        return any(f.path == database for c in children for f in _open_files(c))

    while not opened() and time.monotonic() < deadline and worker.poll() is None:
        time.sleep(0.2)
    assert opened(), "the child never opened its storage"
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


def _open_files(process: psutil.Process) -> list:
    try:
        return process.open_files()
    except psutil.Error:
        return []
