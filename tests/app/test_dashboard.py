"""`hpo dashboard` in a real browser: headless Chromium renders the study a real `hpo run`
produced, and an OOM-pruned trial is told apart from a completed one."""

import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from conftest import REPO, free_port, rendered_text, require_command

from hpo.cli import main
from hpo.search.artifacts import kept


@pytest.fixture
def results(tiny_study, tmp_path, monkeypatch) -> str:
    """A storage holding a completed trial and OOM-pruned ones, from real `hpo run`s."""
    storage = f"sqlite:///{tmp_path / 'dash.db'}"
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "1"]) == 0
    monkeypatch.setenv("HPO_FAULT_OOM_AT_STEP", "2")
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "2"]) == 0
    return storage


@contextlib.contextmanager
def served(storage: str, *extra: str) -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "hpo.cli", "dashboard", "--storage", storage, "--port",
         str(port), *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/studies", timeout=2)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()
                assert time.monotonic() < deadline, "dashboard did not answer"
                time.sleep(0.3)
        yield base
    finally:
        server.terminate()
        try:
            # Seconds on an idle machine; a loaded CI machine once took over 10.
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture
def dashboard(results) -> Iterator[str]:
    require_command("chromium", "chromium")
    with served(results) as base:
        yield base


def request(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body or {}).encode()
    ask = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(ask, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def test_the_dashboard_is_read_only_unless_writes_are_allowed(results):
    study = optuna.load_study(study_name="tiny", storage=results)
    (trial,) = [t for t in study.trials if t.number == 0]
    with served(results) as base:
        status, body = request("POST", f"{base}/api/trials/{trial._trial_id}/user-attrs",
                               {"user_attrs": {"note": "x"}})
        assert status == 403 and "read-only" in body and "--allow-writes" in body
        status, body = request("DELETE", f"{base}/api/studies/{study._study_id}")
        # optuna-dashboard removes the study's artifacts first: that is refused already.
        assert status == 403 and "removing an artifact refused" in body
    after = optuna.load_study(study_name="tiny", storage=results).trials
    assert [(t.state, t.user_attrs) for t in after] == [
        (t.state, t.user_attrs) for t in study.trials]
    (entry,) = kept(study).values()
    store = Path(results.removeprefix("sqlite:///")).with_name("dash-artifacts")
    assert (store / entry["artifact_id"]).is_file(), "the read-only dashboard removed a model"
    with served(results, "--allow-writes") as base:
        status, _ = request("DELETE", f"{base}/api/studies/{study._study_id}")
        assert status == 204
    assert optuna.get_all_study_names(storage=results) == []
    assert not (store / entry["artifact_id"]).exists()


def test_dashboard_shows_trials_parameters_attributes_and_the_oom_prune(dashboard, results,
                                                                         tmp_path):
    studies = rendered_text(f"{dashboard}/dashboard", tmp_path / "p0")
    assert "tiny" in studies

    completed = rendered_text(f"{dashboard}/dashboard/studies/1/trials?numbers=0",
                              tmp_path / "p1")
    for text in ("Trial 0", "Complete", "model_name", "fp_precision",
                 "target_effective_batch_size", "learning_rate", "physical_batch_size",
                 "grad_accum_steps", "padding_efficiency"):
        assert text in completed, text
    assert "prune_reason" not in completed

    # The completed trial's model, kept in the artifact store beside the SQLite file, is
    # listed on its trial and served for download.
    assert "trial-0.zip" in completed
    study = optuna.load_study(study_name="tiny", storage=results)
    (entry,) = kept(study).values()
    trial_id = study.trials[0]._trial_id
    with urllib.request.urlopen(
            f"{dashboard}/artifacts/{study._study_id}/{trial_id}/{entry['artifact_id']}",
            timeout=10) as answer:
        assert answer.read(2) == b"PK"  # a zip archive

    pruned = rendered_text(f"{dashboard}/dashboard/studies/1/trials?numbers=1", tmp_path / "p2")
    assert "Trial 1" in pruned and "Pruned" in pruned
    assert re.search(r"prune_reason\s+oom", pruned)
    assert "out of memory" in pruned


def test_dashboard_binds_loopback_by_default_and_hides_the_password(capsys):
    from hpo.cli import build_parser

    args = build_parser().parse_args(["dashboard"])
    assert args.host == "127.0.0.1" and args.port == 8080
    code = main(["dashboard", "--storage",
                 "postgresql+psycopg2://u:Hidden-Pw@127.0.0.1:1/x", "--port", "1"])
    captured = capsys.readouterr()
    assert code == 2
    assert "Hidden-Pw" not in captured.out + captured.err


def test_every_write_of_the_storage_api_is_refused_and_every_read_is_not():
    from optuna.storages import BaseStorage

    from hpo.app.dashboard import ReadOnlyStorage

    reads = {"remove_session", "check_trial_is_updatable"}
    assert ReadOnlyStorage.upgrade.__code__.co_name == "refuse"  # a schema migration
    for name, attribute in vars(BaseStorage).items():
        if name.startswith("_") or not callable(attribute):
            continue
        refused = getattr(ReadOnlyStorage, name).__code__.co_name == "refuse"
        assert refused == (not name.startswith("get_") and name not in reads), name


def test_the_dashboard_s_artifact_store_is_read_only_unless_writes_are_allowed(tmp_path):
    import io

    import bottle

    from hpo.app.dashboard import DashboardArtifactStore
    from hpo.search.artifacts import open_store

    store = open_store(str(tmp_path / "store"))
    store.write("a1", io.BytesIO(b"model"))
    read_only = DashboardArtifactStore(store, writable=False)
    assert read_only.open_reader("a1").read() == b"model"
    for attempt in (lambda: read_only.remove("a1"),
                    lambda: read_only.write("a2", io.BytesIO(b"x"))):
        with pytest.raises(bottle.HTTPError) as refused:
            attempt()
        assert refused.value.status_code == 403
    assert (tmp_path / "store" / "a1").is_file()
    writable = DashboardArtifactStore(store, writable=True)
    writable.remove("a1")
    writable.remove("a1")  # a model removed when it fell out of the best: no error
    assert not (tmp_path / "store" / "a1").exists()
