"""What `hpo status`, `hpo best` and `hpo studies` show of a study."""

import json
import re

import optuna
import pytest
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
    assert info["counts"] == {"COMPLETE": 0, "PRUNED": 0, "RUNNING": 0, "PAUSED": 0,
                              "WAITING": 0, "FAIL": 0,
                              "INTERRUPTED": 0}


def test_status_counts_paused_trials_apart_and_says_where_each_stands():
    from hpo.app.summary import render_status, status
    from hpo.search import pausing

    study = optuna.create_study(direction="maximize")
    marks = [{pausing.PAUSED_AT: 3, pausing.PAUSES: [1, 3], pausing.RESUMES: [1]},
             {pausing.PAUSED_AT: None, pausing.PAUSES: [1], pausing.RESUMES: [1]}, {}]
    for number, attrs in enumerate(marks):
        trial = study.ask()
        trial.suggest_float("learning_rate", 1e-5, 1e-3, log=True)
        trial.set_user_attr("worker", f"node:{number}")
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
    info = status(study)
    assert (info["counts"]["RUNNING"], info["counts"]["PAUSED"]) == (2, 1)
    lines = render_status(info, "text").splitlines()
    assert lines[0] == "study '" + study.study_name + ("': 0 COMPLETE, 0 PRUNED, 2 RUNNING, "
                                                      "1 PAUSED, 0 WAITING, 0 FAIL")
    header, *rows = lines[1:]
    assert header.split() == ["running", "worker", "for", "paused", "learning_rate"]
    assert [" ".join(row.split()[5:-1]) for row in rows] == [  # after "trial N node:N 0 s"
        "at step 3", "resumed from step 1", "-"]


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


def test_status_shows_each_running_trials_share_of_its_gpu_where_one_is_shared(tiny_study,
                                                                             tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="tiny", storage=storage, direction="maximize")
    for worker, share in (("gpu-node-1:811", "1/2"), ("gpu-node-2:94", None)):
        trial = study.ask()
        trial.set_user_attr("worker", worker)
        if share:
            trial.set_user_attr("gpu_share", share)
    assert main(["status", "--config", str(tiny_study), "--storage", storage]) == 0
    header, *rows = capsys.readouterr().out.splitlines()[1:]
    assert header.split()[:4] == ["running", "worker", "GPU", "share"]
    assert [row.split()[2:4] for row in rows] == [["gpu-node-1:811", "1/2"],
                                                ["gpu-node-2:94", "whole"]]
    assert main(["status", "--config", str(tiny_study), "--storage", storage,
                 "--format", "json"]) == 0
    running = json.loads(capsys.readouterr().out)["running"]
    assert [t["gpu_share"] for t in running] == ["1/2", None]


def finished_study(storage: str, trials: list[tuple[str, str, object, dict]]) -> optuna.Study:
    """A study of trials over models a, b and precisions bf16, none: each (model, precision,
    state, user attributes), valued 0.5 when COMPLETE."""
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState, create_trial

    study = optuna.create_study(study_name="tiny", storage=storage, direction="maximize")
    distributions = {"model_name": CategoricalDistribution(["a", "b"]),
                     "fp_precision": CategoricalDistribution(["bf16", "none"])}
    for model, precision, state, attrs in trials:
        study.add_trial(create_trial(
            state=state, value=0.5 if state == TrialState.COMPLETE else None,
            params={"model_name": model, "fp_precision": precision},
            distributions=distributions, user_attrs=attrs))
    return study


def test_status_shows_device_seconds_per_model_and_precision_and_the_wasted_share(
        tiny_study, tmp_path, capsys):
    from optuna.trial import TrialState

    from hpo.app.summary import compute

    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = finished_study(storage, [
        (model, precision, state, {"trial_seconds": seconds})
        for model, precision, state, seconds in [("a", "bf16", TrialState.COMPLETE, 60),
                                                 ("a", "bf16", TrialState.PRUNED, 20),
                                                 ("b", "none", TrialState.COMPLETE, 100),
                                                 ("b", "none", TrialState.FAIL, 20)]])
    spent = compute(study)
    assert spent["device_seconds"] == 200
    assert (spent["pruned_share"], spent["failed_share"]) == (0.1, 0.1)
    assert spent["by_model_precision"] == [
        {"model_name": "b", "fp_precision": "none", "trials": 2, "device_seconds": 120.0,
         "pruned_seconds": 0.0, "failed_seconds": 20.0, "interrupted_seconds": 0.0,
         "tflops_per_second": None, "mfu": None},
        {"model_name": "a", "fp_precision": "bf16", "trials": 2, "device_seconds": 80.0,
         "pruned_seconds": 20.0, "failed_seconds": 0.0, "interrupted_seconds": 0.0,
         "tflops_per_second": None, "mfu": None}]
    assert main(["status", "--config", str(tiny_study), "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert "compute: 200 device-seconds, 10% on pruned and 10% on failed trials" in out
    assert re.search(r"^  b +none +2 +120 +0 +20$", out, flags=re.MULTILINE)


def test_status_shows_flops_per_second_and_mfu_over_each_rows_training_seconds(
        tiny_study, tmp_path, capsys):
    from optuna.trial import TrialState

    from hpo.app.summary import compute

    storage = f"sqlite:///{tmp_path / 's.db'}"
    # a/bf16 on GPUs: 2 s at 30% of the peak, then 4 s at 10%; b/none on a CPU: no peak.
    study = finished_study(storage, [
        (model, precision, TrialState.COMPLETE, {"trial_seconds": 10, **attrs})
        for model, precision, attrs in [
            ("a", "bf16", {"train_flops": 6e14, "flops_per_second": 3e14, "mfu": 0.3}),
            ("a", "bf16", {"train_flops": 4e14, "flops_per_second": 1e14, "mfu": 0.1}),
            ("b", "none", {"train_flops": 1e12, "flops_per_second": 5e10}),
            ("b", "none", {})]])
    rows = {r["model_name"]: r for r in compute(study)["by_model_precision"]}
    assert (rows["a"]["tflops_per_second"], rows["a"]["mfu"]) == (166.7, 0.1667)
    assert (rows["b"]["tflops_per_second"], rows["b"]["mfu"]) == (0.05, None)
    assert main(["status", "--config", str(tiny_study), "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  model +precision +trials +device-s +pruned-s +failed-s +TFLOP/s +MFU$",
                     out, flags=re.MULTILINE)
    assert re.search(r"^  a +bf16 +2 +20 +0 +0 +167 +16\.7%$", out, flags=re.MULTILINE)
    assert re.search(r"^  b +none +2 +20 +0 +0 +0\.05 +-$", out, flags=re.MULTILINE)


def test_studies_shows_a_dash_not_none_for_a_study_without_trials():
    from optuna.trial import TrialState, create_trial

    from hpo.app.summary import render_studies, studies

    storage = optuna.storages.InMemoryStorage()
    optuna.create_study(study_name="empty", storage=storage, direction="maximize")
    ran = optuna.create_study(study_name="ran", storage=storage, direction="maximize")
    ran.add_trial(create_trial(state=TrialState.COMPLETE, value=0.5))
    rows = studies(storage)
    text = render_studies(rows, "sqlite:///hpo.db", "text")
    assert "None" not in text
    assert text.splitlines()[0] == "empty\t0 trials\tbest -\tstarted -"
    assert re.fullmatch(r"ran\t1 trials\tbest 0\.5000\tstarted \d{4}-\d\d-\d\d [\d:]{8}",
                        text.splitlines()[1])
    assert json.loads(render_studies(rows, "sqlite:///hpo.db", "json"))[0]["started"] is None
    assert yaml.safe_load(render_studies(rows, "sqlite:///hpo.db", "yaml"))[0]["started"] is None


def interrupted_study() -> optuna.Study:
    """Trials as a worker leaves them: a failure, a Ctrl-C re-queued as trial 4, a SIGTERM
    whose retries were used up, and one carrying the marker attribute."""
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState, create_trial

    study = optuna.create_study(study_name="tiny", direction="maximize")
    models = {"model_name": CategoricalDistribution(["a"])}
    for state, seconds, attrs in [
            (TrialState.COMPLETE, 50, {}),
            (TrialState.FAIL, 10, {"error": "RuntimeError: interrupted by a bug"}),
            (TrialState.FAIL, 20, {"error": "interrupted by Ctrl-C"}),
            (TrialState.FAIL, 20, {"error": "interrupted by SIGTERM"})]:
        study.add_trial(create_trial(
            state=state, value=0.5 if state == TrialState.COMPLETE else None,
            params={"model_name": "a"}, distributions=models,
            user_attrs={"trial_seconds": seconds, **attrs}))
    study.add_trial(create_trial(state=TrialState.WAITING, params={"model_name": "a"},
                                 distributions=models,
                                 system_attrs={"failed_trial": 2, "retry_history": [2]}))
    return study


def test_interrupted_trials_are_counted_and_costed_apart_from_failed_ones():
    from hpo.app.summary import render_status, status

    info = status(interrupted_study())
    assert info["counts"] == {"COMPLETE": 1, "PRUNED": 0, "RUNNING": 0, "PAUSED": 0, "WAITING": 1,
                              "FAIL": 1, "INTERRUPTED": 2}
    assert info["interrupted"] == [
        {"trial": 2, "error": "interrupted by Ctrl-C", "requeued_as": 4},
        {"trial": 3, "error": "interrupted by SIGTERM", "requeued_as": None}]
    spent = info["compute"]
    assert (spent["device_seconds"], spent["failed_share"], spent["interrupted_share"]) == (
        100, 0.1, 0.4)
    assert spent["by_model_precision"][0]["failed_seconds"] == 10
    assert spent["by_model_precision"][0]["interrupted_seconds"] == 40
    out = render_status(info, "text")
    assert out.splitlines()[0] == ("study 'tiny': 1 COMPLETE, 0 PRUNED, 0 RUNNING, 1 WAITING, "
                                   "1 FAIL, 2 interrupted (1 re-queued)")
    assert "100 device-seconds, 0% on pruned, 10% on failed and 40% on interrupted trials" in out
    assert re.search(r"^  model +precision +trials +device-s +pruned-s +failed-s +interrupted-s$",
                     out, flags=re.MULTILINE)
    assert re.search(r"^  a +\? +4 +100 +0 +10 +40$", out, flags=re.MULTILINE)
    assert json.loads(render_status(info, "json"))["counts"]["INTERRUPTED"] == 2


def test_the_interrupted_marker_attribute_decides_where_it_is_set():
    from optuna.trial import TrialState, create_trial

    from hpo.app.summary import interrupted

    def trial(state, **attrs):
        return create_trial(state=state, value=0.5 if state == TrialState.COMPLETE else None,
                            user_attrs=attrs)

    assert interrupted(trial(TrialState.FAIL, interrupted=True, error="anything"))
    assert not interrupted(trial(TrialState.FAIL, interrupted=False,
                                 error="interrupted by Ctrl-C"))
    assert interrupted(trial(TrialState.FAIL, error="interrupted by SIGTERM"))  # before it
    assert not interrupted(trial(TrialState.FAIL, error="ValueError: interrupted by Ctrl-C"))
    assert not interrupted(trial(TrialState.COMPLETE, interrupted=True))  # a retry's copy


def test_one_interrupted_trial_reads_re_queued():
    from hpo.app.summary import render_status, status

    study = interrupted_study()
    info = status(study)
    info["interrupted"] = info["interrupted"][:1]
    info["counts"]["INTERRUPTED"] = 1
    assert render_status(info, "text").splitlines()[0].endswith(", 1 interrupted (re-queued)")


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # ask, not optimize
def test_a_trial_freed_after_ctrl_c_shows_as_interrupted_and_re_queued(tmp_path):
    # What executor.free records today, read back as hpo status reads it.
    from hpo.app.summary import render_status, status
    from hpo.errors import Terminated
    from hpo.search.storage import open_storage
    from hpo.trial.executor import free

    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}", heartbeat_interval=60,
                           grace_period=120, max_retry=1)
    study = optuna.create_study(study_name="tiny", storage=storage, direction="maximize")
    # The second claim is the first's re-queued copy, whose one retry is then used up.
    for stop in (KeyboardInterrupt(), Terminated("SIGTERM")):
        trial = study.ask()
        trial.suggest_categorical("model_name", ["a"])
        free(study, trial, stop)
    info = status(study)
    assert info["interrupted"] == [
        {"trial": 0, "error": "interrupted by Ctrl-C", "requeued_as": 1},
        {"trial": 1, "error": "interrupted by SIGTERM", "requeued_as": None}]
    assert info["counts"]["FAIL"] == 0 and info["counts"]["INTERRUPTED"] == 2
    out = render_status(info, "text")
    assert out.splitlines()[0] == ("study 'tiny': 0 COMPLETE, 0 PRUNED, 0 RUNNING, 0 WAITING, "
                                   "0 FAIL, 2 interrupted (1 re-queued)")
    assert info["compute"]["failed_share"] == 0  # their seconds are the interrupted share's
