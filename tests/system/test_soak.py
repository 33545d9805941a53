"""The CI soak (issue 30): benchmarks/soak.py for 2 minutes of random outages, SIGKILLs and
SIGTERMs under three workers and the readers, so a regression in what a fleet must survive
shows here and not in a user's long run. Its checks are the soak's own; the report is shown
when one fails."""

import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def test_a_two_minute_soak_passes_every_check():
    done = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--minutes", "2", "--workers", "3",
         "--seed", "1"], cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "| budget exact | yes |" in done.stdout
