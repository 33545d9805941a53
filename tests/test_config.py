import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, study_dict

from hpo import config
from hpo.config import ConfigError


def write(tmp_path: Path, data) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", ["demo", "redsm5"])
def test_shipped_study_files_are_valid_and_say_how_to_run_them(name):
    path = REPO / "configs" / "studies" / f"{name}.yaml"
    assert path.read_text().startswith(f"# Run: hpo run --study {name}")
    loaded = config.load(path)
    assert loaded.study.name == name
    assert len(loaded.search_space.model_name) >= 2


def test_defaults_and_name(tmp_path):
    loaded = config.load(write(tmp_path, study_dict(["m"], tmp_path)))
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
    ],
)
def test_invalid_files_name_the_key(tmp_path, change, message):
    data = study_dict(["m"], tmp_path)
    change(data)
    with pytest.raises(ConfigError, match=message) as info:
        config.load(write(tmp_path, data))
    assert "\n" not in str(info.value)
    assert str(tmp_path) in str(info.value)


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "data:\n  dir: [unclosed\n")
    with pytest.raises(ConfigError, match=r"study.yaml: malformed YAML \(line \d+"):
        config.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "nope.yaml")


def test_overrides_are_typed(tmp_path):
    path = write(tmp_path, study_dict(["m"], tmp_path))
    loaded = config.load(path, [
        "training.epochs=5",
        "search_space.learning_rate.low=2e-5",
        "search_space.fp_precision=auto",
        "search_space.model_name=[x, y]",
        "study.pruner.name=median",
        "data.max_length=64",
    ])
    assert loaded.training.epochs == 5
    assert loaded.search_space.learning_rate.low == 2e-5
    assert loaded.search_space.fp_precision == "auto"
    assert loaded.search_space.model_name == ["x", "y"]
    assert loaded.study.pruner.name == "median"
    assert loaded.data.max_length == 64


def test_override_can_add_an_optional_section(tmp_path):
    path = write(tmp_path, study_dict(["m"], tmp_path))
    loaded = config.load(
        path, ["search_space.weight_decay.low=0", "search_space.weight_decay.high=0.1"]
    )
    assert loaded.search_space.weight_decay.high == 0.1


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("training.epoch=2", "--set training.epoch: unknown key 'training.epoch'"),
        ("nothing=1", "unknown key 'nothing'"),
        ("training.epochs.value=1", "unknown key 'training.epochs.value'"),
        ("training.epochs", "expected KEY=VALUE"),
    ],
)
def test_bad_overrides(tmp_path, item, message):
    with pytest.raises(ConfigError, match=message):
        config.load(write(tmp_path, study_dict(["m"], tmp_path)), [item])


def test_override_with_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match="training.epochs"):
        config.load(write(tmp_path, study_dict(["m"], tmp_path)), ["training.epochs=many"])


def test_every_problem_of_a_file_is_reported_at_once_with_suggestions(tmp_path):
    data = study_dict(["m"], tmp_path)
    data["training"]["epoch"] = 2
    data["study"] = {"pruner": {"nam": "median"}}
    data["data"]["max_length"] = 4
    del data["data"]["dir"]
    with pytest.raises(ConfigError) as info:
        config.load(write(tmp_path, data))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'study.yaml'}: ")
    for problem in ("unknown key 'training.epoch' (did you mean 'epochs'?)",
                    "unknown key 'study.pruner.nam' (did you mean 'name'?)",
                    "data.max_length: Input should be greater than or equal to 8 (got 4)",
                    "missing key 'data.dir'"):
        assert problem in message


def test_a_bad_override_value_is_blamed_on_the_override_not_the_file(tmp_path):
    path = write(tmp_path, study_dict(["m"], tmp_path))
    with pytest.raises(ConfigError) as info:
        config.load(path, ["training.epochs=many"])
    assert str(info.value).startswith("--set training.epochs=many: training.epochs: ")
    assert str(path) not in str(info.value)
    grace = config.Override("study.grace_period", "5", "HPO_GRACE_PERIOD")
    with pytest.raises(ConfigError, match=r"^HPO_GRACE_PERIOD=5: study: grace_period \(5\) "
                                          r"must exceed heartbeat_interval \(30\)"):
        config.load(path, [grace])
    with pytest.raises(ConfigError, match=r"^--set study.pruner.nme: unknown key "
                                          r"'study.pruner.nme' \(did you mean 'name'\?\)$"):
        config.load(path, ["study.pruner.nme=none"])


def test_a_study_name_is_looked_up_here_first_then_among_the_shipped_ones(tmp_path,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config.find_study("demo") == config.PACKAGED_STUDIES / "demo.yaml"
    assert config.load(config.study_path("redsm5")).study.name == "redsm5"
    mine = tmp_path / "configs" / "studies" / "demo.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text("data: {}\n")
    assert config.find_study("demo").resolve() == mine
    with pytest.raises(ConfigError, match=(
            rf"unknown study 'nosuch': no nosuch.yaml in {mine.parent} nor in hpo's own "
            r"studies \(demo, redsm5\); --config FILE reads any study file")):
        config.study_path("nosuch")


def test_the_shipped_studies_are_installed_with_the_package(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("hpo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for study in (REPO / "configs" / "studies").glob("*.yaml"):
        assert f"hpo/studies/{study.name}" in names


@pytest.mark.parametrize("name", ["successive_halving", "hyperband"])
def test_a_rung_pruner_needs_fewer_min_resource_epochs_than_a_trial_reports(tmp_path, name):
    path = write(tmp_path, study_dict(["m"], tmp_path))
    with pytest.raises(ConfigError, match=rf"study.pruner.min_resource \(2\) must be below the "
                                          rf"2 steps a trial reports .*: {name} would prune"):
        config.load(path, ["training.epochs=2", f"study.pruner.name={name}",
                           "study.pruner.min_resource=2"])
    assert config.load(path, ["training.epochs=3", f"study.pruner.name={name}",
                              "study.pruner.min_resource=2"]).max_steps() == 3


def test_the_default_pruner_is_successive_halving_and_one_epoch_trials_are_no_mistake(
        tmp_path):
    data = study_dict(["m"], tmp_path)
    del data["study"]["pruner"]
    path = write(tmp_path, data)
    loaded = config.load(path, ["training.epochs=1"])
    assert loaded.study.pruner.name == "successive_halving"
    assert config.load(path, ["training.epochs=2"]).study.pruner.min_resource == 1


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
    path = write(tmp_path, study_dict(["m"], tmp_path))
    with pytest.raises(ConfigError, match=message):
        config.load(path, overrides)


def test_an_adapter_set_with_its_method_may_be_enqueued(tmp_path):
    path = write(tmp_path, study_dict(["m"], tmp_path))
    loaded = config.load(path, ["search_space.peft=[none, lora]", "search_space.lora_r=[4, 8]",
                                "study.enqueue=[{peft: lora, lora_r: 8}, {peft: none}]"])
    assert loaded.study.enqueue == [{"peft": "lora", "lora_r": 8}, {"peft": "none"}]
    ranged = config.load(path, ["search_space.peft=[none, lora]",
                                "search_space.adapter_learning_rate={low: 1.0e-4, high: 1.0e-3}",
                                "study.enqueue=[{peft: lora, adapter_learning_rate: 5.0e-4}, "
                                "{peft: none, learning_rate: 2.0e-4}]"])
    assert ranged.study.enqueue[0] == {"peft": "lora", "adapter_learning_rate": 5.0e-4}
