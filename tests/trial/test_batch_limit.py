"""hpo/trial/batch_limit.py: the largest micro-batch that fits. The search on simulated devices
(a step that fails above a limit, a GPU whose peak grows linearly), the bounds and margins
derived, and the limit the study keeps for its workers on real storages."""

import math

import optuna
import pytest
import torch
from conftest import start_worker
from optuna.trial import TrialState

from hpo.cli import main
from hpo.search.storage import open_storage
from hpo.training import memory
from hpo.trial import batch_limit
from hpo.trial.batch_limit import BatchLimit, StudyBatchCache


def simulated(limit: int):
    calls = []

    def step(batch: int) -> None:
        calls.append(batch)
        if batch > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory at {batch}")

    return step, calls


@pytest.mark.parametrize("limit", [1, 3, 7, 23, 37, 100, 200, 255, 256])
def test_search_finds_the_limit_within_nine_probes(limit):
    step, calls = simulated(limit)
    result = batch_limit.search(step, 256, BatchLimit())
    assert result.limit.largest_ok == limit
    assert result.probes == len(calls) <= 9
    if limit < 256:
        assert result.limit.smallest_fail == limit + 1


def test_search_when_even_one_sample_fails():
    step, _ = simulated(0)
    result = batch_limit.search(step, 64, BatchLimit())
    assert result.limit.largest_ok == 0
    assert result.limit.smallest_fail == 1


def test_known_limit_needs_no_probe():
    step, calls = simulated(5)
    first = batch_limit.search(step, 32, BatchLimit())
    again = batch_limit.search(step, 64, first.limit)
    assert again.probes == 0 and calls == [32, 16, 8, 4, 6, 5]
    assert batch_limit.search(step, 4, BatchLimit(8, None)).probes == 0


def test_search_continues_from_a_lower_bound():
    step, calls = simulated(100)
    result = batch_limit.search(step, 256, BatchLimit(32, None))
    assert result.limit == BatchLimit(100, 101)
    assert min(calls) > 32


def test_other_errors_in_a_probe_propagate():
    def step(batch: int) -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError):
        batch_limit.search(step, 16, BatchLimit())


@pytest.mark.parametrize(
    ("limit", "bound", "expected"),
    [
        (BatchLimit(5, 6), 32, 4),  # a GPU that holds 5: margin 0.9 -> 4
        (BatchLimit(1, 2), 32, 1),  # never below 1
        (BatchLimit(32, None), 32, 32),  # no limit met below the bound: no margin
        (BatchLimit(200, 201), 32, 32),  # limit far above the bound
        (BatchLimit(100, 101), 256, 90),
    ],
)
def test_physical_batch(limit, bound, expected):
    assert batch_limit.physical_batch(limit, bound, 0.9) == expected


def test_eval_batch_is_larger_than_training_batch():
    assert batch_limit.eval_batch(BatchLimit(5, 6), 4, 32) == 5
    assert batch_limit.eval_batch(BatchLimit(32, None), 32, 32) == 64


def test_merge_keeps_the_tighter_bounds():
    assert BatchLimit(10, None).merge(BatchLimit(20, 40)) == BatchLimit(20, 40)
    assert BatchLimit(30, 40).merge(BatchLimit(0, 25)) == BatchLimit(24, 25)
    assert BatchLimit(16, None).after_oom(16) == BatchLimit(15, 16)


def linear_device(static: int, per_sample: int, capacity: int):
    """A fake GPU whose peak memory grows linearly with the batch."""
    last = {}

    def step(batch: int) -> None:
        last["peak"] = static + per_sample * batch
        if last["peak"] > capacity:
            raise torch.OutOfMemoryError("CUDA out of memory")

    return step, memory.MemoryProbe(capacity, lambda: last["peak"])


@pytest.mark.parametrize("per_sample_mb", [60, 150, 400, 1400, 7000])
def test_memory_model_finds_the_limit_in_fewer_probes(per_sample_mb):
    gib, mib = 2**30, 2**20
    step, probe = linear_device(2 * gib, per_sample_mb * mib, 16 * gib)
    true_limit = (14 * gib) // (per_sample_mb * mib)
    guided = batch_limit.search(step, 256, BatchLimit(), probe)
    plain = batch_limit.search(step, 256, BatchLimit())
    assert guided.limit == plain.limit == BatchLimit(true_limit, true_limit + 1)
    assert guided.probes <= 5 < plain.probes


def test_memory_model_that_is_wrong_still_finds_the_limit():
    # Memory that grows with the square of the batch: the line overestimates the limit.
    last = {}

    def step(batch: int) -> None:
        last["peak"] = 1000 + 3 * batch**2
        if last["peak"] > 60_000:
            raise torch.OutOfMemoryError("CUDA out of memory")

    result = batch_limit.search(step, 256, BatchLimit(), memory.MemoryProbe(60_000,
                                                                      lambda: last["peak"]))
    assert result.limit == BatchLimit(140, 141)
    assert result.probes <= 13


def test_a_gpu_searches_to_the_physical_limit_and_a_cpu_to_the_trials_batch():
    """On a GPU a model and precision is searched once, to the limit, so a later trial at a
    larger effective batch probes nothing; on a CPU each probe above what fits would meet the
    OOM killer, so the search stops at the trial's own batch."""
    from conftest import CPU_AVX2, H100

    assert batch_limit.search_bound(H100, target=8, max_physical=256) == 256
    assert batch_limit.search_bound(H100, target=512, max_physical=256) == 256
    assert batch_limit.search_bound(CPU_AVX2, target=8, max_physical=256) == 8
    assert batch_limit.search_bound(CPU_AVX2, target=512, max_physical=256) == 256


def test_study_batch_cache_round_trip_and_lowering():
    study = optuna.create_study()
    cache = StudyBatchCache(study)
    assert cache.get("k") == BatchLimit()
    cache.update("k", BatchLimit(5, 6))
    assert StudyBatchCache(study).get("k") == BatchLimit(5, 6)
    lowered = cache.lower("k", 4)
    assert lowered == BatchLimit(3, 4)
    assert batch_limit.physical_batch(lowered, 32, 0.9) == math.floor(0.9 * 3)


def test_an_oom_at_one_sample_prunes_its_trial_but_is_not_kept_for_the_study():
    """Issue 30: one OOM at micro-batch 1 (a GPU another process filled for a moment) was
    stored, and every later trial of that model and precision was pruned for good."""
    study = optuna.create_study()
    cache = StudyBatchCache(study)
    cache.update("k", BatchLimit(8, 12))
    assert cache.lower("k", 1) == BatchLimit(0, 1)  # this trial goes by it
    assert StudyBatchCache(study).get("k") == BatchLimit(8, 12)  # the study keeps what it knew
    assert cache.update("new", BatchLimit(0, 1)) == BatchLimit(0, 1)
    assert StudyBatchCache(study).get("new") == BatchLimit()
    assert "batch_limit:new" not in study.user_attrs
    assert cache.lower("k", 2) == BatchLimit(1, 2)  # an OOM at 2 still lowers it for all
    assert StudyBatchCache(study).get("k") == BatchLimit(1, 2)


def test_study_batch_cache_merges_what_another_worker_wrote(any_storage):
    optuna.create_study(study_name="s", storage=any_storage)
    mine = StudyBatchCache(optuna.load_study(study_name="s", storage=any_storage))
    theirs = StudyBatchCache(optuna.load_study(study_name="s", storage=any_storage))
    theirs.update("k", BatchLimit(8, 12))
    assert mine.update("k", BatchLimit(10, None)) == BatchLimit(10, 12)


def test_batch_cache_is_shared_between_workers(one_model_study, pg_url):
    env = {"HPO_FAULT_OOM_ABOVE_BATCH": "5"}
    first = start_worker(one_model_study, pg_url, 1, env=env)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    second = start_worker(one_model_study, pg_url, 3, env=env)
    assert second.wait(timeout=300) == 0, second.stderr.read()
    trials = sorted(optuna.load_study(study_name="tiny", storage=pg_url).trials,
                    key=lambda t: t.number)
    assert 1 <= trials[0].user_attrs["batch_probes"] <= 9
    assert trials[0].user_attrs["worker"] != trials[1].user_attrs["worker"]
    assert [t.user_attrs["batch_probes"] for t in trials[1:]] == [0, 0]
    assert all(t.user_attrs["physical_batch_size"] == 4 for t in trials)


def test_a_lowered_batch_is_seen_by_the_next_worker(one_model_study, pg_url):
    lowering = start_worker(one_model_study, pg_url, 1, env={"HPO_FAULT_OOM_AT_STEP": "2"})
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


def test_the_shared_batch_cache_is_updated_under_the_study_lock(any_storage):
    import threading
    import time

    from hpo.search import budget
    from hpo.trial.batch_limit import shared_batch_cache

    storage = open_storage(any_storage)
    study = optuna.create_study(study_name="s", storage=storage)
    cache = shared_batch_cache(study, storage)
    with budget.study_lock(storage.engine, "s"):  # another worker merging its own finding
        writer = threading.Thread(target=cache.update, args=("k", BatchLimit(8, 12)))
        writer.start()
        time.sleep(1)
        assert cache.get("k") == BatchLimit()  # it waits for the lock
    writer.join()
    assert cache.get("k") == BatchLimit(8, 12)
    storage.engine.dispose()


def test_an_oom_lowers_the_studys_limit_only_where_the_device_was_not_shared(monkeypatch):

    from conftest import H100

    from hpo.outcome import Outcome
    from hpo.trial.batch_limit import Fitted

    oom = Outcome(TrialState.PRUNED, prune_reason="oom", error="out of memory")
    fitted = Fitted("m|bf16", 12)
    held = [0]
    asked = []
    monkeypatch.setattr(batch_limit.memory, "foreign_bytes",
                        lambda _device: asked.append(1) or held[0])
    assert batch_limit.tried_alone(oom, fitted, H100) == ("m|bf16", 12)
    held[0] = 2**30  # another process holds memory now
    assert batch_limit.tried_alone(oom, fitted, H100) is None
    held[0] = 0
    # it did when the batch was fitted
    assert batch_limit.tried_alone(oom, Fitted("m|bf16", 12, 2**30), H100) is None
    assert batch_limit.tried_alone(oom, None, H100) is None
    # Any other end asks the device nothing.
    asked.clear()
    failed = Outcome(TrialState.FAIL, error="device-side assert")
    assert batch_limit.tried_alone(failed, fitted, H100) is None
    assert asked == []

