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
STEPS = ["hardware", "oom", "steady", "workers", "study", "loop", "check", "batch_search",
         "auto"]


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
    assert len(steps["oom"]["memory_after_mib"]) == 3
    assert steps["hardware"]["shape"].startswith("small BERT")  # a GPU's is base-size
    assert len(steps["study"]["trials"]) == 4
    shared = steps["study"]["shared_gpu"]  # no CUDA: nothing is held outside a worker
    assert shared["warnings"] == 0 and shared["oom_prunes"] == []
    assert shared["cached_under_contention"] == {}
    assert steps["study"]["final"]["pipeline_macro_f1"] == pytest.approx(
        steps["study"]["final"]["test_macro_f1"], abs=2e-3)
    assert steps["loop"]["hpo_over_trainer"] > 0 and all(
        row["mfu"] > 0 for row in steps["loop"]["rows"].values())
    # (h): both loops ran every step, timed whole and after the warm-up.
    for row in steps["steady"]["rows"].values():
        assert row["steps"] == 12 and row["steady_samples_per_second"] > 0 and row["mfu"] > 0
    assert all(goal["met"] is None for goal in steps["steady"]["goals"].values())
    # (i): one worker, then two on one mocked GPU, each with the whole budget.
    runs = steps["workers"]["runs"]
    assert list(runs) == ["one worker", "gpus:2"]
    for run in runs.values():
        assert run["finished"] == 4 and run["trials_per_hour"] > 0
        assert all(t["train_flops"] and t["trial_over_step"] > 0 and t["mfu"] is None
                   for t in run["trials"])
    assert {t["gpu_share"] for t in runs["gpus:2"]["trials"]} == {"1/2"}
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


def test_a_limit_cached_beside_another_process_is_found():
    """Step (e): an OOM at a batch a trial's own peak memory says fits the device alone
    (deberta-v3 at 10 on an H200, run 1) is the neighbour's doing; one near the device's
    memory is not judged so, and a key with no completed trial is left unjudged."""
    contended_limits = _check_module().contended_limits
    rows = [{"state": "COMPLETE", "model": "deberta-v3-base", "precision": "bf16",
             "peak_memory_mib": 20_000.0, "physical_batch_size": 32}]
    total = 143_771.0
    key = "/w/models/deberta-v3-base|bf16|512|NVIDIA H200 143771MiB"
    contended, unjudged = contended_limits(
        {key: {"largest_ok": 9, "smallest_fail": 10},
         "/w/models/bert-base-uncased|bf16|512|NVIDIA H200 143771MiB":
             {"largest_ok": 5, "smallest_fail": 6},
         "/w/models/roberta-base|fp16|512|NVIDIA H200 143771MiB":
             {"largest_ok": 256, "smallest_fail": None}}, rows, total)
    assert list(contended) == [key] and "out of memory at 10" in contended[key]
    assert unjudged == ["/w/models/bert-base-uncased|bf16|512|NVIDIA H200 143771MiB"]
    alone = {key: {"largest_ok": 210, "smallest_fail": 212}}  # 132,500 MiB: near the top
    assert contended_limits(alone, rows, total) == ({}, [])


def test_a_step_that_would_not_fit_the_budget_is_skipped():
    check = _check_module()
    assert check.skip_reason("workers", None) is None  # no budget: the rehearsal
    assert check.skip_reason("workers", check.ESTIMATES["workers"] + 10) is None
    why = check.skip_reason("study", check.ESTIMATES["study"] - 1)
    assert why is not None and "--steps study" in why
    # What the next GPU run must show comes first, and by the estimates fits the default
    # budget of 450 s: the last of them starts with its estimate and the margin left.
    first = ["hardware", "oom", "steady", "workers", "study"]
    assert list(check.STEPS[:5]) == first
    assert sum(check.ESTIMATES[name] for name in first) + check.MARGIN_SECONDS <= 450
