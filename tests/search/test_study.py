"""Creating and joining a study, its pinned space, and the batch-size cache its workers share.
Real storages, real processes."""

import subprocess
import sys

import optuna
import pytest
import yaml
from conftest import REPO, start_worker

from hpo.cli import main
from hpo.hardware import detect, native_precisions, precision_names
from hpo.search.storage import open_storage
from hpo.search.study import decide_precisions, join
from hpo.space import CROWDED, PIN_ATTR, PinnedSpace, StepCosts, by_cost
from hpo.study_files import load
from hpo.trial import step_check


def test_create_is_idempotent_and_pins(tiny_study, any_storage, capsys):
    for _ in range(2):
        assert main(["create", "--config", str(tiny_study), "--storage", any_storage]) == 0
    study = optuna.load_study(study_name="tiny", storage=any_storage)
    assert study.user_attrs["search_space"]["fp_precision"] == ["none"]
    assert len(study.trials) == 0
    assert "ready" in capsys.readouterr().out


def test_auto_precision_is_resolved_by_the_first_worker_not_by_create(tiny_study, tmp_path,
                                                                     capsys):

    spec = yaml.safe_load(tiny_study.read_text())
    spec["search_space"]["fp_precision"] = "auto"
    tiny_study.write_text(yaml.safe_dump(spec))
    storage = f"sqlite:///{tmp_path / 'auto.db'}"
    assert main(["create", "--config", str(tiny_study), "--storage", storage]) == 0
    assert "fp_precision auto (resolved by the first worker" in capsys.readouterr().out
    study = optuna.load_study(study_name="tiny", storage=storage)
    assert study.user_attrs["search_space"]["fp_precision"] is None
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "1"]) == 0
    # The first worker's check measured every native precision; auto keeps the fast ones.
    study = optuna.load_study(study_name="tiny", storage=storage)
    device = detect("cpu")
    native = native_precisions(device)
    measured = step_check.step_seconds(step_check.stored(study, device))
    assert {p for steps in measured.values() for p in steps} == set(native)
    spreads = step_check.step_spreads(step_check.stored(study, device))
    expected = by_cost(measured, native, 0.1, spreads)
    pinned = study.user_attrs["search_space"]
    assert tuple(pinned["fp_precision"]) == expected.kept
    assert pinned["decided"] == {"by": "cost", "tolerance": 0.1, "dropped": expected.dropped,
                                 **({"unsettled": expected.unsettled} if expected.unsettled
                                    else {})}
    assert f"precisions searched: {precision_names(expected.kept)}" in capsys.readouterr().out
    (trial,) = study.trials
    assert trial.params["fp_precision"] in expected.kept


def _pinned_study(storage_url: str, precisions: tuple[str, ...], declared: str = "auto"):
    storage = open_storage(storage_url)
    study = optuna.create_study(study_name="p", storage=storage)
    pinned = PinnedSpace({"fp_precision": declared}, precisions)
    study.set_user_attr(PIN_ATTR, pinned.to_json())
    return study, storage, pinned


def test_auto_precisions_are_decided_once_by_the_first_worker(any_storage):
    study, storage, pinned = _pinned_study(any_storage, ("bf16", "none"))
    fast_bf16 = {"m": {"bf16": 1.0, "none": 1.4}}
    first = decide_precisions(study, storage, pinned, StepCosts(fast_bf16), 0.1)
    assert first.fp_precision == ("bf16",) and first.decided["by"] == "cost"
    # Another worker measured otherwise (noise, another device): the first decision holds.
    second = decide_precisions(study, storage, pinned,
                               StepCosts({"m": {"bf16": 1.4, "none": 1.0}}), 0.1)
    assert second == first
    assert PinnedSpace.from_json(study.user_attrs[PIN_ATTR]) == first
    storage.engine.dispose()


def test_auto_keeps_a_precision_the_first_worker_could_not_step_in_beside_others(tmp_path):
    # The first worker shared its GPU: fp32 ran out of memory in every model. The decision
    # binds the whole fleet, so fp32 stays searched, and the study records why.
    study, storage, pinned = _pinned_study(f"sqlite:///{tmp_path / 'c.db'}", ("bf16", "none"))
    decided = decide_precisions(study, storage, pinned,
                                StepCosts({"m": {"bf16": 1.0}}, None, frozenset({"none"})), 0.1)
    assert decided.fp_precision == ("bf16", "none")
    assert decided.decided == {"by": "cost", "tolerance": 0.1, "dropped": {},
                               "unsettled": {"none": CROWDED}}
    assert PinnedSpace.from_json(study.user_attrs[PIN_ATTR]) == decided
    storage.engine.dispose()


def test_auto_keeps_every_native_precision_without_timings_or_once_trials_sampled(tmp_path):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    study, storage, pinned = _pinned_study(url, ("bf16", "none"))
    skipped = decide_precisions(study, storage, pinned, None, 0.1)
    assert skipped.fp_precision == ("bf16", "none")
    assert skipped.decided == {"by": "native",
                               "why": "no step was measured (the check was skipped)"}
    study, storage, pinned = _pinned_study(f"sqlite:///{tmp_path / 'e.db'}", ("bf16", "none"))
    trial = study.ask()  # an older worker's trial, which sampled from both
    trial.suggest_categorical("fp_precision", ["bf16", "none"])
    late = decide_precisions(study, storage, pinned,
                             StepCosts({"m": {"bf16": 1.0, "none": 2.0}}), 0.1)
    assert late.fp_precision == ("bf16", "none") and late.decided["by"] == "native"
    # An explicit list, and `native`, are not the check's to narrow.
    for declared in (["bf16", "none"], "native"):
        study, storage, pinned = _pinned_study(f"sqlite:///{tmp_path / f'{declared}.db'}",
                                               ("bf16", "none"), declared)
        assert decide_precisions(study, storage, pinned,
                                 StepCosts({"m": {"bf16": 1.0, "none": 2.0}}), 0.1) == pinned


def test_many_workers_create_one_study_on_an_empty_database(tiny_study, pg_url):
    procs = [
        subprocess.Popen([sys.executable, "-m", "hpo.cli", "create", "--config", str(tiny_study),
                          "--storage", pg_url], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, [err for _, err in results]
    summaries = optuna.get_all_study_summaries(pg_url)
    assert [s.study_name for s in summaries] == ["tiny"]


def test_heartbeat_settings_are_fixed_in_the_study_when_it_is_created(tiny_study, tmp_path):
    from conftest import CPU_AVX2

    from hpo.search.storage import open_storage
    from hpo.search.study import join
    from hpo.study_files import load

    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    first = load(tiny_study, ["study.heartbeat_interval=2", "study.grace_period=8",
                              "study.max_retry=1"])
    later = load(tiny_study, [])  # the defaults: 30, 120, 2
    for config in (first, later):
        storage = open_storage(url, heartbeat_interval=config.study.heartbeat_interval,
                               grace_period=config.study.grace_period,
                               max_retry=config.study.max_retry)
        study, _ = join(config, storage, CPU_AVX2)
        assert (storage.get_heartbeat_interval(), storage.grace_period) == (2, 8)
        assert storage.get_heartbeat_stale_trial_callback()._max_retry == 1
    assert study.user_attrs["liveness"] == {"heartbeat_interval": 2, "grace_period": 8,
                                            "max_retry": 1}


def test_what_n_trials_counts_is_fixed_in_the_study_by_its_first_worker(tiny_study, tmp_path):
    from conftest import CPU_AVX2

    from hpo.errors import ConfigError

    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    counted = load(tiny_study, ["study.budget=trials"])
    study, _ = join(counted, open_storage(url), CPU_AVX2)
    assert study.user_attrs["budget"] == "trials"
    join(load(tiny_study, ["study.budget=trials"]), open_storage(url), CPU_AVX2)
    with pytest.raises(ConfigError, match=r"^study.budget: study 'tiny' counts trials \(fixed "
                       r"when its first worker joined\), this file trainings: set "
                       r"study.budget: trials$"):
        join(load(tiny_study, []), open_storage(url), CPU_AVX2)
    join(load(tiny_study, []), open_storage(url), None)  # `hpo create`, `final`: no count


def test_under_a_budget_of_trainings_every_worker_trains_as_long_as_the_first(tiny_study,
                                                                             tmp_path, capsys):
    from conftest import CPU_AVX2

    from hpo.errors import ConfigError

    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    first = load(tiny_study, ["training.epochs=2"])
    study, _ = join(first, open_storage(url), CPU_AVX2)
    assert study.user_attrs["training_steps"] == first.max_steps() == 2
    join(load(tiny_study, ["training.epochs=2"]), open_storage(url), CPU_AVX2)
    with pytest.raises(ConfigError, match=r"^training.epochs: study 'tiny' counts full "
                       r"trainings of 2 steps \(fixed when its first worker joined\), this "
                       r"file's of 3: "):
        join(load(tiny_study, ["training.epochs=3"]), open_storage(url), CPU_AVX2)
    # A budget of trials counts trials, however long each trains.
    other = f"sqlite:///{tmp_path / 'trials.db'}"
    for epochs in (2, 3):
        study, _ = join(load(tiny_study, ["study.budget=trials", f"training.epochs={epochs}"]),
                        open_storage(other), CPU_AVX2)
    assert "training_steps" not in study.user_attrs
    # As `hpo run` says it: one line, exit code 2.
    assert main(["run", "--config", str(tiny_study), "--storage", url, "--n-trials", "1",
                 "--set", "training.epochs=3", "--skip-check"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "hpo: error: training.epochs: study 'tiny' counts full trainings of 2 steps")


def test_a_study_an_earlier_release_made_goes_on_counting_trials(tiny_study, tmp_path, capsys):
    from conftest import CPU_AVX2

    from hpo.errors import ConfigError

    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    for name in ("older", "older-trainings"):
        old = optuna.create_study(study_name=name, storage=url, direction="maximize")
        old.add_trial(optuna.trial.create_trial(value=0.5))  # no record of its count
    with pytest.raises(ConfigError, match="counts trials .* set study.budget: trials$"):
        join(load(tiny_study, ["study.name=older"]), open_storage(url), CPU_AVX2)
    join(load(tiny_study, ["study.name=older", "study.budget=trials"]), open_storage(url),
         CPU_AVX2)
    # A file that said trainings counted them then too.
    study, _ = join(load(tiny_study, ["study.name=older-trainings", "study.budget=trainings"]),
                    open_storage(url), CPU_AVX2)
    assert study.user_attrs["budget"] == "trainings"
    # As `hpo run` says it: one line, exit code 2.
    assert main(["run", "--config", str(tiny_study), "--storage", url, "--n-trials", "1",
                 "--set", "study.name=older", "--skip-check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hpo: error: study.budget: study 'older' counts trials (fixed when its "
                   "first worker joined), this file trainings: set study.budget: trials"]


def test_a_worker_on_another_data_split_is_refused(one_model_study, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert main(["create", "--config", str(one_model_study), "--storage", storage,
                 "--skip-check"]) == 0
    stored = optuna.load_study(study_name="tiny", storage=storage).user_attrs["data_splits"]
    assert {name: s["posts"] for name, s in stored.items()} == {
        "train": 60, "validation": 20, "test": 0}
    capsys.readouterr()
    assert main(["run", "--config", str(one_model_study), "--storage", storage,
                 "--n-trials", "1", "--set", "data.split_seed=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "study 'tiny' searched on another data split (train:" in err[0]


def test_two_seeded_workers_run_enqueued_sets_once_and_never_repeat_each_other(
        tiny_study, pg_url, tmp_path):
    """Issue: with `sampler.seed`, every worker drew the same stream, so two workers ran
    trials 0 and 1, 2 and 3 with equal parameters. The sampler is seeded per trial number
    now; and an enqueued parameter set is run by exactly one worker."""
    config = yaml.safe_load(tiny_study.read_text())
    config["study"]["sampler"] = {"name": "tpe", "seed": 7, "n_startup_trials": 10}
    config["study"]["enqueue"] = [{"learning_rate": 0.0005, "target_effective_batch_size": 8}]
    study_file = tmp_path / "seeded.yaml"
    study_file.write_text(yaml.safe_dump(config))
    workers = [start_worker(study_file, pg_url, 4) for _ in range(2)]
    for worker in workers:
        _, err = worker.communicate(timeout=600)
        assert worker.returncode == 0, err
    # Which of two racing workers runs how many trials is up to the race; a worker started
    # after them runs the study on to 6 trials, so at least two seeded processes drew.
    late = start_worker(study_file, pg_url, 6)
    _, err = late.communicate(timeout=600)
    assert late.returncode == 0, err
    storage = open_storage(pg_url)
    try:
        study = optuna.load_study(study_name="seeded", storage=storage)
        assert study.user_attrs["enqueued"] == 1
        rates = [t.params["learning_rate"] for t in study.trials]
        assert len(rates) == 6 and rates.count(0.0005) == 1
        assert len(set(rates)) == 6
        assert len({t.user_attrs["worker"] for t in study.trials}) >= 2
        # A worker joining later enqueues nothing again.
        join(load(study_file), storage, None)
        assert len(study.get_trials(deepcopy=False)) == 6
    finally:
        storage.engine.dispose()


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_seeded_trial_draws_the_same_whichever_worker_asks_for_it(tiny_study, sampler):
    """A trial's parameters follow from the seed, its number and the history alone: two
    workers taking turns draw what one worker alone draws, past TPE's start-up trials."""
    from hpo.search.study import make_sampler

    config = load(tiny_study, [f"study.sampler.name={sampler}", "study.sampler.seed=7",
                               "study.sampler.n_startup_trials=3"])

    def search(turns: int) -> list[dict]:
        storage = optuna.storages.InMemoryStorage()
        workers = [optuna.create_study(study_name="s", storage=storage, load_if_exists=True,
                                       sampler=make_sampler(config)) for _ in range(turns)]
        for n in range(8):
            study = workers[n % turns]
            trial = study.ask()
            x, y = trial.suggest_float("x", 1e-4, 1.0, log=True), trial.suggest_int("y", 1, 9)
            study.tell(trial, -((x - 0.01) ** 2) - y)
        return [t.params for t in workers[0].trials]

    alone = search(1)
    assert search(2) == alone and search(3) == alone
    assert len({p["x"] for p in alone}) == 8


def test_a_warm_start_runs_the_other_study_s_best_trials_first(tiny_study, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "3"]) == 0
    before = optuna.load_study(study_name="tiny", storage=storage)
    best = sorted((t for t in before.trials if t.state == optuna.trial.TrialState.COMPLETE),
                  key=lambda t: (-t.value, t.number))[:2]
    assert main(["run", "--config", str(tiny_study), "--storage", storage, "--n-trials", "2",
                 "--set", "study.name=again", "--set", "study.warm_start_from=tiny",
                 "--set", "study.warm_start_trials=2"]) == 0
    again = optuna.load_study(study_name="again", storage=storage)
    assert again.user_attrs["enqueued"] == 2
    assert [t.params for t in again.trials[:2]] == [t.params for t in best]
    capsys.readouterr()
    assert main(["run", "--config", str(tiny_study), "--storage", storage, "--n-trials", "1",
                 "--set", "study.name=third", "--set", "study.warm_start_from=nosuch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "study.warm_start_from nosuch: no such study" in err[0]


def test_a_warm_start_renames_an_adapter_trial_s_rate_to_this_space_s_name(tiny_study,
                                                                           tmp_path):
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    from hpo.search.study import warm_start

    storage = open_storage(f"sqlite:///{tmp_path / 'hpo.db'}")
    try:
        old = optuna.create_study(study_name="old", storage=storage, direction="maximize")
        spec = yaml.safe_load(tiny_study.read_text())["search_space"]
        for value, peft, rate in ((0.9, "lora", 5e-4), (0.8, "none", 2e-5)):
            params = {"model_name": spec["model_name"][0], "fp_precision": "none",
                      "target_effective_batch_size": spec["target_effective_batch_size"][0],
                      "learning_rate": rate, "peft": peft}
            dists = {k: CategoricalDistribution([v]) for k, v in params.items()}
            dists["peft"] = CategoricalDistribution(["none", "lora"])
            dists["learning_rate"] = FloatDistribution(1e-6, 1e-2, log=True)
            old.add_trial(optuna.trial.create_trial(params=params, distributions=dists,
                                                    value=value))
        config = load(tiny_study, [
            "search_space.peft=[none, lora]",
            "search_space.learning_rate={low: 1.0e-6, high: 1.0e-3, log: true}",
            "search_space.adapter_learning_rate={low: 1.0e-4, high: 1.0e-2, log: true}",
            "study.warm_start_from=old"])
        lora, full = warm_start(storage, config)
        assert lora["adapter_learning_rate"] == 5e-4 and "learning_rate" not in lora
        assert full["learning_rate"] == 2e-5 and "adapter_learning_rate" not in full
    finally:
        storage.engine.dispose()


def spy_on(monkeypatch, module, name: str) -> dict:
    """The keyword arguments the last `module.name(...)` was made with."""
    made: dict = {}
    original = getattr(module, name)

    def spy(**kwargs):
        made.update(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(module, name, spy)
    return made


def test_the_sampler_settings_reach_optuna(tiny_study, monkeypatch):
    from hpo.search.study import make_sampler
    from hpo.study_files import load

    def first_trial(*sets: str) -> None:
        # A seeded study's sampler is made for each trial, when the trial is asked.
        optuna.create_study(sampler=make_sampler(load(tiny_study, list(sets)))).ask()

    made = spy_on(monkeypatch, optuna.samplers, "TPESampler")
    first_trial("study.sampler.name=tpe")
    assert (made["multivariate"], made["group"], made["constant_liar"]) == (True, False, True)
    first_trial("study.sampler.name=tpe", "study.sampler.group=true",
                "study.sampler.constant_liar=false", "study.sampler.seed=3")
    assert (made["group"], made["constant_liar"]) == (True, False)


def test_successive_halving_prunes_by_epoch_rank(tiny_study):
    from hpo.search.study import make_pruner

    config = load(tiny_study, ["training.epochs=3", "study.pruner.name=successive_halving",
                               "study.pruner.reduction_factor=2"])
    study = optuna.create_study(direction="maximize", pruner=make_pruner(config))
    verdicts = []
    for first_epoch in (0.5, 0.6, 0.1, 0.7):
        trial = study.ask()
        trial.report(first_epoch, 1)
        verdicts.append(trial.should_prune())
        study.tell(trial, first_epoch)
    # Rung 1 keeps the top half of the trials that reached epoch 1 (the first always).
    assert verdicts == [False, False, True, False]


@pytest.mark.parametrize(("overrides", "steps"), [
    (["training.epochs=3"], 3),
    (["training.epochs=3", "search_space.epochs.low=1", "search_space.epochs.high=5"], 5),
    (["training.epochs=3", "data.cv_folds=4"], 4),
])
def test_hyperband_s_resource_is_the_epochs_or_folds_a_trial_reports(tiny_study, monkeypatch,
                                                                      overrides, steps):
    from hpo.search.study import make_pruner

    made = spy_on(monkeypatch, optuna.pruners, "HyperbandPruner")
    make_pruner(load(tiny_study, [*overrides, "study.pruner.name=hyperband"]))
    assert made == {"min_resource": 1, "max_resource": steps, "reduction_factor": 3}


@pytest.mark.parametrize(("name", "pruner"), [("successive_halving", "SuccessiveHalvingPruner"),
                                              ("hyperband", "HyperbandPruner")])
@pytest.mark.parametrize(("overrides", "first"), [
    (["training.epochs=9"], 1),
    (["training.epochs=10"], 2),
    (["training.epochs=52"], 6),
    (["training.epochs=52", "study.pruner.reduction_factor=2"], 13),
    (["training.epochs=3", "search_space.epochs.low=1", "search_space.epochs.high=30"], 4),
    (["training.epochs=30", "data.cv_folds=5"], 1),
])
def test_an_auto_first_rung_comes_after_a_reduction_factor_squared_th_of_the_steps(
        tiny_study, monkeypatch, name, pruner, overrides, first):
    from hpo.search.study import make_pruner

    made = spy_on(monkeypatch, optuna.pruners, pruner)
    make_pruner(load(tiny_study, [*overrides, f"study.pruner.name={name}",
                                  "study.pruner.min_resource=auto"]))
    assert made["min_resource"] == first


def test_a_pruner_that_waits_for_evidence_is_hpos_own(tiny_study):
    from hpo.search.pruning import EvidenceHalvingPruner
    from hpo.search.study import make_pruner

    pruner = make_pruner(load(tiny_study, [
        "training.epochs=52", "study.pruner.name=successive_halving",
        "study.pruner.min_rung_trials=4",
        "study.pruner.min_rung_agreement=0.3"]))
    assert isinstance(pruner, EvidenceHalvingPruner)
    assert (pruner.min_resource, pruner.reduction_factor, pruner.max_resource) == (6, 3, 52)
    assert (pruner.min_trials, pruner.min_agreement) == (4, 0.3)
    plain = make_pruner(load(tiny_study, ["training.epochs=52",
                                          "study.pruner.name=successive_halving"]))
    assert isinstance(plain, optuna.pruners.SuccessiveHalvingPruner)
