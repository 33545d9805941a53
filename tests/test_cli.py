"""`hpo run` end to end on tiny models: the storage holds the parameters and attributes of the
public contract."""

import argparse
import re
import subprocess
import sys

import optuna
import pytest
import yaml
from conftest import REPO, load, require
from conftest import run_in_process as run
from optuna.trial import TrialState

from hpo.cli import COMMANDS, build_parser, main

PARAMS = {"model_name", "fp_precision", "target_effective_batch_size", "learning_rate"}
ATTRS = {
    "physical_batch_size", "grad_accum_steps", "effective_batch_size", "batch_probes",
    "device", "samples_per_second", "padding_efficiency", "train_seconds", "trial_seconds",
    "versions", "worker", "epoch_seconds", "train_flops", "flops_per_second",
}


def test_run_records_parameters_and_attributes(tiny_study, storage, capsys):
    assert run(tiny_study, storage, 3) == 0
    study = load(storage)
    trials = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(trials) == 3 == len(study.trials)
    for trial in trials:
        assert set(trial.params) == PARAMS
        assert set(trial.user_attrs) >= ATTRS
        attrs = trial.user_attrs
        assert attrs["effective_batch_size"] == trial.params["target_effective_batch_size"]
        assert attrs["physical_batch_size"] * attrs["grad_accum_steps"] >= (
            attrs["effective_batch_size"])
        assert 0 < attrs["padding_efficiency"] <= 1
        assert attrs["trial_seconds"] >= attrs["train_seconds"] > 0
        assert len(attrs["epoch_seconds"]) == len(trial.intermediate_values)
        assert attrs["train_flops"] > 0 and attrs["flops_per_second"] > 0
        assert "mfu" not in attrs  # a CPU's peak is not known
        assert 0.0 <= trial.value <= 1.0
    assert study.user_attrs["search_space"]["fp_precision"] == ["none"]
    out = capsys.readouterr().out
    assert "best trial" in out and "trivial baseline" in out
    assert len(re.findall(r"^trial \d+ value ", out, flags=re.MULTILINE)) == 3


def test_a_one_epoch_run_of_a_rung_pruned_study_runs_unpruned_and_says_so(tiny_study, storage,
                                                                         capsys):
    assert run(tiny_study, storage, 2, "--set", "training.epochs=1", "--set",
               "study.pruner.name=successive_halving") == 0
    trials = load(storage).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert "no pruning: trials report 1 step (1 epoch)" in capsys.readouterr().out


def test_a_changed_space_is_refused(tiny_study, storage, capsys):
    assert run(tiny_study, storage, 1) == 0
    capsys.readouterr()
    code = run(tiny_study, storage, 2, "--set", "search_space.learning_rate.low=0.0002")
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "different search space" in err and "\n" not in err
    assert "hpo delete" in err and "another study.name" in err  # and the ways out


def test_delete_asks_first_then_a_changed_space_can_start_over(tiny_study, storage, capsys,
                                                              monkeypatch):
    changed = ("--set", "search_space.learning_rate.low=0.0002")
    assert main(["create", "--config", str(tiny_study), "--storage", storage]) == 0
    assert main(["create", "--config", str(tiny_study), "--storage", storage, *changed]) == 2
    delete = ["delete", "--config", str(tiny_study), "--storage", storage]
    for answer in ("n", "", "no thanks"):
        monkeypatch.setattr("builtins.input", lambda prompt, answer=answer: answer)
        capsys.readouterr()
        assert main(delete) == 0  # declining is a choice, not an error
        assert "study 'tiny' with 0 trials" in capsys.readouterr().out
        assert load(storage).study_name == "tiny"  # kept
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert main(delete) == 0
    assert "deleted study 'tiny'" in capsys.readouterr().out
    with pytest.raises(KeyError):
        load(storage)
    assert main(["create", "--config", str(tiny_study), "--storage", storage, *changed]) == 0


def test_delete_yes_asks_nothing(tiny_study, storage, monkeypatch, capsys):
    assert main(["create", "--config", str(tiny_study), "--storage", storage]) == 0

    def no_prompt(prompt):
        raise AssertionError("--yes must not prompt")

    monkeypatch.setattr("builtins.input", no_prompt)
    assert main(["delete", "--config", str(tiny_study), "--storage", storage, "--yes"]) == 0
    assert optuna.get_all_study_names(storage) == []
    capsys.readouterr()
    assert main(["studies", "--storage", storage]) == 0
    assert capsys.readouterr().out == f"no studies in {storage}\n"


def test_every_command_finds_a_study_by_the_name_its_file_gives(tiny_study, storage,
                                                                tmp_path, monkeypatch, capsys):
    studies = tmp_path / "configs" / "studies"
    studies.mkdir(parents=True)
    spec = yaml.safe_load(tiny_study.read_text())
    spec["study"]["name"] = "renamed"
    (studies / "mine.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.chdir(tmp_path)
    mine = ["--study", "mine", "--storage", storage]
    assert main(["create", *mine, "--skip-check"]) == 0
    assert optuna.load_study(study_name="renamed", storage=storage)
    capsys.readouterr()
    assert main(["status", *mine]) == 0 and "renamed" in capsys.readouterr().out
    assert main(["best", *mine]) == 2
    assert "study 'renamed' has no completed trial yet" in capsys.readouterr().err
    assert main(["delete", *mine, "--yes"]) == 0
    assert "deleted study 'renamed'" in capsys.readouterr().out


def test_nli_pairs_task_runs_and_scores_on_the_post_grid(tiny_study, storage):
    assert run(tiny_study, storage, 1, "--set", "data.task=nli_pairs") == 0
    (trial,) = load(storage).trials
    assert trial.state == TrialState.COMPLETE
    assert set(trial.user_attrs["f1_per_symptom"]) == {
        "DEPRESSED_MOOD", "ANHEDONIA", "APPETITE_CHANGE", "SLEEP_ISSUES", "PSYCHOMOTOR",
        "FATIGUE", "WORTHLESSNESS", "COGNITIVE_ISSUES", "SUICIDAL_THOUGHTS"}
    assert trial.user_attrs["training"]["pos_weight"] == "balanced"


def test_gradient_checkpointing_option(tiny_study, storage):
    assert run(tiny_study, storage, 1, "--set", "training.gradient_checkpointing=true") == 0
    (trial,) = load(storage).trials
    assert trial.state == TrialState.COMPLETE
    assert trial.user_attrs["training"]["gradient_checkpointing"] is True


@pytest.mark.parametrize("args", [[], ["--help"]])
def test_plain_hpo_and_help_describe_the_tool_and_every_command(args):
    result = subprocess.run([sys.executable, "-m", "hpo.cli", *args], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""
    out = result.stdout
    assert out.startswith("usage: hpo")
    assert "hyperparameters of a Hugging Face sequence classifier" in out
    for command in COMMANDS:
        assert re.search(rf"^    {command} +\S", out, flags=re.MULTILINE), command
    assert "examples:" in out and "Exit codes" in out


def test_every_command_has_a_description_and_every_option_a_help():
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(subparsers.choices) == set(COMMANDS)
    missing = [f"{name} {action.option_strings or action.dest}"
               for name, command in subparsers.choices.items()
               for action in command._actions
               if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()]
    assert missing == [], f"give these options a help text in hpo/cli.py: {missing}"
    undescribed = [name for name, command in subparsers.choices.items()
                   if not (command.description or "").strip()]
    assert undescribed == [], f"give these commands a description: {undescribed}"
    listed = {choice.dest: choice.help for choice in subparsers._choices_actions}
    assert all(listed.get(name) for name in COMMANDS)  # the line `hpo --help` shows


def test_check_says_when_it_created_the_study_and_only_then(tiny_study, storage, monkeypatch,
                                                            capsys):
    # The check itself (a training step per combination) is hpo check's own test's; here only
    # what check says around it.
    ran = []
    monkeypatch.setattr("hpo.app.commands._check", lambda *args, **kwargs: ran.append(args))
    command = ["check", "--config", str(tiny_study), "--storage", storage]
    assert main(command) == 0
    out = capsys.readouterr().out
    names = f"--config {tiny_study} --storage {storage}"
    assert out == (f"created study 'tiny' in {storage} to keep the check's verdicts "
                   f"(`hpo run {names}` joins it; `hpo delete {names}` removes it)\n")
    assert load(storage).study_name == "tiny"
    assert main(command) == 0
    assert capsys.readouterr().out == ""  # it existed: nothing to say
    assert len(ran) == 2


def test_generated_and_gated_files_are_ignored_by_git():
    require((REPO / ".git").exists(), "not a git clone")
    # What hpo run, hpo final, the README's fetch snippet and mkdocs write here.
    paths = ["hpo.db", "hpo.hpo-lock", "data/redsm5/redsm5_posts.csv",
             "hpo-artifacts/artifact", "final/demo/config.json", "best.zip", "best/config.json",
             "site/index.html"]
    result = subprocess.run(["git", "check-ignore", *paths], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.split() == paths
