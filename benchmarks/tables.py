"""Tables of recorded learning curves in one JSON Lines format, which `replay.py --table`
replays every policy on (docs/replay-tables.md describes it for table authors):

    {"table": NAME, "direction": "maximize", "space": {PARAM: JSON}, "resource": "epoch"}
    {"params": {...}, "curve": [[seconds, value], ...]}
    ...

Line 1 names the table, the direction of its values, its search space (each parameter as
`optuna.distributions.distribution_to_json` writes it) and what one report is. Every other line
is one recorded run: its parameters and its reports, `curve[k]` being the (k+1)-th report at
`seconds` from the run's start. Runs may have curves of different lengths; a run ends complete
at its last report. Several runs of the same parameters are the same configuration trained
again (other seeds): world k reads one of them, chosen by k, so paired policies meet the same
noise and the worlds differ as training noise does.

A suggestion is answered by the recorded run nearest to it in the space's unit cube (log-scaled
where the distribution is log), among the runs whose categorical values match it, or, where the
table's runs were read from a surrogate that the replay can read too (`answer`: LCBench's, with
`replay.py --surrogate`), by the surrogate at the suggested point itself. Values are
turned to "higher is better" for the policies (a minimized table's values negated); regret is
indifferent to the sign.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)


@dataclass(frozen=True)
class Curve:
    """What a trial meets: a score per report (higher is better), each report's seconds, and
    the seconds before the first."""
    scores: tuple[float, ...]
    seconds: tuple[float, ...]
    setup: float


@dataclass(frozen=True)
class Costs:
    """One-off costs a table measured: a model's first tokenization on a worker, and a batch
    search per model, precision and batch bound (the demo's table; none elsewhere)."""
    tokenization: dict[str, float]
    batch_search: dict[tuple[str, str, int], float]


@dataclass(frozen=True)
class Point:
    """A configuration of a table's space, as `simulate` reads one: no model or precision of
    its own, so no per-model costs."""
    params: tuple[tuple[str, Any], ...]
    model: str = "table"
    precision: str = "none"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.params)


@dataclass(frozen=True)
class Run:
    params: dict[str, Any]
    seconds: tuple[float, ...]  # each report's, counted from the run's start
    values: tuple[float, ...]


def suggest(trial: optuna.trial.BaseTrial, space: dict[str, BaseDistribution]) -> Point:
    """A trial's configuration drawn from a table's space through Optuna's public calls."""
    values = []
    for name, d in space.items():
        if isinstance(d, CategoricalDistribution):
            value = trial.suggest_categorical(name, d.choices)
        elif isinstance(d, IntDistribution):
            value = trial.suggest_int(name, d.low, d.high, step=d.step, log=d.log)
        elif isinstance(d, FloatDistribution):
            value = trial.suggest_float(name, d.low, d.high, step=d.step, log=d.log)
        else:
            raise ValueError(f"{name}: no suggestion for {type(d).__name__}")
        values.append((name, value))
    return Point(tuple(values))


def unit(value: float, d: FloatDistribution | IntDistribution) -> float:
    """Where `value` lies in `d`'s range, from 0 to 1 (in logarithms for a log range)."""
    if d.low == d.high:
        return 0.0
    if d.log:
        return (math.log(value) - math.log(d.low)) / (math.log(d.high) - math.log(d.low))
    return (value - d.low) / (d.high - d.low)


@dataclass
class RecordedTable:
    """A table in the JSON Lines format, looked up as `simulate` reads a table."""
    name: str
    direction: str
    space: dict[str, BaseDistribution]
    resource: str
    runs: list[Run]
    costs: Costs = field(default_factory=lambda: Costs({}, {}))
    max_physical: int = 0
    # A surrogate's run at any point, in place of the nearest recorded run: a search that
    # refines near its incumbent then meets new values, not the same run again.
    answer: Callable[[dict[str, Any]], Run] | None = None
    _groups: dict[tuple, tuple[np.ndarray, list[list[Run]]]] = field(default_factory=dict)
    _cache: dict[tuple[Point, int], Curve] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sign = 1.0 if self.direction == "maximize" else -1.0
        self.numeric = [n for n, d in self.space.items()
                        if not isinstance(d, CategoricalDistribution)]
        self.categorical = [n for n in self.space if n not in self.numeric]
        points: dict[tuple, dict[tuple, list[Run]]] = {}
        for run in self.runs:
            key = tuple(run.params[n] for n in self.categorical)
            where = tuple(run.params[n] for n in self.numeric)
            points.setdefault(key, {}).setdefault(where, []).append(run)
        for key, by_point in points.items():
            coords = np.array([[unit(v, self.space[n]) for n, v in zip(self.numeric, p,
                                                                        strict=True)]
                               for p in by_point], dtype=float).reshape(len(by_point), -1)
            self._groups[key] = (coords, list(by_point.values()))

    @property
    def epochs(self) -> int:
        return max(len(r.values) for r in self.runs)

    def nearest(self, params: dict[str, Any]) -> list[Run]:
        """The runs recorded at the point nearest to `params` (several: other seeds)."""
        key = tuple(params[n] for n in self.categorical)
        if key not in self._groups:
            wanted = dict(zip(self.categorical, key, strict=True))
            raise KeyError(f"table {self.name} has no run with {wanted}")
        coords, runs = self._groups[key]
        if not self.numeric:
            return runs[0]
        where = np.array([unit(params[n], self.space[n]) for n in self.numeric])
        return runs[int(np.argmin(((coords - where) ** 2).sum(axis=1)))]

    def curve(self, config: Point, world: int) -> Curve:
        key = (config, world)
        if key not in self._cache:
            if self.answer is not None:
                run = self.answer(config.as_dict())
            else:
                runs = self.nearest(config.as_dict())
                run = runs[draw(f"{world}:{sorted(runs[0].params.items())}", len(runs))]
            starts = (0.0, *run.seconds[:-1])
            # Each report takes at least a millisecond (recorded clocks can stand still).
            self._cache[key] = Curve(tuple(self.sign * v for v in run.values),
                                     tuple(max(b - a, 1e-3) for a, b in zip(
                                         starts, run.seconds, strict=True)), 0.0)
        return self._cache[key]

    def random_median(self, world: int) -> float:
        """The median value of a random configuration at full fidelity: of the runs' last
        reports, in the policies' orientation (recorded runs are a random sample of the
        space in the tables this format was made for)."""
        return statistics.median(self.sign * r.values[-1] for r in self.runs)


def draw(key: str, n: int) -> int:
    """A choice among `n` that depends on `key` only (not on Python's hash seed)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % n


def read(path: Path) -> RecordedTable:
    lines = path.read_text().splitlines()
    if not lines:
        raise ValueError(f"{path}: empty, a table's first line is its header")
    head = json.loads(lines[0])
    missing = [k for k in ("table", "direction", "space") if k not in head]
    if missing or head["direction"] not in ("maximize", "minimize"):
        raise ValueError(f"{path}: line 1 needs table, direction (maximize or minimize) and "
                         f"space; {'missing ' + missing[0] if missing else 'bad direction'}")
    # distribution_to_json's string, or the object it encodes.
    space = {n: optuna.distributions.json_to_distribution(d if isinstance(d, str)
                                                          else json.dumps(d))
             for n, d in head["space"].items()}
    runs = []
    for number, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        row = json.loads(line)
        curve = row.get("curve") or []
        if set(row.get("params", {})) != set(space) or not curve:
            raise ValueError(f"{path}:{number}: a run needs every parameter of the space and "
                             "at least one report")
        runs.append(Run(row["params"], tuple(float(s) for s, _ in curve),
                        tuple(float(v) for _, v in curve)))
    return RecordedTable(head["table"], head["direction"], space, head.get("resource", "report"),
                         runs)


def write(path: Path, name: str, direction: str, space: dict[str, BaseDistribution],
          resource: str, runs: Iterable[tuple[dict[str, Any], list[list[float]]]]) -> int:
    """A table in the format; returns the number of runs written."""
    head = {"table": name, "direction": direction, "resource": resource,
            "space": {n: optuna.distributions.distribution_to_json(d) for n, d in space.items()}}
    count = 0
    with path.open("w") as out:
        out.write(json.dumps(head) + "\n")
        for params, curve in runs:
            out.write(json.dumps({"params": params, "curve": curve},
                                 separators=(",", ":")) + "\n")
            count += 1
    return count


def from_demo(made: dict) -> Iterable[tuple[dict[str, Any], list[list[float]]]]:
    """The demo's table (benchmarks/learning_curves.json) as runs of this format: one per
    recorded trial, its first report after its set-up and first epoch."""
    columns = made["columns"]
    for values in made["rows"]:
        row = dict(zip(columns, values, strict=True))
        done, curve = row["setup_seconds"], []
        for seconds, score in zip(row["epoch_seconds"], row["f1"], strict=True):
            done += seconds
            curve.append([round(done, 3), score])
        yield ({"model_name": row["model"], "batch": row["batch"],
                "learning_rate": row["learning_rate"], "weight_decay": row["weight_decay"]},
               curve)


def demo_space(made: dict) -> dict[str, BaseDistribution]:
    columns = made["columns"]
    rows = [dict(zip(columns, r, strict=True)) for r in made["rows"]]
    rates = [r["learning_rate"] for r in rows]
    decays = [r["weight_decay"] for r in rows]
    return {"model_name": CategoricalDistribution(sorted({r["model"] for r in rows})),
            "batch": CategoricalDistribution(sorted({r["batch"] for r in rows})),
            "learning_rate": FloatDistribution(min(rates), max(rates), log=True),
            "weight_decay": FloatDistribution(min(decays), max(decays))}


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="the demo's table in the replay's format")
    parser.add_argument("--demo", type=Path, default=Path(__file__).parent /
                        "learning_curves.json")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    made = json.loads(args.demo.read_text())
    count = write(args.output, "demo", "maximize", demo_space(made), "epoch", from_demo(made))
    print(f"{args.output}: {count} runs")


if __name__ == "__main__":
    main()
