"""Trials in child processes: the same results as in-process, and no orphans."""

import os
import signal
import subprocess
import sys
import time

import optuna
import psutil
import pytest
from conftest import REPO
from optuna.trial import TrialState

from hpo.cli import main


def run(study_file, storage, n, *extra) -> int:
    return main(["run", "--config", str(study_file), "--storage", storage, "--n-trials", str(n),
                 *extra])


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
        assert x.user_attrs["worker"] != y.user_attrs["worker"]  # y ran in another process


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
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
