"""Planning a trial: the physical batch the batch search finds under a fake memory limit, the
study's cached limit that spares a later trial of the same key every probe, the watch told
before each probe, and a combination the check found unusable refused before any of it. The
probes' step is faked: these run in milliseconds, with no model trained."""

from __future__ import annotations

import math
from types import SimpleNamespace

import optuna
import pytest
import torch
from conftest import study_dict

from hpo.config import StudyConfig
from hpo.hardware import Device
from hpo.search.liveness import LiveTrial
from hpo.space import Params, PinnedSpace
from hpo.trial import batch_limit, planning, step_check
from hpo.trial.batch_limit import BatchLimit, StudyBatchCache
from hpo.trial.context import TrialContext
from hpo.trial.resources import Resources

CPU = Device("cpu", "test CPU", 8 * 2**30)


class _Models:
    def tokenizer(self, _name: str) -> SimpleNamespace:
        return SimpleNamespace(model_max_length=512, pad_token_id=None)


def _resources(tmp_path, **training) -> Resources:
    config = StudyConfig.model_validate(study_dict(["m"], tmp_path, **training))
    return Resources(config, PinnedSpace({}, ("none",)), CPU, [], [], ("a", "b"),
                     models=_Models())  # type: ignore[arg-type]


@pytest.fixture
def fits_up_to(monkeypatch):
    """Fake probes: a step of more than `limit[0]` sequences runs out of memory; each probed
    batch is appended to `tried`."""
    limit, tried = [5], []

    def model(*_args) -> torch.nn.Module:
        return torch.nn.Linear(1, 1)

    def step(_model, _plan, _device, batch: int, length: int) -> float:
        assert length == 32  # data.max_length, below the tokenizer's 512
        tried.append(batch)
        if batch > limit[0]:
            raise torch.OutOfMemoryError("fake: out of memory")
        return 0.0

    monkeypatch.setattr(batch_limit.adapters, "build", model)
    monkeypatch.setattr(batch_limit, "prepare", lambda built, _plan, _device: built)
    monkeypatch.setattr(batch_limit, "probe_step", step)
    return limit, tried


def _fit(resources: Resources, cache: StudyBatchCache, target: int, watch=batch_limit.unwatched):
    params = Params("m", "none", target, 1e-4)
    training = resources.config.training
    return batch_limit.fit_batch(params, training, resources, cache, watch=watch)


def test_the_batch_search_keeps_a_safety_margin_and_accumulates_to_the_exact_target(
        tmp_path, fits_up_to):
    _, tried = fits_up_to
    resources = _resources(tmp_path)
    cache = StudyBatchCache(optuna.create_study())
    plan, key, probes = _fit(resources, cache, 16)
    assert 1 <= probes == len(tried) <= 5 and max(tried) > 5
    assert plan.physical_batch == math.floor(0.9 * 5) == 4  # training.safety_margin
    assert plan.grad_accum_steps == 4 and plan.effective_batch == 16
    assert plan.eval_batch == 5  # the largest batch a full step survived
    assert cache.get(key) == BatchLimit(5, 6)


def test_a_later_trial_of_the_same_key_probes_nothing(tmp_path, fits_up_to):
    _, tried = fits_up_to
    resources = _resources(tmp_path)
    cache = StudyBatchCache(optuna.create_study())
    first, key, _ = _fit(resources, cache, 16)
    tried.clear()
    later, again, probes = _fit(resources, cache, 8)
    assert (again, probes, tried) == (key, 0, [])
    assert later.physical_batch == first.physical_batch and later.grad_accum_steps == 2


def test_a_batch_that_meets_no_limit_trains_whole_with_no_margin(tmp_path, fits_up_to):
    limit, _ = fits_up_to
    limit[0] = 1000
    plan, _, _ = _fit(_resources(tmp_path), StudyBatchCache(optuna.create_study()), 8)
    assert (plan.physical_batch, plan.grad_accum_steps, plan.eval_batch) == (8, 1, 16)


def test_the_watch_hears_each_probe_before_it_runs(tmp_path, fits_up_to):
    _, tried = fits_up_to
    heard: list[tuple[str, int]] = []
    _, key, _ = _fit(_resources(tmp_path), StudyBatchCache(optuna.create_study()), 16,
                     lambda k, batch: heard.append((k, batch)))
    assert heard == [(key, batch) for batch in tried]


def test_out_of_memory_at_one_sample_is_an_error_and_not_cached(tmp_path, fits_up_to):
    limit, _ = fits_up_to
    limit[0] = 0
    study = optuna.create_study()
    with pytest.raises(torch.OutOfMemoryError, match="even at micro-batch 1"):
        _fit(_resources(tmp_path), StudyBatchCache(study), 8)
    # One sample out of memory says the device was full then, not that the key never fits.
    assert not [k for k in study.user_attrs if k.startswith(StudyBatchCache.PREFIX)]


def test_a_combination_the_check_found_unusable_is_refused_before_any_probe(
        tmp_path, fits_up_to, monkeypatch):
    _, tried = fits_up_to
    monkeypatch.setattr(step_check, "unusable", lambda *_args: "its step failed in the check")
    study = optuna.create_study()
    context = TrialContext(study, LiveTrial(study.ask()), StudyBatchCache(study), display=None)
    with pytest.raises(step_check.Unusable, match="m none: its step failed in the check"):
        planning.plan_trial(context, Params("m", "none", 8, 1e-4), _resources(tmp_path))
    assert tried == []


def test_on_a_shared_device_the_search_ignores_the_cached_limit_and_caches_nothing(
        tmp_path, fits_up_to):
    # Another process holds memory: a limit found alone (100 fits) may not fit now, and
    # what fits now must not cap every worker on this kind of device.
    _, tried = fits_up_to
    resources = _resources(tmp_path)
    cache = StudyBatchCache(optuna.create_study())
    params = Params("m", "none", 16, 1e-4)
    key = batch_limit.cache_key(params, resources.config.training, 32, CPU)
    cache.update(key, BatchLimit(100, 200))
    training = resources.config.training
    plan, _, probes = batch_limit.fit_batch(params, training, resources, cache, shared=2**30)
    assert probes == len(tried) > 0 and plan.physical_batch == 4
    assert cache.get(key) == BatchLimit(100, 200)
    assert max(tried) <= 16  # no further than the trial's batch


def test_a_trial_planned_on_a_shared_device_says_so_and_records_it(
        tmp_path, fits_up_to, monkeypatch):
    from conftest import Quiet

    monkeypatch.setattr(step_check, "unusable", lambda *_args: None)
    monkeypatch.setattr(planning.memory, "foreign_bytes", lambda _device: 3 * 2**30)
    data = SimpleNamespace(labels=torch.zeros(4, 2))
    monkeypatch.setattr(Resources, "encoded", lambda _self, _name: (data, data, "fake"))
    monkeypatch.setattr(Resources, "pad_id", lambda _self, _name: 0)
    study = optuna.create_study()
    display = Quiet()
    context = TrialContext(study, LiveTrial(study.ask()), StudyBatchCache(study),
                           display=display)  # type: ignore[arg-type]
    planned = planning.plan_trial(context, Params("m", "none", 8, 1e-4), _resources(tmp_path))
    assert planned.shared_bytes == 3 * 2**30 and planned.plan.physical_batch == 4
    assert any("3.0 GiB of" in m and "one worker per GPU" in m
               for m in display.messages), display.messages
    assert not [k for k in study.user_attrs if k.startswith(StudyBatchCache.PREFIX)]
