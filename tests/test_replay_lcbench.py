"""benchmarks/replay_lcbench.py: the replay on YAHPO Gym's LCBench surrogate. Here on a
made-up surrogate whose accuracies and times are known (the real one needs its ONNX file,
not in this repository, and onnxruntime)."""

from __future__ import annotations

import functools
import json
import math
import sys

import optuna
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import replay  # noqa: E402
import replay_lcbench  # noqa: E402

TASKS = ("3945", "7593")


def made_up(task: str, configs: list[dict[str, float]]) -> list[dict[str, float]]:
    """Accuracy (in percent, as LCBench's) rising with the epoch to a top that peaks at a
    learning rate of 1e-2, higher on task 3945; the cumulative time 2 s an epoch, except that
    it goes back 1 s at epoch 3 (the surrogate's time is not always increasing)."""
    out = []
    for c in configs:
        top = (90.0 if task == "3945" else 70.0) - 10 * abs(math.log10(c["learning_rate"] / 1e-2))
        e = c["epoch"]
        out.append({"val_accuracy": top * (1 - 0.5 ** e),
                    "time": 2.0 * e - (3.0 if e == 3 else 0.0)})
    return out


@pytest.fixture()
def surrogate() -> replay_lcbench.Surrogate:
    return replay_lcbench.Surrogate(made_up, TASKS)


def config(rate: float) -> replay_lcbench.Mlp:
    trial = optuna.trial.FixedTrial({"batch_size": 64, "learning_rate": rate, "momentum": 0.9,
                                     "weight_decay": 1e-3, "num_layers": 2, "max_units": 128,
                                     "max_dropout": 0.1})
    return replay_lcbench.sample(trial)


def test_a_curve_is_the_surrogates_accuracy_per_epoch_and_its_times_made_monotone(surrogate):
    curve = surrogate.curve(config(1e-2), 0)
    assert len(curve.scores) == len(curve.seconds) == replay_lcbench.EPOCHS
    assert curve.scores[0] == pytest.approx(0.45) and curve.scores[-1] == pytest.approx(0.9)
    # 2, 4, then 3 (1 s back: a millisecond), then 8: 4 s after the 4 reached before.
    assert curve.seconds[:4] == pytest.approx((2.0, 2.0, 1e-3, 4.0))
    assert curve.setup == 0.0
    # World k is task k mod the tasks: world 1 reads 7593, world 2 3945 again.
    assert surrogate.curve(config(1e-2), 1).scores[-1] == pytest.approx(0.7)
    assert surrogate.curve(config(1e-2), 2) == curve


def test_the_oracle_is_the_best_of_random_configurations_at_any_epoch(surrogate):
    found = surrogate.oracle(0)
    # The peak is 0.9 at a rate of exactly 1e-2; random rates come near it, not above.
    assert 0.85 < found <= 0.9
    assert surrogate.oracle(2) == found  # the same task, cached


def test_hpo_is_built_from_its_schema_defaults_and_the_peers_from_their_libraries():
    chosen = dict((p.name, p) for p, searches in replay_lcbench.policies(
        ["hpo", "expert", "novice", "random", "tpe-hyperband", "sh2"], 0,
        {"sh2": ["study.pruner.reduction_factor=2"]}) if not searches)
    assert isinstance(chosen["hpo"].study.pruner, optuna.pruners.SuccessiveHalvingPruner)
    assert chosen["hpo"].sampler_for is not None  # reseeded per trial, as hpo's workers do
    assert isinstance(chosen["expert"].study.pruner, optuna.pruners.MedianPruner)
    assert isinstance(chosen["novice"].study.pruner, optuna.pruners.NopPruner)
    assert isinstance(chosen["random"].study.sampler, optuna.samplers.RandomSampler)
    assert isinstance(chosen["tpe-hyperband"].study.pruner, optuna.pruners.HyperbandPruner)
    assert {policy.study.study_name for policy in chosen.values()} == {"replay-0"}
    study = replay_lcbench.default_study()
    defaults = (replay_lcbench.config_module.SamplerConfig(),
                replay_lcbench.config_module.PrunerConfig())
    assert (study.study.sampler, study.study.pruner) == defaults
    assert study.training.epochs == replay_lcbench.EPOCHS


def test_tpe_with_hyperband_is_optunas_pairing_as_it_comes_whatever_hpos_first_rung(
        monkeypatch):
    made: list[dict] = []
    original = optuna.pruners.HyperbandPruner

    def spy(**kwargs):
        made.append(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(optuna.pruners, "HyperbandPruner", spy)
    replay_lcbench.policies(["tpe-hyperband", "hb"], 0, {"hb": [
        "study.pruner.name=hyperband", "study.pruner.min_resource=auto"]})
    # Optuna's HyperbandPruner() starts at one epoch; hpo's `auto` at 52 / 3^2.
    assert [m["min_resource"] for m in made] == [1, 6]


def test_the_replay_runs_and_holds_g1_and_g2_per_peer(tmp_path, capsys):
    output = tmp_path / "out.json"
    replay_lcbench.main(["--budget", "4", "--repetitions", "2", "--output", str(output),
                         "--policies", "expert", "random", "--hpo-set",
                         "study.pruner.name=median"],
                        table=functools.partial(replay_lcbench.Surrogate, made_up, TASKS))
    result = json.loads(output.read_text())
    assert set(result["versus"]) == {"expert", "random"}
    assert result["hpo_sets"] == ["study.pruner.name=median"]
    first = result["repetitions_data"][0]
    assert first["oracle"]["task"] == "3945"
    assert first["oracle"]["best"] >= max(run["steps"][-1][1] for name, run in first.items()
                                          if name != "oracle")
    assert "hpo vs expert: G1" in capsys.readouterr().out
    # The table renders as replay.py's do.
    assert "| 4 trials x 1 | expert |" in replay.render([output], None)


def test_without_the_surrogates_files_it_says_what_to_fetch(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        replay_lcbench.main(["--data", str(tmp_path)])
    assert stop.value.code == 2
    assert "slds-lmu/yahpo_data" in capsys.readouterr().err
