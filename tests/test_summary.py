"""What `hpo status`, `hpo best` and `hpo studies` show of a study."""

import json
import re

import optuna
import yaml

from hpo.cli import main


def best_trial_rate(storage: str) -> float:
    return optuna.load_study(study_name="tiny", storage=storage).best_params["learning_rate"]


def test_status_best_and_studies(tiny_study, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "2"]) == 0
    capsys.readouterr()
    assert main(["status", "--config", str(tiny_study), "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert out.startswith("study 'tiny': 2 COMPLETE, 0 PRUNED, 0 RUNNING, 0 WAITING, 0 FAIL\n")
    assert re.search(r"^best: trial \d, macro_f1 0\.\d{4}$", out, flags=re.MULTILINE)
    shown = re.search(r"^  learning_rate +(\S+)$", out, flags=re.MULTILINE).group(1)
    assert shown == f"{best_trial_rate(storage):.4g}"  # 4 significant digits, not 17
    assert main(["best", "--config", str(tiny_study), "--storage", storage,
                 "--format", "json"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert set(best["params"]) >= {"model_name", "fp_precision", "target_effective_batch_size",
                                   "learning_rate"}
    runtime = best["runtime"]
    assert runtime["effective_batch_size"] == best["params"]["target_effective_batch_size"]
    assert runtime["physical_batch_size"] * runtime["grad_accum_steps"] >= (
        runtime["effective_batch_size"])
    assert best["training"]["max_grad_norm"] == 1.0
    assert main(["best", "--config", str(tiny_study), "--storage", storage]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trial"] == best["trial"]
    assert main(["studies", "--storage", storage]) == 0
    assert capsys.readouterr().out.startswith("tiny\t2 trials")


def test_a_study_without_a_completed_trial_has_no_best(tiny_study, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    assert main(["create", "--config", str(tiny_study), "--storage", storage]) == 0
    capsys.readouterr()
    assert main(["best", "--config", str(tiny_study), "--storage", storage]) == 2
    assert "has no completed trial yet" in capsys.readouterr().err
    assert main(["status", "--config", str(tiny_study), "--storage", storage,
                 "--format", "json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["best"] is None and info["running"] == []
    assert info["counts"] == {"COMPLETE": 0, "PRUNED": 0, "RUNNING": 0, "WAITING": 0, "FAIL": 0}


def test_status_shows_running_trials_as_a_table(tiny_study, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="tiny", storage=storage, direction="maximize")
    for worker, rate in (("gpu-node-1:811", 0.000123456789), ("gpu-node-22:94", 3e-5)):
        study.enqueue_trial({"learning_rate": rate, "model_name": "tiny-bert"})
        trial = study.ask()
        trial.suggest_float("learning_rate", 1e-5, 1e-3, log=True)
        trial.suggest_categorical("model_name", ["tiny-bert"])
        trial.set_user_attr("worker", worker)
    assert main(["status", "--config", str(tiny_study), "--storage", storage]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "study 'tiny': 0 COMPLETE, 0 PRUNED, 2 RUNNING, 0 WAITING, 0 FAIL"
    header, *rows = lines[1:]
    assert header.split() == ["running", "worker", "for", "learning_rate", "model_name"]
    assert [row.split()[:3] for row in rows] == [["trial", "0", "gpu-node-1:811"],
                                                ["trial", "1", "gpu-node-22:94"]]
    assert [row.split()[-2:] for row in rows] == [["0.0001235", "tiny-bert"],
                                                 ["3e-05", "tiny-bert"]]
    assert len({line.index("tiny-bert") for line in rows}) == 1  # the columns line up
    assert main(["status", "--config", str(tiny_study), "--storage", storage,
                 "--format", "json"]) == 0
    running = json.loads(capsys.readouterr().out)["running"]
    assert [t["params"]["learning_rate"] for t in running] == [0.000123456789, 3e-5]


def test_status_shows_device_seconds_per_model_and_precision_and_the_wasted_share(
        tiny_study, tmp_path, capsys):
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState, create_trial

    from hpo.summary import compute

    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="tiny", storage=storage, direction="maximize")
    models = CategoricalDistribution(["a", "b"])
    precisions = CategoricalDistribution(["bf16", "none"])
    for model, precision, state, seconds in [("a", "bf16", TrialState.COMPLETE, 60),
                                             ("a", "bf16", TrialState.PRUNED, 20),
                                             ("b", "none", TrialState.COMPLETE, 100),
                                             ("b", "none", TrialState.FAIL, 20)]:
        study.add_trial(create_trial(
            state=state, value=0.5 if state == TrialState.COMPLETE else None,
            params={"model_name": model, "fp_precision": precision},
            distributions={"model_name": models, "fp_precision": precisions},
            user_attrs={"trial_seconds": seconds}))
    spent = compute(study)
    assert spent["device_seconds"] == 200
    assert (spent["pruned_share"], spent["failed_share"]) == (0.1, 0.1)
    assert spent["by_model_precision"] == [
        {"model_name": "b", "fp_precision": "none", "trials": 2, "device_seconds": 120.0,
         "pruned_seconds": 0.0, "failed_seconds": 20.0},
        {"model_name": "a", "fp_precision": "bf16", "trials": 2, "device_seconds": 80.0,
         "pruned_seconds": 20.0, "failed_seconds": 0.0}]
    assert main(["status", "--config", str(tiny_study), "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert "compute: 200 device-seconds, 10% on pruned and 10% on failed trials" in out
    assert re.search(r"^  b +none +2 +120 +0 +20$", out, flags=re.MULTILINE)
