"""The centre of the search space, run first: hpo.search.centre and its place in the queue."""

import math

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from hpo.config import SearchSpace
from hpo.search import centre
from hpo.search.study import join
from hpo.study_files import load, study_path


@pytest.mark.parametrize(("dist", "expected"), [
    (FloatDistribution(1e-5, 1e-3, log=True), 1e-4),
    (FloatDistribution(0.0, 0.1), 0.05),
    (FloatDistribution(0.0, 0.9, step=0.3), 0.6),  # 0.45 onto the grid: 0.3 x round(1.5)
    (IntDistribution(16, 512, log=True), 91),
    (IntDistribution(1, 5), 3),
    (IntDistribution(2, 10, step=4), 6),
    (CategoricalDistribution([32, 8, 16, 64]), 16),  # numbers: the middle, lower of two
    (CategoricalDistribution(["b", "a", "c"]), "b"),  # names: the first, as listed
    (CategoricalDistribution([True, False]), True),
])
def test_the_centre_of_each_kind_of_distribution(dist, expected):
    found = centre.centre(dist)
    assert found == pytest.approx(expected) and type(found) is type(expected)
    assert dist._contains(dist.to_internal_repr(found))


@pytest.mark.parametrize("name", ["demo", "redsm5"])
def test_the_centre_of_each_shipped_study_is_a_point_of_its_space(name):
    space = load(study_path(name)).search_space
    point = centre.of_space(space)
    assert space.rejects(point) is None
    assert point["model_name"] == space.model_name[0]
    assert "fp_precision" not in point  # the device's to decide
    low, high = space.learning_rate.low, space.learning_rate.high
    assert point["learning_rate"] == pytest.approx(math.sqrt(low * high))


def test_adapter_settings_follow_the_centre_s_method():
    base = {"model_name": ["m"], "target_effective_batch_size": [8, 16],
            "learning_rate": {"low": 1e-5, "high": 1e-3, "log": True},
            "lora_r": [4, 8, 16], "adapter_learning_rate": {"low": 1e-4, "high": 1e-2,
                                                             "log": True}}
    whole = SearchSpace.model_validate({**base, "peft": ["none", "lora"]})
    assert centre.of_space(whole) == {"model_name": "m", "target_effective_batch_size": 8,
                                      "peft": "none", "learning_rate": pytest.approx(1e-4)}
    adapted = SearchSpace.model_validate({**base, "peft": ["lora", "none"]})
    point = centre.of_space(adapted)
    assert point == {"model_name": "m", "target_effective_batch_size": 8, "peft": "lora",
                     "lora_r": 8, "adapter_learning_rate": pytest.approx(1e-3)}
    assert adapted.rejects(point) is None and whole.rejects(centre.of_space(whole)) is None


def test_the_study_runs_the_centre_first_only_where_its_file_enqueues_nothing(tiny_study,
                                                                             tmp_path):
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    config = load(tiny_study, ["study.sampler.centre_first=true"])
    study, _ = join(config, optuna.storages.RDBStorage(url), None)
    assert study.user_attrs["enqueued"] == 1
    (waiting,) = study.get_trials(deepcopy=False)
    assert waiting.state == optuna.trial.TrialState.WAITING
    assert waiting.system_attrs["fixed_params"] == centre.of_space(config.search_space)
    given = load(tiny_study, ["study.sampler.centre_first=true", "study.name=given",
                              "study.enqueue=[{learning_rate: 0.0005}]"])
    other, _ = join(given, optuna.storages.RDBStorage(url), None)
    assert [t.system_attrs["fixed_params"] for t in other.get_trials(deepcopy=False)] == [
        {"learning_rate": 0.0005}]
    off, _ = join(load(tiny_study, ["study.sampler.centre_first=false", "study.name=plain"]),
                  optuna.storages.RDBStorage(url), None)
    assert off.user_attrs["enqueued"] == 0 and not off.get_trials(deepcopy=False)
