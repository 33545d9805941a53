"""benchmarks/tables.py: the JSON Lines format of recorded learning curves that the replay
searches, read back and looked up as the replay reads it."""

from __future__ import annotations

import json

import optuna
import pytest
import replay
import tables
from conftest import REPO
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

SPACE = {"opt": CategoricalDistribution(["sgd", "adam"]),
         "lr": FloatDistribution(1e-4, 1e-1, log=True),
         "layers": IntDistribution(1, 5)}


def made(tmp_path, direction: str = "maximize") -> tables.RecordedTable:
    runs = [({"opt": "sgd", "lr": 1e-4, "layers": 1}, [[1.0, 0.1], [2.0, 0.2]]),
            ({"opt": "sgd", "lr": 1e-2, "layers": 1}, [[1.0, 0.5], [2.0, 0.6], [3.0, 0.7]]),
            ({"opt": "sgd", "lr": 1e-2, "layers": 1}, [[1.5, 0.4], [3.0, 0.65], [4.5, 0.66]]),
            ({"opt": "adam", "lr": 1e-3, "layers": 5}, [[2.0, 0.3], [2.0, 0.35]])]
    path = tmp_path / "t.jsonl"
    assert tables.write(path, "t", direction, SPACE, "epoch", runs) == 4
    return tables.read(path)


def test_a_table_is_read_back_as_written(tmp_path):
    table = made(tmp_path)
    assert (table.name, table.direction, table.resource) == ("t", "maximize", "epoch")
    assert table.space == SPACE and table.epochs == 3
    assert table.runs[1].seconds == (1.0, 2.0, 3.0) and table.runs[1].values == (0.5, 0.6, 0.7)
    # The space may also be written as the objects distribution_to_json encodes.
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    head["space"] = {n: json.loads(d) for n, d in head["space"].items()}
    (tmp_path / "o.jsonl").write_text("\n".join([json.dumps(head), *lines[1:]]))
    assert tables.read(tmp_path / "o.jsonl").space == SPACE


@pytest.mark.parametrize("head, row, says", [
    ({"table": "t", "space": {}}, None, "missing direction"),
    ({"table": "t", "direction": "up", "space": {}}, None, "bad direction"),
    ({"table": "t", "direction": "maximize", "space": {
        "lr": optuna.distributions.distribution_to_json(SPACE["lr"])}},
     {"params": {}, "curve": [[1, 0.5]]}, "t.jsonl:2: a run needs every parameter"),
])
def test_a_malformed_table_is_refused_naming_its_line(tmp_path, head, row, says):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (head, row) if x is not None))
    with pytest.raises(ValueError, match=says):
        tables.read(path)


def test_a_suggestion_reads_the_nearest_run_in_the_unit_cube_its_categories_matching(tmp_path):
    table = made(tmp_path)
    # 3e-3 is nearer 1e-2 than 1e-4 in logarithms (though nearer 1e-4 in plain numbers).
    near = table.nearest({"opt": "sgd", "lr": 3e-3, "layers": 1})
    assert {r.values[-1] for r in near} == {0.7, 0.66}  # both seeds of that point
    # adam has one run: any adam suggestion reads it, whatever its other values.
    assert table.nearest({"opt": "adam", "lr": 1e-4, "layers": 1})[0].values == (0.3, 0.35)
    with pytest.raises(KeyError, match="no run with"):
        table.nearest({"opt": "rmsprop", "lr": 1e-4, "layers": 1})


def test_a_world_reads_one_seed_of_a_point_and_worlds_differ(tmp_path):
    table = made(tmp_path)
    point = tables.Point((("opt", "sgd"), ("lr", 1e-2), ("layers", 1)))
    finals = {w: table.curve(point, w).scores[-1] for w in range(20)}
    assert set(finals.values()) == {0.7, 0.66}
    assert table.curve(point, 3) == table.curve(point, 3)
    # A curve's seconds are each report's own, from the run's start.
    seeded = next(w for w, v in finals.items() if v == 0.66)
    assert table.curve(point, seeded).seconds == (1.5, 1.5, 1.5)
    # Reports at the same second cost a millisecond.
    adam = tables.Point((("opt", "adam"), ("lr", 1e-3), ("layers", 5)))
    assert table.curve(adam, 0).seconds == (2.0, 1e-3)


def test_a_table_with_an_answer_reads_it_at_the_point_itself_not_the_nearest_run(tmp_path):
    table = made(tmp_path)
    asked = []

    def answer(params):
        asked.append(params)
        return tables.Run(params, (1.0, 2.0), (params["lr"], 2 * params["lr"]))

    table.answer = answer
    point = tables.Point((("opt", "sgd"), ("lr", 3e-3), ("layers", 2)))
    assert table.curve(point, 0).scores == (3e-3, 6e-3)  # not the run recorded at 1e-2
    assert table.curve(point, 0).seconds == (1.0, 1.0)
    table.curve(point, 0)
    assert asked == [{"opt": "sgd", "lr": 3e-3, "layers": 2}]  # once a point and world
    # A suggestion between two recorded points meets a value of its own.
    other = tables.Point((("opt", "sgd"), ("lr", 4e-3), ("layers", 2)))
    assert table.curve(other, 0).scores != table.curve(point, 0).scores


def test_a_minimized_table_is_negated_for_the_policies(tmp_path):
    table = made(tmp_path, "minimize")
    point = tables.Point((("opt", "adam"), ("lr", 1e-3), ("layers", 5)))
    assert table.curve(point, 0).scores == (-0.3, -0.35)
    # The median of the last reports -0.2, -0.7, -0.66 and -0.35.
    assert table.random_median(0) == pytest.approx(-0.505)


def test_runs_of_different_lengths_end_complete_at_their_last_report(tmp_path):
    table = made(tmp_path)

    class Fixed:
        name, startup, gap = "fixed", 0.0, 0.0

        def __init__(self, points):
            self.points = iter(points)

        def ask(self):
            point = next(self.points)

            class Run:
                config = point

                def report(self, epoch, score):
                    return False

                def finish(self, scores, stopped):
                    pass
            return Run()

        def slowdown(self, model):
            return 1.0

    points = [tables.Point((("opt", "adam"), ("lr", 1e-3), ("layers", 5))),
              tables.Point((("opt", "sgd"), ("lr", 1e-4), ("layers", 1)))]
    trials = replay.simulate(Fixed(points), table, 0, 1, budget=2)
    assert [(len(t.scores), t.state) for t in trials] == [(2, "COMPLETE")] * 2
    assert [t.end for t in trials] == pytest.approx([2.001, 4.001])


def test_the_shipped_demo_table_is_the_demos_curves_in_the_format():
    shipped = tables.read(REPO / "benchmarks" / "tables" / "demo.jsonl")
    made_demo = json.loads((REPO / "benchmarks" / "learning_curves.json").read_text())
    assert len(shipped.runs) == len(made_demo["rows"]) and shipped.epochs == made_demo["epochs"]
    first = dict(zip(made_demo["columns"], made_demo["rows"][0], strict=True))
    assert shipped.runs[0].values == tuple(first["f1"])
    assert shipped.runs[0].seconds[0] == pytest.approx(first["setup_seconds"]
                                                       + first["epoch_seconds"][0], abs=1e-3)
