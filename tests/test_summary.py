"""What `hpo status`, `hpo best` and `hpo studies` show of a study."""

import json

import yaml

from hpo.cli import main


def test_status_best_and_studies(tiny_study, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "2"]) == 0
    capsys.readouterr()
    assert main(["status", "--config", str(tiny_study), "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert "COMPLETE 2" in out and "best trial" in out
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
