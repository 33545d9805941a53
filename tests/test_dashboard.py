"""`hpo dashboard` in a real browser: headless Chromium renders the study a real `hpo run`
produced, and an OOM-pruned trial is told apart from a completed one."""

import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO, require_command

from hpo.cli import main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendered_text(url: str, profile) -> str:
    """The page's text after its scripts ran, as headless Chromium renders it."""
    dom = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=20000",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    ).stdout
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


@pytest.fixture
def dashboard(tiny_study, tmp_path, monkeypatch):
    require_command("chromium", "chromium")
    storage = f"sqlite:///{tmp_path / 'dash.db'}"
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "1"]) == 0
    monkeypatch.setenv("HPO_FAULT_OOM_AT_STEP", "2")
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "2"]) == 0
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "hpo.cli", "dashboard", "--storage", storage, "--port",
         str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/studies", timeout=2)
            break
        except OSError:
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "dashboard did not answer"
            time.sleep(0.3)
    yield base
    server.terminate()
    server.wait(timeout=10)


def test_dashboard_shows_trials_parameters_attributes_and_the_oom_prune(dashboard, tmp_path):
    studies = rendered_text(f"{dashboard}/dashboard", tmp_path / "p0")
    assert "tiny" in studies

    completed = rendered_text(f"{dashboard}/dashboard/studies/1/trials?numbers=0",
                              tmp_path / "p1")
    for text in ("Trial 0", "Complete", "model_name", "fp_precision",
                 "target_effective_batch_size", "learning_rate", "physical_batch_size",
                 "grad_accum_steps", "padding_efficiency"):
        assert text in completed, text
    assert "prune_reason" not in completed

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
