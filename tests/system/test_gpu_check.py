"""The GPU check's rehearsal (benchmarks/gpu/run.sh --rehearse): every step of the check that
runs on a GPU machine, run on this CPU with tiny replicas and injected out-of-memory errors,
so that the check cannot rot between GPU runs. It also checks what travels there."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

GPU = REPO / "benchmarks" / "gpu"
STEPS = ["hardware", "check", "batch_search", "oom", "study", "loop", "auto"]


@pytest.mark.slow
def test_the_gpu_check_rehearses_every_step_on_the_cpu(tmp_path):
    if not any((GPU / "wheels").glob("hpo-*.whl")):
        # What travels is prepared as before a GPU run (downloads from the package index).
        subprocess.run(["bash", str(GPU / "prepare.sh")], check=True, timeout=600)
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", str(GPU / "run.sh"), "--rehearse", str(out)], capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "size: ok" in result.stdout and "imports: ok" in result.stdout
    report = json.loads((out / "gpu.json").read_text())
    assert report["rehearsal"] is True
    assert list(report["steps"]) == STEPS
    failed = {name: step["problems"] for name, step in report["steps"].items()
              if step["status"] != "ok"}
    assert not failed, failed
    steps = report["steps"]
    # The injected limit (6 samples) is found, and the batch trained with keeps the margin.
    for search in steps["batch_search"]["searches"]:
        assert search["true_largest"] == 6 and search["physical_batch"] == 5, search
    assert steps["oom"]["trials"][0]["prune_reason"] == "oom"
    assert len(steps["study"]["trials"]) == 4
    assert steps["study"]["final"]["pipeline_macro_f1"] == pytest.approx(
        steps["study"]["final"]["test_macro_f1"], abs=2e-3)
    assert steps["loop"]["hpo_over_trainer"] > 0 and all(
        row["mfu"] > 0 for row in steps["loop"]["rows"].values())
    assert steps["auto"]["pinned"]["decided"]["by"] == "cost"
    assert (out / "run.log").read_text().count("== step") == 2 * len(STEPS)
