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
    assert steps["oom"]["trials"][1]["prune_reason"] == "oom"
    assert len(steps["study"]["trials"]) == 4
    assert steps["study"]["final"]["pipeline_macro_f1"] == pytest.approx(
        steps["study"]["final"]["test_macro_f1"], abs=2e-3)
    assert steps["loop"]["hpo_over_trainer"] > 0 and all(
        row["mfu"] > 0 for row in steps["loop"]["rows"].values())
    assert steps["auto"]["pinned"]["decided"]["by"] == "cost"
    assert (out / "run.log").read_text().count("== step") == 2 * len(STEPS)


def _check_module():
    import importlib.util

    path = list(sys.path)  # check.py puts its folders on the path, for its own imports
    try:
        spec = importlib.util.spec_from_file_location("gpu_check", GPU / "check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def _row(state, reason, after):
    return {"state": state, "prune_reason": reason, "memory_after_mib": after}


def test_the_oom_step_finds_a_leak_that_stays():
    """The criterion the H200 run needed: memory a process keeps for good from its first
    trial on is no leak, memory the OOM left behind is, whether or not it is freed later."""
    oom_problems = _check_module().oom_problems
    clean = [_row("COMPLETE", None, 65.0), _row("PRUNED", "oom", 65.0),
             _row("COMPLETE", None, 65.0)]
    assert oom_problems(clean, rehearse=False) == []
    leaked = [_row("COMPLETE", None, 65.0), _row("PRUNED", "oom", 577.0),
              _row("COMPLETE", None, 577.0)]
    assert len(oom_problems(leaked, rehearse=False)) == 2
    assert oom_problems(clean[:2], rehearse=False) == [
        "3 trials expected (the worker goes on after the OOM): 2"]
    failed = [clean[0], _row("FAIL", None, 65.0), clean[2]]
    assert "did not end PRUNED (oom)" in oom_problems(failed, rehearse=False)[0]
