"""Finding and reading study files: `--study NAME`, the shipped studies, `--set` and
environment overrides, and every problem of a file in one line."""

import subprocess
import sys
import zipfile

import pytest
from conftest import REPO, study_dict, write_study

from hpo import study_files
from hpo.errors import ConfigError
from hpo.study_files import load


@pytest.mark.parametrize("name", ["demo", "redsm5"])
def test_shipped_study_files_are_valid_and_say_how_to_run_them(name):
    path = REPO / "configs" / "studies" / f"{name}.yaml"
    assert path.read_text().startswith(f"# Run: hpo run --study {name}")
    loaded = load(path)
    assert loaded.study.name == name
    assert len(loaded.search_space.model_name) >= 2


@pytest.mark.parametrize("name", ["demo", "redsm5"])
@pytest.mark.parametrize("overrides", [
    ["training.epochs=1"], ["training.epochs=2"], ["training.epochs=30"],
    ["training.epochs=1", "study.pruner.name=hyperband"],
    ["training.epochs=1", "study.pruner.name=median"], ["data.cv_folds=2"],
    ["training.epochs=1", "training.evaluations_per_epoch=4"],
])
def test_a_shipped_study_stays_valid_under_the_obvious_overrides(name, overrides):
    """Overriding a setting never makes a shipped file invalid (a one-epoch demo was refused
    because its pruner, with nothing to rank, would prune nothing)."""
    loaded = load(REPO / "configs" / "studies" / f"{name}.yaml", overrides)
    assert (loaded.pruning_note() is None) is loaded.prunes()


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write_study(tmp_path, "data:\n  dir: [unclosed\n")
    with pytest.raises(ConfigError, match=r"study.yaml: malformed YAML \(line \d+"):
        load(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "nope.yaml")


def test_overrides_are_typed(tmp_path):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    loaded = load(path, [
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
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    loaded = load(
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
        load(write_study(tmp_path, study_dict(["m"], tmp_path)), [item])


def test_override_with_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match="training.epochs"):
        load(write_study(tmp_path, study_dict(["m"], tmp_path)), ["training.epochs=many"])


def test_every_problem_of_a_file_is_reported_at_once_with_suggestions(tmp_path):
    data = study_dict(["m"], tmp_path)
    data["training"]["epoch"] = 2
    data["study"] = {"pruner": {"nam": "median"}}
    data["data"]["max_length"] = 4
    del data["data"]["dir"]
    with pytest.raises(ConfigError) as info:
        load(write_study(tmp_path, data))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'study.yaml'}: ")
    for problem in ("unknown key 'training.epoch' (did you mean 'epochs'?)",
                    "unknown key 'study.pruner.nam' (did you mean 'name'?)",
                    "data.max_length: Input should be greater than or equal to 8 (got 4)",
                    "missing key 'data.dir'"):
        assert problem in message


def test_a_bad_override_value_is_blamed_on_the_override_not_the_file(tmp_path):
    path = write_study(tmp_path, study_dict(["m"], tmp_path))
    with pytest.raises(ConfigError) as info:
        load(path, ["training.epochs=many"])
    assert str(info.value).startswith("--set training.epochs=many: training.epochs: ")
    assert str(path) not in str(info.value)
    grace = study_files.Override("study.grace_period", "5", "HPO_GRACE_PERIOD")
    with pytest.raises(ConfigError, match=r"^HPO_GRACE_PERIOD=5: study: grace_period \(5\) "
                                          r"must exceed heartbeat_interval \(30\)"):
        load(path, [grace])
    with pytest.raises(ConfigError, match=r"^--set study.pruner.nme: unknown key "
                                          r"'study.pruner.nme' \(did you mean 'name'\?\)$"):
        load(path, ["study.pruner.nme=none"])


def test_a_study_name_is_looked_up_here_first_then_among_the_shipped_ones(tmp_path,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert study_files.find_study("demo") == study_files.PACKAGED_STUDIES / "demo.yaml"
    assert load(study_files.study_path("redsm5")).study.name == "redsm5"
    mine = tmp_path / "configs" / "studies" / "demo.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text("data: {}\n")
    assert study_files.find_study("demo").resolve() == mine
    with pytest.raises(ConfigError, match=(
            rf"unknown study 'nosuch': no nosuch.yaml in {mine.parent} nor in hpo's own "
            r"studies \(demo, redsm5\); --config FILE reads any study file")):
        study_files.study_path("nosuch")


def test_the_shipped_studies_are_installed_with_the_package(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("hpo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for study in (REPO / "configs" / "studies").glob("*.yaml"):
        assert f"hpo/studies/{study.name}" in names
