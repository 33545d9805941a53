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
