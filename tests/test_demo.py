"""The README's main job: the demo study, 20 trials, run as a user runs it."""

import subprocess

import optuna
import pytest
from conftest import REPO
from optuna.trial import TrialState


@pytest.mark.slow
def test_demo_study_beats_the_trivial_baseline(tmp_path):
    storage = f"sqlite:///{tmp_path / 'demo.db'}"
    result = subprocess.run(
        ["hpo", "run", "--study", "demo", "--n-trials", "20", "--storage", storage],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    study = optuna.load_study(study_name="demo", storage=storage)
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(finished) == 20
    for trial in finished:
        assert trial.user_attrs["effective_batch_size"] == (
            trial.params["target_effective_batch_size"])
    baseline = study.user_attrs["baseline"]["macro_f1"]
    assert study.best_value > baseline + 0.2, (study.best_value, baseline)
    assert "best trial" in result.stdout and "trivial baseline" in result.stdout
