"""benchmarks/replay_lcbench.py: LCBench's surrogate written as tables of the replay's format.
Here with a made-up surrogate whose accuracies and times are known (the real one needs its
ONNX file, not in this repository, and onnxruntime)."""

from __future__ import annotations

import json
import math

import pytest
import replay_lcbench
import tables

TASKS = ["3945", "7593"]


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
def written(tmp_path) -> dict[str, tables.RecordedTable]:
    replay_lcbench.main(["--output", str(tmp_path), "--configurations", "30"], made_up, TASKS)
    return {task: tables.read(tmp_path / f"lcbench-{task}.jsonl") for task in TASKS}


def test_each_task_is_a_table_of_random_configurations_and_their_curves(written):
    table = written["3945"]
    assert table.name == "lcbench-3945" and table.direction == "maximize"
    assert set(table.space) == set(replay_lcbench.SPACE) and len(table.runs) == 30
    run = table.runs[0]
    assert len(run.values) == replay_lcbench.EPOCHS == table.epochs
    top = 0.9 - 0.1 * abs(math.log10(run.params["learning_rate"] / 1e-2))
    assert run.values[0] == pytest.approx(top / 2, abs=1e-6)
    # 2, 4, then 1 (back in time: a millisecond after 4), then 8.
    assert run.seconds[:4] == pytest.approx((2.0, 4.0, 4.001, 8.0))
    # Integers of the space stay integers; every value lies in its range.
    assert isinstance(run.params["num_layers"], int)
    for name, (low, high, _, _) in replay_lcbench.SPACE.items():
        assert all(low <= r.params[name] <= high for r in table.runs)
    # The configurations are drawn per task, the same on every call.
    assert [r.params for r in written["7593"].runs] != [r.params for r in table.runs]


def test_without_the_surrogates_files_it_says_what_to_fetch(tmp_path, capsys):
    with pytest.raises(SystemExit) as ended:
        replay_lcbench.main(["--data", str(tmp_path), "--output", str(tmp_path / "t")])
    assert ended.value.code == 2
    assert "yahpo_data" in capsys.readouterr().err


def test_the_tasks_are_the_34_of_the_surrogates_space(tmp_path):
    folder = tmp_path / "lcbench"
    folder.mkdir()
    space = {"hyperparameters": [{"name": "OpenML_task_id", "choices": TASKS}]}
    (folder / "config_space.json").write_text(json.dumps(space))
    assert replay_lcbench.tasks_of(tmp_path) == TASKS


def test_the_surrogates_answer_at_a_recorded_configuration_is_its_recorded_run(written):
    """`replay.py --surrogate` answers each suggestion by the surrogate at that point: where
    the table recorded one, the very run recorded (checked on the real surrogate too, 300
    runs of 3 tasks: benchmarks/README.md), and elsewhere a curve of its own."""
    table = written["7593"]
    answer = replay_lcbench.answerer(made_up, "7593")
    for run in table.runs[:5]:
        assert answer(run.params) == run
    moved = {**table.runs[0].params, "learning_rate": table.runs[0].params["learning_rate"] * 1.01}
    assert answer(moved).values != table.runs[0].values
    assert replay_lcbench.task_of("lcbench-7593") == "7593"
    assert replay_lcbench.task_of("demo") is None


def test_check_says_whether_the_surrogate_gives_the_recorded_runs(tmp_path, capsys):
    replay_lcbench.main(["--output", str(tmp_path), "--configurations", "6"], made_up, TASKS)
    with pytest.raises(SystemExit) as ended:
        replay_lcbench.main(["--output", str(tmp_path), "--check", "4"], made_up, TASKS)
    assert ended.value.code == 0
    assert "8 of 8 recorded runs answered exactly" in capsys.readouterr().out

    def drifted(task, configs):
        return [{**row, "val_accuracy": row["val_accuracy"] + 0.01}
                for row in made_up(task, configs)]

    with pytest.raises(SystemExit) as ended:
        replay_lcbench.main(["--output", str(tmp_path), "--check", "4"], drifted, TASKS)
    assert ended.value.code == 1 and "differs at" in capsys.readouterr().err
