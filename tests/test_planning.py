"""Planning a trial: the physical batch found by the batch search under an injected memory
limit, and the study's cached limit used by every later trial of the same key."""

import math
from collections import defaultdict

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
