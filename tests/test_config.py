"""The schema: each key's type and range, and how the keys of a study file go together."""


import pytest
from conftest import study_dict, write_study

from hpo.errors import ConfigError
from hpo.study_files import load


def test_defaults_and_name(tmp_path):
    loaded = load(write_study(tmp_path, study_dict(["m"], tmp_path)))
    assert loaded.study.name == "study"
    assert loaded.training.safety_margin == 0.9
    assert loaded.training.max_grad_norm == 1.0
    assert loaded.search_space.fp_precision == ["none"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["training"].update(epochz=3), "unknown key 'training.epochz'"),
        (lambda d: d.update(extra_section={}), "unknown key 'extra_section'"),
        (lambda d: d["training"].update(epochs="three"), "training.epochs: Input should be"),
        (lambda d: d["search_space"].update(model_name=[]), "search_space.model_name"),
        (lambda d: d["search_space"].update(target_effective_batch_size=[]),
         "search_space.target_effective_batch_size"),
        (lambda d: d["search_space"]["learning_rate"].update(low=1.0, high=0.1),
         "search_space.learning_rate: low \\(1.0\\) is greater than high \\(0.1\\)"),
        (lambda d: d["search_space"].update(fp_precision=["fp8"]), "unknown precision 'fp8'"),
        (lambda d: d["search_space"].update(fp_precision=[]), "fp_precision"),
        (lambda d: d["search_space"].update(dropout={"low": 0.0, "high": 0.2}),
         "unknown key 'search_space.dropout'"),
        (lambda d: d["data"].pop("dir"), "missing key 'data.dir'"),
        (lambda d: d["data"].update(task="regression"), "data.task"),
        (lambda d: d["training"].update(safety_margin=1.5), "training.safety_margin"),
        (lambda d: d["training"].update(device="tpu"), "training.device"),
        (lambda d: d["study"].update(enqueue=[{"learning_rate": 1.0}]),
         "study.enqueue\\[0\\]: learning_rate 1.0 is outside \\[0.0001, 0.001\\]"),
        (lambda d: d["study"].update(enqueue=[{"dropout": 0.1}]),
         "study.enqueue\\[0\\]: dropout is not a parameter of the search space"),
        (lambda d: d["study"].update(enqueue=[{"model_name": "other"}]),
         "study.enqueue\\[0\\]: model_name 'other' is not one of \\['m'\\]"),
        (lambda d: (d["search_space"].update(fp_precision="auto"),
                    d["study"].update(enqueue=[{"fp_precision": "bf16"}])),
         "fp_precision is auto in the search space: leave it out"),
        (lambda d: d["study"]["sampler"].update(group=True, multivariate=False),
         "sampler.group needs sampler.multivariate: true"),
        (lambda d: d["study"]["sampler"].update(startup_min_complete=2),
         "sampler.startup_min_complete needs sampler.startup_counts_paused: true"),
    ],
)
def test_invalid_files_name_the_key(tmp_path, change, message):
    data = study_dict(["m"], tmp_path)
    change(data)
    with pytest.raises(ConfigError, match=message) as info:
        load(write_study(tmp_path, data))
    assert "\n" not in str(info.value)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("name", ["successive_halving", "hyperband"])
def test_a_rung_pruner_needs_fewer_min_resource_epochs_than_a_trial_reports(tmp_path, name):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    with pytest.raises(ConfigError, match=rf"study.pruner.min_resource \(2\) must be below the "
                                          rf"2 steps a trial reports .*: {name} would prune"):
        load(path, ["training.epochs=2", f"study.pruner.name={name}",
                           "study.pruner.min_resource=2"])
    assert load(path, ["training.epochs=3", f"study.pruner.name={name}",
                              "study.pruner.min_resource=2"]).max_steps() == 3


@pytest.mark.parametrize(("overrides", "why"), [
    (["study.pruner.name=hyperband"], "study.pruner.pause needs successive_halving, not "
                                      "hyperband"),
    (["data.cv_folds=3"], r"study.pruner.pause cannot pause a cross-validated trial"),
])
def test_pausing_trials_needs_successive_halving_and_one_model_per_trial(tmp_path, overrides,
                                                                         why):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    pausing = ["training.epochs=4", "study.pruner.name=successive_halving",
               "study.pruner.pause=true"]
    with pytest.raises(ConfigError, match=why):
        load(path, [*pausing, *overrides])
    assert load(path, pausing).study.pruner.pause


def test_a_pause_neither_bool_nor_auto_is_named_in_one_short_line(tmp_path):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    with pytest.raises(ConfigError) as raised:
        load(path, ["study.pruner.pause=sometimes"])
    assert str(raised.value).endswith("study.pruner.pause: expected true, false or auto "
                                      "(got 'sometimes')")
    assert "bool" not in str(raised.value)


def test_pause_auto_pauses_where_a_store_holds_the_checkpoints_else_stops(tmp_path):
    from hpo.search.artifacts import with_pause_decided

    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    auto = ["training.epochs=4", "study.pruner.name=successive_halving",
            "study.pruner.pause=auto"]
    sqlite = f"sqlite:///{tmp_path / 'hpo.db'}"
    decided, said = with_pause_decided(load(path, auto), sqlite)
    assert decided.study.pruner.pause is True
    assert said == (f"  study.pruner.pause auto: a trial its rung would stop pauses, its "
                    f"checkpoint in {tmp_path / 'hpo-artifacts'} (at most 8, "
                    f"study.pruner.max_checkpoints)")
    # Without a store it pauses too, keeping no checkpoint.
    decided, said = with_pause_decided(load(path, auto), "postgresql://h/db")
    assert decided.study.pruner.pause is True and decided.study.pruner.max_checkpoints == 0
    assert said == ("  study.pruner.pause auto: a trial its rung would stop pauses, without a "
                    "checkpoint (no study.artifacts): promoted, it trains again from its start")
    stored, said = with_pause_decided(
        load(path, [*auto, "study.artifacts=/shared", "study.pruner.max_checkpoints=8"]),
        "postgresql://h/db")
    assert stored.study.pruner.pause is True and stored.study.pruner.max_checkpoints == 8
    assert said.endswith("checkpoint in /shared (at most 8, study.pruner.max_checkpoints)")
    # Where a trial cannot pause, auto is no error: it stops, and says why (or, under a
    # pruner that never pauses, nothing).
    folds, said = with_pause_decided(load(path, [*auto, "data.cv_folds=3"]), sqlite)
    assert folds.study.pruner.pause is False and "cannot pause (data.cv_folds)" in said
    median = load(path, ["training.epochs=4", "study.pruner.pause=auto"])
    assert with_pause_decided(median, sqlite)[0].study.pruner.pause is False
    assert with_pause_decided(median, sqlite)[1] is None
    # true and false stay as the file says them.
    stopping = [*auto[:2], "study.pruner.pause=false"]
    assert with_pause_decided(load(path, stopping), sqlite) == (load(path, stopping), None)


def test_by_default_a_rung_pauses_and_n_counts_full_trainings(tmp_path):
    # Issue 63: the default search; a file that says nothing gets it, and the old rule
    # (Optuna's: stop for good, count trials) is two settings away.
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    study = load(path, []).study
    assert (study.pruner.pause, study.budget, study.pruner.max_checkpoints) == (
        "auto", "trainings", 8)
    old = load(path, ["study.pruner.pause=false", "study.budget=trials"]).study
    assert (old.pruner.pause, old.budget) == (False, "trials")


def test_max_checkpoints_is_a_count_or_null(tmp_path):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    assert load(path, ["study.pruner.max_checkpoints=0"]).study.pruner.max_checkpoints == 0
    assert load(path).study.pruner.max_checkpoints == 8
    assert load(path, ["study.pruner.max_checkpoints=null"]).study.pruner.max_checkpoints is None
    with pytest.raises(ConfigError, match="study.pruner.max_checkpoints"):
        load(path, ["study.pruner.max_checkpoints=-1"])


def test_pausing_trials_needs_an_artifact_store_for_their_checkpoints(tmp_path):
    from hpo.search.artifacts import checkpoint_store

    config = load(write_study(tmp_path, study_dict(["m"], tmp_path)),
                  ["study.pruner.name=successive_halving", "study.pruner.pause=true"])
    with pytest.raises(ConfigError, match="study.pruner.pause keeps paused trials' "
                                          "checkpoints in the artifact store: set "
                                          "study.artifacts"):
        checkpoint_store(config, "postgresql://h/db")
    assert checkpoint_store(config, f"sqlite:///{tmp_path / 'hpo.db'}") is not None
    assert (tmp_path / "hpo-artifacts").is_dir()
    assert checkpoint_store(load(write_study(tmp_path, study_dict(["m"], tmp_path))),
                            "postgresql://h/db") is None  # a study that stops trials
    none_kept = config.model_copy(update={"study": config.study.model_copy(update={
        "pruner": config.study.pruner.model_copy(update={"max_checkpoints": 0})})})
    assert checkpoint_store(none_kept, "postgresql://h/db") is None  # needs no store


@pytest.mark.parametrize("value", ["x", 0, 2.5, True, "6"])
def test_min_resource_is_auto_or_a_whole_number_of_epochs(tmp_path, value):
    data = study_dict(["m"], tmp_path)
    data["study"]["pruner"] = {"min_resource": value}
    with pytest.raises(ConfigError, match=r"study.pruner.min_resource: expected auto or a "
                                          r"whole number of epochs, at least 1 \(got "):
        load(write_study(tmp_path, data))


@pytest.mark.parametrize("name", ["successive_halving", "hyperband"])
def test_an_auto_first_rung_with_nothing_to_prune_runs_without_pruning_and_says_so(tmp_path,
                                                                                   name):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    one = load(path, ["training.epochs=1", f"study.pruner.name={name}",
                      "study.pruner.min_resource=auto"])
    assert not one.prunes()
    assert one.pruning_note() == (f"  no pruning: trials report 1 step (1 epoch) and "
                                  f"study.pruner ({name}) decides only before the last; "
                                  f"more epochs or training.evaluations_per_epoch let it prune")
    two = load(path, ["training.epochs=2", f"study.pruner.name={name}",
                      "study.pruner.min_resource=auto"])
    assert two.prunes() and two.pruning_note() is None
    assert two.study.pruner.first_rung(2) == 1


@pytest.mark.parametrize(("overrides", "prunes"), [
    (["study.pruner.name=median", "training.epochs=1"], False),
    (["study.pruner.name=median", "training.epochs=2"], True),
    (["study.pruner.name=median", "study.pruner.n_warmup_steps=2", "training.epochs=2"], False),
    (["study.pruner.name=none", "training.epochs=5"], False),
    (["study.pruner.name=successive_halving", "training.epochs=1", "data.cv_folds=3"], True),
])
def test_whether_a_pruner_can_stop_a_trial_follows_the_steps_it_reports(tmp_path, overrides,
                                                                         prunes):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    loaded = load(path, overrides)
    assert loaded.prunes() is prunes
    # A pruner the file turns off needs no word; one that cannot act does.
    assert (loaded.pruning_note() is None) is (prunes or "study.pruner.name=none" in overrides)


def test_the_default_pruner_is_successive_halving_and_one_epoch_trials_are_no_mistake(
        tmp_path):
    data = study_dict(["m"], tmp_path)
    del data["study"]["pruner"]
    path = write_study(tmp_path, data)
    loaded = load(path, ["training.epochs=1"])
    assert loaded.study.pruner.name == "successive_halving"
    assert load(path, ["training.epochs=2"]).study.pruner.min_resource == "auto"


@pytest.mark.parametrize(("overrides", "message"), [
    (["search_space.lora_r=[4]"], "lora_r is searched, but peft has no lora or dora"),
    (["search_space.peft=[lora]", "search_space.lora_alpha=[8]",
      "search_space.lora_alpha_ratio=[2]"], "search lora_alpha or lora_alpha_ratio, not both"),
    (["search_space.peft=[lora]", "search_space.lora_r={low: 0, high: 8}"],
     "lora_r must be at least 1"),
    (["search_space.peft=[lora]", "search_space.lora_alpha={low: 0, high: 8}"],
     "lora_alpha must be above 0"),
    (["search_space.peft=[lora]", "search_space.lora_dropout={low: 0, high: 1}"],
     "lora_dropout must lie in"),
    (["search_space.peft=[lora]", "search_space.lora_alpha_ratio=[1, 2]",
      "training.lora_alpha=16"], "training.lora_alpha fixes alpha"),
    (["search_space.peft=[none, lora]", "search_space.lora_r=[4, 8]",
      "study.enqueue=[{lora_r: 8}]"],
     r"study.enqueue\[0\]: lora_r is set, but the set may run without adapters"),
    (["search_space.peft=[qlora]"], "search_space.peft.0"),
    (["search_space.adapter_learning_rate={low: 1.0e-4, high: 1.0e-3}"],
     "adapter_learning_rate is searched, but peft has no lora or dora"),
    (["search_space.peft=[none, lora]", "search_space.adapter_learning_rate={low: 1, high: 0.1}"],
     r"low \(1.0\) is greater than high"),
    (["search_space.peft=[none, lora]", "search_space.adapter_learning_rate={low: 1.0e-4, high: "
      "1.0e-3}", "study.enqueue=[{learning_rate: 2.0e-4}]"],
     r"study.enqueue\[0\]: learning_rate is set, but the set may run with adapters"),
    (["search_space.peft=[none, lora]", "search_space.adapter_learning_rate={low: 1.0e-4, high: "
      "1.0e-3}", "study.enqueue=[{peft: none, adapter_learning_rate: 1.0e-4}]"],
     r"adapter_learning_rate is set, but the set may run without adapters"),
])
def test_adapter_settings_are_checked_when_the_file_is_read(tmp_path, overrides, message):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    with pytest.raises(ConfigError, match=message):
        load(path, overrides)


def test_an_adapter_set_with_its_method_may_be_enqueued(tmp_path):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    loaded = load(path, ["search_space.peft=[none, lora]", "search_space.lora_r=[4, 8]",
                                "study.enqueue=[{peft: lora, lora_r: 8}, {peft: none}]"])
    assert loaded.study.enqueue == [{"peft": "lora", "lora_r": 8}, {"peft": "none"}]
    ranged = load(path, ["search_space.peft=[none, lora]",
                                "search_space.adapter_learning_rate={low: 1.0e-4, high: 1.0e-3}",
                                "study.enqueue=[{peft: lora, adapter_learning_rate: 5.0e-4}, "
                                "{peft: none, learning_rate: 2.0e-4}]"])
    assert ranged.study.enqueue[0] == {"peft": "lora", "adapter_learning_rate": 5.0e-4}


def test_evaluations_inside_an_epoch_let_a_one_epoch_study_prune(tmp_path):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    loaded = load(path, ["training.epochs=1", "training.evaluations_per_epoch=4",
                         "study.pruner.name=successive_halving"])
    assert loaded.max_steps() == 4 and loaded.prunes() and loaded.pruning_note() is None
    assert loaded.study.pruner.first_rung(loaded.max_steps()) == 1
    with pytest.raises(ConfigError, match=r"training.evaluations_per_epoch: a cross-validated "
                                          r"trial \(data.cv_folds\) reports once per fold"):
        load(path, ["training.evaluations_per_epoch=2", "data.cv_folds=3"])
