"""A study that pauses trials instead of stopping them (`study.pruner.pause`), run by real
workers on real storages: paused trials resumed from their checkpoints, no epoch trained
twice, the budget kept, and a worker killed while it resumes a trial losing nothing."""

from collections import Counter
from pathlib import Path

import optuna
import yaml
from conftest import run_in_process, start_worker, study_dict
from optuna.trial import FrozenTrial, TrialState
from optuna_dashboard import get_note

from hpo.search import pausing

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def pausing_study(tmp_path: Path, models: list[Path], data: Path, **study: object) -> Path:
    # Balanced label weights and large rates: the tiny models' scores then differ between
    # trials, so rungs rank them and later trials promote paused ones.
    config = study_dict(models, data, epochs=4, pos_weight="balanced")
    config["search_space"]["learning_rate"] = {"low": 1.0e-3, "high": 3.0e-2, "log": True}
    config["study"]["pruner"] = {"name": "successive_halving", "min_resource": 1,
                                 "reduction_factor": 2, "pause": True}
    # A budget of trials (not the default trainings) holds each study to exactly `n`
    # trials, which the checks below count; the tests of trainings say so.
    config["study"]["budget"] = "trials"
    config["study"].update(study)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def checkpoints_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("checkpoint-*")) if directory.is_dir() else []


def trained_once(trial: FrozenTrial) -> bool:
    """Each epoch the trial reported was trained once: its records hold one entry per epoch
    it reached, however often it paused and resumed."""
    steps = sorted(trial.intermediate_values)
    return (steps == list(range(1, len(steps) + 1))
            and len(trial.user_attrs.get("epoch_seconds", [])) == len(steps))


def assert_ended_cleanly(trials: list[FrozenTrial], n: int, artifacts: Path) -> None:
    """The study holds its `n` trials, all finished and none failed; a trial still paused at
    the end was pruned as not promoted; no checkpoint is left in the store."""
    assert len(trials) == n and all(t.state in FINISHED for t in trials), Counter(
        t.state for t in trials)
    assert all(trained_once(t) for t in trials)
    for trial in trials:
        if trial.user_attrs.get("prune_reason") == pausing.NOT_PROMOTED:
            assert max(trial.intermediate_values) == trial.user_attrs[pausing.PAUSES][-1]
    assert checkpoints_in(artifacts) == []


def test_paused_trials_resume_from_their_checkpoints_and_the_rest_end_pruned(
        tmp_path, tiny_model, tiny_model_b, small_data):
    study_file = pausing_study(tmp_path, [tiny_model, tiny_model_b], small_data)
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert run_in_process(study_file, storage, 8) == 0
    trials = optuna.load_study(study_name="tiny", storage=storage).trials
    assert_ended_cleanly(trials, 8, tmp_path / "hpo-artifacts")
    paused = [t for t in trials if t.user_attrs.get(pausing.PAUSES)]
    resumed = [t for t in trials if t.user_attrs.get(pausing.RESUMES)]
    assert paused and resumed, "no trial paused and resumed: the study tests nothing"
    for trial in resumed:
        # It went on past the step it was resumed from.
        assert max(trial.intermediate_values) > trial.user_attrs[pausing.RESUMES][0]
    # The dashboard says where each trial that paused stands, on its page.
    study = optuna.load_study(study_name="tiny", storage=storage)
    notes = {t.number: get_note(optuna.trial.Trial(study, t._trial_id)) for t in paused}
    for trial in paused:
        said = notes[trial.number]
        if trial.user_attrs.get("prune_reason") == pausing.NOT_PROMOTED:
            assert said.startswith("**Pruned, not promoted**: paused at step ")
        else:
            assert said.startswith("**Resumed** from step ")


def test_pause_auto_without_a_store_pauses_and_trains_a_promoted_trial_again(
        tmp_path, tiny_model, tiny_model_b, small_data, pg_url, capsys):
    """`pause: auto` on PostgreSQL with no `study.artifacts` pauses without checkpoints: a
    promoted trial trains again from its start, each step reported once, and a budget of
    trainings counts what it trained twice."""
    study_file = pausing_study(tmp_path, [tiny_model, tiny_model_b], small_data,
                               budget="trainings")
    config = yaml.safe_load(study_file.read_text())
    config["study"]["pruner"]["pause"] = "auto"
    study_file.write_text(yaml.safe_dump(config))
    assert run_in_process(study_file, pg_url, 4) == 0
    said = capsys.readouterr().out
    assert ("study.pruner.pause auto: a trial its rung would stop pauses, without a "
            "checkpoint (no study.artifacts): promoted, it trains again from its start") in said
    storage = optuna.storages.RDBStorage(pg_url)
    try:
        trials = optuna.load_study(study_name="tiny", storage=storage).trials
    finally:
        storage.engine.dispose()
    assert_ended_cleanly(trials, len(trials), tmp_path / "nowhere")
    assert not any(t.user_attrs.get(pausing.CHECKPOINT, {}).get("id") for t in trials)
    again = [t for t in trials if t.user_attrs.get(pausing.RETRAINED)]
    assert again, "no trial was promoted: the study tests nothing"
    assert "it kept no checkpoint (study.pruner.max_checkpoints), so it trains again" in said
    for trial in again:  # trained from its start, on past where it paused
        assert trial.user_attrs[pausing.RETRAINED] == trial.user_attrs[pausing.RESUMES][0]
        assert max(trial.intermediate_values) > trial.user_attrs[pausing.RESUMES][0]
    trained = sum(max(t.intermediate_values) + t.user_attrs.get(pausing.RETRAINED, 0)
                  for t in trials)
    assert trained <= 16  # 4 trainings of 4 epochs, what was trained twice included


def killed_at_resume_then_finished(study_file: Path, pg_url: str
                                   ) -> tuple[FrozenTrial, list[FrozenTrial]]:
    """A worker alone runs until it resumes its first paused trial and dies there; two
    workers then finish the study. The killed run's trial as the dead worker left it, and
    the study's trials at the end."""
    env = {"HPO_HEARTBEAT_INTERVAL": "1", "HPO_GRACE_PERIOD": "4"}
    victim = start_worker(study_file, pg_url, 8, env={**env, "HPO_FAULT_KILL_AT": "resume"})
    assert victim.wait(timeout=600) == -9, victim.stderr.read()[-2000:]
    storage = optuna.storages.RDBStorage(pg_url)
    try:
        study = optuna.load_study(study_name="tiny", storage=storage)
        killed = [t for t in study.trials if t.user_attrs.get(pausing.RESUMES)]
        assert len(killed) == 1 and killed[0].state == TrialState.RUNNING
        workers = [start_worker(study_file, pg_url, 8, env=env) for _ in range(2)]
        for process in workers:
            assert process.wait(timeout=600) == 0, process.stderr.read()[-2000:]
        trials = optuna.load_study(study_name="tiny", storage=storage).trials
    finally:
        storage.engine.dispose()
    return killed[0], trials


def test_a_worker_killed_while_it_resumes_a_trial_loses_its_checkpoint_to_no_one(
        tmp_path, tiny_model, tiny_model_b, small_data, pg_url):
    artifacts = tmp_path / "artifacts"
    study_file = pausing_study(tmp_path, [tiny_model, tiny_model_b], small_data,
                               artifacts=str(artifacts))
    # Of the two workers that finish the study, one takes the dead run's trial back to
    # paused at its checkpoint, and one resumes it from there.
    killed, trials = killed_at_resume_then_finished(study_file, pg_url)
    assert not pausing.is_paused(killed)  # claimed, and then its worker died
    assert_ended_cleanly(trials, 8, artifacts)
    again = trials[killed.number]
    resumes = again.user_attrs[pausing.RESUMES]
    # Resumed twice from the checkpoint it paused at: no retry copy, no epoch of it retrained
    # before that checkpoint.
    assert len(resumes) >= 2 and resumes[0] == resumes[1] == again.user_attrs[pausing.PAUSES][0]
    assert not any(t.system_attrs.get("retry_history") for t in trials)


def test_a_worker_killed_while_it_trains_a_promoted_trial_again_leaves_it_paused(
        tmp_path, tiny_model, tiny_model_b, small_data, pg_url):
    """No checkpoints kept (`max_checkpoints: 0`): a promoted trial trains again from its
    start, and a worker killed doing so leaves it paused where it was, for another to train
    again; the steps each claim trains again are counted, none reported twice."""
    study_file = pausing_study(tmp_path, [tiny_model, tiny_model_b], small_data)
    config = yaml.safe_load(study_file.read_text())
    config["study"]["pruner"]["max_checkpoints"] = 0
    study_file.write_text(yaml.safe_dump(config))
    killed, trials = killed_at_resume_then_finished(study_file, pg_url)
    paused_at = killed.user_attrs[pausing.PAUSES][0]
    assert killed.user_attrs[pausing.RETRAINED] == paused_at  # charged at the claim
    assert_ended_cleanly(trials, 8, tmp_path / "nowhere")
    again = trials[killed.number]
    resumes = again.user_attrs[pausing.RESUMES]
    assert len(resumes) >= 2 and resumes[0] == resumes[1] == paused_at
    # Each claim charged what it would train again, the dead run's included.
    assert again.user_attrs[pausing.RETRAINED] == sum(resumes)
    assert not any(t.system_attrs.get("retry_history") for t in trials)


def test_under_a_budget_of_trainings_pausing_trains_at_most_n_full_trainings(
        tmp_path, tiny_model, tiny_model_b, small_data):
    """`study.budget: trainings`: `--n-trials 4` of 4 epochs buys 16 epochs; paused and
    stopped trials give back what they did not train, so more than 4 trials run, and no
    epoch is trained twice or past the budget."""
    study_file = pausing_study(tmp_path, [tiny_model, tiny_model_b], small_data,
                               budget="trainings")
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert run_in_process(study_file, storage, 4) == 0
    trials = optuna.load_study(study_name="tiny", storage=storage).trials
    assert_ended_cleanly(trials, len(trials), tmp_path / "hpo-artifacts")
    assert len(trials) > 4
    assert sum(max(t.intermediate_values) for t in trials) <= 16
    assert any(t.user_attrs.get(pausing.PAUSES) for t in trials)
    # A second worker finds nothing left to start: no whole training fits.
    assert run_in_process(study_file, storage, 4) == 0
    assert len(optuna.load_study(study_name="tiny", storage=storage).trials) == len(trials)
