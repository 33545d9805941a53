"""benchmarks/learning_curves.py: the grid it records and how a stopped recording's trials
reach the table (its trials themselves are `hpo run`'s, tested there)."""

from __future__ import annotations

import json

import learning_curves
import optuna
import pytest
from optuna.trial import TrialState

from hpo import config as config_module
from hpo import study_files
from hpo.search.study import SPLITS


def demo() -> config_module.StudyConfig:
    return study_files.load(study_files.study_path("demo"))


def test_the_grid_covers_the_demo_space_three_rates_a_decade():
    points = learning_curves.grid(demo(), ("none", "bf16"))
    assert len(points) == 2 * 2 * 3 * 3 * 7
    rates = sorted({p["learning_rate"] for p in points})
    assert rates == [1e-05, 2.15e-05, 4.64e-05, 0.0001, 0.000215, 0.000464, 0.001]
    assert sorted({p["weight_decay"] for p in points}) == [0.0, 0.05, 0.1]
    assert {p["target_effective_batch_size"] for p in points} == {8, 16, 32}


def finished(study: optuna.Study, params: dict, state: TrialState) -> None:
    study.enqueue_trial(params)
    trial = study.ask()
    space = demo().search_space
    trial.suggest_categorical("model_name", space.model_name)
    trial.suggest_categorical("fp_precision", ["none"])
    trial.suggest_categorical("target_effective_batch_size", space.target_effective_batch_size)
    trial.suggest_float("learning_rate", 1e-5, 1e-3, log=True)
    trial.suggest_float("weight_decay", 0.0, 0.1)
    for name, value in {"epoch_seconds": [10.0, 11.0], "epoch_scores": [0.3, 0.4],
                        "trial_seconds": 30.5, "tokenization_seconds": 2.0,
                        "batch_search_seconds": 1.5, "batch_probes": 2,
                        "model_seconds": 0.5}.items():
        trial.set_user_attr(name, value)
    if state != TrialState.RUNNING:
        study.tell(trial, 0.4, state=state if state == TrialState.FAIL else None)


@pytest.fixture
def stopped(tmp_path) -> str:
    """A recording's storage as a kill leaves it: one trial done, one running."""
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    study = optuna.create_study(storage=storage, study_name=learning_curves.STUDY_NAME)
    study.set_user_attr(SPLITS, {"train": {"posts": 420}})
    point = learning_curves.grid(demo(), ("none",))
    finished(study, point[0], TrialState.COMPLETE)
    finished(study, point[1], TrialState.RUNNING)
    return storage


def test_a_finished_trial_becomes_a_row_and_a_running_one_is_left_alone(stopped, tmp_path):
    table = learning_curves.load_table(tmp_path / "table.json")
    assert learning_curves.harvest(table, stopped, seed=0) == 1
    assert learning_curves.harvest(table, stopped, seed=0) == 0  # never twice
    row = dict(zip(table["columns"], table["rows"][0], strict=True))
    assert row["f1"] == [0.3, 0.4] and row["epoch_seconds"] == [10.0, 11.0]
    assert row["setup_seconds"] == 9.5 and row["batch_probes"] == 2
    assert table["train_size"] == 420
    study = optuna.load_study(study_name=learning_curves.STUDY_NAME, storage=stopped)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.RUNNING]


def test_before_recording_again_the_killed_trial_is_failed_and_enqueued_again(stopped,
                                                                               tmp_path):
    table = learning_curves.load_table(tmp_path / "table.json")
    learning_curves.harvest(table, stopped, seed=0, requeue=True)
    study = optuna.load_study(study_name=learning_curves.STUDY_NAME, storage=stopped)
    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING]
    assert study.trials[2].system_attrs["fixed_params"] == study.trials[1].params


def test_the_table_file_reads_back_one_row_a_line(stopped, tmp_path):
    output = tmp_path / "table.json"
    table = learning_curves.load_table(output)
    learning_curves.save(table, output, learning_curves.harvest(table, stopped, seed=0))
    text = output.read_text()
    assert json.loads(text) == table
    assert text.count("\n[") == 1 and table["machine"] in text


def test_a_resumed_recording_enqueues_only_points_neither_recorded_nor_waiting(stopped,
                                                                              tmp_path):
    table = learning_curves.load_table(tmp_path / "table.json")
    learning_curves.harvest(table, stopped, seed=0, requeue=True)
    study = optuna.load_study(study_name=learning_curves.STUDY_NAME, storage=stopped)
    points = learning_curves.grid(demo(), ("none",))[:3]
    missing = [p for p in points if learning_curves.key(p, 0) not in {
        tuple(r[:6]) for r in table["rows"]}]
    # Point 0 is recorded, point 1 waits (the killed trial, enqueued again): only point 2.
    assert learning_curves.enqueue_missing(study, missing, seed=0) == 1
    assert learning_curves.enqueue_missing(study, missing, seed=0) == 0


def test_training_noise_is_the_spread_of_a_points_best_epoch_across_its_seeds():
    def row(rate, seed, f1):
        return ["m", "none", 8, rate, 0.0, seed, f1, [1.0] * len(f1), 2.0, 0.5, 0.0, 0, 1.0]

    table = {"rows": [row(1e-4, 1, [0.2, 0.5]), row(1e-4, 0, [0.4, 0.3]),
                      row(1e-3, 0, [0.1, 0.1]), row(1e-3, 2, [0.1, 0.3]),
                      row(1e-5, 0, [0.05, 0.06])]}
    # Best epochs: 1e-4 seeds 0 and 1 are 0.4 and 0.5; 1e-3 are 0.1 and 0.3; 1e-5 one seed.
    count, median, high, lowest, highest = learning_curves.training_noise(table)
    assert count == 2 and median == pytest.approx(0.15) and high == pytest.approx(0.19)
    assert (lowest, highest) == (0.06, 0.4)
    assert learning_curves.training_noise({"rows": [row(1e-4, 0, [0.3])]}) is None


def _row(seed, f1, epochs, setup=2.0, rate=1e-4, model="m"):
    return [model, "none", 8, rate, 0.0, seed, f1, epochs, setup, 0.5, 0.25, 1, 1.0]


def test_a_pinned_parts_row_pays_the_reference_machines_median_seconds():
    table = {"rows": [_row(0, [0.1, 0.2], [10.0, 20.0], setup=2.0),
                      _row(1, [0.2, 0.3], [12.0, 30.0], setup=4.0),
                      _row(0, [0.1, 0.1], [99.0, 99.0], rate=1e-3)]}
    part = {"seed": 2}
    row = learning_curves.priced(table, part, _row(2, [0.3, 0.4], [5.0, 6.0], setup=9.0))
    at = dict(zip(learning_curves.COLUMNS, row, strict=True))
    assert at["f1"] == [0.3, 0.4] and at["seed"] == 2  # the part's own training
    assert at["epoch_seconds"] == [11.0, 25.0] and at["setup_seconds"] == 3.0
    assert (part["measured_epoch_seconds"], part["priced_epoch_seconds"]) == (11.0, 36.0)
    with pytest.raises(SystemExit, match="no reference recording"):
        learning_curves.priced(table, part, _row(2, [0.3], [5.0], rate=1e-5))


def test_the_gate_records_points_the_table_holds_and_measures_how_far_they_moved():
    rows = [_row(2, [0.1 * i, 0.2], [1.0, 1.0], rate=r) for i, r in
            enumerate([1e-5, 1e-4, 1e-3, 2e-3], 1)] + [_row(0, [0.5, 0.5], [1.0, 1.0])]
    table = {"rows": rows}
    points = learning_curves.gate_points(table, 2, 2)
    assert [p["learning_rate"] for p in points] == [1e-5, 1e-3]  # spread, seed 2's own
    again = {"rows": [_row(2, [0.1, 0.20003], [7.0, 7.0], rate=1e-5),
                      _row(2, [0.3, 0.2], [7.0, 7.0], rate=1e-3)]}
    assert learning_curves.gate_difference(table, again, 2) == pytest.approx(3e-5)
    again["rows"][1][6] = [0.31, 0.2]
    assert learning_curves.gate_difference(table, again, 2) == pytest.approx(0.01)
    with pytest.raises(SystemExit, match="needs 5 recorded points of seed 2"):
        learning_curves.gate_points(table, 2, 5)


def test_a_table_of_another_cpu_kind_takes_only_a_pinned_part(tmp_path, monkeypatch):
    output = tmp_path / "table.json"
    table = learning_curves.load_table(output)
    table["machine"] = "Some Other CPU (avx2)"
    learning_curves.save(table, output, 0, force=True)
    with pytest.raises(SystemExit, match="record a part with --pinned"):
        learning_curves.main(["--output", str(output), "--work", str(tmp_path), "--seeds", "2"])
    learning_curves.main(["--output", str(output), "--work", str(tmp_path), "--summary"])


def test_a_gate_that_moved_points_like_training_noise_takes_a_tagged_draw_else_refuses():
    # Seeds whose best F1 span 0.2 at every point: the training noise's median.
    rows = [_row(s, [0.2 + 0.1 * s, 0.3 + 0.1 * s], [1.0, 1.0], rate=r)
            for s in (0, 1) for r in (1e-5, 1e-4, 1e-3)]
    rows += [_row(2, [0.4, 0.5], [1.0, 1.0], rate=r) for r in (1e-5, 1e-4, 1e-3)]
    table = {"rows": rows}
    same = {"rows": [_row(2, [0.4, 0.5], [2.0, 2.0], rate=r) for r in (1e-5, 1e-4, 1e-3)]}
    assert learning_curves.gated(table, same, 2, 3)["as"] == "the seed's own"
    moved = {"rows": [_row(2, [0.4, 0.45 + d], [2.0, 2.0], rate=r)
                      for d, r in ((0.0, 1e-5), (0.02, 1e-4), (0.3, 1e-3))]}
    part = learning_curves.gated(table, moved, 2, 3)
    assert part["as"] == "a tagged noise draw"
    assert part["gate"]["median_best_f1_difference"] == pytest.approx(0.05)
    assert part["gate"]["training_noise_median"] == pytest.approx(0.2)
    assert part["gate"]["max_f1_difference"] == pytest.approx(0.25)
    far = {"rows": [_row(2, [0.1, 0.2], [2.0, 2.0], rate=r) for r in (1e-5, 1e-4, 1e-3)]}
    with pytest.raises(SystemExit, match="more than the table's training noise"):
        learning_curves.gated(table, far, 2, 3)
