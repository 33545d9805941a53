"""Planning a trial: the physical batch found by the batch search under an injected memory
limit, and the study's cached limit used by every later trial of the same key."""

import math
from collections import defaultdict

import yaml
from conftest import run_in_process as run
from conftest import trials_of as trials
from optuna.trial import TrialState


def test_oom_above_batch_gives_physical_batch_four_and_a_cached_search(
    tiny_study, storage, monkeypatch
):
    monkeypatch.setenv("HPO_FAULT_OOM_ABOVE_BATCH", "5")
    assert run(tiny_study, storage, 6) == 0
    probes = defaultdict(list)
    for trial in trials(storage):
        assert trial.state == TrialState.COMPLETE
        assert trial.user_attrs["physical_batch_size"] == 4
        assert trial.user_attrs["effective_batch_size"] == (
            trial.params["target_effective_batch_size"])
        assert trial.user_attrs["grad_accum_steps"] == math.ceil(
            trial.params["target_effective_batch_size"] / 4)
        probes[trial.params["model_name"]].append(trial.user_attrs["batch_probes"])
    assert probes, "no trial ran"
    for model_probes in probes.values():
        assert 1 <= model_probes[0] <= 9
        assert all(p == 0 for p in model_probes[1:])


def test_a_models_first_search_reaches_the_physical_limit_so_no_later_trial_probes(
    one_model_study, storage
):
    """The first search probes up to `training.max_physical_batch_size`, not the trial's own
    effective batch: a later trial at a larger effective batch finds its answer cached."""
    config = yaml.safe_load(one_model_study.read_text())
    config["study"]["enqueue"] = [{"target_effective_batch_size": 8},
                                  {"target_effective_batch_size": 16}]
    one_model_study.write_text(yaml.safe_dump(config))
    assert run(one_model_study, storage, 2) == 0
    first, second = trials(storage)
    assert [t.params["target_effective_batch_size"] for t in (first, second)] == [8, 16]
    assert first.user_attrs["batch_probes"] >= 1
    assert second.user_attrs["batch_probes"] == 0
    assert [t.user_attrs["physical_batch_size"] for t in (first, second)] == [8, 16]
    assert [t.user_attrs["grad_accum_steps"] for t in (first, second)] == [1, 1]
