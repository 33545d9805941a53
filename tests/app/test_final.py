"""From a search to a model: `hpo final` trains the chosen trial again per seed, scores every
run on the held-out test split, and exports a model that a plain transformers pipeline, in a
process of its own, scores to the report's figure. Real training of the tiny model."""

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import optuna
import pytest
import yaml
from conftest import REPO, study_dict

from hpo.cli import main


@pytest.fixture(scope="module")
def searched(tmp_path_factory, tiny_model, small_data):
    """A study of three finished trials over the tiny model, with a test split held out."""
    root = tmp_path_factory.mktemp("searched")
    config = study_dict([tiny_model], small_data, epochs=2)
    config["data"]["test_fraction"] = 0.2
    config["study"]["objective_epoch"] = "best"
    study_file = root / "tiny.yaml"
    study_file.write_text(yaml.safe_dump(config))
    storage = f"sqlite:///{root / 'hpo.db'}"
    assert main(["run", "--config", str(study_file), "--storage", storage, "--n-trials", "3",
                 "--set", "study.sampler.name=random"]) == 0
    return study_file, root / "hpo.db"


@pytest.fixture
def study(searched, tmp_path):
    """The searched study in a storage of this test's own."""
    study_file, database = searched
    shutil.copy(database, tmp_path / "hpo.db")
    return study_file, f"sqlite:///{tmp_path / 'hpo.db'}"


def final(study_file, storage, *extra) -> int:
    return main(["final", "--config", str(study_file), "--storage", storage, *extra])


PIPELINE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from transformers import pipeline

    model, data = Path(sys.argv[1]), Path(sys.argv[2])
    report = json.loads((model / "report.json").read_text())
    import csv
    with (data / "redsm5_posts.csv").open(encoding="utf-8", newline="") as handle:
        texts = {row["post_id"]: row["text"] for row in csv.DictReader(handle)}
    ids = report["data"]["test_post_ids"]
    classify = pipeline("text-classification", model=str(model), top_k=None, truncation=True)
    # As the README and the model card apply them.
    thresholds = classify.model.config.decision_thresholds
    out = classify([texts[i] for i in ids])
    predicted = {i: [x["label"] for x in o if x["score"] > thresholds[x["label"]]]
                 for i, o in zip(ids, out)}
    print(json.dumps(predicted))
""")


def gold_symptoms(data, ids) -> dict[str, set[str]]:
    from hpo.data.redsm5 import read_redsm5

    posts = {p.post_id: p for p in read_redsm5(data)}
    return {i: set(posts[i].symptoms) for i in ids}


def macro_f1(predicted: dict[str, set], gold: dict[str, set], names) -> float:
    scores = []
    for name in names:
        tp = sum(name in predicted[i] and name in gold[i] for i in gold)
        fp = sum(name in predicted[i] and name not in gold[i] for i in gold)
        fn = sum(name not in predicted[i] and name in gold[i] for i in gold)
        scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return sum(scores) / len(scores)


def pipeline_macro_f1(output, data, cwd) -> float:
    """The export's test macro-F1 as a plain transformers pipeline, in a process of its own,
    scores it at the config's thresholds."""
    result = subprocess.run(
        [sys.executable, "-c", PIPELINE, str(output), str(data)], capture_output=True,
        text=True, timeout=300, cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    predicted = {i: set(labels) for i, labels in
                 json.loads(result.stdout.strip().splitlines()[-1]).items()}
    report = json.loads((output / "report.json").read_text())
    gold = gold_symptoms(data, report["data"]["test_post_ids"])
    return macro_f1(predicted, gold, list(report["exported"]["thresholds"]))


def test_the_exported_model_scores_in_a_plain_pipeline_as_the_report_says(
        study, tmp_path, small_data, capsys):
    study_file, storage = study
    output = tmp_path / "model"
    assert final(study_file, storage, "--seeds", "2", "--output", str(output)) == 0
    shown = capsys.readouterr().out
    report = json.loads((output / "report.json").read_text())
    best = optuna.load_study(study_name="tiny", storage=storage).best_trial

    assert report["trial"] == best.number
    assert [r["seed"] for r in report["runs"]] == [42, 43]
    # The first seed is the trial's own: the same run, the same validation score.
    assert report["runs"][0]["validation"] == pytest.approx(best.value, abs=1e-4)
    assert report["runs"][0]["epoch"] == best.user_attrs["value_epoch"]
    assert report["data"]["posts"] == {"train": 44, "validation": 20, "test": 16}
    exported = report["exported"]
    for name in ("macro_f1", "micro_f1"):
        low, high = exported["test_interval_95"][name]
        assert low <= exported["test"][name] <= high
    assert set(exported["per_symptom"]) == set(exported["thresholds"])
    assert report["baseline"]["name"] == "all_positive"
    assert f"test macro_f1 {exported['test']['macro_f1']:.4f}" in shown

    assert pipeline_macro_f1(output, small_data, tmp_path) == pytest.approx(
        exported["test"]["macro_f1"], abs=1e-4)

    config = json.loads((output / "config.json").read_text())
    assert {name: int(i) for i, name in config["id2label"].items()} == config["label2id"]
    assert set(config["label2id"]) == set(exported["thresholds"])
    card = (output / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert f"{exported['test']['macro_f1']:.4f}" in card
    # The search's optimism is shown beside the number it is measured against.
    at_half = report["seed_spread"]["test_at_0.5_macro_f1"]["mean"]
    assert report["optimism"] == pytest.approx(report["search_validation"] - at_half, abs=1e-9)
    assert f"{report['optimism']:+.4f} against the mean test macro_f1 at threshold 0.5" in (
        " ".join(card.split()))
    assert f"{at_half:.4f}" in card and f"{at_half:.4f}" in shown
    # Each seed said as users count them, never as the trial's start.
    assert "seed 1 of 2 (training seed 42)" in shown and "seed 2 of 2" in shown
    assert f"trial {best.number} start" not in shown
    # The weights readable by whoever reads the config (safetensors writes them 0600).
    assert len({path.stat().st_mode for path in output.iterdir()}) == 1

    # The README's snippet, as written, prints the symptoms over their thresholds first.
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "demo").symlink_to(output)
    result = subprocess.run(
        [sys.executable, "-c", readme_snippet()], capture_output=True, text=True,
        timeout=300, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    symptoms, scores = (ast.literal_eval(line) for line in result.stdout.splitlines())
    thresholds = exported["thresholds"]
    assert symptoms == [s["label"] for s in scores if s["score"] > thresholds[s["label"]]]
    assert {s["label"] for s in scores} == set(thresholds)
    # So does the model card's, one list per post.
    card_code = card.split("```python\n", 1)[1].split("```", 1)[0].replace("PATH", str(output))
    result = subprocess.run([sys.executable, "-c", card_code], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert all(set(ast.literal_eval(line)) <= set(thresholds)
               for line in result.stdout.splitlines()) and len(result.stdout.splitlines()) == 2


def readme_snippet() -> str:
    """The README's pipeline snippet, the Python between `python - <<'EOF'` and `EOF`."""
    text = (REPO / "README.md").read_text()
    return text.split("python - <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]


def test_refit_trains_on_training_and_validation_with_thresholds_at_half(study, tmp_path):
    study_file, storage = study
    output = tmp_path / "model"
    assert final(study_file, storage, "--refit", "--seeds", "1", "--output", str(output)) == 0
    report = json.loads((output / "report.json").read_text())
    assert report["refit"] is True and report["thresholds"] == "0.5"
    (run,) = report["runs"]
    assert run["validation"] is None
    best = optuna.load_study(study_name="tiny", storage=storage).best_trial
    assert run["epochs"] == best.user_attrs["value_epoch"]
    assert set(report["exported"]["thresholds"].values()) == {0.5}
    assert report["exported"]["test"] == report["exported"]["test_at_0.5"]


def test_a_chosen_trial_is_trained_instead_of_the_best(study, tmp_path):
    study_file, storage = study
    trials = optuna.load_study(study_name="tiny", storage=storage).trials
    other = next(t for t in trials if t.number != optuna.load_study(
        study_name="tiny", storage=storage).best_trial.number)
    output = tmp_path / "model"
    assert final(study_file, storage, "--trial", str(other.number), "--seeds", "1",
                 "--output", str(output)) == 0
    report = json.loads((output / "report.json").read_text())
    assert report["trial"] == other.number
    assert report["params"]["learning_rate"] == other.params["learning_rate"]


def one_line_error(capsys, *fragments) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("hpo")
    for fragment in fragments:
        assert fragment in err[0]


def test_a_study_without_a_complete_trial(study_file_only, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'empty.db'}"
    assert main(["create", "--config", str(study_file_only), "--storage", storage,
                 "--skip-check"]) == 0
    capsys.readouterr()
    assert final(study_file_only, storage, "--output", str(tmp_path / "m")) == 2
    one_line_error(capsys, "has no COMPLETE trial")


@pytest.fixture
def study_file_only(searched):
    return searched[0]


@pytest.mark.parametrize("trial, fragment", [("7", "has no trial 7"),
                                             ("x", "expected a trial number")])
def test_an_unknown_trial(study, tmp_path, capsys, trial, fragment):
    study_file, storage = study
    assert final(study_file, storage, "--trial", trial, "--output", str(tmp_path / "m")) == 2
    one_line_error(capsys, fragment)


def test_a_trial_that_did_not_complete(study, tmp_path, capsys):
    study_file, storage = study
    loaded = optuna.load_study(study_name="tiny", storage=storage)
    pruned = loaded.ask()
    loaded.tell(pruned, state=optuna.trial.TrialState.PRUNED)
    assert final(study_file, storage, "--trial", str(pruned.number),
                 "--output", str(tmp_path / "m")) == 2
    one_line_error(capsys, f"trial {pruned.number}", "is PRUNED, not COMPLETE")


def test_an_output_that_cannot_be_written(study, tmp_path, capsys):
    study_file, storage = study
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert final(study_file, storage, "--output", str(blocker / "model")) == 2
    one_line_error(capsys, f"--output {blocker / 'model'}: cannot write there")


def test_refit_with_tuned_thresholds_is_refused(study, capsys):
    study_file, storage = study
    assert final(study_file, storage, "--refit", "--thresholds", "tuned") == 2
    one_line_error(capsys, "--thresholds tuned needs the validation split")


def test_another_data_split_than_the_search_s_is_refused(study, tmp_path, capsys):
    study_file, storage = study
    assert final(study_file, storage, "--set", "data.split_seed=99",
                 "--output", str(tmp_path / "m")) == 2
    one_line_error(capsys, "searched on another data split")


def test_no_test_split_to_score_on(study, tmp_path, capsys):
    study_file, storage = study
    assert final(study_file, storage, "--set", "data.test_fraction=0",
                 "--output", str(tmp_path / "m")) == 2
    one_line_error(capsys, "data.test_fraction is 0")


def test_hpo_final_is_in_the_help():
    result = subprocess.run([sys.executable, "-m", "hpo.cli", "final", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    assert "--refit" in result.stdout and "--seeds" in result.stdout


def test_an_earlier_export_is_replaced_whole_and_a_foreign_directory_refused(
        study, tmp_path, capsys):
    study_file, storage = study
    output = tmp_path / "model"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    assert final(study_file, storage, "--seeds", "1", "--output", str(output)) == 2
    one_line_error(capsys, f"--output {output}: not empty and not an earlier hpo final export")
    (output / "notes.txt").unlink()
    assert final(study_file, storage, "--seeds", "1", "--output", str(output)) == 0
    (output / "stale.bin").write_text("from an earlier export")
    assert final(study_file, storage, "--seeds", "1", "--output", str(output)) == 0
    assert not (output / "stale.bin").exists() and (output / "report.json").is_file()
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_a_model_trained_with_adapters_is_exported_merged_for_a_plain_pipeline(
        tmp_path, tiny_model, small_data):
    config = study_dict([tiny_model], small_data, epochs=2)
    config["data"]["test_fraction"] = 0.2
    config["search_space"]["peft"] = ["dora"]
    config["search_space"]["adapter_learning_rate"] = {"low": 1e-3, "high": 2e-3}
    study_file = tmp_path / "tiny.yaml"
    study_file.write_text(yaml.safe_dump(config))
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert main(["run", "--config", str(study_file), "--storage", storage,
                 "--n-trials", "1"]) == 0
    (trial,) = optuna.load_study(study_name="tiny", storage=storage).trials
    assert trial.params["peft"] == "dora" and trial.user_attrs["trainable_share"] < 1
    assert "learning_rate" not in trial.params
    # The kept checkpoint is a plain model too: merged weights, no adapter files.
    (blob,) = [p for p in (tmp_path / "hpo-artifacts").rglob("*") if p.is_file()]
    names = set(zipfile.ZipFile(blob).namelist())
    assert "model.safetensors" in names and "adapter_config.json" not in names
    output = tmp_path / "model"
    assert final(study_file, storage, "--seeds", "1", "--output", str(output)) == 0
    report = json.loads((output / "report.json").read_text())
    assert report["runs"][0]["validation"] == pytest.approx(trial.value, abs=1e-4)
    assert report["params"]["learning_rate"] == trial.params["adapter_learning_rate"]
    assert not (output / "adapter_config.json").exists()
    assert pipeline_macro_f1(output, small_data, tmp_path) == pytest.approx(
        report["exported"]["test"]["macro_f1"], abs=1e-4)
    assert "DORA adapters (peft: r 8, alpha 16" in (output / "README.md").read_text()


def test_a_device_others_use_is_searched_for_what_is_left_and_the_user_told(
        tmp_path, monkeypatch):
    from types import SimpleNamespace

    from conftest import Quiet

    from hpo.app import final as final_module
    from hpo.config import StudyConfig
    from hpo.hardware import Device
    from hpo.space import Params
    from hpo.trial.batch_limit import StudyBatchCache, unfitted_plan

    config = StudyConfig.model_validate(study_dict(["m"], tmp_path))
    device = Device("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30)
    resources = SimpleNamespace(config=config, device=device)
    found = final_module.Recipe(3, 0.5, Params("m", "bf16", 16, 1e-4), config.training, 1)
    searched_with = []

    def fit_batch(params, training, *_args, shared=0):
        searched_with.append(shared)
        return unfitted_plan(params, training), "key", 2

    monkeypatch.setattr(final_module, "fit_batch", fit_batch)
    monkeypatch.setattr(final_module.memory, "foreign_bytes", lambda _device: 41 * 2**30)
    display = Quiet()
    cache = StudyBatchCache(optuna.create_study())
    _, probes = final_module.fitted_plan(found, resources, cache, False, display)
    assert probes == 2 and searched_with == [41 * 2**30]
    assert len(display.messages) == 1
    assert "41.0 GiB of" in display.messages[0] and "GPU of its own" in display.messages[0]

    monkeypatch.setattr(final_module.memory, "foreign_bytes", lambda _device: 0)
    display = Quiet()
    final_module.fitted_plan(found, resources, cache, False, display)
    assert searched_with[-1] == 0 and display.messages == []


def test_a_search_scored_inside_epochs_is_refit_to_the_evaluation_its_value_came_from(
        tmp_path, tiny_model, small_data):
    config = study_dict([tiny_model], small_data, epochs=2)
    config["data"]["test_fraction"] = 0.2
    config["study"]["objective_epoch"] = "best"
    config["training"]["evaluations_per_epoch"] = 3
    study_file = tmp_path / "tiny.yaml"
    study_file.write_text(yaml.safe_dump(config))
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert main(["run", "--config", str(study_file), "--storage", storage, "--n-trials", "2",
                 "--set", "study.sampler.name=random"]) == 0
    trials = optuna.load_study(study_name="tiny", storage=storage).trials
    assert [sorted(t.intermediate_values) for t in trials] == [[1, 2, 3, 4, 5, 6]] * 2
    assert all(len(t.user_attrs["epoch_seconds"]) == 6 for t in trials)
    best = max(trials, key=lambda t: t.value)
    epoch = best.user_attrs["value_epoch"]
    assert epoch in (0.333, 0.667, 1, 1.333, 1.667, 2)
    output = tmp_path / "model"
    assert final(study_file, storage, "--refit", "--seeds", "1", "--output", str(output)) == 0
    (run,) = json.loads((output / "report.json").read_text())["runs"]
    assert run["epochs"] == run["epoch"] == epoch
